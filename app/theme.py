"""Light or dark: the views follow the system palette (pyqtgraph's own default is black).

Series colours come from the Okabe-Ito palette (Okabe and Ito, "Color Universal Design",
2002): eight colours that stay distinct for the common forms of colour blindness. Each role
takes the member that reads on the current background: the blue that is dark enough for white
paper is too dark on a black one, so a dark theme takes the sky blue instead.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtGui import QPalette

OKABE_ITO = {
    "black": "#000000", "orange": "#E69F00", "sky": "#56B4E9", "green": "#009E73",
    "yellow": "#F0E442", "blue": "#0072B2", "vermillion": "#D55E00", "purple": "#CC79A7",
}


def is_dark(palette: QPalette) -> bool:
    return palette.window().color().lightness() < 128


def series_colors(palette: QPalette) -> dict[str, Any]:
    """The plots' colours for this palette: "patched", "control", "mismatch", "cursor" (hex
    strings) and "overlays" (a list, for the other runs of the history)."""
    o, dark = OKABE_ITO, is_dark(palette)
    return {
        "patched": o["sky"] if dark else o["blue"],
        "control": o["orange"],
        "mismatch": o["vermillion"],
        "cursor": o["purple"],
        "overlays": ([o["green"], o["purple"], o["yellow"], "#FFFFFF"] if dark else
                     [o["green"], o["purple"], o["sky"], o["black"]]),
    }


def style_graphics(graphics: Any, plots: list[Any], palette: QPalette,
                   point_size: float | None = None) -> None:
    """Background, axes and titles of a pyqtgraph GraphicsLayoutWidget from a Qt palette; with
    ``point_size``, the tick labels in that size (the report's figures: at least 10 pt)."""
    import pyqtgraph as pg
    from PySide6.QtGui import QFont

    background, foreground = palette.base().color(), palette.text().color()
    pg.setConfigOptions(background=background, foreground=foreground, antialias=True)
    graphics.setBackground(background)
    font = QFont(graphics.font())
    if point_size is not None:
        font.setPointSizeF(point_size)
    for plot in plots:
        plot.hideButtons()  # (pyqtgraph's "A" auto-range button: the views fit themselves)
        for name in ("left", "bottom"):
            axis = plot.getAxis(name)
            axis.setPen(foreground)
            axis.setTextPen(foreground)
            axis.setStyle(tickFont=font)
            # the label's style is kept by later setLabel calls that pass none
            axis.labelStyle = {"color": foreground.name(),
                               "font-size": f"{font.pointSizeF():g}pt"}
            axis._updateLabel()
        plot.titleLabel.setAttr("color", foreground)
        plot.titleLabel.setAttr("size", f"{font.pointSizeF():g}pt")
        if plot.titleLabel.text:
            plot.titleLabel.setText(plot.titleLabel.text)


def style_bar(bar: Any, palette: QPalette, point_size: float | None = None) -> None:
    """A colour bar's axis and label in the palette's text colour (`style_graphics` styles the
    plots' axes only; the bar's would keep pyqtgraph's grey when made first); with
    ``point_size``, in that size."""
    from PySide6.QtGui import QFont

    foreground = palette.text().color()
    font = QFont()
    if point_size is not None:
        font.setPointSizeF(point_size)
    bar.axis.setPen(foreground)
    bar.axis.setTextPen(foreground)
    bar.axis.setStyle(tickFont=font)
    label = bar.getAxis("bottom" if bar.horizontal else "left")  # (the bar's label is there)
    label.labelStyle = {"color": foreground.name(), "font-size": f"{font.pointSizeF():g}pt"}
    label._updateLabel()  # (as `style_graphics` does: setLabel keeps an earlier colour)


def legend_style(legend: Any, palette: QPalette, point_size: float | None = None) -> None:
    """A legend on an opaque background with a frame, its text in the palette's colour."""
    import pyqtgraph as pg

    base, text = palette.base().color(), palette.text().color()
    legend.setBrush(pg.mkBrush(base))
    legend.setPen(pg.mkPen(palette.mid().color()))
    legend.setLabelTextColor(text)
    if point_size is not None:
        legend.setLabelTextSize(f"{point_size:g}pt")
    for _, label in legend.items:  # entries already there: redrawn in the new colour and size
        label.setText(label.text, color=text.name(),
                      size=legend.opts["labelTextSize"])


def legend_row(graphics: Any, columns: int, spacing: int = 12, margin: int = 4,
               scaled: bool = True, **place: int) -> tuple[Any, Any]:
    """A legend in a row of its own above the plots of ``graphics`` (a GraphicsLayoutWidget,
    at ``place``: row, col, colspan), so it never covers a point; returns (the row's layout,
    the LegendItem). ``scaled``: laid out like the plots and scaled with them (pyqtgraph's
    legends float over a zoomable view and ignore transformations; an exported figure is drawn
    larger than the screen's). Its height is set once filled, with the row's
    ``layout.setRowFixedHeight``."""
    import pyqtgraph as pg

    row = graphics.addLayout(**{"row": 0, "col": 0, **place})
    row.setContentsMargins(0, 0, 0, 0)
    legend = pg.LegendItem(colCount=columns, horSpacing=spacing, verSpacing=-6)
    legend.layout.setContentsMargins(margin, 0, margin, 0)
    if scaled:
        legend.setFlag(legend.GraphicsItemFlag.ItemIgnoresTransformations, False)
    row.addItem(legend, row=0, col=0)
    return row, legend


class FollowsPalette:
    """A panel whose plots follow the palette (a light or dark theme chosen while it is shown):
    mix in before QWidget; the panel's ``_restyle()`` runs on each palette change."""

    def changeEvent(self, event: Any) -> None:  # noqa: N802 - Qt override
        from PySide6.QtCore import QEvent

        if event.type() == QEvent.Type.PaletteChange:
            self._restyle()  # type: ignore[attr-defined]
        super().changeEvent(event)  # type: ignore[misc]
