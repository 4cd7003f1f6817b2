"""The (minimal) window builds offscreen and names its model."""

from __future__ import annotations

from app.main_window import MainWindow


def test_window_opens(qtbot) -> None:  # type: ignore[no-untyped-def]
    window = MainWindow(model="demo")
    qtbot.addWidget(window)
    window.show()
    assert "demo" in window.windowTitle()
