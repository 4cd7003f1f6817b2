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


def _clean_env(monkeypatch: pytest.MonkeyPatch, **env: str) -> None:
    monkeypatch.setattr(sys, "platform", "linux")
    for name in ("QT_QPA_PLATFORM", "DISPLAY", "WAYLAND_DISPLAY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_no_display_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """Issue 35 #2: over SSH (no DISPLAY, no WAYLAND_DISPLAY) Qt aborted with SIGABRT (134) and
    a hint about reinstalling; now one ctxpatch line, exit 2, before Qt is imported."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    env["XDG_CONFIG_HOME"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-m", "ctxpatch"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ctxpatch: error: no display"), lines
    assert "xvfb-run" in lines[0] and "ctxpatch compare" in lines[0]


@pytest.mark.parametrize("platform", ["", "xcb"])
def test_no_display_is_refused_before_qt(monkeypatch: pytest.MonkeyPatch, platform: str) -> None:
    _clean_env(monkeypatch, **({"QT_QPA_PLATFORM": platform} if platform else {}))
    monkeypatch.setattr(gui, "missing_xcb_libraries", lambda: [])  # (libraries all there)
    with pytest.raises(UserError, match="no display to open the window on"):
        gui.check_display()


def test_a_display_that_refuses_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    _clean_env(monkeypatch, DISPLAY=":77")
    monkeypatch.setattr(gui, "missing_xcb_libraries", lambda: [])
    monkeypatch.setattr(gui, "_display_reachable", lambda: False)
    with pytest.raises(UserError, match="cannot connect to the X display ':77'"):
        gui.check_display()
    monkeypatch.setattr(gui, "_display_reachable", lambda: True)
    gui.check_display()  # the negative control: a display that answers opens


def test_wayland(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A compositor that refuses is one line; Wayland without X makes Qt use Wayland (its
    default would try xcb and abort); wayland asked for without a compositor is one line."""
    import socket

    _clean_env(monkeypatch, WAYLAND_DISPLAY="wayland-9", XDG_RUNTIME_DIR=str(tmp_path))
    with pytest.raises(UserError, match="cannot connect to the Wayland display 'wayland-9'"):
        gui.check_display()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(tmp_path / "wayland-9"))
        server.listen(1)
        gui.check_display()
        assert os.environ["QT_QPA_PLATFORM"] == "wayland"
    _clean_env(monkeypatch, QT_QPA_PLATFORM="wayland")
    with pytest.raises(UserError, match="WAYLAND_DISPLAY is unset"):
        gui.check_display()


def test_offscreen_needs_no_display(monkeypatch: pytest.MonkeyPatch) -> None:
    _clean_env(monkeypatch, QT_QPA_PLATFORM="offscreen")
    monkeypatch.setattr(gui, "missing_xcb_libraries", lambda: ["libxcb-icccm.so.4"])
    gui.check_display()  # no error
