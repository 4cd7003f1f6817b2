"""The main window. For now a minimal one: it names the model and points to the command line;
the full window (model, input, generation, plots and patch panels) is its own issue."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QMainWindow


class MainWindow(QMainWindow):
    def __init__(self, model: str = "demo") -> None:
        super().__init__()
        self.setWindowTitle(f"ctxpatch — {model}")
        label = QLabel(
            f"<h2>ctxpatch</h2><p>Model: <b>{model}</b></p>"
            "<p>The interactive window is under construction. Run a comparison with<br>"
            "<code>ctxpatch compare --absorb all --query \"…\"</code></p>"
        )
        label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        label.setTextFormat(Qt.TextFormat.RichText)
        self.setCentralWidget(label)
        self.resize(720, 420)
