"""The Qt binding does not leak references to None (PySide6 6.12.0 dropped two per Python paint
override; on Python < 3.12 the window then dies with "deallocating None" after a few thousand
paints, so pyproject.toml excludes it). This test fails if such a build is installed."""

from __future__ import annotations

import gc
import sys
from typing import Any

from PySide6.QtCore import QRectF
from PySide6.QtGui import QPainter
from PySide6.QtWidgets import QWidget


class _Painted(QWidget):
    def paintEvent(self, event: Any) -> None:  # noqa: N802 - Qt override
        painter = QPainter(self)
        painter.drawRect(QRectF(0, 0, 5, 5))
        painter.end()


def test_painting_keeps_none_alive(qtbot: Any) -> None:
    w = _Painted()
    qtbot.addWidget(w)
    w.show()
    w.repaint()
    gc.collect()
    before = sys.getrefcount(None)
    for _ in range(300):
        w.repaint()
    gc.collect()
    assert before - sys.getrefcount(None) < 50
