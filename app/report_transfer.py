"""The report's "Transfer" section (../shared/ANALYSIS.md A3), from a run record's
``analysis.transfer`` (`core.transfer.transfer`): the source x target heatmap of the retained
effect R on a fixed [-1, 1] (an R below -1 drawn at -1, and said so), beside it the mean patch's
and the previous token's R over the target tokens with the diagonal for reference (one figure,
`TRANSFER`, PNG and SVG like the other sections'), the one line of `core.analysis
.transfer_caveat` where the diagonal cannot reproduce the run, and a table of the means and the
tokens that match. The numbers here are also the Transfer tab's (`app.panels.transfer_panel`).

`app.report_analysis` places the section after the lens and the geometry; a record without the
transfer gives neither the section nor the figure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..core.analysis import transfer_caveat, transfer_means
from .report_analysis import TRANSFER, _esc, _figure_html, _heatmap, token_label

#: the figure's size in the report, in CSS pixels (as `app.report.PLOT_SIZE`)
TRANSFER_SIZE = (670, 330)
#: the heatmap's fixed colour scale; an R below its low end is drawn at it
TRANSFER_LEVELS = (-1.0, 1.0)


# -- the numbers --------------------------------------------------------------------------------
def _floats(values: Sequence[Any]) -> np.ndarray:
    return np.array([np.nan if x is None else float(x) for x in values], dtype=float)


def transfer_arrays(section: dict[str, Any]) -> dict[str, np.ndarray]:
    """A transfer section as arrays (None as NaN): ``retained``, ``match`` (bool), ``linf``,
    ``relative_linf``: T x T, rows = source step, columns = target step; ``diagonal``,
    ``mean``, ``previous``: [T] (R of each step's own patches, of the mean patch, of the
    previous step's patch; NaN at t = 0 for the last)."""
    r = section.get("retained") or []
    n = len(r)

    def square(key: str) -> np.ndarray:
        rows = section.get(key) or []
        return np.array([_floats(row) for row in rows], dtype=float).reshape(n, n)

    retained = square("retained")
    return {"retained": retained,
            "match": np.array([[bool(x) for x in row] for row in section.get("match") or []],
                              dtype=bool).reshape(n, n),
            "linf": square("linf"), "relative_linf": square("relative_linf"),
            "diagonal": np.diagonal(retained).copy(),
            "mean": _floats(section.get("mean") or [np.nan] * n),
            "previous": _floats(section.get("previous") or [np.nan] * n)}


def step_tokens(record: dict[str, Any]) -> list[str]:
    """The texts of a run record's generated tokens (the model with the context's), in order."""
    return [str((s.get("baseline_token") or {}).get("text", "")) for s in record.get("steps") or []]


def clipped_below(m: np.ndarray, low: float = TRANSFER_LEVELS[0]) -> tuple[int, float | None]:
    """How many finite entries of ``m`` lie below ``low`` (drawn at ``low``), and the lowest."""
    below = m[np.isfinite(m) & (m < low)]
    return int(below.size), (float(below.min()) if below.size else None)


def transfer_counts(section: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Token matches as (matching, of how many): the diagonal, off the diagonal, the mean
    patch and the previous step."""
    a = transfer_arrays(section)
    m, n = a["match"], a["match"].shape[0]
    off = ~np.eye(n, dtype=bool)
    previous = [x for x in section.get("previous_match") or [] if x is not None]
    return {"diagonal": (int(np.diagonal(m).sum()), n),
            "off_diagonal": (int(m[off].sum()), int(off.sum())),
            "mean": (sum(bool(x) for x in section.get("mean_match") or []), n),
            "previous": (sum(bool(x) for x in previous), len(previous))}


def _share(x: Any) -> str:
    return "n/a" if x is None else f"{x:.3g}"


# -- the figure ---------------------------------------------------------------------------------
class TransferFigure:
    """The source x target heatmap of the retained effect R on a fixed [-1, 1] (left; an R
    below -1 drawn at -1), and over the target tokens the mean patch's and the previous step's
    R with the diagonal for reference (right)."""

    def __init__(self, point_size: float) -> None:
        import pyqtgraph as pg
        from PySide6.QtCore import Qt

        from .panels.heatmap import LabelAxis
        from .panels.plots_panel import TokenAxis
        from .theme import legend_row, legend_style, series_colors, style_bar, style_graphics

        self.graphics = pg.GraphicsLayoutWidget()
        self.graphics.setAttribute(Qt.WidgetAttribute.WA_DontShowOnScreen)
        self.graphics.setFixedSize(*TRANSFER_SIZE)
        # the legend has a row of its own above both plots: it never covers a point
        self.legend_row, self.legend = legend_row(self.graphics, columns=3, spacing=8, colspan=2)
        self.matrix = self.graphics.addPlot(row=1, col=0, axisItems={
            "bottom": LabelAxis("bottom"), "left": LabelAxis("left")})
        self.matrix.setLabel("bottom", "target token")
        self.matrix.setLabel("left", "source token (its patches)")
        self.matrix.invertY(True)  # source 1's row at the top
        self.image, self.bar = _heatmap(self.matrix, "retained effect R")
        self.curves = self.graphics.addPlot(row=1, col=1, axisItems={"bottom": TokenAxis("bottom")})
        self.curves.setLabel("bottom", "target token")
        self.curves.setLabel("left", "R")
        self.curves.showGrid(x=False, y=True, alpha=0.2)
        self.curves.getAxis("left").setTicks([[(v, f"{v:g}") for v in (-1, -0.5, 0, 0.5, 1)]])
        self.curves.setMouseEnabled(False, False)
        self.curves.hideButtons()
        colors = series_colors(self.graphics.palette())
        grey = (128, 128, 128)  # (the reference lines: readable on light and dark)
        self.diagonal = self.curves.plot([], [], name="own (diagonal)",
                                         pen=pg.mkPen(grey, width=2, style=Qt.PenStyle.DotLine))
        self.mean = self.curves.plot([], [], name="mean patch",
                                     pen=pg.mkPen(colors["patched"], width=2), symbol="o",
                                     symbolSize=6, symbolBrush=colors["patched"],
                                     symbolPen=pg.mkPen(colors["patched"]))
        self.previous = self.curves.plot([], [], name="previous token",
                                         pen=pg.mkPen(colors["control"], width=2,
                                                      style=Qt.PenStyle.DashLine),
                                         symbol="s", symbolSize=6, symbolBrush=colors["control"],
                                         symbolPen=pg.mkPen(colors["control"]))
        self.curves.addItem(pg.InfiniteLine(pos=0, angle=0, pen=pg.mkPen(grey)))
        for curve in (self.mean, self.previous, self.diagonal):
            self.legend.addItem(curve, curve.name())
        legend_style(self.legend, self.graphics.palette(), point_size)
        self.legend.updateSize()
        self.legend_row.layout.setRowFixedHeight(0, self.legend.height() + 4)
        self.graphics.ci.layout.setColumnStretchFactor(0, 1)
        self.graphics.ci.layout.setColumnStretchFactor(1, 1)
        style_graphics(self.graphics, [self.matrix, self.curves], self.graphics.palette(),
                       point_size)
        style_bar(self.bar, self.graphics.palette(), point_size)

    def draw(self, section: dict[str, Any], tokens: Sequence[str]) -> Any:
        from PySide6.QtCore import QRectF
        from PySide6.QtWidgets import QApplication

        a = transfer_arrays(section)
        low, high = TRANSFER_LEVELS
        m = a["retained"]
        n = m.shape[0]
        self.image.setImage(np.clip(m, low, high) if n else np.full((1, 1), np.nan),
                            autoLevels=False)
        self.bar.setLevels(TRANSFER_LEVELS)  # fixed, centred at 0
        self.image.setRect(QRectF(0.5, 0.5, max(n, 1), max(n, 1)))
        self.matrix.setXRange(0.5, max(n, 1) + 0.5, padding=0)
        self.matrix.setYRange(0.5, max(n, 1) + 0.5, padding=0)
        labels = {t + 1: token_label(tokens[t]) if t < len(tokens) else str(t + 1)
                  for t in range(n)}
        for axis in ("bottom", "left"):
            self.matrix.getAxis(axis).set_labels(labels)
        x = np.arange(1, n + 1, dtype=float)
        for curve, key in ((self.mean, "mean"), (self.previous, "previous"),
                           (self.diagonal, "diagonal")):
            y = np.clip(a[key], low, None)
            keep = np.isfinite(y)
            curve.setData(x[keep], y[keep])
        self.curves.setXRange(0.5, max(n, 1) + 0.5, padding=0)
        self.curves.setYRange(low - 0.1, high + 0.1, padding=0)  # (the ±1 labels drawn)
        self.graphics.show()
        QApplication.processEvents()
        return self.graphics


# -- the HTML -----------------------------------------------------------------------------------
def clip_note(m: np.ndarray) -> str:
    """The sentence that says which entries the fixed colour scale clips ("" when none)."""
    count, lowest = clipped_below(m)
    if not count:
        return ""
    low = TRANSFER_LEVELS[0]
    return (f"{count} {'entry lies' if count == 1 else 'entries lie'} below R = {low:g} "
            f"(lowest {lowest:.3g}) and {'is' if count == 1 else 'are'} drawn at {low:g}.")


def transfer_html(section: dict[str, Any], images: dict[str, str],
                   record: dict[str, Any] | None) -> str:
    a = transfer_arrays(section)
    n = a["retained"].shape[0]
    means, counts = transfer_means(section), transfer_counts(section)
    out = [("<h2>Transfer</h2>\n<p>Does the patch set of one token work at another "
            "(ANALYSIS.md A3)? Each generated token's whole patch set, unchanged, is applied at "
            f"every other token's reduced input ({_esc(n)} x {_esc(n)}); the retained effect "
            "R(s→t) = 1 − TVD(p<sub>t</sub>, q<sub>s→t</sub>) / TVD(p<sub>t</sub>, "
            "q<sub>∅,t</sub>), with p<sub>t</sub> the full-context distribution and "
            "q<sub>∅,t</sub> the unpatched control: 1 is the context's whole effect, 0 none, "
            "below 0 harm. Rows: the source token (whose patches), columns: the target token; "
            "the colours on a fixed scale [−1, 1], centred at 0. The curves: the mean of all "
            "tokens' patch sets, and the previous token's, at each token, with the diagonal "
            "(each token's own patches) for reference. " + _esc(clip_note(a["retained"]))
            + "</p>\n")]
    caveat = transfer_caveat(record) if record else None
    if caveat:
        out.append(f"<p><b>{_esc(caveat)}</b></p>\n")
    if TRANSFER in images:
        out.append(_figure_html("Transfer: retained effect R, source x target token",
                                images[TRANSFER], TRANSFER_SIZE[0]))
    rows = [("own patches (the diagonal)", means["diagonal"], counts["diagonal"]),
            ("another token's patches (off the diagonal)", means["off_diagonal"],
             counts["off_diagonal"]),
            ("the mean patch", means["mean"], counts["mean"]),
            ("the previous token's patches", means["previous"], counts["previous"])]
    out.append("<h3>Retained effect, means</h3>\n<table class=\"transfer\"><tr><th>patches "
               "applied</th><th>mean R</th><th>tokens that match</th></tr>" + "".join(
                   f"<tr><td>{_esc(name)}</td><td>{_esc(_share(mean))}</td>"
                   f"<td>{_esc(f'{k}/{total}')}</td></tr>" for name, mean, (k, total) in rows)
               + "</table>")
    return "".join(out)


__all__ = ["TRANSFER", "TRANSFER_LEVELS", "TRANSFER_SIZE", "TransferFigure", "clip_note",
           "clipped_below", "step_tokens", "transfer_arrays", "transfer_counts", "transfer_html"]
