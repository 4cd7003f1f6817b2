"""The transfer tab (../shared/ANALYSIS.md A3): does the patch set of one token work at another?

The source x target heatmap of the retained effect ``R(s->t) = 1 - TVD(p_t, q_{s->t}) /
TVD(p_t, q_{0,t})`` (rows: the source step whose patches are applied, columns: the target step
whose reduced input they act on), on a fixed diverging scale over [-1, 1] centred on 0, an R
below -1 drawn at -1 and said so; hovering a cell gives R, the token match, the L-inf and the two
tokens. Beside it, over the target steps, the mean patch's R and the previous step's R, with the
diagonal (each step's own patches) for reference. A run whose diagonal cannot reproduce it
(method direct on a post-norm-scale model) says so in one line above the matrix
(`core.analysis.transfer_caveat`).

Everything is read from the run record's ``analysis.transfer`` (`core.transfer.transfer`), so a
run reopened from a session shows the same tab without recomputing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from ...core.analysis import transfer_caveat, transfer_means
from ..report_analysis import token_label
from ..report_transfer import (
    TRANSFER_LEVELS,
    clip_note,
    step_tokens,
    transfer_arrays,
    transfer_counts,
)
from ..theme import (
    OKABE_ITO,
    FollowsPalette,
    legend_row,
    legend_style,
    series_colors,
    style_bar,
    style_graphics,
)
from .heatmap import COLORMAP, LabelAxis, cell_under, matrix_image, show_matrix
from .lens_panel import visible
from .plots_panel import TokenAxis

NO_TRANSFER = ("No transfer in this run: tick Transfer under Analyses and run again "
               "(command line: ctxpatch compare --analyze transfer).")
NOT_FINISHED = ("This run asked for the transfer but holds none: it was cancelled before the "
                "transfer ended. Run it again (Ctrl+Return) to compute it.")
HINT = ("Hover over the matrix for R, the token match and the L∞ of one source token's patches "
        "at one target token; over the curves for their values at a token.")
DEFINITION = ("Retained effect R(s→t) = 1 − TVD(p_t, q_s→t) / TVD(p_t, q_∅,t): the patches of "
              "token s applied at token t's reduced input, against the full context (p_t) and "
              "the unpatched control (q_∅,t). 1: the context's whole effect, 0: none, below 0: "
              "harm.")
GREY = (128, 128, 128)


def _number(x: float) -> str:
    return "n/a" if not np.isfinite(x) else f"{x:+.4g}"


class QtTransferPanel(FollowsPalette, QWidget):
    """The transfer of one run, from its record (`set_record`)."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.section: dict[str, Any] | None = None
        self.arrays: dict[str, np.ndarray] = {}
        self.tokens: list[str] = []
        self.message = QLabel(NO_TRANSFER)
        self.message.setWordWrap(True)
        self.caveat = QLabel()  # why the matrix does not measure transfer, when it does not
        self.caveat.setWordWrap(True)
        self.caveat.setTextFormat(Qt.TextFormat.PlainText)
        self.caveat.setStyleSheet(f"color: {OKABE_ITO['vermillion']}; font-weight: bold;")
        self.summary = QLabel()
        self.summary.setWordWrap(True)
        self.summary.setToolTip(DEFINITION)
        self.readout = QLabel(HINT)
        self.readout.setTextFormat(Qt.TextFormat.PlainText)
        self.readout.setMinimumWidth(10)  # a long line is cut, never widens the window
        self.graphics = pg.GraphicsLayoutWidget()
        self.matrix_plot = self.graphics.addPlot(row=0, col=0, rowspan=2, axisItems={
            "bottom": LabelAxis("bottom"), "left": LabelAxis("left")})
        self.matrix_plot.setLabel("bottom", "target token (the input the patches act on)")
        self.graphics.setToolTip(DEFINITION)
        self.matrix_plot.setLabel("left", "source token (whose patches)")
        self.image = matrix_image(self.matrix_plot, TRANSFER_LEVELS)
        self.bar = pg.ColorBarItem(values=TRANSFER_LEVELS, colorMap=pg.colormap.get(COLORMAP),
                                   label="retained effect R", interactive=False, width=14)
        self.bar.setImageItem(self.image)
        self.graphics.addItem(self.bar, row=0, col=1, rowspan=2)
        # the curves' legend in a row of its own above them: it never covers a point
        self.legend_row, self.legend = legend_row(self.graphics, columns=2, scaled=False, col=2)
        self.curves_plot = self.graphics.addPlot(row=1, col=2,
                                                 axisItems={"bottom": TokenAxis("bottom")})
        self.curves_plot.setLabel("bottom", "target token")
        self.curves_plot.setLabel("left", "retained effect R")
        self.curves_plot.showGrid(x=False, y=True, alpha=0.2)
        self.curves_plot.setMenuEnabled(False)
        self.diagonal_curve = self.curves_plot.plot(
            [], [], name="own (diagonal)",
            pen=pg.mkPen(GREY, width=2, style=Qt.PenStyle.DotLine))
        self.mean_curve = self.curves_plot.plot([], [], name="mean patch", symbol="o",
                                                symbolSize=6)
        self.previous_curve = self.curves_plot.plot([], [], name="previous token",
                                                    symbol="s", symbolSize=6)
        for curve in (self.mean_curve, self.previous_curve, self.diagonal_curve):
            self.legend.addItem(curve, curve.name())
        self.curves_plot.addItem(pg.InfiniteLine(pos=0, angle=0, pen=pg.mkPen(GREY)))
        self.curves_plot.getAxis("left").setTicks(
            [[(v, f"{v:g}") for v in (-1, -0.5, 0, 0.5, 1)]])
        self.graphics.ci.layout.setColumnStretchFactor(0, 3)
        self.graphics.ci.layout.setColumnStretchFactor(2, 2)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.message)
        layout.addWidget(self.caveat)
        layout.addWidget(self.summary)
        layout.addWidget(self.readout)
        layout.addWidget(self.graphics, 1)
        self._hover = pg.SignalProxy(self.graphics.scene().sigMouseMoved, rateLimit=30,
                                     slot=self._on_hover)
        self._restyle()
        self.set_record(None)

    def _restyle(self) -> None:
        palette = self.palette()
        style_graphics(self.graphics, [self.matrix_plot, self.curves_plot], palette)
        colors = series_colors(palette)
        for curve, colour, style in ((self.mean_curve, colors["patched"], Qt.PenStyle.SolidLine),
                                     (self.previous_curve, colors["control"],
                                      Qt.PenStyle.DashLine)):
            curve.setPen(pg.mkPen(colour, width=2, style=style))
            curve.setSymbolBrush(colour)
            curve.setSymbolPen(pg.mkPen(colour))
        legend_style(self.legend, palette)
        self.legend.updateSize()
        self.legend_row.layout.setRowFixedHeight(0, self.legend.height() + 4)
        style_bar(self.bar, palette)

    # -- filling ------------------------------------------------------------------------------
    def clear(self, message: str | None = None) -> None:
        """Empty the tab (a new run), with ``message`` in its place (default: how to get it)."""
        self.section, self.arrays, self.tokens = None, {}, []
        self.image.clear()
        for curve in (self.mean_curve, self.previous_curve, self.diagonal_curve):
            curve.setData([], [])
        self.message.setText(message or NO_TRANSFER)
        self.message.show()
        for widget in (self.caveat, self.summary, self.readout, self.graphics):
            widget.hide()

    def set_record(self, record: dict[str, Any] | None, message: str | None = None) -> None:
        """Show the transfer of ``record`` (a run record), or ``message`` when it has none (a
        run that asked for it and holds none says it was cancelled)."""
        section = ((record or {}).get("analysis") or {}).get("transfer")
        if not section or not section.get("retained"):
            asked = "transfer" in ((record or {}).get("settings") or {}).get("analyze", ())
            self.clear(message or (NOT_FINISHED if record and asked else None))
            return
        assert record is not None
        self.section, self.arrays = section, transfer_arrays(section)
        n = self.arrays["retained"].shape[0]
        texts = step_tokens(record)[:n]
        self.tokens = [visible(t) for t in texts] + [""] * (n - len(texts))
        show_matrix(self.matrix_plot, self.image, self.displayed(), first=1,
                    levels=TRANSFER_LEVELS)
        labels = {t + 1: token_label(texts[t]) if t < len(texts) else str(t + 1)
                  for t in range(n)}
        for axis in ("bottom", "left"):
            self.matrix_plot.getAxis(axis).set_labels(labels)
        x = np.arange(1, n + 1, dtype=float)
        for curve, key in ((self.mean_curve, "mean"), (self.previous_curve, "previous"),
                           (self.diagonal_curve, "diagonal")):
            y = np.clip(self.arrays[key], TRANSFER_LEVELS[0], None)
            keep = np.isfinite(y)
            curve.setData(x[keep], y[keep])
        self.curves_plot.setXRange(0.5, n + 0.5, padding=0)
        self.curves_plot.setYRange(TRANSFER_LEVELS[0] - 0.1, TRANSFER_LEVELS[1] + 0.1, padding=0)
        self.matrix_plot.setTitle(f"retained effect R, source × target ({n} tokens)")
        self.curves_plot.setTitle("over the target tokens")
        caveat = transfer_caveat(record)
        self.caveat.setText(caveat or "")
        self.caveat.setVisible(bool(caveat))
        self.summary.setText(self.summary_text())
        self.message.hide()
        self.readout.setText(HINT)
        for widget in (self.summary, self.readout, self.graphics):
            widget.show()

    def displayed(self) -> np.ndarray:
        """The matrix as drawn: the record's R (rows = source, columns = target, NaN where
        undefined) with values below the scale's low end at it."""
        return np.clip(self.arrays["retained"], TRANSFER_LEVELS[0], TRANSFER_LEVELS[1])

    def summary_text(self) -> str:
        if self.section is None:
            return ""
        means, counts = transfer_means(self.section), transfer_counts(self.section)

        def part(name: str, key: str) -> str:
            value, (k, total) = means[key], counts[key]
            shown = "n/a" if value is None else f"{value:.3g}"
            return f"{name} <b>{shown}</b> ({k}/{total} match)"

        note = clip_note(self.arrays["retained"])
        return ("Mean R: " + ", ".join([part("own patches", "diagonal"),
                                       part("another token's", "off_diagonal"),
                                       part("the mean patch", "mean"),
                                       part("the previous token's", "previous")])
                + "." + (f" Colour scale fixed at [−1, 1]: {note}" if note else ""))

    # -- reading ------------------------------------------------------------------------------
    def hover_text(self, source: int, target: int) -> str:
        """The cell (source row, target column, from 0) in words; "" outside the matrix."""
        if self.section is None:
            return ""
        a = self.arrays
        n = a["retained"].shape[0]
        if not (0 <= source < n and 0 <= target < n):
            return ""
        r = a["retained"][source, target]
        clipped = " (drawn at −1)" if np.isfinite(r) and r < TRANSFER_LEVELS[0] else ""
        rel = a["relative_linf"][source, target]
        rel_text = "" if not np.isfinite(rel) else f" ({rel:.3g} of the logit scale)"
        return (f"patches of token {source + 1} {self.tokens[source]!r} at token {target + 1} "
                f"{self.tokens[target]!r} · R {_number(r)}{clipped} · token "
                f"{'matches' if a['match'][source, target] else 'does not match'} · L∞ "
                f"{_number(a['linf'][source, target]).lstrip('+')}{rel_text}")

    def curve_text(self, target: int) -> str:
        """The curves' values at one target token (from 0); "" outside them."""
        if self.section is None:
            return ""
        a = self.arrays
        n = a["retained"].shape[0]
        if not 0 <= target < n:
            return ""
        return (f"token {target + 1} {self.tokens[target]!r} · mean patch R "
                f"{_number(a['mean'][target])} · previous token's R "
                f"{_number(a['previous'][target])} · own patches R "
                f"{_number(a['diagonal'][target])}")

    def _on_hover(self, args: tuple[object, ...]) -> None:
        pos = args[0]
        text = ""
        if self.section is not None:
            cell = cell_under(self.matrix_plot, pos)  # type: ignore[arg-type]
            if cell is not None:
                text = self.hover_text(*cell)
            elif self.curves_plot.sceneBoundingRect().contains(pos):  # type: ignore[arg-type]
                point = self.curves_plot.vb.mapSceneToView(pos)
                text = self.curve_text(int(round(point.x())) - 1)
        self.readout.setText(text or HINT)
        self.graphics.setToolTip(text or DEFINITION)
