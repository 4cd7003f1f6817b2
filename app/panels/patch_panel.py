"""The patch explorer: a layer x token heatmap of patch norms for one parameter (gate, up, down,
scale, bias...), absolute or relative to the parameter's own norm, and the per-layer profile of
the selected token. Norms span many decades, so both views are log10.

The colormap is the sequential ``viridis``, not a diverging one (STYLE.md 21 suggests CET-D1):
log-norms have no natural centre, and a sequential map reads as "bigger" at a glance.
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF, Qt
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QVBoxLayout, QWidget

from ..state import RunState
from ..theme import FollowsPalette, series_colors, style_graphics
from .plots_panel import TokenAxis

FLOOR = 1e-30
HOVER_HINT = "Hover over the heatmap for a cell's layer, token, parameter and value."


class QtPatchPanel(FollowsPalette, QWidget):
    def __init__(self, state: RunState, parent: QWidget | None = None,
                 point_size: float | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self.point_size = point_size
        self.param = QComboBox()
        self.param.setToolTip("Which patched parameter to show (names without the layer prefix)")
        self.scale = QComboBox()
        self.scale.addItems(["absolute", "relative to the parameter"])
        self.scale.setToolTip("Frobenius norm of a matrix patch (L2 of a vector patch), or that "
                              "norm divided by the parameter's own norm")
        top = QHBoxLayout()
        top.addWidget(QLabel("Parameter"))
        top.addWidget(self.param, 1)
        top.addWidget(QLabel("Norm"))
        top.addWidget(self.scale)
        self.readout = QLabel(HOVER_HINT)  # the cell under the mouse, in words and numbers
        self.readout.setTextFormat(Qt.TextFormat.PlainText)
        self.readout.setMinimumWidth(10)  # long texts are cut, never widen the window
        self.graphics = pg.GraphicsLayoutWidget()
        self.heat_plot = self.graphics.addPlot(row=0, col=0,
                                               axisItems={"bottom": TokenAxis("bottom")})
        self.heat_plot.setLabel("bottom", "generated token")
        self.heat_plot.setLabel("left", "layer")
        self.image = pg.ImageItem(axisOrder="row-major")
        self.heat_plot.addItem(self.image)
        self.bar = pg.ColorBarItem(values=(0, 1), colorMap="viridis", label="log10 norm",
                                   interactive=False)
        self.bar.setImageItem(self.image, insert_in=self.heat_plot)
        # the selected token: its column outlined and lightly shaded (a 1-px line was lost)
        self.cursor = pg.LinearRegionItem(values=(0.5, 1.5), movable=False)
        self.cursor.setVisible(False)
        self.heat_plot.addItem(self.cursor, ignoreBounds=True)
        self.profile = self.graphics.addPlot(row=1, col=0,
                                             axisItems={"bottom": TokenAxis("bottom")})
        self.profile.setLabel("bottom", "layer")
        self.profile.getAxis("left").enableAutoSIPrefix(False)
        self.profile.setLabel("left", "log10 norm")  # drawn as log10 values: a log axis
        # labels every minor tick when the range is under a decade
        self.profile.showGrid(x=True, y=True, alpha=0.2)
        self.profile_curve = self.profile.plot([], [], pen=pg.mkPen((40, 110, 220), width=2),
                                               symbol="o", symbolSize=5)
        self.graphics.ci.layout.setRowStretchFactor(0, 3)
        self.graphics.ci.layout.setRowStretchFactor(1, 2)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(top)
        layout.addWidget(self.readout)
        layout.addWidget(self.graphics)
        self.param.currentTextChanged.connect(self._on_param)
        self.scale.currentIndexChanged.connect(self._on_scale)
        self.graphics.scene().sigMouseClicked.connect(self._on_click)
        self._hover = pg.SignalProxy(self.graphics.scene().sigMouseMoved, rateLimit=30,
                                     slot=self._on_heat_hover)
        self._restyle()
        state.subscribe(self._on_state)

    def set_point_size(self, point_size: float | None) -> None:
        """Tick and label text in this size (the report's figures: 10 pt)."""
        self.point_size = point_size
        self._restyle()

    def _restyle(self) -> None:
        style_graphics(self.graphics, [self.heat_plot, self.profile], self.palette(),
                       self.point_size)
        colors = series_colors(self.palette())
        self.profile_curve.setPen(pg.mkPen(colors["patched"], width=2))
        self.profile_curve.setSymbolBrush(colors["patched"])
        self.profile_curve.setSymbolPen(pg.mkPen(colors["patched"]))
        shade = pg.mkColor(colors["cursor"])
        shade.setAlpha(50)
        self.cursor.setBrush(shade)
        for line in self.cursor.lines:
            line.setPen(pg.mkPen(colors["cursor"], width=2.5))

    def _on_param(self, text: str) -> None:
        if text and text != self.state.param:
            self.state.set_view(param=text)

    def _on_scale(self, index: int) -> None:
        self.state.set_view(relative=index == 1)

    def _on_click(self, event: object) -> None:
        pos = event.scenePos()  # type: ignore[attr-defined]
        if self.heat_plot.sceneBoundingRect().contains(pos):
            x = self.heat_plot.vb.mapSceneToView(pos).x()
            self.state.select(int(round(x)) - 1)

    def _on_heat_hover(self, args: tuple[object, ...]) -> None:
        pos = args[0]
        text = ""
        if self.heat_plot.sceneBoundingRect().contains(pos):  # type: ignore[arg-type]
            point = self.heat_plot.vb.mapSceneToView(pos)
            text = self.cell_text(int(round(point.x())) - 1, int(round(point.y())))
        self.readout.setText(text or HOVER_HINT)
        self.graphics.setToolTip(text)  # also where the mouse rests

    def cell_text(self, step: int, row: int) -> str:
        """One heatmap cell in words: layer, token (number and text), parameter and value; ""
        outside the cells."""
        layers, steps = self.state.layers(), self.state.steps
        if not (0 <= step < len(steps) and 0 <= row < len(layers)):
            return ""
        m = self.state.norm_matrix()
        value = m[row, step] if m.shape == (len(layers), len(steps)) else np.nan
        kind = "relative norm" if self.state.relative else "norm"
        if np.isfinite(value):
            number = f"{value:.3g}" + (f" (log10 {np.log10(value):.2f})" if value > 0 else "")
        else:
            number = "no patch"
        token = steps[step].baseline_text.replace("\n", "↵")
        return (f"layer {layers[row]} · token {step + 1} {token!r} · {self.state.param} · "
                f"{kind} {number}")

    def _on_state(self, event: str) -> None:
        if event == "reset":
            self.param.blockSignals(True)
            self.param.clear()
            self.param.blockSignals(False)
        if event in ("reset", "view"):  # (the readout named the previous parameter's cell)
            self.readout.setText(HOVER_HINT)
            self.graphics.setToolTip("")
        if event in ("reset", "step", "view", "finished"):
            self._sync_params()
            self._update_heatmap()
        if event in ("reset", "step", "view", "selection", "finished"):
            self._update_profile()

    def _sync_params(self) -> None:
        keys = self.state.param_keys()
        if keys != [self.param.itemText(i) for i in range(self.param.count())]:
            self.param.blockSignals(True)
            self.param.clear()
            self.param.addItems(keys)
            self.param.blockSignals(False)
        if self.state.param:
            self.param.setCurrentText(self.state.param)

    def _update_heatmap(self) -> None:
        layers = self.state.layers()
        m = self.state.norm_matrix()
        if m.size == 0 or np.isnan(m).all():
            self.image.clear()
            return
        logm = np.log10(np.maximum(m, FLOOR))
        finite = logm[np.isfinite(logm)]
        lo, hi = float(finite.min()), float(finite.max())
        if hi - lo < 1e-9:
            lo, hi = lo - 0.5, hi + 0.5
        self.image.setImage(logm, autoLevels=False)
        self.bar.setLevels((lo, hi))
        self.image.setRect(QRectF(0.5, -0.5, m.shape[1], m.shape[0]))
        self.heat_plot.setXRange(0.5, m.shape[1] + 0.5, padding=0)  # the cells, edge to edge
        self.heat_plot.setYRange(-0.5, m.shape[0] - 0.5, padding=0)
        every = max(1, -(-len(layers) // 10))
        self.heat_plot.getAxis("left").setTicks(
            [[(i, str(layer)) for i, layer in enumerate(layers) if i % every == 0]])
        label = "relative norm" if self.state.relative else "norm"
        self.heat_plot.setTitle(f"{self.state.param} — log10 {label}")

    def _update_profile(self) -> None:
        steps = self.state.steps
        if not steps:
            self.profile_curve.setData([], [])
            self.cursor.setVisible(False)
            return
        i = self.state.selected if self.state.selected is not None else len(steps) - 1
        m = self.state.norm_matrix()
        layers = np.array(self.state.layers(), dtype=float)
        y = m[:, i] if m.shape[1] > i else np.full(len(layers), np.nan)
        keep = np.isfinite(y) & (y > 0)
        self.profile_curve.setData(layers[keep], np.log10(y[keep]))
        label = "relative norm" if self.state.relative else "norm"
        self.profile.setLabel("left", f"log10 {label}")
        self.profile.setTitle(f"token {i + 1}: per-layer profile")
        self.cursor.setVisible(self.state.selected is not None)
        self.cursor.setRegion((i + 0.5, i + 1.5))

    def heatmap_shape(self) -> tuple[int, int]:
        img = self.image.image
        return (0, 0) if img is None else tuple(img.shape)  # type: ignore[return-value]
