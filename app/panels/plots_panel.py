"""Per-token plots (like the paper's Figure 3): logit L-infinity difference and TVD on log
scales, token match, each with the unpatched control on the same axes, so the context's effect
and the patch's fidelity show together. Mismatches are marked; a vertical line follows the
selected token, and clicking a plot selects the nearest token.

Items are created once and updated with ``setData`` (STYLE.md 21).
"""

from __future__ import annotations

import html
import math
from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QFontMetricsF
from PySide6.QtWidgets import QCheckBox, QLabel, QVBoxLayout, QWidget

from ..state import RunState
from ..theme import FollowsPalette, legend_row, legend_style, series_colors, style_graphics

#: log plots cannot show 0; exact zeros are drawn at this floor
FLOOR = 1e-12
#: the log plots' vertical margin beyond the outermost decades that hold data, in decades
MARGIN = 0.25
#: the empty log plots' range (decades) before any data
EMPTY_DECADES = (-8, 0)
TITLES = {"linf": "logit L∞ difference", "tvd": "TVD", "match": "token match"}
LEGEND = {"patched": "patched (no context)", "control": "control (no context, unpatched)",
          "mismatch": "mismatch"}


def sci(value: float) -> str:
    """The one tick format of the log axes: 1e-6, 3e-7, 1e0, 1e2 (values given as log10)."""
    mantissa, exponent = f"{10.0 ** value:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


class DecadeAxis(pg.AxisItem):
    """A log10 axis with a tick and a label at every decade (1e-6, 1e-5, ..., 1e0), all in one
    format. Only when the decades are closer than a line of text is every 2nd (5th, ...) decade
    labelled, the others still ticked; a range inside one decade falls back to 2e-6, 5e-6..."""

    def tickValues(self, minVal: float, maxVal: float, size: float) -> list:  # noqa: N802,N803
        lo, hi = sorted((minVal, maxVal))
        first, last = math.ceil(lo - 1e-9), math.floor(hi + 1e-9)
        if last < first:  # zoomed inside a decade
            return [(1.0, [v for v in np.log10(np.arange(1, 10)) + math.floor(lo)
                           if lo <= v <= hi])]
        decades = [float(d) for d in range(first, last + 1)]
        per_decade = size / max(hi - lo, 1e-9)  # pixels
        line = QFontMetricsF(self.style["tickFont"] or self.font()).height()
        # pyqtgraph's own crowding test counts 0.8 of a line: labels may nearly touch
        step = next(k for k in (1, 2, 3, 5, 10, 20, 50, 100, 10**9)
                    if k * per_decade >= 0.8 * line)
        if step == 1:
            return [(1.0, decades)]
        return [(float(step), [d for d in decades if int(d) % step == 0]),
                (1.0, [d for d in decades if int(d) % step])]

    def tickStrings(self, values: list[float], scale: float, spacing: float) -> list[str]:  # noqa: N802
        return [sci(v) for v in values]


class TokenAxis(pg.AxisItem):
    """The generated-token axis: integer ticks only (1, 2, 3 or 5, 10, 15...), never 1.5."""

    def tickSpacing(self, minVal: float, maxVal: float, size: float) -> list:  # noqa: N802,N803
        levels = [(max(1.0, float(round(spacing))), 0.0)
                  for spacing, _ in super().tickSpacing(minVal, maxVal, size)
                  if spacing >= 1 and float(spacing).is_integer()]
        unique = list(dict.fromkeys(levels))
        return unique or [(1.0, 0.0)]

    def tickStrings(self, values: list[float], scale: float, spacing: float) -> list[str]:  # noqa: N802
        return [str(int(round(v))) for v in values]


def shown_ticks(axis: pg.AxisItem) -> list[str]:
    """The labels an axis draws at its current range and size, first level (always drawn)
    first; for tests and for looking (what `generateDrawSpecs` would write)."""
    lo, hi = axis.range
    length = axis.height() if axis.orientation in ("left", "right") else axis.width()
    levels = axis.tickValues(lo, hi, length)
    labels: list[str] = []
    for spacing, values in levels[:1]:
        labels += axis.tickStrings([v for v in values if lo <= v <= hi], 1.0, spacing)
    return labels


def legend_name(label: str) -> str:
    """An overlaid run in the legend: its number ("#2"), and "other prompt" when its label says
    so; a long legend would widen the plots past the window."""
    number = label.split(" ", 1)[0]
    return number + (" · other prompt" if label.endswith("other prompt") else "")


def token_label(step: Any) -> str:
    """The selected token in words beside its cursor: number and text, and the patched model's
    token where it differs."""
    base = step.baseline_text.replace("\n", "↵")
    text = f" {step.step + 1}: {base!r}"
    if not step.patched.match:
        text += f" → {step.patched.text.replace(chr(10), '↵')!r}"
    return text.replace("{", "{{").replace("}", "}}")  # (the label formats its text)


class QtPlotsPanel(FollowsPalette, QWidget):
    def __init__(self, state: RunState, parent: QWidget | None = None,
                 point_size: float | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self.point_size = point_size  # None: the application's font (the report asks for 10 pt)
        self.graphics = pg.GraphicsLayoutWidget()
        self.overlay = QCheckBox("Overlay the other runs of the history")
        self.overlay.setToolTip("Compare runs: every other run's patched curves on the same axes "
                                "(for example float32 direct, bfloat16 direct, bfloat16 stable)")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.comparison = QLabel()  # Figure 4 in numbers, for the overlaid runs
        self.comparison.setTextFormat(Qt.TextFormat.RichText)
        self.comparison.hide()
        layout.addWidget(self.overlay)
        layout.addWidget(self.comparison)
        layout.addWidget(self.graphics)
        self._overlay_items: list[tuple[pg.PlotItem, pg.PlotDataItem]] = []
        self._overlay_series: list[dict[str, np.ndarray]] = []
        self.plots: dict[str, pg.PlotItem] = {}
        self.curves: dict[tuple[str, str], pg.PlotDataItem] = {}
        self.marks: dict[str, pg.PlotDataItem] = {}
        self.cursors: dict[str, pg.InfiniteLine] = {}
        # the legend has a row of its own above the plots: it never covers a point
        self.legend_row, self.legend = legend_row(self.graphics, columns=4, spacing=18, margin=6)
        for row, metric in enumerate(("linf", "tvd", "match"), start=1):
            axes = {"bottom": TokenAxis("bottom")}
            if metric != "match":
                axes["left"] = DecadeAxis("left")
            plot = self.graphics.addPlot(row=row, col=0, axisItems=axes)
            plot.setLabel("left", TITLES[metric])
            for side in ("left", "bottom"):  # no "(x0.001)" SI scaling: ticks say the values
                plot.getAxis(side).enableAutoSIPrefix(False)
            plot.showGrid(x=True, y=True, alpha=0.25)
            plot.setMenuEnabled(False)  # no log/FFT menu that would undo the axes above
            if metric != "match":
                plot.setLogMode(x=False, y=True)
                plot.getAxis("left").setStyle(hideOverlappingLabels=True)  # never on a neighbour
                plot.getAxis("bottom").setStyle(showValues=False)  # the token plot has them
            else:
                plot.getAxis("left").setTicks([[(0, "no"), (1, "yes")]])
                plot.setLabel("bottom", "generated token")
            lines = metric != "match"  # token match is yes/no: markers, no zigzag lines
            self.curves[(metric, "patched")] = plot.plot(
                [], [], symbol="o", symbolSize=6 if lines else 8, name=LEGEND["patched"])
            self.curves[(metric, "control")] = plot.plot(
                [], [], symbol="s", symbolSize=5 if lines else 11, name=LEGEND["control"])
            self.marks[metric] = plot.plot([], [], pen=None, symbol="x", symbolSize=12,
                                           symbolBrush=None, name=LEGEND["mismatch"])
            # the top plot's cursor names its token (the axes count tokens; this says which)
            cursor = (pg.InfiniteLine(angle=90, movable=False, label="",
                                      labelOpts={"position": 0.9, "anchors": [(0, 0.5),
                                                                              (0, 0.5)]})
                      if metric == "linf" else pg.InfiniteLine(angle=90, movable=False))
            cursor.setVisible(False)
            plot.addItem(cursor, ignoreBounds=True)
            self.cursors[metric] = cursor
            if row > 1:
                plot.setXLink(self.plots["linf"])
            self.plots[metric] = plot
        for row, stretch in ((1, 3), (2, 3), (3, 2)):  # yes/no needs less height than decades
            self.graphics.ci.layout.setRowStretchFactor(row, stretch)
        for metric in ("linf", "tvd"):  # the room for the edge labels changes with the size
            self.plots[metric].vb.sigResized.connect(lambda *_: self._fit())
        for key in ("patched", "control"):
            self.legend.addItem(self.curves[("linf", key)], LEGEND[key])
        self.legend.addItem(self.marks["linf"], LEGEND["mismatch"])
        self.graphics.scene().sigMouseClicked.connect(self._on_click)
        # the cursor follows the mouse over the plots, at most 30 updates a second
        self._hover = pg.SignalProxy(self.graphics.scene().sigMouseMoved, rateLimit=30,
                                     slot=self._on_hover)
        self._restyle()
        self._fit()
        state.subscribe(self._on_state)

    def set_point_size(self, point_size: float | None) -> None:
        """Tick, label and legend text in this size (the report's figures: 10 pt)."""
        self.point_size = point_size
        self._restyle()

    def _restyle(self) -> None:
        """Colours and fonts from the palette: Okabe-Ito colours that read on it."""
        palette = self.palette()
        style_graphics(self.graphics, list(self.plots.values()), palette, self.point_size)
        legend_style(self.legend, palette, self.point_size)
        colors = series_colors(palette)
        self._colors = colors
        for metric in self.plots:
            lines = metric != "match"
            patched, control = colors["patched"], colors["control"]
            self.curves[(metric, "patched")].setPen(pg.mkPen(patched, width=2) if lines else None)
            self.curves[(metric, "patched")].setSymbolBrush(patched)
            self.curves[(metric, "patched")].setSymbolPen(pg.mkPen(patched))
            self.curves[(metric, "control")].setPen(
                pg.mkPen(control, width=2, style=Qt.PenStyle.DashLine) if lines else None)
            self.curves[(metric, "control")].setSymbolBrush(control if lines else None)
            self.curves[(metric, "control")].setSymbolPen(pg.mkPen(control, width=1.5))
            self.marks[metric].setSymbolPen(pg.mkPen(colors["mismatch"], width=2.5))
            self.cursors[metric].setPen(pg.mkPen(colors["cursor"], width=1.5))
        self.cursors["linf"].label.setColor(palette.text().color())
        for k, (_, item) in enumerate(self._overlay_items):
            item.setPen(self._overlay_pen(item.opts.get("overlay_index", k)))
        self._align_axes()
        self.legend.updateSize()
        self.legend_row.layout.setRowFixedHeight(0, self.legend.height() + 4)

    def _align_axes(self) -> None:
        """One width for the three left axes, so the x-linked plots line up."""
        axis = self.plots["linf"].getAxis("left")
        metrics = QFontMetricsF(axis.style["tickFont"] or axis.font())
        width = metrics.horizontalAdvance("1e-12") + metrics.height() * 1.6 + 14
        for plot in self.plots.values():
            plot.getAxis("left").setWidth(int(width))

    def _on_click(self, event: object) -> None:
        self._select_at(event.scenePos())  # type: ignore[attr-defined]

    def _on_hover(self, args: tuple[object, ...]) -> None:
        self._select_at(args[0])

    def _select_at(self, pos: object) -> None:
        for plot in self.plots.values():
            if plot.sceneBoundingRect().contains(pos):
                x = plot.vb.mapSceneToView(pos).x()
                if self.state.steps and 0.5 <= x <= len(self.state.steps) + 0.5:
                    self.state.select(int(round(x)) - 1)
                return

    def _on_state(self, event: str) -> None:
        if event in ("reset", "step", "finished"):
            self._update()
        if event in ("reset", "selection", "step"):
            self._update_cursor()

    def _update(self) -> None:
        x = np.arange(1, len(self.state.steps) + 1, dtype=float)
        bad = self.state.mismatches()
        for metric in ("linf", "tvd", "match"):
            for side in ("patched", "control"):
                y = self.state.series(side, metric)
                if metric != "match":
                    y = np.maximum(y, FLOOR)
                shown = np.isfinite(y)  # a run made without the control has none
                self.curves[(metric, side)].setData(x[shown], y[shown])
            y = self.state.series("patched", metric)
            if metric != "match":
                y = np.maximum(y, FLOOR)
            self.marks[metric].setData(bad + 1.0, y[bad] if len(bad) else np.array([]))
        self._fit()

    def _fit(self) -> None:
        """Every series inside its axes with a margin: x from half a token before the first to
        half a token after the last (while running, up to the tokens asked for), y from the
        decade below the smallest value to the decade above the largest, plus `MARGIN`."""
        n = len(self.state.steps)
        if self.state.running or not n:
            n = max(n, self.state.max_tokens or 10)
        n = max([n, 1] + [len(s["match"]) for s in self._overlay_series])
        self.plots["linf"].setXRange(0.5, n + 0.5, padding=0)  # the others are linked
        for metric in ("linf", "tvd"):
            values = [self.state.series(side, metric) for side in ("patched", "control")]
            values += [s[metric] for s in self._overlay_series if metric in s]
            y = np.concatenate(values) if values else np.array([])
            y = np.maximum(y[np.isfinite(y)], FLOOR)
            if y.size:
                lo, hi = math.floor(np.log10(y.min())), math.ceil(np.log10(y.max()))
                hi = max(hi, lo + 1)
            else:
                lo, hi = EMPTY_DECADES
            self._set_log_range(self.plots[metric], lo, hi)
        self.plots["match"].setYRange(-0.3, 1.3, padding=0)

    @staticmethod
    def _set_log_range(plot: pg.PlotItem, lo: int, hi: int) -> None:
        """Decades lo..hi, with room beyond them for half a label (labels that would cross the
        plot's edge are not drawn: see `DecadeAxis`) and at least `MARGIN` of a decade."""
        axis = plot.getAxis("left")
        line = QFontMetricsF(axis.style["tickFont"] or axis.font()).height()
        height, margin = plot.vb.height(), MARGIN
        edge = 0.6 * line + 2  # pixels from the outermost decade to the edge
        if height > 4 * edge:
            margin = max(MARGIN, edge * (hi - lo) / (height - 2 * edge))
        plot.setYRange(lo - margin, hi + margin, padding=0)

    def _update_cursor(self) -> None:
        i = self.state.selected
        for cursor in self.cursors.values():
            cursor.setVisible(i is not None)
            if i is not None:
                cursor.setValue(i + 1)
        if i is not None and i < len(self.state.steps):
            self.cursors["linf"].label.setFormat(token_label(self.state.steps[i]))

    def cursor_label(self) -> str:
        """What the cursor's label says (for tests)."""
        return str(self.cursors["linf"].label.toPlainText())

    def _overlay_pen(self, k: int) -> Any:
        colors = self._colors["overlays"]
        return pg.mkPen(colors[k % len(colors)], width=2, style=Qt.PenStyle.DotLine)

    def set_overlays(self, runs: list[tuple[str, dict[str, np.ndarray]]],
                     shown_label: str = "this run") -> None:
        """Draw other runs' patched curves: (label, {"linf"|"tvd"|"match": per-step values}),
        and a Figure-4-style line per run: token match, median and max TVD, max logit L∞.
        They are named in the legend above the plots."""
        self._set_comparison(runs, shown_label)
        named = {id(item) for _, item in self._overlay_items}
        for plot, item in self._overlay_items:
            plot.removeItem(item)
        for sample, _ in list(self.legend.items):
            if id(sample.item) in named:
                self.legend.removeItem(sample.item)
        self._overlay_items = []
        self._overlay_series = [series for _, series in runs]
        for k, (label, series) in enumerate(runs):
            pen = self._overlay_pen(k)
            for metric, values in series.items():
                y = np.maximum(values, FLOOR) if metric != "match" else values
                x = np.arange(1, len(values) + 1, dtype=float)
                if metric == "match":  # yes/no: markers, as for this run
                    item = pg.PlotDataItem(x, y, pen=None, symbol="t", symbolSize=7,
                                           symbolBrush=None, symbolPen=pen)
                else:
                    item = pg.PlotDataItem(x, y, pen=pen)
                item.opts["overlay_index"] = k
                self.plots[metric].addItem(item)
                if metric == "linf":  # (the run's number: its settings are in the table)
                    self.legend.addItem(item, html.escape(legend_name(label)))
                self._overlay_items.append((self.plots[metric], item))
        self.legend.updateSize()
        self.legend_row.layout.setRowFixedHeight(0, self.legend.height() + 4)
        self._fit()

    def _set_comparison(self, runs: list[tuple[str, dict[str, np.ndarray]]],
                        shown_label: str) -> None:
        if not runs or not self.state.steps:
            self.comparison.hide()
            return
        shown = (shown_label,
                 {m: self.state.series("patched", m) for m in ("linf", "tvd", "match")})
        rows = []
        for label, series in [shown, *runs]:
            n = len(series["match"])
            rows.append(
                f"<tr><td>{html.escape(label)}</td><td>{int(series['match'].sum())}/{n}</td>"
                f"<td>{np.median(series['tvd']):.3g}</td><td>{series['tvd'].max():.3g}</td>"
                f"<td>{series['linf'].max():.3g}</td></tr>")
        self.comparison.setText(
            "<table cellspacing=0 cellpadding=2><tr><th align=left>run</th><th>match</th>"
            "<th>median TVD</th><th>max TVD</th><th>max logit L∞</th></tr>"
            + "".join(rows) + "</table>")
        self.comparison.show()

    def point_counts(self) -> dict[str, int]:
        """How many points each curve holds (for tests)."""
        return {f"{m}/{s}": len(c.getData()[0] if c.getData()[0] is not None else [])
                for (m, s), c in self.curves.items()}

    def overlay_count(self) -> int:
        return len(self._overlay_items)
