"""The context dynamics tab (../shared/ANALYSIS.md A5): how the patches grow as the context is read.

Run on demand (Run dynamics, Ctrl+D) with the window's context, query, model and options; the
result is a `core.dynamics.Dynamics` record (`set_record`), so a session reopens it without
recomputing. Shown:

- the context as text, every token on the colour of its share of the increments (or of its
  increment's lens logit for the answer token); hovering a token gives its increment per layer,
  its share and its lens logit, clicking it marks it in the plots;
- a layer x context-token heatmap of each layer's increments as shares of that layer's total
  (which tokens moved that layer), clicking a row chooses the layer;
- for the chosen layer (or summed over all layers) the patch norm |P_{l,i}| over the prefixes
  i = 0..n and the increments |P_{l,i} - P_{l,i-1}|;
- the increments' lens logit for the answer token per context token.

Keys: Ctrl+D runs, Esc cancels (the window's), [ and ] choose the previous or next layer, C
switches the text's colouring.
"""

from __future__ import annotations

import html
import math
from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QEvent, QRectF, Qt, QUrl, Signal
from PySide6.QtGui import QColor, QCursor, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSplitter,
    QTextBrowser,
    QToolTip,
    QVBoxLayout,
    QWidget,
)

from ...core.dynamics import SHRINKING, Dynamics, trend
from ..report_analysis import token_label
from ..theme import OKABE_ITO, series_colors, style_bar, style_graphics
from .lens_panel import COLORMAP, QtColorScale, visible
from .plots_panel import TokenAxis

NO_DYNAMICS = ("No context dynamics yet. Press Run dynamics (Ctrl+D): the context is read token "
               "by token with the query fixed, one comparison step per context prefix, and each "
               "context token's share of the patch's growth is shown here.")
HINT = ("Hover a token or a heatmap cell for its numbers; click a token to mark it, a heatmap "
        "row to choose its layer. Keys: [ and ] layer, C colouring.")
ALL = "all layers"
COLOURINGS = ("share of the increments", "lens logit for the answer")
#: the share colouring: from the background (no share) to vermillion (the largest share)
SHARE_TOP = QColor(OKABE_ITO["vermillion"])
HEATMAP = "viridis"


def layer_view(d: Dynamics, row: int | None) -> dict[str, np.ndarray]:
    """The curves of one layer (``row`` in ``d.layers``' order) or, with None, summed over the
    layers: ``norm`` (n + 1,) |P_i| for i = 0..n, ``increment`` (n,), ``share`` (n,) of the
    increments (summing to 1), ``lens`` (n,) the increments' lens logit for the answer."""
    if row is None:
        return {"norm": d.norm.sum(0), "increment": d.increment.sum(0), "share": d.attribution,
                "lens": d.lens_logit}
    return {"norm": d.norm[row], "increment": d.increment[row],
            "share": d.attribution_by_layer[row], "lens": d.lens_increment[row]}


def share_colour(share: float, top: float, base: QColor) -> QColor:
    """``base`` blended towards `SHARE_TOP` by ``share / top`` (0: ``base`` itself)."""
    t = 0.0 if not (top > 0 and math.isfinite(share)) else max(0.0, min(1.0, share / top))
    return QColor(*(round(a + t * (b - a)) for a, b in zip(
        base.getRgb()[:3], SHARE_TOP.getRgb()[:3], strict=True)))


def _number(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{x:+.3g}"


class ContextAxis(TokenAxis):
    """The context-token axis: integer ticks labelled with the tokens' texts (as many as fit:
    pyqtgraph hides the labels that would overlap)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.labels: list[str] = []

    def tickStrings(self, values: list[float], scale: float, spacing: float) -> list[str]:  # noqa: N802
        out = []
        for v in values:
            i = int(round(v))
            out.append(token_label(self.labels[i - 1]) if 1 <= i <= len(self.labels)
                       else str(i))
        return out


class LayerAxis(TokenAxis):
    """The heatmap's layer axis: rows 0..L-1 labelled with their layers, as many as fit."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.layers: list[int] = []

    def tickStrings(self, values: list[float], scale: float, spacing: float) -> list[str]:  # noqa: N802
        rows = [int(round(v)) for v in values]
        return [str(self.layers[i]) if 0 <= i < len(self.layers) else "" for i in rows]


class _ShareScale(QtColorScale):
    """The share colouring's scale: 0 .. the largest share, as percentages."""

    def labels(self) -> list[tuple[float, str]]:
        lo, hi = self.levels
        return [(f, f"{100 * (lo + f * (hi - lo)):.3g}%") for f in (0.0, 0.25, 0.5, 0.75, 1.0)]


class QtDynamicsPanel(QWidget):
    """The context dynamics of the window's context (`set_record`), run on request."""

    #: Run dynamics was pressed (the window checks and starts the job)
    run_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.record: dict[str, Any] | None = None  # the result as its JSON record
        self.result: Dynamics | None = None
        self.selected: int | None = None  # the marked context token (0-based)
        self.run_button = QPushButton("Run dynamics (Ctrl+D)")
        self.run_button.setToolTip("Read the context token by token with the query fixed: one "
                                   "comparison step per context prefix (Esc cancels)")
        self.run_button.clicked.connect(self.run_requested.emit)
        self.layer = QComboBox()
        self.layer.setToolTip("The layer whose curves and shares are shown, or all layers "
                              "summed ([ and ] step through them)")
        self.colouring = QComboBox()
        self.colouring.addItems(COLOURINGS)
        self.colouring.setToolTip("What the context's colours show (C switches)")
        top = QHBoxLayout()
        top.setContentsMargins(0, 0, 0, 0)
        top.addWidget(self.run_button)
        top.addWidget(QLabel("Layer"))
        top.addWidget(self.layer)
        top.addWidget(QLabel("Colour the context by"))
        top.addWidget(self.colouring)
        top.addStretch(1)
        self.message = QLabel(NO_DYNAMICS)
        self.message.setWordWrap(True)
        self.summary = QLabel()
        self.summary.setWordWrap(True)
        self.summary.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.readout = QLabel(HINT)
        self.readout.setTextFormat(Qt.TextFormat.PlainText)
        self.readout.setMinimumWidth(10)  # a long line is cut, never widens the window
        self.text = QTextBrowser()
        font = self.text.font()
        font.setPointSizeF(font.pointSizeF() * 1.25)
        self.text.setFont(font)
        self.text.setOpenLinks(False)
        self.text.setMouseTracking(True)
        self.text.highlighted.connect(self._on_token_hover)
        self.text.anchorClicked.connect(self._on_token_clicked)
        self.share_scale = _ShareScale()
        self.share_scale.cmap = pg.ColorMap([0.0, 1.0], [QColor("white"), SHARE_TOP])
        self.lens_scale = QtColorScale()
        self.scale_caption = QLabel()
        self.scale_caption.setWordWrap(True)
        left = QWidget()
        lv = QVBoxLayout(left)
        lv.setContentsMargins(0, 0, 0, 0)
        lv.addWidget(self.text, 1)
        lv.addWidget(self.share_scale)
        lv.addWidget(self.lens_scale)
        lv.addWidget(self.scale_caption)
        self.graphics = pg.GraphicsLayoutWidget()
        self._build_plots()
        self.splitter = QSplitter()
        self.splitter.addWidget(left)
        self.splitter.addWidget(self.graphics)
        self.splitter.setStretchFactor(0, 1)
        self.splitter.setStretchFactor(1, 2)
        self.splitter.setSizes([330, 670])
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(top)
        layout.addWidget(self.message)
        layout.addWidget(self.summary)
        layout.addWidget(self.readout)
        layout.addWidget(self.splitter, 1)
        self.layer.currentIndexChanged.connect(lambda _: self._redraw())
        self.colouring.currentIndexChanged.connect(lambda _: self._colour_text())
        for keys, slot in (("[", lambda: self.step_layer(-1)), ("]", lambda: self.step_layer(1)),
                           ("C", self._switch_colouring)):
            shortcut = QShortcut(QKeySequence(keys), self)
            shortcut.setContext(Qt.ShortcutContext.WidgetWithChildrenShortcut)
            shortcut.activated.connect(slot)
        self._hover = pg.SignalProxy(self.graphics.scene().sigMouseMoved, rateLimit=30,
                                     slot=self._on_plot_hover)
        self.graphics.scene().sigMouseClicked.connect(self._on_plot_click)
        self._restyle()
        self.set_record(None)

    def _build_plots(self) -> None:
        g = self.graphics
        self.heat = g.addPlot(row=0, col=0, axisItems={"bottom": TokenAxis("bottom"),
                                                       "left": LayerAxis("left")})
        self.heat.setLabel("left", "layer")
        self.heat.setTitle("each layer's increments as shares (a row sums to 100%)")
        self.heat.setMenuEnabled(False)
        self.heat.setMouseEnabled(False, False)
        self.heat.hideButtons()
        self.image = pg.ImageItem(axisOrder="row-major")
        self.heat.addItem(self.image)
        self.image.setColorMap(pg.colormap.get(HEATMAP))
        self.bar = pg.ColorBarItem(values=(0, 1), colorMap=pg.colormap.get(HEATMAP),
                                   label="share (%)", interactive=False, width=12)
        self.bar.setImageItem(self.image)
        g.addItem(self.bar, row=0, col=1)
        self.curves = g.addPlot(row=1, col=0, axisItems={"bottom": TokenAxis("bottom")})
        self.curves.setLabel("left", "norm")
        self.curves.showGrid(x=False, y=True, alpha=0.2)
        self.norm_curve = self.curves.plot([], [], symbol="o", symbolSize=5)
        self.increment_curve = self.curves.plot([], [], symbol="s", symbolSize=5)
        self.lens_plot = g.addPlot(row=2, col=0, axisItems={"bottom": ContextAxis("bottom")})
        self.lens_plot.setLabel("left", "logit")
        self.lens_plot.setLabel("bottom", "context token i (the prefix of length i ends there)")
        self.lens_plot.showGrid(x=False, y=True, alpha=0.2)
        self.lens_bars = pg.BarGraphItem(x=[], height=[], width=0.7)
        self.lens_plot.addItem(self.lens_bars)
        self.lens_plot.addItem(pg.InfiniteLine(pos=0, angle=0, pen=pg.mkPen((128, 128, 128))))
        for plot in (self.curves, self.lens_plot):
            plot.setXLink(self.heat)
            plot.setMenuEnabled(False)
            plot.setMouseEnabled(False, False)
            plot.hideButtons()
        self.cursors = []
        for plot in (self.heat, self.curves, self.lens_plot):
            line = pg.InfiniteLine(angle=90, movable=False)
            line.hide()
            plot.addItem(line)
            self.cursors.append(line)
        for plot in (self.heat, self.curves, self.lens_plot):  # (their x axes aligned)
            plot.getAxis("left").setWidth(self.fontMetrics().horizontalAdvance("−0.0001") + 28)
        g.ci.layout.setRowStretchFactor(0, 3)
        g.ci.layout.setRowStretchFactor(1, 2)
        g.ci.layout.setRowStretchFactor(2, 2)

    def changeEvent(self, event: QEvent) -> None:  # noqa: N802 - Qt override
        if event.type() == QEvent.Type.PaletteChange:
            self._restyle()
            self._colour_text()
        super().changeEvent(event)

    def _restyle(self) -> None:
        style_graphics(self.graphics, [self.heat, self.curves, self.lens_plot], self.palette())
        style_bar(self.bar, self.palette(), self.font().pointSizeF())

        colours = series_colors(self.palette())
        for curve, colour in ((self.norm_curve, colours["patched"]),
                              (self.increment_curve, colours["control"])):
            curve.setPen(pg.mkPen(colour, width=2))
            curve.setSymbolBrush(colour)
            curve.setSymbolPen(pg.mkPen(colour))
        for line in self.cursors:
            line.setPen(pg.mkPen(colours["cursor"], width=1.5))

    # -- filling ------------------------------------------------------------------------------
    def set_record(self, record: dict[str, Any] | None) -> None:
        """Show a dynamics record (`core.dynamics.Dynamics.to_dict`, as the job gives it or a
        session holds it), or the hint to run it (None).

        Raises:
            UserError: a record that `core.dynamics_record.read_dynamics` refuses (the tab is
                then unchanged).
        """
        if record is None:
            self.record = self.result = None
            self.selected = None
            self.text.clear()
            self.image.clear()
            for curve in (self.norm_curve, self.increment_curve):
                curve.setData([], [])
            self.lens_bars.setOpts(x=[], height=[])
            self.message.setText(NO_DYNAMICS)
            self.message.show()
            for widget in (self.summary, self.readout, self.splitter, self.layer,
                           self.colouring):
                widget.setVisible(False)
            return
        from ...core.dynamics_record import read_dynamics

        result = read_dynamics(record, "the dynamics")
        self.record, self.result, self.selected = record, result, None
        self.layer.blockSignals(True)
        self.layer.clear()
        self.layer.addItems([ALL, *(f"layer {layer}" for layer in result.layers)])
        self.layer.blockSignals(False)
        self.message.hide()
        for widget in (self.summary, self.readout, self.splitter, self.layer, self.colouring):
            widget.setVisible(True)
        self.readout.setText(HINT)
        self.summary.setText(self.summary_html())
        self._draw_heatmap()
        self._redraw()

    def summary_html(self) -> str:
        d = self.result
        if d is None:
            return ""
        n, s = len(d.context_ids), d.settings
        first, last = trend(d.increment.sum(0))
        ratio = last / first if first > 0 else math.nan
        verdict = ("shrinking" if ratio < SHRINKING else "growing" if ratio > 1 / SHRINKING
                   else "about flat")
        top = sorted(range(n), key=lambda i: -d.attribution[i])[:3]
        tops = ", ".join(f"{html.escape(repr(visible(d.context_tokens[i])))} "
                         f"{100 * d.attribution[i]:.1f}%" for i in top)
        seconds = d.seconds.get("total")
        took = f", {seconds:.1f} s" if isinstance(seconds, float | int) else ""
        return (f"Answer <b>{html.escape(repr(d.answer[1]))}</b> to the query "
                f"{html.escape(repr(str(s.get('query', ''))))} · {n} context tokens · "
                f"{len(d.layers)} patched layers · {html.escape(str(s.get('model', '')))}, "
                f"{html.escape(str(s.get('method', '')))}{took}<br>Increments (summed over "
                f"layers) <b>{verdict}</b>: last third {last:.3g} against first third "
                f"{first:.3g} · largest shares: {tops}")

    def _row(self) -> int | None:
        """The chosen layer's row in the result (None: all layers)."""
        index = self.layer.currentIndex()
        return index - 1 if index > 0 else None

    def step_layer(self, delta: int) -> None:
        if self.result is not None:
            self.layer.setCurrentIndex(max(0, min(self.layer.count() - 1,
                                                  self.layer.currentIndex() + delta)))

    def _switch_colouring(self) -> None:
        self.colouring.setCurrentIndex(1 - self.colouring.currentIndex())

    def _draw_heatmap(self) -> None:
        d = self.result
        assert d is not None
        shares = d.attribution_by_layer  # (L, n)
        n, rows = len(d.context_ids), len(d.layers)
        top = float(np.nanmax(shares)) if shares.size and np.nanmax(shares) > 0 else 1.0
        # drawn in percent: the colour bar's axis (45 px) holds "10", never "0.10"
        self.image.setImage(100 * shares, autoLevels=False, levels=(0.0, 100 * top))
        self.bar.setLevels((0.0, 100 * top))
        self.image.setRect(QRectF(0.5, -0.5, n, rows))
        self.heat.getAxis("left").layers = list(d.layers)  # (labels as many as the height holds)
        self.heat.getAxis("left").picture = None
        self.heat.vb.setLimits(xMin=0, xMax=n + 1)
        self.heat.setXRange(0, n + 0.5, padding=0)
        self.heat.setYRange(-0.5, rows - 0.5, padding=0)

    def _redraw(self) -> None:
        d = self.result
        if d is None:
            return
        view = layer_view(d, self._row())
        n = len(d.context_ids)
        self.norm_curve.setData(np.arange(n + 1, dtype=float), view["norm"])
        self.increment_curve.setData(np.arange(1, n + 1, dtype=float), view["increment"])
        where = "summed over layers" if self._row() is None else self.layer.currentText()
        colours = series_colors(self.palette())
        self.curves.setTitle(f"<span style='color:{colours['patched']}'>● |P<sub>i</sub>|</span>"
                             f" and <span style='color:{colours['control']}'>■ increment "
                             f"|P<sub>i</sub> − P<sub>i−1</sub>|</span>, {where}")
        lens = view["lens"]
        keep = np.isfinite(lens)
        x = np.arange(1, n + 1, dtype=float)[keep]
        colours = [series_colors(self.palette())["mismatch"] if v > 0 else
                   series_colors(self.palette())["patched"] for v in lens[keep]]
        self.lens_bars.setOpts(x=x, height=lens[keep], brushes=colours, pens=colours)
        self.lens_plot.setTitle(f"lens logit for the answer {visible(d.answer[1])!r}, {where}")
        self.lens_plot.getAxis("bottom").labels = list(d.context_tokens)
        self.lens_plot.getAxis("bottom").picture = None  # (redrawn with the new labels)
        self.heat.setXRange(0, n + 0.5, padding=0)
        self._colour_text()

    # -- the context as text -------------------------------------------------------------------
    def token_values(self) -> tuple[np.ndarray, str]:
        """What colours the tokens now: (values (n,), "share" or "lens")."""
        assert self.result is not None
        view = layer_view(self.result, self._row())
        if self.colouring.currentIndex() == 0:
            return view["share"], "share"
        return view["lens"], "lens"

    def token_colours(self) -> list[QColor]:
        """Each context token's background colour in the text, in context order."""
        if self.result is None:
            return []
        values, kind = self.token_values()
        finite = values[np.isfinite(values)]
        base = self.text.palette().base().color()
        if kind == "share":
            top = float(finite.max()) if finite.size else 0.0
            return [share_colour(float(v), top, base) for v in values]
        half = float(np.abs(finite).max()) if finite.size and np.abs(finite).max() > 0 else 1.0
        cmap = pg.colormap.get(COLORMAP)
        return [cmap.map(0.5 + 0.5 * max(-1.0, min(1.0, float(v) / half)), mode="qcolor")
                if math.isfinite(v) else QColor(170, 170, 170) for v in values]

    def _colour_text(self) -> None:
        d = self.result
        if d is None:
            return
        values, kind = self.token_values()
        finite = values[np.isfinite(values)]
        spans = []
        for i, (token, colour) in enumerate(zip(d.context_tokens, self.token_colours(),
                                                strict=True)):
            ink = "#ffffff" if colour.lightness() < 110 else "#000000"
            shown = html.escape(token.replace("\r", "␍").replace("\t", "→"), quote=False)
            shown = shown.replace("\n", "↵<br>") or "∅"
            frame = ("border-bottom:2px solid black; font-weight:bold;"
                     if i == self.selected else "")
            spans.append(f'<a href="#t{i}" style="background-color:{colour.name()};'
                         f'color:{ink};text-decoration:none;{frame}">{shown}</a>')
        self.text.setHtml(f'<div style="white-space:pre-wrap; line-height:150%">'
                          f'{"".join(spans)}</div>')
        where = "summed over layers" if self._row() is None else self.layer.currentText()
        self.share_scale.setVisible(kind == "share")
        self.lens_scale.setVisible(kind == "lens")
        if kind == "share":
            self.share_scale.set_levels(0.0, float(finite.max()) if finite.size else 1.0)
            self.scale_caption.setText(f"Colour: each token's share of the increments "
                                       f"({where}).")
        else:
            half = float(np.abs(finite).max()) if finite.size else 1.0
            self.lens_scale.set_levels(-half, half)
            self.scale_caption.setText(
                f"Colour: each token's increment of the lens logit for the answer "
                f"{visible(d.answer[1])!r} ({where}; red raises it, blue lowers it).")

    def token_text(self, i: int) -> str:
        """Context token ``i`` (0-based) in words: share, increment per layer, lens logit."""
        d = self.result
        if d is None or not 0 <= i < len(d.context_ids):
            return ""
        per_layer = ", ".join(f"{layer}: {d.increment[j, i]:.3g}"
                              for j, layer in enumerate(d.layers))
        row = self._row()
        own = ("" if row is None else f" (layer {d.layers[row]}: "
               f"{100 * d.attribution_by_layer[row, i]:.1f}%)")
        return (f"token {i + 1} {visible(d.context_tokens[i])!r} · share "
                f"{100 * d.attribution[i]:.1f}%{own} · lens logit for "
                f"{visible(d.answer[1])!r} {_number(float(d.lens_logit[i]))} · increment per "
                f"layer {per_layer} · the prefix's own answer "
                f"{visible(d.prefix_tokens[i])!r}")

    def _on_token_hover(self, url: QUrl) -> None:
        text = self.token_text(int(url.fragment()[1:])) if url.fragment().startswith("t") else ""
        self.readout.setText(text or HINT)
        if text:
            QToolTip.showText(QCursor.pos(), text.replace(" · ", "\n"), self.text)
        else:
            QToolTip.hideText()

    def _on_token_clicked(self, url: QUrl) -> None:
        if url.fragment().startswith("t"):
            self.select(int(url.fragment()[1:]))

    def select(self, i: int | None) -> None:
        """Mark context token ``i`` (0-based) in the text and the plots (None: none)."""
        self.selected = i
        for line in self.cursors:
            line.setVisible(i is not None)
            if i is not None:
                line.setValue(i + 1)
        self._colour_text()

    # -- the plots -----------------------------------------------------------------------------
    def cell_text(self, row: int, i: int) -> str:
        """The heatmap's cell (layer row ``row``, context token ``i``, from 0) in words."""
        d = self.result
        if d is None or not (0 <= row < len(d.layers) and 0 <= i < len(d.context_ids)):
            return ""
        return (f"layer {d.layers[row]} · token {i + 1} {visible(d.context_tokens[i])!r} · "
                f"increment {d.increment[row, i]:.4g} · share "
                f"{100 * d.attribution_by_layer[row, i]:.1f}% of the layer's · |P| "
                f"{d.norm[row, i + 1]:.4g} · lens logit "
                f"{_number(float(d.lens_increment[row, i]))}")

    def _plot_at(self, pos: Any) -> tuple[str, float, float] | None:
        for name, plot in (("heat", self.heat), ("curves", self.curves),
                           ("lens", self.lens_plot)):
            if plot.sceneBoundingRect().contains(pos):
                point = plot.vb.mapSceneToView(pos)
                return name, point.x(), point.y()
        return None

    def _on_plot_hover(self, args: tuple[Any, ...]) -> None:
        d, found = self.result, self._plot_at(args[0])
        text = ""
        if d is not None and found is not None:
            name, x, y = found
            i = int(round(x)) - 1
            if name == "heat":
                text = self.cell_text(int(round(y)), i)
            elif name == "curves" and -1 <= i < len(d.context_ids):
                view = layer_view(d, self._row())
                text = (f"prefix {i + 1}: |P| {view['norm'][i + 1]:.4g}" +
                        (f" · increment of token {i + 1} {visible(d.context_tokens[i])!r} "
                         f"{view['increment'][i]:.4g}" if i >= 0 else " (no context: 0)"))
            elif name == "lens" and 0 <= i < len(d.context_ids):
                view = layer_view(d, self._row())
                text = (f"token {i + 1} {visible(d.context_tokens[i])!r} · lens logit for "
                        f"{visible(d.answer[1])!r} {_number(float(view['lens'][i]))}")
        self.readout.setText(text or HINT)
        self.graphics.setToolTip(text)

    def _on_plot_click(self, event: Any) -> None:
        found = self._plot_at(event.scenePos())
        if self.result is None or found is None:
            return
        name, x, y = found
        i = int(round(x)) - 1
        if name == "heat" and 0 <= int(round(y)) < len(self.result.layers):
            self.layer.setCurrentIndex(int(round(y)) + 1)
        if 0 <= i < len(self.result.context_ids):
            self.select(i)

    def heatmap(self) -> np.ndarray:
        """The heatmap's values as drawn, as shares (layers x context tokens; for tests)."""
        image = self.image.image
        return np.zeros((0, 0)) if image is None else np.asarray(image) / 100
