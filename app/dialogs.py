"""File dialogs that remember their folder (per kind: exports, sessions, images, model
folders) across dialogs and starts, in the application's settings."""

from __future__ import annotations

import os

from PySide6.QtCore import QSettings
from PySide6.QtWidgets import QFileDialog, QWidget


def _key(kind: str) -> str:
    return f"dialogs/{kind}"


def start(kind: str, name: str = "") -> str:
    """Where a dialog of ``kind`` opens: the folder last used for it (if it still exists),
    with ``name`` as the suggested file name."""
    folder = QSettings().value(_key(kind))
    if not (isinstance(folder, str) and os.path.isdir(folder)):
        folder = ""
    return os.path.join(folder, name) if folder and name else (folder or name)


def remember(kind: str, path: str) -> str:
    """Keep the folder of ``path`` for the next dialog of ``kind``; returns ``path``."""
    if path:
        folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
        QSettings().setValue(_key(kind), folder)
    return path


def save_file(parent: QWidget, kind: str, title: str, name: str, filters: str) -> str:
    path, _ = QFileDialog.getSaveFileName(parent, title, start(kind, name), filters)
    return remember(kind, path)


def open_file(parent: QWidget, kind: str, title: str, filters: str) -> str:
    path, _ = QFileDialog.getOpenFileName(parent, title, start(kind), filters)
    return remember(kind, path)


def open_folder(parent: QWidget, kind: str, title: str) -> str:
    return remember(kind, QFileDialog.getExistingDirectory(parent, title, start(kind)))
