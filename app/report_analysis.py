"""The report's analysis sections (../shared/ANALYSIS.md A1, A2 and A3), drawn from a run
record's ``analysis``: the context lens (a layer x token heatmap of the logit each layer's context
effect adds to the emitted token, and per token the layers that write it most, split into the
mixer's and the MLP's parts), the patch geometry (per parameter role, the effective and summed
rank per layer, and the token x token cosines of the layer with the largest patches) and the
transfer (its own module, `app.report_transfer`: the source x target heatmap of the retained
effect R, the mean patch's and the previous step's R over the tokens, and their means).

A record without ``analysis`` gives no section and no figure. A part the lens leaves undefined
in a layer (None in the record) is written "not defined" in tables and left blank in heatmaps,
never as zero. The figures are pyqtgraph plots made once and redrawn per record, written as PNG
and SVG by `app.report`'s writers.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..core.analysis import strongest_layers
from ..core.geometry import role_of

#: the figures' size in the report, in CSS pixels (as `app.report.PLOT_SIZE`)
LENS_SIZE = (670, 420)
GEOMETRY_SIZE = (670, 330)
LENS = "lens"  # the lens heatmap's image name
GEOMETRY = "geometry/"  # the prefix of each role's figure: "geometry/mlp.gate_proj"
TRANSFER = "transfer"  # the transfer figure's image name
NOT_DEFINED = "not defined"
DIVERGING = "CET-D1"
_LABEL_CHARS = 8  # a token's text on an axis, at most (then "…")
_FIGURES: dict[str, Any] = {}  # made once and reused (tests/app/conftest.py: never destroyed)


# -- the numbers --------------------------------------------------------------------------------
def lens_matrix(lens: dict[str, Any]) -> tuple[list[int], list[str], np.ndarray]:
    """The lens heatmap's data: the layers (ascending), the emitted tokens' texts, and the
    (layers, tokens) matrix of the total part's logit for the emitted token (NaN where a layer
    has no total readout at that step)."""
    steps = lens.get("steps") or []
    layers = sorted({int(k) for s in steps for k in s.get("layers", {})})
    row = {layer: i for i, layer in enumerate(layers)}
    m = np.full((len(layers), len(steps)), np.nan)
    for t, step in enumerate(steps):
        for key, parts in step.get("layers", {}).items():
            total = (parts or {}).get("total")
            if total is not None and total.get("emitted") is not None:
                m[row[int(key)], t] = float(total["emitted"])
    return layers, [str(s.get("token", "")) for s in steps], m


def lens_rows(lens: dict[str, Any], n: int = 3) -> list[tuple[int, str, list[tuple[Any, ...]]]]:
    """Per lens step: (step, token, its ``n`` strongest layers as `strongest_layers` gives them:
    ``(layer, total, mixer, mlp)``, a part None where it is not defined)."""
    return [(int(s["step"]), str(s.get("token", "")), strongest_layers(s, n))
            for s in lens.get("steps") or []]


def role_label(role: str) -> str:
    """A role without its model prefix and ``.weight``: ``mlp.gate_proj`` for
    ``model.layers.{}.mlp.gate_proj.weight``."""
    rest = role.split("{}", 1)[-1].lstrip(".")
    return rest.removesuffix(".weight") or role


def _energy(entry: dict[str, Any]) -> float:
    """The sum over steps of a patch's squared Frobenius norm (the Gram's diagonal)."""
    inner = entry.get("inner") or []
    diag = [row[i] for i, row in enumerate(inner) if i < len(row) and row[i] is not None]
    return float(sum(x for x in diag if math.isfinite(x)))


def geometry_roles(geometry: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per parameter role (`role_label`, in the record's order): ``layers`` ascending, their
    ``effective_rank`` and ``summed_rank`` (None where the record has none), ``kind``, and the
    layer with the largest patches (the largest sum over steps of ``|P_t|_F^2``): ``largest``
    (its layer), ``name`` (its parameter) and ``gram`` (its T x T cosines, NaN where a patch is
    zero). Parameters outside a layer are left out."""
    grouped: dict[str, list[tuple[int, str, dict[str, Any]]]] = {}
    for name, entry in (geometry.get("params") or {}).items():
        role, layer = role_of(name), entry.get("layer")
        if role is None or layer is None:
            continue
        grouped.setdefault(role_label(role), []).append((int(layer), name, entry))
    out = {}
    for label, items in grouped.items():
        items.sort(key=lambda item: item[0])
        layer, name, entry = max(items, key=lambda item: _energy(item[2]))
        gram = entry.get("gram") or []
        out[label] = {
            "layers": [i for i, _, _ in items],
            "effective_rank": [e.get("effective_rank") for _, _, e in items],
            "summed_rank": [e.get("summed_rank") for _, _, e in items],
            "kind": entry.get("kind"), "largest": layer, "name": name,
            "energy": _energy(entry),
            "gram": np.array([[np.nan if x is None else float(x) for x in row] for row in gram],
                             dtype=float).reshape(len(gram), len(gram)),
        }
    return out


def steps_of(geometry: dict[str, Any]) -> int:
    """How many steps the geometry spans (the size of its Grams)."""
    for entry in (geometry.get("params") or {}).values():
        return len(entry.get("gram") or [])
    return 0


# -- the figures --------------------------------------------------------------------------------
def token_label(text: str) -> str:
    """A token's text for an axis: newlines and tabs as ↵ and →, spaces as ␣ when it has
    nothing else, at most `_LABEL_CHARS` characters."""
    shown = text.replace("\r", "").replace("\n", "↵").replace("\t", "→")
    if not shown.strip():
        shown = shown.replace(" ", "␣") or "∅"
    return shown if len(shown) <= _LABEL_CHARS else shown[:_LABEL_CHARS - 1] + "…"


def _figure(kind: str, point_size: float) -> Any:
    """The figure ``kind`` ("lens", "geometry" or "transfer"), made on first use."""
    if kind not in _FIGURES:
        if kind == "transfer":
            from .report_transfer import TransferFigure as make
        else:
            make = {"lens": _LensFigure, "geometry": _GeometryFigure}[kind]
        _FIGURES[kind] = make(point_size)
    return _FIGURES[kind]


def _heatmap(plot: Any, label: str) -> tuple[Any, Any]:
    """A still heatmap on ``plot`` (no mouse, no buttons): its row-major image and its colour
    bar (the diverging map, levels set by the caller's ``bar.setLevels``), inside the plot."""
    import pyqtgraph as pg

    plot.setMouseEnabled(False, False)
    plot.hideButtons()
    image = pg.ImageItem(axisOrder="row-major")
    plot.addItem(image)
    bar = pg.ColorBarItem(values=(-1, 1), colorMap=DIVERGING, interactive=False, label=label)
    bar.setImageItem(image, insert_in=plot)
    return image, bar


class _LensFigure:
    """The layer x token heatmap of the emitted token's lens logit, centred at 0."""

    def __init__(self, point_size: float) -> None:
        import pyqtgraph as pg
        from PySide6.QtCore import Qt

        from .panels.heatmap import LabelAxis
        from .panels.plots_panel import TokenAxis
        from .theme import style_bar, style_graphics

        self.graphics = pg.GraphicsLayoutWidget()
        self.graphics.setAttribute(Qt.WidgetAttribute.WA_DontShowOnScreen)
        self.graphics.setFixedSize(*LENS_SIZE)
        self.plot = self.graphics.addPlot(row=0, col=0, axisItems={
            "left": TokenAxis("left"), "bottom": LabelAxis("bottom")})
        self.plot.setLabel("bottom", "emitted token")
        self.plot.setLabel("left", "layer")
        self.image, self.bar = _heatmap(self.plot, "logit added to the emitted token")
        # a label may reach past the plot's ends (the first token's, under the layer axis)
        self.plot.getAxis("bottom").setStyle(hideOverlappingLabels=False)
        style_graphics(self.graphics, [self.plot], self.graphics.palette(), point_size)
        style_bar(self.bar, self.graphics.palette(), point_size)

    def draw(self, lens: dict[str, Any]) -> Any:
        from PySide6.QtCore import QRectF
        from PySide6.QtWidgets import QApplication

        layers, tokens, m = lens_matrix(lens)
        finite = np.abs(m[np.isfinite(m)])
        top = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
        self.image.setImage(m, autoLevels=False)
        self.bar.setLevels((-top, top))  # centred at 0: white is "adds nothing"
        self.image.setRect(QRectF(0.5, -0.5, m.shape[1], m.shape[0]))
        self.plot.setXRange(0.5, m.shape[1] + 0.5, padding=0)
        self.plot.setYRange(-0.5, m.shape[0] - 0.5, padding=0)
        every = max(1, -(-len(layers) // 12))
        self.plot.getAxis("left").setTicks(
            [[(i, str(layer)) for i, layer in enumerate(layers) if i % every == 0]])
        self.plot.getAxis("bottom").set_labels(  # (every k-th: they never overlap)
            {t + 1: token_label(text) for t, text in enumerate(tokens)})
        self.graphics.show()
        QApplication.processEvents()
        return self.graphics


class _GeometryFigure:
    """For one parameter role: effective and summed rank per layer (left), and the token x token
    cosines of its layer with the largest patches on a fixed [-1, 1] (right)."""

    def __init__(self, point_size: float) -> None:
        import pyqtgraph as pg
        from PySide6.QtCore import Qt

        from .panels.plots_panel import TokenAxis
        from .theme import legend_row, legend_style, series_colors, style_bar, style_graphics

        self.graphics = pg.GraphicsLayoutWidget()
        self.graphics.setAttribute(Qt.WidgetAttribute.WA_DontShowOnScreen)
        self.graphics.setFixedSize(*GEOMETRY_SIZE)
        self.legend_row, self.legend = legend_row(self.graphics, columns=2)  # (above the ranks)
        self.ranks = self.graphics.addPlot(row=1, col=0,
                                           axisItems={"bottom": TokenAxis("bottom")})
        self.ranks.setLabel("bottom", "layer")
        self.ranks.setLabel("left", "rank")
        self.ranks.showGrid(x=True, y=True, alpha=0.2)
        self.ranks.setMouseEnabled(False, False)
        self.ranks.hideButtons()
        colors = series_colors(self.graphics.palette())
        self.effective = self.ranks.plot([], [], name="effective rank",
                                         pen=pg.mkPen(colors["patched"], width=2), symbol="o",
                                         symbolSize=6, symbolBrush=colors["patched"],
                                         symbolPen=pg.mkPen(colors["patched"]))
        self.summed = self.ranks.plot([], [], name="rank of the sum",
                                      pen=pg.mkPen(colors["control"], width=2,
                                                   style=Qt.PenStyle.DashLine),
                                      symbol="s", symbolSize=6, symbolBrush=colors["control"],
                                      symbolPen=pg.mkPen(colors["control"]))
        for curve in (self.effective, self.summed):
            self.legend.addItem(curve, curve.name())
        legend_style(self.legend, self.graphics.palette(), point_size)
        self.legend.updateSize()
        self.legend_row.layout.setRowFixedHeight(0, self.legend.height() + 4)
        self.gram = self.graphics.addPlot(row=0, col=1, rowspan=2, axisItems={
            "bottom": TokenAxis("bottom"), "left": TokenAxis("left")})
        self.gram.setLabel("bottom", "token")
        self.gram.setLabel("left", "token")
        self.gram.invertY(True)  # a matrix: token 1's row at the top
        self.image, self.bar = _heatmap(self.gram, "cosine")
        self.graphics.ci.layout.setColumnStretchFactor(0, 1)
        self.graphics.ci.layout.setColumnStretchFactor(1, 1)
        style_graphics(self.graphics, [self.ranks, self.gram], self.graphics.palette(),
                       point_size)
        style_bar(self.bar, self.graphics.palette(), point_size)

    def draw(self, role: dict[str, Any], steps: int) -> Any:
        from PySide6.QtCore import QRectF
        from PySide6.QtWidgets import QApplication

        x = np.array(role["layers"], dtype=float)

        def ys(values: Sequence[Any]) -> np.ndarray:
            return np.array([np.nan if v is None else float(v) for v in values])

        for curve, values in ((self.effective, role["effective_rank"]),
                              (self.summed, role["summed_rank"])):
            y = ys(values)
            keep = np.isfinite(y)
            curve.setData(x[keep], y[keep])
        self.ranks.setXRange(float(x.min()) - 0.5, float(x.max()) + 0.5, padding=0)
        self.ranks.setYRange(-0.3, max(1, steps) + 0.5, padding=0)  # (0 drawn and labelled)
        gram = role["gram"]
        n = gram.shape[0]
        self.image.setImage(gram if n else np.full((1, 1), np.nan), autoLevels=False)
        self.bar.setLevels((-1.0, 1.0))  # fixed: cosines
        self.image.setRect(QRectF(0.5, 0.5, max(n, 1), max(n, 1)))
        self.gram.setXRange(0.5, max(n, 1) + 0.5, padding=0)
        self.gram.setYRange(0.5, max(n, 1) + 0.5, padding=0)
        self.gram.setTitle(f"layer {role['largest']}: cosines")
        self.graphics.show()
        QApplication.processEvents()
        return self.graphics


def analysis_images(analysis: dict[str, Any] | None, png: Any, svg: Any,
                    point_size: float, record: dict[str, Any] | None = None
                    ) -> dict[str, tuple[bytes, bytes]]:
    """The analysis figures as {name: (PNG bytes, SVG bytes)}: `LENS`, then ``geometry/<role>``
    per parameter role, then `TRANSFER`; nothing for what the record does not hold. ``png`` and
    ``svg`` draw a laid-out `GraphicsLayoutWidget` (`app.report`'s writers); ``record``: the
    run record they come from (its tokens label the transfer's axes)."""
    images: dict[str, tuple[bytes, bytes]] = {}
    if not analysis:
        return images
    lens = analysis.get("lens")
    if lens and lens.get("steps") and lens_matrix(lens)[0]:
        figure = _figure("lens", point_size)
        widget = figure.draw(lens)
        images[LENS] = png(widget), svg(widget)
        widget.hide()
    geometry = analysis.get("geometry")
    if geometry:
        steps = steps_of(geometry)
        for label, role in geometry_roles(geometry).items():
            figure = _figure("geometry", point_size)
            widget = figure.draw(role, steps)
            images[GEOMETRY + label] = png(widget), svg(widget)
            widget.hide()
    transfer = analysis.get("transfer")
    if transfer and transfer.get("retained"):
        from .report_transfer import step_tokens

        widget = _figure("transfer", point_size).draw(transfer, step_tokens(record or {}))
        images[TRANSFER] = png(widget), svg(widget)
        widget.hide()
    return images


# -- the HTML ----------------------------------------------------------------------------------
def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _signed(x: Any) -> str:
    return NOT_DEFINED if x is None else f"{x:+.3g}"


def _figure_html(title: str, src: str, width: int) -> str:
    return (f"<div class=\"figure\"><h3>{_esc(title)}</h3><p class=\"figure\">"
            f"<img src=\"{_esc(src)}\" width=\"{width}\"></p></div>")


def _lens_html(lens: dict[str, Any], images: dict[str, str]) -> str:
    s = [x for x in lens.get("s") or [] if x is not None]
    head = ("<h2>Context lens</h2>\n<p>What each layer's context effect "
            "δ = T<sub>C</sub> − T<sub>0</sub> writes into the vocabulary (docs/ANALYSES.md): "
            "δ read through the unembedding with the final norm frozen at the full-context "
            "residual (direct effect only; what δ does through later layers is not in it). "
            "The heatmap shows the logit each layer adds to the token the model with the "
            "context emitted; red promotes it, blue suppresses it, white adds nothing; a blank "
            "cell is a layer without a readout at that token.")
    if s:
        head += (f" The frozen norm's scale s<sub>t</sub> ranges over "
                 f"{_esc(f'{min(s):.3g}')}–{_esc(f'{max(s):.3g}')}.")
    head += "</p>\n"
    figure = (_figure_html("Context lens: the emitted token's logit per layer and token",
                           images[LENS], LENS_SIZE[0]) if LENS in images else "")
    body = []
    for step, token, best in lens_rows(lens):
        # the token's cells on its first row only (no rowspan: Qt's PDF splits such a cell
        # at a page's foot into an empty piece)
        cells = f"<td>{step + 1}</td><td><code>{_esc(repr(token))}</code></td>"
        if not best:
            body.append(f"<tr>{cells}<td colspan=\"4\">no layer readable</td></tr>")
            continue
        for i, (layer, total, mixer, mlp) in enumerate(best):
            body.append("<tr>" + (cells if i == 0 else "<td></td><td></td>") + "".join(
                f"<td>{_esc(v)}</td>" for v in (layer, _signed(total), _signed(mixer),
                                                 _signed(mlp))) + "</tr>")
    table = ("<h3>The layers that write each token most</h3>\n"
             "<p>Per generated token, the three layers whose context effect adds the most to its "
             "logit, and that logit split into the mixer's part (attention or state space) and "
             f"the MLP's; \"{NOT_DEFINED}\" where a part does not exist in that layer.</p>\n"
             "<table class=\"lens\"><thead><tr><th>token</th><th>text</th><th>layer</th>"
             "<th>total</th><th>mixer</th><th>MLP</th></tr></thead>" + "".join(body) +
             "</table>")
    return head + figure + table


def _geometry_html(geometry: dict[str, Any], images: dict[str, str]) -> str:
    roles = geometry_roles(geometry)
    steps = steps_of(geometry)
    out = [("<h2>Patch geometry</h2>\n<p>How each parameter's patches over the "
            f"{_esc(steps)} generated tokens align and how many directions they span "
            "(docs/ANALYSES.md), from the stored factors. Effective rank: exp of the entropy of "
            "the normalised singular values of the stack of the patches (1 when all align, T "
            "when orthogonal); rank of the sum: the rank of Σ<sub>t</sub> P<sub>t</sub>. The "
            "heatmap holds the Frobenius cosines between the patches of two tokens, in the "
            "layer whose patches are largest (Σ<sub>t</sub> |P<sub>t</sub>|², fixed scale "
            "[−1, 1]; blank where a patch is zero).</p>\n")]
    rows = []
    for label, role in roles.items():
        name = GEOMETRY + label
        if name in images:
            out.append(_figure_html(f"Patch geometry: {label} (largest patches in layer "
                                    f"{role['largest']})", images[name], GEOMETRY_SIZE[0]))
        eff = [e for e in role["effective_rank"] if e is not None]
        summed = [r for r in role["summed_rank"] if r is not None]
        rows.append((label, len(role["layers"]),
                     f"{min(eff):.3g}–{max(eff):.3g}" if eff else "—",
                     f"{min(summed)}–{max(summed)}" if summed else "—", role["largest"]))
    if rows:
        out.append("<h3>Ranks per parameter role</h3>\n<table class=\"geometry\"><tr>"
                   "<th>parameter</th><th>layers</th><th>effective rank</th>"
                   "<th>rank of the sum</th><th>largest patches in layer</th></tr>" + "".join(
                       "<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in row) + "</tr>"
                       for row in rows) + "</table>")
    else:
        out.append("<p>No patched parameter inside a layer.</p>")
    return "".join(out)


def analysis_html(analysis: dict[str, Any] | None, images: dict[str, str],
                  record: dict[str, Any] | None = None) -> str:
    """The report's "Context lens", "Patch geometry" and "Transfer" sections ("" without
    ``analysis``); ``images`` maps each figure's name to its ``src``; ``record``: the run record
    (its settings say whether the transfer's diagonal can reproduce the run)."""
    if not analysis:
        return ""
    parts = []
    if analysis.get("lens"):
        parts.append(_lens_html(analysis["lens"], images))
    if analysis.get("geometry"):
        parts.append(_geometry_html(analysis["geometry"], images))
    if (analysis.get("transfer") or {}).get("retained"):
        from .report_transfer import transfer_html

        parts.append(transfer_html(analysis["transfer"], images, record))
    return "\n".join(parts) + ("\n" if parts else "")


def figure_titles(images: dict[str, Any]) -> set[str]:
    """The image names this module places (the report's own plot list leaves them out)."""
    return {name for name in images
            if name in (LENS, TRANSFER) or name.startswith(GEOMETRY)}


__all__ = ["GEOMETRY", "LENS", "NOT_DEFINED", "TRANSFER", "analysis_html", "analysis_images",
           "figure_titles", "geometry_roles", "lens_matrix", "lens_rows", "role_label",
           "token_label"]
