"""Light or dark: the views follow the system palette (pyqtgraph's own default is black)."""

from __future__ import annotations

from typing import Any

from PySide6.QtGui import QPalette


def is_dark(palette: QPalette) -> bool:
    return palette.window().color().lightness() < 128


def style_graphics(graphics: Any, plots: list[Any], palette: QPalette) -> None:
    """Background, axes and titles of a pyqtgraph GraphicsLayoutWidget from a Qt palette."""
    import pyqtgraph as pg

    background, foreground = palette.base().color(), palette.text().color()
    pg.setConfigOptions(background=background, foreground=foreground, antialias=True)
    graphics.setBackground(background)
    for plot in plots:
        for name in ("left", "bottom"):
            axis = plot.getAxis(name)
            axis.setPen(foreground)
            axis.setTextPen(foreground)
        plot.titleLabel.setAttr("color", foreground)
