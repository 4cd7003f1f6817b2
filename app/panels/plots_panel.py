"""Per-token plots (like the paper's Figure 3): logit L-infinity difference and TVD on log
scales, token match, each with the unpatched control on the same axes, so the context's effect
and the patch's fidelity show together. Mismatches are marked; a vertical line follows the
selected token, and clicking a plot selects the nearest token.

Items are created once and updated with ``setData`` (STYLE.md 21).
"""

from __future__ import annotations

import html

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QEvent, Qt
from PySide6.QtWidgets import QCheckBox, QLabel, QVBoxLayout, QWidget

from app.state import RunState
from app.theme import style_graphics

#: log plots cannot show 0; exact zeros are drawn at this floor
FLOOR = 1e-12
PATCHED = (40, 110, 220)
CONTROL = (120, 120, 120)
MISMATCH = (220, 40, 40)


class QtPlotsPanel(QWidget):
    def __init__(self, state: RunState, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
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
        self.plots: dict[str, pg.PlotItem] = {}
        self.curves: dict[tuple[str, str], pg.PlotDataItem] = {}
        self.marks: dict[str, pg.PlotDataItem] = {}
        self.cursors: dict[str, pg.InfiniteLine] = {}
        titles = {"linf": "logit L∞ difference", "tvd": "TVD", "match": "token match"}
        for row, metric in enumerate(("linf", "tvd", "match")):
            plot = self.graphics.addPlot(row=row, col=0)
            plot.setLabel("left", titles[metric])
            plot.showGrid(x=True, y=True, alpha=0.2)
            if metric != "match":
                plot.setLogMode(x=False, y=True)
            else:
                plot.setYRange(-0.1, 1.1)
                plot.getAxis("left").setTicks([[(0, "no"), (1, "yes")]])
                plot.setLabel("bottom", "generated token")
            if metric == "match":  # the space between "no" and "yes" is free for the legend
                plot.addLegend(offset=(-10, 18))
            self.curves[(metric, "patched")] = plot.plot(
                [], [], pen=pg.mkPen(PATCHED, width=2), symbol="o", symbolSize=5,
                symbolBrush=PATCHED, name="patched (no context)")
            self.curves[(metric, "control")] = plot.plot(
                [], [], pen=pg.mkPen(CONTROL, width=1.5, style=Qt.PenStyle.DashLine),
                name="control (no context, unpatched)")
            self.marks[metric] = plot.plot(
                [], [], pen=None, symbol="x", symbolSize=12,
                symbolPen=pg.mkPen(MISMATCH, width=2), symbolBrush=None, name="mismatch")
            cursor = pg.InfiniteLine(angle=90, movable=False, pen=pg.mkPen((200, 160, 0), width=1))
            cursor.setVisible(False)
            plot.addItem(cursor, ignoreBounds=True)
            self.cursors[metric] = cursor
            if row:
                plot.setXLink(self.plots["linf"])
            self.plots[metric] = plot
        self.graphics.scene().sigMouseClicked.connect(self._on_click)
        # the cursor follows the mouse over the plots, at most 30 updates a second
        self._hover = pg.SignalProxy(self.graphics.scene().sigMouseMoved, rateLimit=30,
                                     slot=self._on_hover)
        style_graphics(self.graphics, list(self.plots.values()), self.palette())
        state.subscribe(self._on_state)

    def changeEvent(self, event: QEvent) -> None:  # noqa: N802 - Qt override
        if event.type() == QEvent.Type.PaletteChange:
            style_graphics(self.graphics, list(self.plots.values()), self.palette())
        super().changeEvent(event)

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

    def _update_cursor(self) -> None:
        i = self.state.selected
        for cursor in self.cursors.values():
            cursor.setVisible(i is not None)
            if i is not None:
                cursor.setValue(i + 1)

    def set_overlays(self, runs: list[tuple[str, dict[str, np.ndarray]]],
                     shown_label: str = "this run") -> None:
        """Draw other runs' patched curves: (label, {"linf"|"tvd"|"match": per-step values}),
        and a Figure-4-style line per run: token match, median and max TVD, max logit L∞."""
        self._set_comparison(runs, shown_label)
        for plot, item in self._overlay_items:
            plot.removeItem(item)
            if plot.legend is not None:
                plot.legend.removeItem(item)
        if self.plots["tvd"].legend is not None and not runs:
            self.plots["tvd"].legend.clear()
        self._overlay_items = []
        tvd = self.plots["tvd"]
        if runs and tvd.legend is None:  # the overlays are named in the TVD plot's own legend
            tvd.addLegend(offset=(-10, 5))
        for k, (label, series) in enumerate(runs):
            colour = pg.intColor(k, hues=max(len(runs), 3), values=1, maxValue=200)
            for metric, values in series.items():
                y = np.maximum(values, FLOOR) if metric != "match" else values
                item = pg.PlotDataItem(np.arange(1, len(values) + 1, dtype=float), y,
                                       pen=pg.mkPen(colour, width=1.5,
                                                    style=Qt.PenStyle.DotLine))
                self.plots[metric].addItem(item)
                if metric == "tvd":
                    tvd.legend.addItem(item, label)
                self._overlay_items.append((self.plots[metric], item))

    def _set_comparison(self, runs: list[tuple[str, dict[str, np.ndarray]]],
                        shown_label: str) -> None:
        if not runs or not self.state.steps:
            self.comparison.hide()
            return
        shown = (shown_label, {m: self.state.series("patched", m) for m in ("linf", "tvd", "match")})
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
