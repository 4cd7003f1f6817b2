"""The context lens tab (../shared/ANALYSIS.md A1): per patched layer and generated token, what
the context's effect at that layer writes into the vocabulary.

A layer x token grid: each cell shows the top promoted token of the layer's whole effect
("total") and is coloured by the logit that effect adds to the token the full-context model
emitted (diverging colours centred at 0, the scale below the grid). Hovering a cell shows, and
clicking it (or moving to it with the arrow keys) pins, the top-10 promoted and suppressed
tokens of the three parts (total, mixer, MLP); beside them a per-layer bar chart of the mixer's
and the MLP's emitted logits at the selected token.

Everything is read from the run record's ``analysis.lens`` (`core.analysis.analysis_section`), so
a run reopened from a session shows the same tab without recomputing. A part that is None in the
record is not defined in that layer, and says so; it is never drawn as a zero.
"""

from __future__ import annotations

import html
import math
from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import (
    QModelIndex,
    QPersistentModelIndex,
    QRectF,
    QSize,
    Qt,
    Signal,
)
from PySide6.QtGui import (
    QBrush,
    QColor,
    QFontMetrics,
    QLinearGradient,
    QPainter,
    QPaintEvent,
    QPen,
    QTextOption,
)
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QSplitter,
    QStyle,
    QStyledItemDelegate,
    QStyleOptionViewItem,
    QTableWidget,
    QTableWidgetItem,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from ..theme import OKABE_ITO, FollowsPalette, style_graphics
from .heatmap import COLORMAP  # (blue: the layer lowers the emitted token's logit, red: raises)
from .plots_panel import TokenAxis

PART_NAMES = {"total": "total", "mixer": "mixer", "mlp": "MLP"}
#: why a part is None in a record (`core.lens.Lens.deltas`)
UNDEFINED = ("not defined in this layer: the block changes its output after v + branch (as "
             "Gemma 4's per-layer embeddings do), so the context's effect does not split into "
             "a mixer's and an MLP's part there")
UNDEFINED_TOTAL = ("not defined in this layer: the lens could not read this layer's output "
                   "at this token")
NO_LENS = ("No context lens in this run: tick Lens under Analyses and run again "
           "(command line: ctxpatch compare --analyze lens).")
KNOCKOUT_HINT = ("Knock-out: the emitted token's logit with one layer's patches dropped, the "
                 "others kept (its total effect through the later layers, where the bars are "
                 "its direct effect). One reduced pass per layer.")
HINT = ("Cells: the top token the layer's context effect promotes; colour: the logit it adds "
        "to the emitted token. Hover for the top-10 lists; click or use the arrow keys to pin.")


def visible(text: str) -> str:
    """A token's text as a cell shows it: line breaks and tabs drawn, an empty text as ∅."""
    return text.replace("\n", "↵").replace("\r", "␍").replace("\t", "⇥") or "∅"


def lens_layers(lens: dict[str, Any]) -> list[int]:
    """The layers the lens read, ascending (the grid's rows)."""
    return sorted({int(k) for s in lens.get("steps", []) for k in s.get("layers", {})})


def part_of(lens: dict[str, Any], step: int, layer: int, part: str) -> dict[str, Any] | None:
    """One part of one layer at one step, as the record holds it (None: not defined)."""
    steps = lens.get("steps", [])
    if not 0 <= step < len(steps):
        return None
    return (steps[step].get("layers", {}).get(str(layer)) or {}).get(part)


def emitted_matrix(lens: dict[str, Any], part: str = "total") -> np.ndarray:
    """The emitted token's logit added by ``part``, layers x steps (NaN where not defined)."""
    layers, steps = lens_layers(lens), lens.get("steps", [])
    out = np.full((len(layers), len(steps)), np.nan)
    for j in range(len(steps)):
        for i, layer in enumerate(layers):
            p = part_of(lens, j, layer, part)
            if p is not None and p.get("emitted") is not None:
                out[i, j] = float(p["emitted"])
    return out


def _number(x: Any) -> str:
    return "n/a" if x is None else f"{float(x):+.3g}"


def _pairs(items: list[list[Any]]) -> list[str]:
    return [f"{visible(str(t))!s} {_number(v)}" for t, v, *_ in items]


def part_text(p: dict[str, Any] | None, part: str) -> str:
    """One part in plain words: the emitted logit, then the promoted and suppressed lists."""
    name = PART_NAMES[part]
    if p is None:
        return f"{name}: {UNDEFINED_TOTAL if part == 'total' else UNDEFINED}"
    return (f"{name}: emitted token {_number(p.get('emitted'))}\n"
            f"  promoted: {', '.join(_pairs(p.get('promoted', [])))}\n"
            f"  suppressed: {', '.join(_pairs(p.get('suppressed', [])))}")


def _part_html(p: dict[str, Any] | None, part: str) -> str:
    name = PART_NAMES[part]
    if p is None:
        why = UNDEFINED_TOTAL if part == "total" else UNDEFINED
        return f"<td valign='top'><b>{name}</b><br><i>{html.escape(why)}</i></td>"

    def rows(items: list[list[Any]]) -> str:
        return "".join(f"<tr><td>{html.escape(visible(str(t)))}</td>"
                       f"<td align='right'>{_number(v)}</td></tr>" for t, v, *_ in items)

    return (f"<td valign='top'><b>{name}</b><br>emitted {_number(p.get('emitted'))}"
            f"<table cellspacing='0' cellpadding='1'><tr><td colspan='2'><u>promoted</u></td>"
            f"</tr>{rows(p.get('promoted', []))}<tr><td colspan='2'><u>suppressed</u></td></tr>"
            f"{rows(p.get('suppressed', []))}</table></td>")


class _PinnedFrame(QStyledItemDelegate):
    """Cells keep their colour when selected (a highlight would hide it, and the highlight's
    blue reads as a negative logit); the pinned cell gets a frame instead."""

    def paint(self, painter: QPainter, option: QStyleOptionViewItem,
              index: QModelIndex | QPersistentModelIndex) -> None:
        selected = bool(option.state & QStyle.StateFlag.State_Selected)
        plain = QStyleOptionViewItem(option)
        plain.state &= ~QStyle.StateFlag.State_Selected
        plain.state &= ~QStyle.StateFlag.State_HasFocus
        super().paint(painter, plain, index)
        if selected:
            painter.save()
            painter.setPen(QPen(option.palette.text().color(), 2))
            painter.drawRect(option.rect.adjusted(1, 1, -1, -1))
            painter.restore()


class QtColorScale(QWidget):
    """A horizontal colour bar with its scale, ``lo`` .. 0 .. ``hi`` (its caption is a label
    beside it, which wraps)."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.levels = (-1.0, 1.0)
        self.cmap = pg.colormap.get(COLORMAP)
        self.setMinimumHeight(2 * self.fontMetrics().height() + 8)

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt override
        return QSize(300, 2 * self.fontMetrics().height() + 8)

    def labels(self) -> list[tuple[float, str]]:
        """The scale's ticks: (fraction along the bar, text)."""
        lo, hi = self.levels
        return [(f, f"{lo + f * (hi - lo):+.3g}" if f != 0.5 else "0")
                for f in (0.0, 0.25, 0.5, 0.75, 1.0)]

    def set_levels(self, lo: float, hi: float) -> None:
        self.levels = (lo, hi)
        self.update()

    def paintEvent(self, event: QPaintEvent) -> None:  # noqa: N802 - Qt override
        painter = QPainter(self)
        fm = QFontMetrics(self.font())
        h = fm.height()
        ticks = self.labels()
        margin = max(fm.horizontalAdvance(t) for _, t in ticks) // 2 + 4
        bar = QRectF(margin, 2, max(10, self.width() - 2 * margin), h)
        gradient = QLinearGradient(bar.left(), 0, bar.right(), 0)
        for x in np.linspace(0, 1, 11):
            gradient.setColorAt(float(x), self.cmap.map(float(x), mode="qcolor"))
        painter.fillRect(bar, QBrush(gradient))
        painter.setPen(self.palette().text().color())
        painter.drawRect(bar)
        for frac, label in ticks:
            x = bar.left() + frac * bar.width()
            painter.drawLine(int(x), int(bar.bottom()), int(x), int(bar.bottom()) + 3)
            w = fm.horizontalAdvance(label)
            painter.drawText(int(x - w / 2), int(bar.bottom()) + 3 + fm.ascent(), label)
        painter.end()


class QtLensPanel(FollowsPalette, QWidget):
    """The context lens of one run, from its record (`set_record`), and the knock-out of a
    step's layers on demand (`knockout_requested`, answered by `set_knockout`)."""

    #: the step (0-based) whose layers the user asked to knock out
    knockout_requested = Signal(int)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.lens: dict[str, Any] | None = None
        self.knockouts: dict[int, dict[str, Any]] = {}  # step -> core.knockout.knockout
        self.step: int | None = None  # the pinned token
        self.layers: list[int] = []
        self.levels = 1.0  # the colour scale's half-width
        self.cmap = pg.colormap.get(COLORMAP)
        self.message = QLabel(NO_LENS)
        self.message.setWordWrap(True)
        self.readout = QLabel(HINT)  # the cell under the mouse, in one line
        self.readout.setTextFormat(Qt.TextFormat.PlainText)
        self.readout.setMinimumWidth(10)  # a long line is cut, never widens the window
        self.grid = QTableWidget(0, 0)
        self.grid.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.grid.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.grid.setMouseTracking(True)
        self.grid.setItemDelegate(_PinnedFrame(self.grid))
        self.grid.setWordWrap(False)
        self.grid.setToolTip("")
        self.grid.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Interactive)
        self.grid.horizontalHeader().setDefaultSectionSize(
            self.fontMetrics().horizontalAdvance("sauerkraut") + 8)
        self.grid.verticalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Fixed)
        self.grid.verticalHeader().setDefaultSectionSize(self.fontMetrics().height() + 6)
        self.scale = QtColorScale()
        caption = QLabel("Colour: the logit the layer's context effect adds to the emitted "
                         "token (red raises it, blue lowers it; grey: not defined).")
        caption.setWordWrap(True)
        self.details = QTextBrowser()
        self.details.setOpenLinks(False)
        # words are never broken (Qt's default breaks them anywhere when a column is narrow:
        # "internatio|nalization"); a list wider than the view scrolls
        self.details.setWordWrapMode(QTextOption.WrapMode.WordWrap)
        self.graphics = pg.GraphicsLayoutWidget()
        self.bars = self.graphics.addPlot(row=0, col=0, axisItems={"bottom": TokenAxis("bottom")})
        self.bars.setLabel("bottom", "layer")
        self.bars.setLabel("left", "emitted-token logit")
        self.bars.showGrid(x=False, y=True, alpha=0.2)
        self.bars.addLegend(offset=(10, 10))  # (top left: the layers that act are late)
        self.mixer_bars = pg.BarGraphItem(x=[], height=[], width=0.4, name="mixer",
                                          brush=OKABE_ITO["orange"])
        self.mlp_bars = pg.BarGraphItem(x=[], height=[], width=0.4, name="MLP",
                                        brush=OKABE_ITO["blue"])
        self.total_dots = pg.ScatterPlotItem(symbol="o", size=7, name="total",
                                             brush=OKABE_ITO["black"], pen=None)
        for item in (self.mixer_bars, self.mlp_bars, self.total_dots):
            self.bars.addItem(item)
        self.knockout_dots = pg.ScatterPlotItem(symbol="d", size=10, name="knock-out",
                                                brush=OKABE_ITO["vermillion"], pen=None)
        self.bars.addItem(self.knockout_dots)
        self.bars.addItem(pg.InfiniteLine(pos=0, angle=0, pen=pg.mkPen((128, 128, 128))))
        self.knockout_button = QPushButton("Knock out each layer at this token")
        self.knockout_button.setShortcut("K")
        self.knockout_button.setToolTip(KNOCKOUT_HINT + " Shortcut: K.")
        self.knockout_button.clicked.connect(self._ask_knockout)
        self.knockout_note = QLabel("")
        self.knockout_note.setWordWrap(True)
        self.knockout_note.setMinimumWidth(10)
        knock = QWidget()
        kv = QHBoxLayout(knock)
        kv.setContentsMargins(0, 0, 0, 0)
        kv.addWidget(self.knockout_button)
        kv.addStretch(1)
        below = QWidget()
        bv = QVBoxLayout(below)
        bv.setContentsMargins(0, 0, 0, 0)
        bv.addWidget(self.graphics, 1)
        bv.addWidget(knock)
        bv.addWidget(self.knockout_note)
        left = QWidget()
        lv = QVBoxLayout(left)
        lv.setContentsMargins(0, 0, 0, 0)
        lv.addWidget(self.grid, 1)
        lv.addWidget(self.scale)
        lv.addWidget(caption)
        right = QSplitter(Qt.Orientation.Vertical)
        right.addWidget(self.details)
        right.addWidget(below)
        right.setStretchFactor(0, 1)
        right.setStretchFactor(1, 1)
        self.splitter = QSplitter()
        self.splitter.addWidget(left)
        self.splitter.addWidget(right)
        self.splitter.setStretchFactor(0, 3)
        self.splitter.setStretchFactor(1, 2)
        self.splitter.setSizes([600, 400])
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.message)
        layout.addWidget(self.readout)
        layout.addWidget(self.splitter, 1)
        self.grid.cellEntered.connect(self._on_hover)
        self.grid.currentCellChanged.connect(self._on_current)
        self._restyle()
        self.set_record(None)

    def _restyle(self) -> None:
        style_graphics(self.graphics, [self.bars], self.palette())

    # -- filling ------------------------------------------------------------------------------
    def clear(self, message: str | None = None) -> None:
        """Empty the tab (a new run), with ``message`` in its place (default: how to get it)."""
        self.lens, self.layers, self.knockouts, self.step = None, [], {}, None
        self.grid.clear()
        self.grid.setRowCount(0)
        self.grid.setColumnCount(0)
        self.details.clear()
        self._set_bars(None)
        self.message.setText(message or NO_LENS)
        self.message.show()
        self.readout.hide()
        self.splitter.hide()

    def set_record(self, record: dict[str, Any] | None, message: str | None = None) -> None:
        """Show the lens of ``record`` (a run record), or ``message`` when it has none."""
        lens = ((record or {}).get("analysis") or {}).get("lens")
        if not lens or not lens.get("steps"):
            self.clear(message)
            return
        if lens is not self.lens:
            self.knockouts = {}
        self.lens, self.layers = lens, lens_layers(lens)
        steps = lens["steps"]
        emitted = emitted_matrix(lens)
        finite = np.abs(emitted[np.isfinite(emitted)])
        self.levels = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
        self.scale.set_levels(-self.levels, self.levels)
        grid = self.grid
        grid.blockSignals(True)
        grid.clear()
        grid.setRowCount(len(self.layers))
        grid.setColumnCount(len(steps))
        grid.setHorizontalHeaderLabels([f"{j + 1}\n{visible(s['token'])}"
                                        for j, s in enumerate(steps)])
        grid.setVerticalHeaderLabels([f"layer {layer}" for layer in self.layers])
        for i, layer in enumerate(self.layers):
            for j in range(len(steps)):
                grid.setItem(i, j, self._cell(j, layer, emitted[i, j]))
        grid.blockSignals(False)
        self.message.hide()
        self.readout.setText(HINT)
        self.readout.show()
        self.splitter.show()
        grid.setCurrentCell(len(self.layers) - 1, 0)
        self._on_current(len(self.layers) - 1, 0)

    def _cell(self, step: int, layer: int, value: float) -> QTableWidgetItem:
        total = part_of(self.lens or {}, step, layer, "total")
        promoted = (total or {}).get("promoted") or []
        item = QTableWidgetItem(visible(str(promoted[0][0])) if promoted else "n/a")
        if math.isfinite(value):
            colour = self.cmap.map(0.5 + 0.5 * max(-1.0, min(1.0, value / self.levels)),
                                   mode="qcolor")
        else:
            colour = QColor(170, 170, 170)
        item.setBackground(colour)
        item.setForeground(QColor("white") if colour.lightness() < 110 else QColor("black"))
        item.setToolTip(self.cell_html(step, layer))
        return item

    # -- reading ------------------------------------------------------------------------------
    def cell_text(self, step: int, layer: int) -> str:
        """One cell in plain words: layer, token, then each part's emitted logit and top-10
        lists (or why the part is not defined); "" outside the grid."""
        if self.lens is None or not 0 <= step < len(self.lens["steps"]):
            return ""
        token = visible(self.lens["steps"][step]["token"])
        head = f"layer {layer} · token {step + 1} {token!r}"
        return "\n".join([head, *(part_text(part_of(self.lens, step, layer, p), p)
                                  for p in PART_NAMES)])

    def cell_html(self, step: int, layer: int, pinned: bool = False) -> str:
        """`cell_text` as a table: one column per part (the tooltip and the pinned view)."""
        if self.lens is None or not 0 <= step < len(self.lens["steps"]):
            return ""
        token = visible(self.lens["steps"][step]["token"])
        cells = "".join(_part_html(part_of(self.lens, step, layer, p), p) for p in PART_NAMES)
        return (f"<b>layer {layer} · token {step + 1} {html.escape(repr(token))}</b>"
                f"{' (pinned)' if pinned else ''}"
                f"<table cellspacing='6'><tr>{cells}</tr></table>")

    def cell(self, step: int, row: int) -> QTableWidgetItem | None:
        return self.grid.item(row, step)

    def _on_hover(self, row: int, col: int) -> None:
        if self.lens is None or not 0 <= row < len(self.layers):
            return
        layer = self.layers[row]
        total = part_of(self.lens, col, layer, "total")
        token = visible(self.lens["steps"][col]["token"])
        top = ", ".join(_pairs(((total or {}).get("promoted") or [])[:3]))
        self.readout.setText(
            f"layer {layer} · token {col + 1} {token!r} · emitted "
            f"{_number((total or {}).get('emitted'))} · promotes {top or 'n/a'}")

    def _on_current(self, row: int, col: int, *_: int) -> None:
        if self.lens is None or not (0 <= row < len(self.layers) and col >= 0):
            return
        self.details.setHtml(self.cell_html(col, self.layers[row], pinned=True))
        self.step = col
        self._set_bars(col)

    # -- the knock-out ------------------------------------------------------------------------
    def _ask_knockout(self) -> None:
        if self.lens is not None and self.step is not None:
            self.knockout_requested.emit(self.step)

    def set_knockout(self, result: dict[str, Any]) -> None:
        """Show a step's knock-out (`core.knockout.knockout`) beside its lens bars."""
        self.knockouts[int(result["step"])] = result
        if self.step == int(result["step"]):
            self._set_bars(self.step)

    def knockout_effects(self) -> dict[int, float]:
        """The knock-out markers drawn for the pinned token (for tests): layer -> effect."""
        x, y = self.knockout_dots.getData()
        return {int(round(a)): float(b) for a, b in zip(x, y, strict=True)}

    def _set_knockout(self, step: int | None) -> None:
        result = self.knockouts.get(step) if step is not None else None
        if result is None:
            self.knockout_dots.setData([], [])
            self.knockout_note.setText("" if step is None else
                                       "Not computed for this token (press K).")
            return
        if not result.get("reproduces", True):
            self.knockout_note.setText(
                f"Knock-out not readable at this token: with every patch written into the "
                f"weights the run is {result.get('prob_gap', math.nan):.2g} in probability from "
                "the full context's (method direct's unbounded post-norm-scale patches do "
                "that): run with method stable and knock out again.")
            self.knockout_dots.setData([], [])
            return
        effect = {int(k): float(v) for k, v in result["effect"].items()}
        layers = sorted(effect)
        self.knockout_dots.setData(np.array(layers, dtype=float),
                                   np.array([effect[i] for i in layers]))
        top = max(layers, key=lambda i: abs(effect[i])) if layers else None
        self.knockout_note.setText(
            f"Knock-out at this token: emitted-token logit {result['all']:.4g} with every "
            f"patch, {result['none']:.4g} with none"
            + (f"; dropping layer {top} alone changes it most ({-effect[top]:+.4g})"
               if top is not None else "")
            + ". Diamonds: logit lost when the layer's patches are dropped.")

    def _set_bars(self, step: int | None) -> None:
        if self.lens is None or step is None:
            for bars in (self.mixer_bars, self.mlp_bars):
                bars.setOpts(x=[], height=[])
            self.total_dots.setData([], [])
            self.bars.setTitle("")
            self._set_knockout(None)
            return
        x = np.array(self.layers, dtype=float)
        series = {}
        undefined: list[int] = []
        for part in PART_NAMES:
            values = []
            for layer in self.layers:
                p = part_of(self.lens, step, layer, part)
                values.append(math.nan if p is None or p.get("emitted") is None
                              else float(p["emitted"]))
                if p is None and part != "total":
                    undefined.append(layer)
            series[part] = np.array(values)
        for bars, part, shift in ((self.mixer_bars, "mixer", -0.2), (self.mlp_bars, "mlp", 0.2)):
            keep = np.isfinite(series[part])
            bars.setOpts(x=x[keep] + shift, height=series[part][keep])
        keep = np.isfinite(series["total"])
        self.total_dots.setData(x[keep], series["total"][keep])
        token = visible(self.lens["steps"][step]["token"])
        note = (f" — parts not defined in layer(s) {', '.join(map(str, sorted(set(undefined))))}"
                if undefined else "")
        self.bars.setTitle(f"token {step + 1} {token!r}: emitted-token logit per layer{note}")
        self._set_knockout(step)

    def bar_heights(self) -> dict[str, np.ndarray]:
        """The bar chart's values (for tests): {"mixer": ..., "mlp": ...} by layer shown."""
        return {"mixer": np.asarray(self.mixer_bars.opts["height"], dtype=float),
                "mlp": np.asarray(self.mlp_bars.opts["height"], dtype=float)}
