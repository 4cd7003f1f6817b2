"""Issue 20: the real window on X11. A machine without the libraries Qt's xcb platform needs gets
one line naming the packages (not Qt's abort), and the window opens, runs and saves a screenshot
under Xvfb with the xcb platform (CI installs Xvfb: .ci/run)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ctxpatch.app import gui
from ctxpatch.core.errors import UserError

LDD = """\tlinux-vdso.so.1 (0x00007ffc)
\tlibQt6XcbQpa.so.6 => /site/PySide6/Qt/lib/libQt6XcbQpa.so.6 (0x00007f)
\tlibxcb-icccm.so.4 => not found
\tlibxcb-keysyms.so.1 => not found
\tlibxcb.so.1 => /lib/x86_64-linux-gnu/libxcb.so.1 (0x00007f)
"""


def test_missing_libraries_are_read_from_ldd() -> None:
    missing = gui.missing_xcb_libraries(LDD)
    assert missing[:2] == ["libxcb-icccm.so.4", "libxcb-keysyms.so.1"]


def test_missing_libraries_are_one_line_with_the_apt_command(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("QT_QPA_PLATFORM", "xcb")
    monkeypatch.setattr(gui, "missing_xcb_libraries",
                        lambda: ["libxcb-icccm.so.4", "libxcb-keysyms.so.1", "libxcb-cursor.so.0"])
    for root, said in ((False, "'sudo apt-get install"), (True, "'apt-get install")):
        monkeypatch.setattr(gui, "_is_root", lambda root=root: root)  # (root has no sudo)
        with pytest.raises(UserError) as exc:
            gui.check_xcb()
        line = str(exc.value)
        assert f"{said} libxcb-icccm4 libxcb-keysyms1 libxcb-cursor0" in line
        assert "\n" not in line and "offscreen" in line


def test_offscreen_needs_no_x_libraries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QT_QPA_PLATFORM", "offscreen")
    monkeypatch.setattr(gui, "missing_xcb_libraries", lambda: ["libxcb-icccm.so.4"])
    gui.check_xcb()  # no error


def _xvfb() -> str | None:
    found = shutil.which("Xvfb")
    if found is None and os.environ.get("CTXPATCH_REQUIRE_XVFB"):
        pytest.fail("CI asked for the xcb window test (CTXPATCH_REQUIRE_XVFB) but Xvfb is missing")
    return found


def test_the_window_opens_under_xvfb_with_xcb(tmp_path: Path, tiny_model_dir: str) -> None:
    xvfb = _xvfb()
    if xvfb is None:
        pytest.skip("Xvfb is not installed (apt-get install xvfb); CI installs it")
    read, write = os.pipe()
    server = subprocess.Popen([xvfb, "-displayfd", str(write), "-screen", "0", "1400x900x24",
                               "-nolisten", "tcp"], pass_fds=(write,),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(write)
    try:
        display = os.read(read, 16).decode().strip()
        assert display, "Xvfb gave no display number"
        env = {**os.environ, "QT_QPA_PLATFORM": "xcb", "DISPLAY": f":{display}",
               "XDG_CONFIG_HOME": str(tmp_path / "config"),
               "XDG_STATE_HOME": str(tmp_path / "state")}
        shot = tmp_path / "window.png"
        out = subprocess.run([sys.executable, "-m", "ctxpatch", "--screenshot", str(shot),
                              "--model", tiny_model_dir, "--max-new-tokens", "2"],
                             env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert shot.stat().st_size > 10_000
    finally:
        os.close(read)
        server.terminate()
        server.wait(timeout=10)
