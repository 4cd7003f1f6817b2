"""The geometry tab (../shared/ANALYSIS.md A2): how one parameter's patches align over the run.

For the chosen parameter (its name without the layer, as the patch explorer names it) and layer:
the token x token cosine heatmap of its patches (the Frobenius cosines of the record's ``gram``),
the layer x layer heatmap of the parameter's role at a chosen token (``across_layers``), and the
singular values of the stack of its patches with the effective rank and the rank of their sum.
Both heatmaps share one fixed diverging scale over [-1, 1]; a cell where a patch is zero (None
in the record) is left blank.

Everything is read from the run record's ``analysis.geometry`` (`core.geometry.patch_geometry`),
so a run reopened from a session shows the same tab without recomputing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QSpinBox, QVBoxLayout, QWidget

from ...core.geometry import role_of
from ..state import param_key
from ..theme import FollowsPalette, series_colors, style_bar, style_graphics
from .heatmap import COLORMAP, cell_under, matrix_image, show_matrix
from .lens_panel import visible
from .plots_panel import TokenAxis

NO_GEOMETRY = ("No patch geometry in this run: tick Geometry under Analyses and run again "
               "(command line: ctxpatch compare --analyze geometry).")
HINT = "Hover over a heatmap for the two tokens (or layers) and their cosine."


def as_matrix(rows: list[list[Any]] | None) -> np.ndarray:
    """A record's nested list as a float array, None as NaN."""
    if not rows:
        return np.zeros((0, 0))
    return np.array([[np.nan if x is None else float(x) for x in row] for row in rows])


class QtGeometryPanel(FollowsPalette, QWidget):
    """The patch geometry of one run, from its record (`set_record`)."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.geometry: dict[str, Any] | None = None
        self.tokens: list[str] = []
        #: param key (no layer) -> layer -> the record's parameter name
        self.names: dict[str, dict[int | None, str]] = {}
        self.message = QLabel(NO_GEOMETRY)
        self.message.setWordWrap(True)
        self.param = QComboBox()
        self.param.setToolTip("Which patched parameter (names without the layer prefix)")
        self.layer = QComboBox()
        self.layer.setToolTip("The layer whose patches the token x token heatmap and the "
                              "singular values show")
        self.step = QSpinBox()
        self.step.setToolTip("The token at which the layer x layer heatmap compares the layers")
        self.step.setPrefix("token ")
        top = QHBoxLayout()
        top.addWidget(QLabel("Parameter"))
        top.addWidget(self.param, 2)
        top.addWidget(QLabel("Layer"))
        top.addWidget(self.layer)
        top.addWidget(QLabel("Layers compared at"))
        top.addWidget(self.step)
        top.addStretch(1)
        self.controls = QWidget()
        self.controls.setLayout(top)
        top.setContentsMargins(0, 0, 0, 0)
        self.summary = QLabel()
        self.summary.setWordWrap(True)
        self.readout = QLabel(HINT)
        self.readout.setTextFormat(Qt.TextFormat.PlainText)
        self.readout.setMinimumWidth(10)
        self.graphics = pg.GraphicsLayoutWidget()
        cmap = pg.colormap.get(COLORMAP)
        self.tokens_plot = self.graphics.addPlot(row=0, col=0, axisItems={
            "bottom": TokenAxis("bottom"), "left": TokenAxis("left")})
        self.layers_plot = self.graphics.addPlot(row=0, col=1)
        self.sigma_plot = self.graphics.addPlot(row=0, col=3,
                                                axisItems={"bottom": TokenAxis("bottom")})
        self.token_image = matrix_image(self.tokens_plot)
        self.layer_image = matrix_image(self.layers_plot)
        self.tokens_plot.setLabel("bottom", "token")
        self.tokens_plot.setLabel("left", "token")
        self.layers_plot.setLabel("bottom", "layer")
        self.layers_plot.setLabel("left", "layer")
        self.bar = pg.ColorBarItem(values=(-1, 1), colorMap=cmap, label="cosine",
                                   interactive=False, width=14)
        self.bar.setImageItem([self.token_image, self.layer_image])
        self.graphics.addItem(self.bar, row=0, col=2)
        self.sigma_plot.setLabel("bottom", "rank k")
        self.sigma_plot.setLabel("left", "singular value")
        self.sigma_plot.showGrid(x=False, y=True, alpha=0.2)
        self.sigma_curve = self.sigma_plot.plot([], [], symbol="o", symbolSize=6)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.message)
        layout.addWidget(self.controls)
        layout.addWidget(self.summary)
        layout.addWidget(self.readout)
        layout.addWidget(self.graphics, 1)
        self.param.currentTextChanged.connect(self._on_param)
        self.layer.currentIndexChanged.connect(lambda _: self._update())
        self.step.valueChanged.connect(lambda _: self._update_layers())
        self._hover = pg.SignalProxy(self.graphics.scene().sigMouseMoved, rateLimit=30,
                                     slot=self._on_hover)
        self._restyle()
        self.set_record(None)

    def _restyle(self) -> None:
        style_graphics(self.graphics, [self.tokens_plot, self.layers_plot, self.sigma_plot],
                       self.palette())
        style_bar(self.bar, self.palette())
        colour = series_colors(self.palette())["patched"]
        self.sigma_curve.setPen(pg.mkPen(colour, width=2))
        self.sigma_curve.setSymbolBrush(colour)
        self.sigma_curve.setSymbolPen(pg.mkPen(colour))

    # -- filling ------------------------------------------------------------------------------
    def clear(self, message: str | None = None) -> None:
        """Empty the tab (a new run), with ``message`` in its place (default: how to get it)."""
        self.geometry, self.tokens, self.names = None, [], {}
        for box in (self.param, self.layer):
            box.blockSignals(True)
            box.clear()
            box.blockSignals(False)
        self.token_image.clear()
        self.layer_image.clear()
        self.sigma_curve.setData([], [])
        self.message.setText(message or NO_GEOMETRY)
        self.message.show()
        for widget in (self.controls, self.summary, self.readout, self.graphics):
            widget.hide()

    def set_record(self, record: dict[str, Any] | None, message: str | None = None) -> None:
        """Show the geometry of ``record`` (a run record), or ``message`` when it has none."""
        geometry = ((record or {}).get("analysis") or {}).get("geometry")
        if not geometry or not geometry.get("params"):
            self.clear(message)
            return
        self.geometry = geometry
        self.tokens = [visible(str((s.get("baseline_token") or {}).get("text", "")))
                       for s in (record or {}).get("steps", [])]
        self.names = {}
        for name, entry in geometry["params"].items():
            layer = entry.get("layer")
            key = param_key(name, layer) if layer is not None else name
            self.names.setdefault(key, {})[layer] = name
        self.param.blockSignals(True)
        self.param.clear()
        self.param.addItems(list(self.names))
        self.param.blockSignals(False)
        steps = len(next(iter(geometry["params"].values())).get("gram") or [])
        self.step.blockSignals(True)
        self.step.setRange(1, max(1, steps))
        self.step.setValue(1)
        self.step.blockSignals(False)
        self.message.hide()
        for widget in (self.controls, self.summary, self.readout, self.graphics):
            widget.show()
        self._on_param(self.param.currentText())

    def _on_param(self, key: str) -> None:
        layers = self.names.get(key, {})
        current = self.layer.currentText()
        self.layer.blockSignals(True)
        self.layer.clear()
        self.layer.addItems(["—" if layer is None else str(layer) for layer in layers])
        if self.layer.findText(current) >= 0:
            self.layer.setCurrentText(current)
        self.layer.blockSignals(False)
        self._update()

    # -- reading ------------------------------------------------------------------------------
    def selected_name(self) -> str | None:
        """The record's name of the parameter shown (the chosen one at the chosen layer)."""
        layers = list(self.names.get(self.param.currentText(), {}).items())
        index = self.layer.currentIndex()
        return layers[index][1] if 0 <= index < len(layers) else None

    def entry(self) -> dict[str, Any] | None:
        name = self.selected_name()
        return None if self.geometry is None or name is None else self.geometry["params"][name]

    def across(self) -> tuple[list[int], np.ndarray] | None:
        """The layers and the L x L cosines of the shown parameter's role at the chosen token;
        None where the role has fewer than two layers of one shape."""
        name, entry = self.selected_name(), self.entry()
        if self.geometry is None or name is None or entry is None:
            return None
        role = role_of(name)
        for key, group in (self.geometry.get("across_layers") or {}).items():
            if key.split(" ")[0] == role and entry.get("layer") in group["layers"]:
                steps = group["steps"]
                t = min(self.step.value() - 1, len(steps) - 1)
                return list(group["layers"]), as_matrix(steps[t])
        return None

    def _update(self) -> None:
        entry = self.entry()
        if entry is None:
            return
        gram = as_matrix(entry.get("gram"))
        n = gram.shape[0]
        show_matrix(self.tokens_plot, self.token_image, gram, first=1)
        self.tokens_plot.setTitle(f"token × token cosine, layer {entry.get('layer')}")
        sigma = np.array([np.nan if s is None else float(s)
                          for s in entry.get("singular_values") or []])
        keep = np.isfinite(sigma)  # (none where a patch is NaN or infinite)
        self.sigma_curve.setData(np.arange(1, len(sigma) + 1)[keep], sigma[keep])
        self.sigma_plot.setTitle("singular values of the stack" if keep.any() else
                                 "singular values: n/a (a NaN or infinite patch)")
        eff, summed = entry.get("effective_rank"), entry.get("summed_rank")
        energy = entry.get("energy") or []
        first = (f"; rank 1 holds {100 * energy[0]:.0f}% of the energy"
                 if energy and energy[0] is not None else "")
        kind = ("rank-1 patches u aᵀ" if entry.get("kind") == "rank1" else "vector deltas")
        shape = "×".join(map(str, entry.get("shape") or []))
        self.summary.setText(
            f"<b>{self.selected_name()}</b> ({kind}, {shape}) over {n} token(s): effective rank "
            f"<b>{'n/a' if eff is None else f'{eff:.3g}'}</b>, rank of the summed patch "
            f"<b>{'n/a' if summed is None else summed}</b>{first}.")
        self._update_layers()

    def _update_layers(self) -> None:
        found = self.across()
        if found is None:
            self.layer_image.clear()
            self.layers_plot.setTitle("layer × layer: no other layer of this shape")
            return
        layers, cos = found
        show_matrix(self.layers_plot, self.layer_image, cos, first=0)
        ticks = [(i, str(layer)) for i, layer in enumerate(layers)
                 if i % max(1, -(-len(layers) // 10)) == 0]
        for axis in ("bottom", "left"):
            self.layers_plot.getAxis(axis).setTicks([ticks])
        t = self.step.value()
        token = self.tokens[t - 1] if t - 1 < len(self.tokens) else ""
        self.layers_plot.setTitle(f"layer × layer cosine at token {t} {token!r}")

    def hover_text(self, plot: str, i: int, j: int) -> str:
        """The cell (row ``i``, column ``j``, from 0) of ``plot`` ("tokens" or "layers") in
        words; "" outside it."""
        if plot == "tokens":
            entry = self.entry()
            gram = as_matrix((entry or {}).get("gram"))
            if not (0 <= i < gram.shape[0] and 0 <= j < gram.shape[1]):
                return ""
            value = gram[i, j]
            ti = self.tokens[i] if i < len(self.tokens) else ""
            tj = self.tokens[j] if j < len(self.tokens) else ""
            where = f"token {i + 1} {ti!r} × token {j + 1} {tj!r}"
        else:
            found = self.across()
            if found is None:
                return ""
            layers, cos = found
            if not (0 <= i < len(layers) and 0 <= j < len(layers)):
                return ""
            value = cos[i, j]
            where = f"layer {layers[i]} × layer {layers[j]} at token {self.step.value()}"
        number = "n/a (a zero patch)" if not np.isfinite(value) else f"{value:+.4f}"
        return f"{self.param.currentText()} · {where} · cosine {number}"

    def _on_hover(self, args: tuple[object, ...]) -> None:
        pos = args[0]
        text = ""
        if self.geometry is not None:
            for name, plot, first in (("tokens", self.tokens_plot, 1),
                                      ("layers", self.layers_plot, 0)):
                cell = cell_under(plot, pos, first)  # type: ignore[arg-type]
                if cell is not None:
                    text = self.hover_text(name, *cell)
        self.readout.setText(text or HINT)
        self.graphics.setToolTip(text)
