"""Opens the desktop window (Qt is imported here, never at command-line start-up)."""

from __future__ import annotations

import argparse
import sys


def run_app(args: argparse.Namespace) -> int:
    from PySide6.QtWidgets import QApplication

    from app.main_window import MainWindow

    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("ctxpatch")
    app.setOrganizationName("ctxpatch")
    window = MainWindow(model=args.model)
    window.show()
    return int(app.exec())
