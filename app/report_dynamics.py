"""The report's "Context dynamics" section (../shared/ANALYSIS.md A5), drawn from a dynamics record
(`core.dynamics.Dynamics.to_dict`): the context with every token on the colour of its share of
the increments, a layer x context-token heatmap of each layer's increments as shares, the patch
norms and the increments per layer over the prefixes, the increments' lens logit for the answer,
and a table of every context token's numbers.

It is a section of a run's report when the window has computed dynamics (`app.report`), and the
body of ``ctxpatch dynamics --report`` (`dynamics_document_html`). The figures are pyqtgraph
plots made once and redrawn per record, written as PNG and SVG by `app.report`'s writers; the
numbers come from `core.dynamics_record.read_dynamics` (the record checked, then rebuilt).
"""

from __future__ import annotations

import html
import math
from typing import Any

import numpy as np

from ..core.dynamics import SHRINKING, Dynamics, trend
from .report_analysis import token_label

HEATMAP_SIZE = (670, 360)
CURVES_SIZE = (670, 300)
LENS_SIZE = (670, 260)
INCREMENTS = "dynamics/increments"
CURVES = "dynamics/curves"
LENS = "dynamics/lens"
SHARE_TOP = (213, 94, 0)  # Okabe-Ito vermillion: the largest share
_FIGURES: dict[str, Any] = {}  # made once and reused (tests/app/conftest.py: never destroyed)


def read(record: dict[str, Any]) -> Dynamics:
    from ..core.dynamics_record import read_dynamics

    return read_dynamics(record, "the dynamics")


def verdict(d: Dynamics) -> tuple[float, float, str]:
    """The increments summed over layers: the first and last third's means and their trend in
    words (as `core.dynamics.summary_lines` says it)."""
    first, last = trend(d.increment.sum(0))
    ratio = last / first if first > 0 else math.nan
    word = ("shrinking" if ratio < SHRINKING else "growing" if ratio > 1 / SHRINKING
            else "about flat")
    return first, last, word


# -- the figures --------------------------------------------------------------------------------
class _Figures:
    """The three figures of the section, on fixed sizes."""

    def __init__(self, point_size: float) -> None:
        import pyqtgraph as pg
        from PySide6.QtCore import Qt

        from .panels.heatmap import LabelAxis
        from .panels.plots_panel import TokenAxis
        from .theme import series_colors, style_bar, style_graphics

        def widget(size: tuple[int, int]) -> Any:
            g = pg.GraphicsLayoutWidget()
            g.setAttribute(Qt.WidgetAttribute.WA_DontShowOnScreen)
            g.setFixedSize(*size)
            return g

        self.point_size = point_size
        self.heat_graphics = widget(HEATMAP_SIZE)
        self.heat = self.heat_graphics.addPlot(row=0, col=0, axisItems={
            "left": TokenAxis("left"), "bottom": LabelAxis("bottom")})
        self.heat.setLabel("bottom", "context token")
        self.heat.setLabel("left", "layer")
        self.image = pg.ImageItem(axisOrder="row-major")
        self.heat.addItem(self.image)
        self.bar = pg.ColorBarItem(values=(0, 1), colorMap="viridis", interactive=False,
                                   label="share of the layer's increments")
        self.bar.setImageItem(self.image, insert_in=self.heat)
        self.heat.getAxis("bottom").setStyle(hideOverlappingLabels=False)
        self.curve_graphics = widget(CURVES_SIZE)
        self.norms = self.curve_graphics.addPlot(row=0, col=0,
                                                 axisItems={"bottom": TokenAxis("bottom")})
        self.increments = self.curve_graphics.addPlot(row=0, col=1,
                                                      axisItems={"bottom": TokenAxis("bottom")})
        self.norms.setLabel("bottom", "prefix length i")
        self.norms.setLabel("left", "|P_l,i| (Frobenius)")
        self.increments.setLabel("bottom", "context token i")
        self.increments.setLabel("left", "|P_l,i − P_l,i−1|")
        self.lens_graphics = widget(LENS_SIZE)
        self.lens = self.lens_graphics.addPlot(row=0, col=0,
                                               axisItems={"bottom": LabelAxis("bottom")})
        self.lens.setLabel("bottom", "context token")
        self.lens.setLabel("left", "lens logit")
        self.lens_bars = pg.BarGraphItem(x=[], height=[], width=0.7)
        self.lens.addItem(self.lens_bars)
        self.lens.addItem(pg.InfiniteLine(pos=0, angle=0, pen=pg.mkPen((128, 128, 128))))
        self.lens.getAxis("bottom").setStyle(hideOverlappingLabels=False)
        self.plots = [self.heat, self.norms, self.increments, self.lens]
        for plot in self.plots:
            plot.setMouseEnabled(False, False)
            plot.hideButtons()
            plot.showGrid(x=False, y=plot is not self.heat, alpha=0.2)
        for g, plots in ((self.heat_graphics, [self.heat]),
                         (self.curve_graphics, [self.norms, self.increments]),
                         (self.lens_graphics, [self.lens])):
            style_graphics(g, plots, g.palette(), point_size)
        style_bar(self.bar, self.heat_graphics.palette(), point_size)
        self.colours = series_colors(self.heat_graphics.palette())

    def draw(self, d: Dynamics) -> dict[str, Any]:
        import pyqtgraph as pg
        from PySide6.QtCore import QRectF
        from PySide6.QtWidgets import QApplication

        n, rows = len(d.context_ids), len(d.layers)
        labels = [token_label(t) for t in d.context_tokens]
        shares = d.attribution_by_layer
        top = float(np.nanmax(shares)) if shares.size and np.nanmax(shares) > 0 else 1.0
        self.image.setImage(shares if shares.size else np.full((1, 1), np.nan),
                            autoLevels=False)
        self.bar.setLevels((0.0, top))
        self.image.setRect(QRectF(0.5, -0.5, n, max(rows, 1)))
        self.heat.setXRange(0.5, n + 0.5, padding=0)
        self.heat.setYRange(-0.5, max(rows, 1) - 0.5, padding=0)
        every = max(1, -(-rows // 12))
        self.heat.getAxis("left").setTicks(
            [[(i, str(layer)) for i, layer in enumerate(d.layers) if i % every == 0]])
        for plot in (self.norms, self.increments):
            plot.clearPlots()
        cmap = pg.colormap.get("viridis")
        for j in range(rows):
            pen = pg.mkPen(cmap.map(j / max(rows - 1, 1) * 0.85, mode="qcolor"), width=1.5)
            self.norms.plot(np.arange(n + 1, dtype=float), d.norm[j], pen=pen)
            self.increments.plot(np.arange(1, n + 1, dtype=float), d.increment[j], pen=pen)
        first = d.layers[0] if d.layers else 0
        last = d.layers[-1] if d.layers else 0
        self.norms.setTitle(f"patch norm per layer (dark: layer {first}, light: {last})")
        self.increments.setTitle("increment per layer")
        lens = d.lens_logit
        keep = np.isfinite(lens)
        brushes = [self.colours["mismatch"] if v > 0 else self.colours["patched"]
                   for v in lens[keep]]
        self.lens_bars.setOpts(x=np.arange(1, n + 1, dtype=float)[keep], height=lens[keep],
                               brushes=brushes, pens=brushes)
        self.lens.setXRange(0.5, n + 0.5, padding=0)
        self.lens.setTitle(f"each token's lens logit for the answer {token_label(d.answer[1])!r}"
                           " (summed over layers)")
        for g in (self.heat_graphics, self.curve_graphics, self.lens_graphics):
            g.show()
        QApplication.processEvents()  # laid out: the axes' widths are known
        for plot in (self.heat, self.lens):  # (every k-th token, as the room allows)
            plot.getAxis("bottom").set_labels(dict(enumerate(labels, 1)))
        QApplication.processEvents()
        return {INCREMENTS: self.heat_graphics, CURVES: self.curve_graphics,
                LENS: self.lens_graphics}


def dynamics_images(record: dict[str, Any] | None, png: Any, svg: Any,
                    point_size: float) -> dict[str, tuple[bytes, bytes]]:
    """The section's figures as {name: (PNG bytes, SVG bytes)} (nothing without a record)."""
    if not record:
        return {}
    d = read(record)
    if "figures" not in _FIGURES:
        _FIGURES["figures"] = _Figures(point_size)
    widgets = _FIGURES["figures"].draw(d)
    images = {name: (png(w), svg(w)) for name, w in widgets.items()}
    for w in widgets.values():
        w.hide()
    return images


# -- the HTML ----------------------------------------------------------------------------------
def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _signed(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{x:+.4g}"


def _figure_html(title: str, src: str, width: int) -> str:
    return (f"<div class=\"figure\"><h3>{_esc(title)}</h3><p class=\"figure\">"
            f"<img src=\"{_esc(src)}\" width=\"{width}\"></p></div>")


def coloured_context(d: Dynamics) -> str:
    """The context as HTML, each token on white blended to vermillion by its share."""
    top = float(d.attribution.max()) if d.attribution.size else 0.0
    spans = []
    for token, share in zip(d.context_tokens, d.attribution, strict=True):
        t = share / top if top > 0 and math.isfinite(share) else 0.0
        rgb = tuple(round(255 + t * (c - 255)) for c in SHARE_TOP)
        ink = "#ffffff" if t > 0.75 else "#000000"
        shown = _esc(token).replace("\n", "↵<br>").replace("\t", "→") or "∅"
        spans.append(f"<span style=\"background-color:#{rgb[0]:02x}{rgb[1]:02x}{rgb[2]:02x};"
                     f"color:{ink}\">{shown}</span>")
    return f"<div class=\"gen\">{''.join(spans)}</div>"


def dynamics_html(record: dict[str, Any] | None, images: dict[str, str]) -> str:
    """The "Context dynamics" section ("" without a record); ``images`` maps each figure's name
    to its ``src``."""
    if not record:
        return ""
    d = read(record)
    n, s = len(d.context_ids), d.settings
    first, last, word = verdict(d)
    seconds = d.seconds.get("total")
    took = (f" It took {seconds:.1f} s ({seconds / max(n, 1):.2f} s per prefix)."
            if isinstance(seconds, float | int) else "")
    out = [f"<h2>Context dynamics</h2>\n<p>How the patches grow as the context is read "
           f"(ANALYSIS.md A5): the query fixed, the context cut to its first i tokens for i = "
           f"1..{n}, one comparison step each (absorb context); P<sub>l,i</sub> is layer l's "
           f"patch with the first i context tokens (P<sub>l,0</sub> = 0), its increment "
           f"|P<sub>l,i</sub> − P<sub>l,i−1</sub>|<sub>F</sub> what token i added. A token's "
           f"share is its increment summed over layers, over the sum for all tokens; its lens "
           f"logit is how much its increment raised the answer's context-lens logit (summed "
           f"over layers; the lens logits telescope to the whole context's). Model "
           f"<b>{_esc(s.get('model', ''))}</b>, method {_esc(s.get('method', ''))}, "
           f"{_esc(s.get('dtype', ''))}; query <code>{_esc(repr(s.get('query', '')))}</code>; "
           f"answer (the whole context's first token) <code>{_esc(repr(d.answer[1]))}</code>; "
           f"{n} context tokens, {len(d.layers)} patched layers.{_esc(took)}</p>\n"
           f"<p>Increments summed over layers: mean {first:.3g} over the first third of the "
           f"context, {last:.3g} over the last third: <b>{word}</b>.</p>\n"
           "<h3>The context, coloured by each token's share of the increments</h3>\n"
           + coloured_context(d)]
    titles = {INCREMENTS: "Each layer's increments as shares, per context token",
              CURVES: "Patch norms and increments per layer over the prefixes",
              LENS: "The increments' lens logit for the answer, per context token"}
    widths = {INCREMENTS: HEATMAP_SIZE[0], CURVES: CURVES_SIZE[0], LENS: LENS_SIZE[0]}
    out += [_figure_html(title, images[name], widths[name]) for name, title in titles.items()
            if name in images]
    rows = "".join(
        f"<tr><td>{i + 1}</td><td><code>{_esc(repr(d.context_tokens[i]))}</code></td>"
        f"<td>{100 * d.attribution[i]:.2f}%</td><td>{d.increment[:, i].sum():.4g}</td>"
        f"<td>{_signed(float(d.lens_logit[i]))}</td>"
        f"<td><code>{_esc(repr(d.prefix_tokens[i]))}</code></td></tr>" for i in range(n))
    out.append("<h3>Every context token</h3>\n<table class=\"dynamics\"><tr><th>i</th>"
               "<th>token</th><th>share</th><th>increment (summed over layers)</th>"
               "<th>lens logit for the answer</th><th>the prefix's own answer</th></tr>"
               + rows + "</table>")
    return "\n".join(out) + "\n"


def figure_names(images: dict[str, Any]) -> set[str]:
    """The image names this module places (the report's own plot list leaves them out)."""
    return {name for name in images if name.startswith("dynamics/")}


__all__ = ["CURVES", "INCREMENTS", "LENS", "coloured_context", "dynamics_html",
           "dynamics_images", "figure_names", "verdict"]
