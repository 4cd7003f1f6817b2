"""Opens the desktop window (Qt is imported here, never at command-line start-up).

``ctxpatch --screenshot FILE [compare options]`` opens the window (offscreen works), runs that
comparison to the end, saves a PNG of the whole window and exits: 0 when the run completed,
2 when it failed on the user's input, 1 on an internal failure.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

#: the command-line options the window understands (the rest of `compare` is headless only)
WINDOW_OPTIONS = ("model", "dtype", "device", "method", "absorb", "scope", "layers",
                  "output_control", "context", "query", "max_new_tokens", "chat_template",
                  "disable", "image", "device_map", "max_memory", "offload_folder",
                  "trust_remote_code", "allow_pickle")


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

    from app.main_window import MainWindow

    logging.getLogger("ctxpatch").error("".join(traceback.format_exception(exc_type, exc, tb)))
    for w in QApplication.topLevelWidgets():
        if isinstance(w, MainWindow):
            w.show_error(f"internal error: {exc_type.__name__}: {exc} (details in the log)")


def window_options(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in WINDOW_OPTIONS if hasattr(args, k)}


def run_app(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    from core.errors import UserError

    window = (*WINDOW_OPTIONS, "command", "screenshot", "quiet")
    ignored = sorted(k for k in vars(args) if k not in window)
    if ignored:  # compare-only options are not silently dropped
        flag = "--" + ignored[0].replace("_", "-")
        raise UserError(f"{flag} is for 'ctxpatch compare' (or bench), not the window: run "
                        f"'ctxpatch compare ... {flag}', or leave it out")
    if getattr(args, "image", None):
        from core.images import read_image

        read_image(args.image)  # a bad file is one line before the window opens
    from PySide6.QtWidgets import QApplication

    from app.main_window import MainWindow
    screenshot = getattr(args, "screenshot", None)
    if screenshot:
        from core.outputs import check_outputs

        check_outputs({"--screenshot": screenshot}, [getattr(args, "model", None),
                                                       getattr(args, "image", None)])
    _setup_logging()
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("ctxpatch")
    app.setOrganizationName("ctxpatch")
    app.setDesktopFileName("ctxpatch")
    from PySide6.QtGui import QIcon

    import resources

    icon = QIcon()
    for path in resources.icon_paths():
        icon.addFile(path)
    app.setWindowIcon(icon)
    options = window_options(args)
    window = MainWindow(autoload=not screenshot, options=options)
    _WINDOWS.append(window)  # alive until the process ends (never destroyed mid-session)
    sys.excepthook = _excepthook
    window.show()
    logging.getLogger("ctxpatch").info("window shown %.2f s after start", time.perf_counter() - t0)
    if not screenshot:
        window.offer_autosave()
        return int(app.exec())
    return _screenshot(app, window, screenshot)


def _screenshot(app: Any, window: Any, path: str) -> int:
    from PySide6.QtCore import QEventLoop, QTimer

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
        if not window.grab().save(path):
            result["outcome"] = "unsaved"
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
        print(f"ctxpatch: error: cannot write {path}", file=sys.stderr)
        return 2
    message = window.last_error or outcome
    print(f"ctxpatch: error: {message}", file=sys.stderr)
    return 1 if message.startswith("internal error") else 2
