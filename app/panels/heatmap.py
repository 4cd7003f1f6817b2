"""What the analysis tabs' heatmaps share (the Geometry and Transfer tabs; STYLE.md 21): a
matrix drawn as a row-major `ImageItem` on a diverging colour map at fixed levels, row 0 on top,
its cells edge to edge, the cell under the mouse, and an axis labelled with token texts.

The report's figures (`app.report_analysis`) use `LabelAxis` too; axis texts are
`app.report_analysis.token_label`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, QRectF
from PySide6.QtGui import QFontMetrics

#: the diverging colour map of every analysis heatmap (blue below 0, white at 0, red above)
COLORMAP = "CET-D1"


def matrix_image(plot: pg.PlotItem, levels: tuple[float, float] = (-1.0, 1.0)) -> pg.ImageItem:
    """A heatmap on ``plot``: a row-major image (row 0 on top, as a matrix reads) on the
    diverging `COLORMAP` at fixed ``levels``; the plot's context menu off."""
    image = pg.ImageItem(axisOrder="row-major")
    plot.addItem(image)
    plot.invertY(True)
    plot.setMenuEnabled(False)
    image.setColorMap(pg.colormap.get(COLORMAP))
    image.setLevels(levels)
    return image


def show_matrix(plot: pg.PlotItem, image: pg.ImageItem, m: np.ndarray, first: int = 1,
                levels: tuple[float, float] = (-1.0, 1.0)) -> None:
    """Draw ``m`` (rows x columns) with its cells centred on ``first``, ``first + 1``, ...;
    NaN cells are left blank; zoom and pan stay inside the cells."""
    rows, cols = m.shape
    image.setImage(m, autoLevels=False, levels=levels)
    image.setRect(QRectF(first - 0.5, first - 0.5, cols, rows))
    plot.vb.setLimits(xMin=first - 0.5, xMax=first - 0.5 + cols,
                      yMin=first - 0.5, yMax=first - 0.5 + rows)
    plot.setRange(xRange=(first - 0.5, first - 0.5 + cols),
                  yRange=(first - 0.5, first - 0.5 + rows), padding=0)


def cell_under(plot: pg.PlotItem, pos: QPointF, first: int = 1) -> tuple[int, int] | None:
    """The (row, column), from 0, of the cell under the scene position ``pos`` on a heatmap
    drawn by `show_matrix` with ``first``; None off the plot."""
    if not plot.sceneBoundingRect().contains(pos):
        return None
    point = plot.vb.mapSceneToView(pos)
    return int(round(point.y())) - first, int(round(point.x())) - first


class LabelAxis(pg.AxisItem):
    """An axis whose ticks are integer positions labelled with texts (tokens): every k-th
    label, k chosen so that they do not overlap at the axis' length and zoom."""

    def __init__(self, orientation: str, **kwargs: object) -> None:
        super().__init__(orientation, **kwargs)
        self.labels: dict[int, str] = {}

    def set_labels(self, labels: dict[int, str]) -> None:
        self.labels = dict(labels)
        self.picture = None
        self.update()

    def _room(self) -> float:
        """The room one label takes along the axis, in pixels."""
        metrics = QFontMetrics(self.style.get("tickFont") or self.font())
        if self.orientation in ("left", "right"):
            return metrics.height() + 2
        return max((metrics.horizontalAdvance(s) for s in self.labels.values()), default=0) + 10

    def tickValues(self, minVal: float, maxVal: float,  # noqa: N802,N803 - pyqtgraph override
                   size: float) -> list[tuple[float, list[float]]]:
        if not self.labels:
            return super().tickValues(minVal, maxVal, size)
        lo, hi = sorted((minVal, maxVal))  # (an inverted axis gives them high first)
        keys = sorted(k for k in self.labels if lo <= k <= hi)
        if not keys:
            return []
        every = max(1, math.ceil(self._room() * len(keys) / max(size, 1.0)))
        return [(float(every), [float(k) for k in keys[::every]])]

    def tickStrings(self, values: Sequence[float], scale: float,  # noqa: N802 - override
                    spacing: float) -> list[str]:
        if not self.labels:
            return super().tickStrings(values, scale, spacing)
        return [self.labels.get(int(round(v)), "") for v in values]


__all__ = ["COLORMAP", "LabelAxis", "cell_under", "matrix_image", "show_matrix"]
