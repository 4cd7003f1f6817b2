"""Opens the desktop window (Qt is imported here, never at command-line start-up).

``ctxpatch --screenshot FILE [compare options]`` opens the window (offscreen works), runs that
comparison to the end, saves a PNG of the whole window and exits: 0 when the run completed,
2 when it failed on the user's input, 1 on an internal failure. It neither reads nor writes the
window's settings (the options given, over their documented defaults), and leaves any autosave
of a session that did not close cleanly as it was.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

_WINDOWS: list[Any] = []


def _setup_logging() -> str:
    import platformdirs

    folder = platformdirs.user_log_path("ctxpatch", appauthor=False)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handler: logging.Handler = logging.FileHandler(folder / "ctxpatch.log", encoding="utf-8")
    except OSError:
        handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger = logging.getLogger("ctxpatch")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return str(folder / "ctxpatch.log")


def _excepthook(exc_type: Any, exc: BaseException, tb: Any) -> None:
    """An exception in a slot becomes a logged error and a message, not a dead window."""
    import traceback

    from PySide6.QtWidgets import QApplication

    from .main_window import MainWindow

    logging.getLogger("ctxpatch").error("".join(traceback.format_exception(exc_type, exc, tb)))
    for w in QApplication.topLevelWidgets():
        if isinstance(w, MainWindow):
            w.show_error(f"internal error: {exc_type.__name__}: {exc} (details in the log)")


#: the Debian/Ubuntu package of each library Qt's xcb platform plugin needs that a fresh
#: machine may lack (sonames as ``ldd`` reports them; libxcb-cursor is loaded at run time)
XCB_PACKAGES = {
    "libxcb-icccm.so.4": "libxcb-icccm4", "libxcb-keysyms.so.1": "libxcb-keysyms1",
    "libxcb-cursor.so.0": "libxcb-cursor0", "libxcb-image.so.0": "libxcb-image0",
    "libxcb-render-util.so.0": "libxcb-render-util0", "libxkbcommon-x11.so.0": "libxkbcommon-x11-0",
    "libxcb-xkb.so.1": "libxcb-xkb1", "libxcb-shape.so.0": "libxcb-shape0",
    "libxcb-randr.so.0": "libxcb-randr0", "libxcb-xinerama.so.0": "libxcb-xinerama0",
    "libxcb-util.so.1": "libxcb-util1", "libxkbcommon.so.0": "libxkbcommon0",
    "libxcb-sync.so.1": "libxcb-sync1", "libxcb-xfixes.so.0": "libxcb-xfixes0",
    "libxcb-shm.so.0": "libxcb-shm0", "libxcb-render.so.0": "libxcb-render0",
    "libX11-xcb.so.1": "libx11-xcb1", "libxcb.so.1": "libxcb1", "libEGL.so.1": "libegl1",
    "libGL.so.1": "libgl1", "libfontconfig.so.1": "libfontconfig1", "libdbus-1.so.3": "libdbus-1-3",
}


def missing_xcb_libraries(ldd_output: str | None = None) -> list[str]:
    """The sonames Qt's xcb platform plugin needs and cannot find here (Linux), read from ``ldd``
    on the plugin and its Qt library, plus libxcb-cursor, which Qt loads at run time."""
    import ctypes.util
    import subprocess
    from pathlib import Path

    if ldd_output is None:
        import PySide6

        qt = Path(PySide6.__file__).parent / "Qt"
        files = [qt / "plugins" / "platforms" / "libqxcb.so", qt / "lib" / "libQt6XcbQpa.so.6"]
        try:
            ldd_output = "".join(
                subprocess.run(["ldd", str(f)], capture_output=True, text=True, timeout=20).stdout
                for f in files if f.is_file())
        except (OSError, subprocess.SubprocessError):
            return []  # no ldd: let Qt say it
    missing = []
    for line in ldd_output.splitlines():
        name, _, where = line.strip().partition(" => ")
        if where.strip() == "not found" and name not in missing:
            missing.append(name)
    if ctypes.util.find_library("xcb-cursor") is None and "libxcb-cursor.so.0" not in missing:
        missing.append("libxcb-cursor.so.0")
    return missing


def _display_reachable() -> bool:
    """Whether libxcb connects to ``$DISPLAY`` (Qt aborts the process when it cannot): one
    connection, about a millisecond on a local display."""
    import ctypes

    try:
        xcb = ctypes.CDLL("libxcb.so.1")
    except OSError:
        return True  # let Qt say it
    xcb.xcb_connect.restype = ctypes.c_void_p
    xcb.xcb_connect.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
    xcb.xcb_connection_has_error.argtypes = [ctypes.c_void_p]
    xcb.xcb_disconnect.argtypes = [ctypes.c_void_p]
    connection = xcb.xcb_connect(None, None)
    try:
        return xcb.xcb_connection_has_error(connection) == 0
    finally:
        xcb.xcb_disconnect(connection)


def _wayland_reachable() -> bool:
    """Whether the compositor's socket ``$WAYLAND_DISPLAY`` accepts a connection (relative names
    live in ``$XDG_RUNTIME_DIR``, as libwayland resolves them)."""
    import socket

    name = os.environ.get("WAYLAND_DISPLAY", "")
    if not name:
        return False
    path = name if name.startswith("/") else os.path.join(os.environ.get("XDG_RUNTIME_DIR", ""),
                                                          name)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(2)
            sock.connect(path)
    except OSError:
        return False
    return True


#: what to do without a display, the end of each "cannot open the window" line
HEADLESS = ("connect with 'ssh -X', run it under 'xvfb-run ctxpatch', or work headless with "
            "'ctxpatch compare ...' (or QT_QPA_PLATFORM=offscreen for --screenshot)")


def check_display() -> None:
    """Before Qt starts on Linux, where a window that cannot open aborts the process (SIGABRT,
    with a hint about reinstalling): every such case is one line with the fix, exit 2. No
    display (``DISPLAY`` and ``WAYLAND_DISPLAY`` unset, as over SSH), a Wayland compositor that
    refuses, Wayland without X (Qt is then told to use Wayland rather than fail on xcb), and
    then the xcb checks (`check_xcb`: missing libraries, a display that refuses). Other
    platforms (offscreen, minimal, vnc...) are left to Qt."""
    from ..core.errors import UserError

    if not sys.platform.startswith("linux"):
        return
    platform = os.environ.get("QT_QPA_PLATFORM", "")
    display, wayland = os.environ.get("DISPLAY"), os.environ.get("WAYLAND_DISPLAY")
    if platform.startswith("wayland") or (platform == "" and wayland and not display):
        if not wayland:
            raise UserError(f"QT_QPA_PLATFORM={platform} but WAYLAND_DISPLAY is unset, so there "
                            f"is no Wayland display to open the window on: {HEADLESS}")
        if not _wayland_reachable():
            raise UserError(f"cannot connect to the Wayland display {wayland!r} (is the "
                            f"compositor running, and is XDG_RUNTIME_DIR this session's?): "
                            f"{HEADLESS}")
        if platform == "":
            os.environ["QT_QPA_PLATFORM"] = "wayland"  # (Qt's default would try xcb, no X here)
        return
    if platform not in ("", "xcb"):
        return
    if not display:
        raise UserError(f"no display to open the window on (DISPLAY is unset, as over SSH): "
                        f"{HEADLESS}")
    check_xcb()


def check_xcb() -> None:
    """Before Qt starts on X11 (where a missing library aborts the process with a message that
    names no package): one line naming the packages to install; then whether ``$DISPLAY``
    accepts a connection."""
    from ..core.errors import UserError

    platform = os.environ.get("QT_QPA_PLATFORM", "")
    if not sys.platform.startswith("linux") or platform not in ("", "xcb"):
        return
    if platform == "" and (os.environ.get("WAYLAND_DISPLAY") or not os.environ.get("DISPLAY")):
        return  # Qt picks Wayland (`check_display` says when there is no display at all)
    missing = missing_xcb_libraries()
    if missing:
        packages = " ".join(XCB_PACKAGES.get(m, m) for m in missing)
        sudo = "" if _is_root() else "sudo "  # (root in a container has no sudo)
        raise UserError(f"the window needs system libraries that Qt's X11 (xcb) platform uses and "
                        f"this machine lacks ({', '.join(missing)}): install them with '{sudo}"
                        f"apt-get install {packages}' (README: Troubleshooting), or run headless "
                        "with QT_QPA_PLATFORM=offscreen")
    if not _display_reachable():
        raise UserError(f"cannot connect to the X display {os.environ.get('DISPLAY')!r} (is it "
                        f"running, and may this user use it? 'xhost', 'xauth'): {HEADLESS}")


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def window_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options given on the command line that the window takes (`core.spec.window_names`)."""
    from ..core.spec import window_names

    return {k: getattr(args, k) for k in window_names() if hasattr(args, k)}


def run_app(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    from ..core.errors import UserError
    from ..core.spec import window_names

    window = (*window_names(), "command", "screenshot", "quiet")
    ignored = sorted(k for k in vars(args) if k not in window)
    if ignored:  # compare-only options are not silently dropped
        from ..core.spec import flag as spec_flag
        from ..core.spec import names

        name = ignored[0]
        flag = spec_flag(name) if name in names() else "--" + name.replace("_", "-")
        raise UserError(f"{flag} is for 'ctxpatch compare' (or bench), not the window: run "
                        f"'ctxpatch compare ... {flag}', or leave it out")
    if getattr(args, "image", None):
        from ..core.images import read_image

        read_image(args.image)  # a bad file is one line before the window opens
    check_display()
    from PySide6.QtWidgets import QApplication

    from .main_window import MainWindow
    screenshot = getattr(args, "screenshot", None)
    if screenshot:  # (before Qt starts; again below, against the model the window opens on)
        from ..core.outputs import check_outputs, run_inputs

        check_outputs({"--screenshot": screenshot}, run_inputs(getattr(args, "model", None),
                                                                getattr(args, "image", None)))
    _setup_logging()
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("ctxpatch")
    app.setOrganizationName("ctxpatch")
    app.setDesktopFileName("ctxpatch")
    from PySide6.QtGui import QIcon

    from .. import resources

    icon = QIcon()
    for path in resources.icon_paths():
        icon.addFile(path)
    app.setWindowIcon(icon)
    options = window_options(args)
    # a screenshot's window leaves the user's settings and autosaves as they were
    window = MainWindow(autoload=not screenshot, options=options, persistent=not screenshot)
    _WINDOWS.append(window)  # alive until the process ends (never destroyed mid-session)
    if screenshot:  # never a file the window reads (the demo's cache folder, say)
        window.files.check_writes("--screenshot", screenshot)
        picture_format(screenshot)  # a format Qt cannot write: before the run, not after
    sys.excepthook = _excepthook
    window.show()
    logging.getLogger("ctxpatch").info("window shown %.2f s after start", time.perf_counter() - t0)
    if not screenshot:
        window.offer_autosave()
        return int(app.exec())
    return _screenshot(app, window, screenshot)


def picture_format(path: str) -> str:
    """The format a picture is saved in, from its name (PNG when it says none).

    Raises:
        UserError: Qt cannot write that format.
    """
    from pathlib import Path

    from PySide6.QtGui import QImageWriter

    from ..core.errors import UserError

    kind = Path(path).suffix.lstrip(".").upper() or "PNG"
    if kind.lower() not in {bytes(f.data()).decode().lower()
                            for f in QImageWriter.supportedImageFormats()}:
        raise UserError(f"cannot write {path}: Qt cannot save a picture as {kind} (name it "
                        ".png)")
    return kind


def write_picture(picture: Any, path: str) -> None:
    """Save a QPixmap or QImage atomically (`core.export.atomic_write`), in the format its name
    says (PNG when it says none), so that a failed save leaves the file there was.

    Raises:
        UserError: it cannot be written, or Qt cannot write that format.
    """

    from ..core.errors import UserError
    from ..core.export import atomic_write

    kind = picture_format(path)

    def write(tmp: str) -> None:
        if not picture.save(tmp, kind):
            raise UserError(f"cannot write {path}: Qt cannot save a picture as {kind} (name it "
                            ".png)")

    atomic_write(path, write)


def _screenshot(app: Any, window: Any, path: str) -> int:
    from PySide6.QtCore import QEventLoop, QTimer

    from ..core.errors import UserError

    result: dict[str, str] = {}
    loop = QEventLoop()

    def done(outcome: str) -> None:
        result["outcome"] = outcome
        if outcome != "completed":
            loop.quit()
            return
        if window.state.steps:
            window.state.select(len(window.state.steps) - 1)
        QTimer.singleShot(200, save)

    def save() -> None:
        app.processEvents()
        try:
            write_picture(window.grab(), path)
        except UserError as exc:
            result["outcome"], result["why"] = "unsaved", str(exc)
        loop.quit()

    window.resize(1400, 900)  # the same picture whatever size the window was saved at
    window.run_finished.connect(done)
    QTimer.singleShot(0, window.start_run)
    loop.exec()
    window.close()
    outcome = result.get("outcome", "failed")
    if outcome == "completed":
        print(f"saved {path}", file=sys.stderr)
        return 0
    if outcome == "unsaved":
        print(f"ctxpatch: error: {result['why']}", file=sys.stderr)
        return 2
    message = window.last_error or outcome
    print(f"ctxpatch: error: {message}", file=sys.stderr)
    return 1 if message.startswith("internal error") else 2
