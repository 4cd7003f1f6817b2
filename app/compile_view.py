"""The compiled context as the window and the reports show it (ANALYSIS.md A4): the results
table's rows, the retained-effect-vs-rank figure, and the report's "Compiled context" section.

Everything here reads a compile record (`core.compile_record.compile_record`: plain JSON data),
never a model or a tensor, so a record reopened from a session draws as it did when computed.
"""

from __future__ import annotations

import html
import math
from typing import Any

#: the figure's size in the report, in CSS pixels (the page's width, as `app.report.PLOT_SIZE`)
CURVE_SIZE = (670, 360)
CURVE = "compile-rank-curve"  # the figure's name (its PNG and SVG files)
SETS = (("train", "train"), ("held_out", "held-out"))
NOT_DEFINED = "—"


def number(x: Any, digits: str = ".3g") -> str:
    """A table's number; None (the context changed nothing there) or NaN as a dash."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return NOT_DEFINED
    return format(x, digits)


def answer_text(text: str) -> str:
    """An answer as a table shows it: newlines and tabs as ↵ and →, other control characters
    as their Unicode pictures (␈), an empty answer (an end of text at once) as ∅."""
    if not text:
        return "∅"
    return "".join("↵" if c == "\n" else "→" if c == "\t" else chr(0x2400 + ord(c))
                   if ord(c) < 32 else "␡" if c == "\x7f" else c for c in text.replace("\r", ""))


def table_rows(record: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row per query, the training ones first: set, query, match, retained effect, L-inf,
    mean TVD, the compiled model's answer without the context, the full-context answer."""
    rows = []
    for key, label in SETS:
        for r in record.get(key) or []:
            rows.append((label, r["query"], f"{r['match']}/{r['tokens']}",
                         number(r["retained"]), number(r["linf"]), number(r["tvd"]),
                         answer_text(r["answer"]), answer_text(r["full_context_answer"])))
    return rows


HEADER = ("set", "query", "match", "retained R", "L∞", "mean TVD",
          "compiled, without the context", "full context")


def pooled_line(record: dict[str, Any]) -> str:
    """The pooled retained effect and token match of each set, in one line."""
    pooled = record.get("pooled") or {}
    parts = []
    for key, label in SETS:
        p = pooled.get(key) or {}
        if p.get("tokens"):
            parts.append(f"{label}: R {number(p.get('retained'))}, match {p.get('match')}/"
                         f"{p.get('tokens')}")
    return (f"Rank {record.get('rank')}, ridge {number(record.get('ridge'))}; pooled over the "
            "tokens: " + "; ".join(parts)) if parts else ""


def curve_series(curve: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """Each set's (ranks, retained effects), the ranks where it is defined."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for key, _ in SETS:
        pts = [(p["rank"], p["pooled"][key]["retained"]) for p in curve
               if p["pooled"][key].get("retained") is not None]
        out[key] = ([k for k, _ in pts], [float(r) for _, r in pts])
    return out


class CurveFigure:
    """Retained effect R (pooled) against the rank, log2 axis, training and held-out queries;
    R = 1 is the full context's effect, 0 the unpatched model's."""

    def __init__(self, point_size: float | None = None, report: bool = False) -> None:
        import pyqtgraph as pg
        from PySide6.QtCore import Qt

        from .theme import legend_row, legend_style, series_colors, style_graphics

        self.graphics = pg.GraphicsLayoutWidget()
        if report:
            self.graphics.setAttribute(Qt.WidgetAttribute.WA_DontShowOnScreen)
            self.graphics.setFixedSize(*CURVE_SIZE)
        self.legend_row, self.legend = legend_row(self.graphics, columns=2)
        self.plot = self.graphics.addPlot(row=1, col=0)
        self.plot.setLabel("bottom", "rank k")
        self.plot.setLabel("left", "retained effect R")
        self.plot.showGrid(x=True, y=True, alpha=0.2)
        self.plot.setMouseEnabled(False, False)
        self.plot.hideButtons()
        palette = self.graphics.palette()
        colors = series_colors(palette)
        self.lines = {}
        for (key, label), color in zip(SETS, (colors["patched"], colors["control"]),
                                       strict=True):
            self.lines[key] = self.plot.plot([], [], name=f"{label} queries",
                                             pen=pg.mkPen(color, width=2), symbol="o",
                                             symbolSize=7, symbolBrush=color,
                                             symbolPen=pg.mkPen(color))
            self.legend.addItem(self.lines[key], f"{label} queries")
        mid = palette.mid().color()
        for y in (0.0, 1.0):
            self.plot.addItem(pg.InfiniteLine(y, angle=0, pen=pg.mkPen(
                mid, width=1, style=Qt.PenStyle.DashLine)))
        style_graphics(self.graphics, [self.plot], palette, point_size)
        legend_style(self.legend, palette, point_size)
        self.legend.updateSize()
        self.legend_row.layout.setRowFixedHeight(0, self.legend.height() + 4)

    def draw(self, curve: list[dict[str, Any]]) -> Any:
        """Draw a record's ``curve``; returns the figure's widget."""
        series = curve_series(curve)
        ranks = sorted({p["rank"] for p in curve})
        for key, (ks, rs) in series.items():
            self.lines[key].setData([math.log2(k) for k in ks], rs)
        if ranks:
            self.plot.getAxis("bottom").setTicks([[(math.log2(k), str(k)) for k in ranks]])
            lo, hi = math.log2(ranks[0]), math.log2(ranks[-1])
            self.plot.setXRange(lo - 0.3, hi + 0.3 if hi > lo else lo + 0.3, padding=0)
        values = [r for _, rs in series.values() for r in rs] + [0.0, 1.0]
        self.plot.setYRange(min(values), max(values), padding=0.08)
        return self.graphics


def compile_images(record: dict[str, Any] | None, png: Any, svg: Any,
                   point_size: float) -> dict[str, tuple[bytes, bytes]]:
    """The report's figure of a compile record ({`CURVE`: (PNG, SVG)}); none without a sweep."""
    if not record or len(record.get("curve") or []) < 2:
        return {}
    from PySide6.QtWidgets import QApplication

    figure = CurveFigure(point_size, report=True)
    widget = figure.draw(record["curve"])
    widget.show()  # lays it out; never on screen
    QApplication.processEvents()
    out = {CURVE: (png(widget), svg(widget))}
    widget.hide()
    widget.deleteLater()
    return out


def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def compile_html(record: dict[str, Any] | None, images: dict[str, str]) -> str:
    """The report's "Compiled context" section ("" without a record); ``images`` maps the
    figure's name to its ``src``."""
    if not record:
        return ""
    head = "".join(f"<th>{_esc(h)}</th>" for h in HEADER[:6])
    body = "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in row[:6]) + "</tr>"
                   for row in table_rows(record))
    answers = "".join(
        f"<tr><td>{_esc(row[0])}</td><td>{_esc(row[1])}</td><td>{_esc(row[6])}</td>"
        f"<td>{_esc(row[7])}</td></tr>" for row in table_rows(record))
    layers = record.get("layers") or []
    worst = max((x["residual"] for x in layers if x.get("residual") is not None), default=None)
    adapter = record.get("adapter")
    figure = ""
    if CURVE in images:
        figure = (f"<div class=\"figure\"><h3>Retained effect against the rank</h3>"
                  f"<p class=\"figure\"><img src=\"{_esc(images[CURVE])}\" "
                  f"width=\"{CURVE_SIZE[0]}\"></p></div>")
    return f"""<h2>Compiled context</h2>
<p>The context compiled into one weight delta per layer (ANALYSIS.md A4): ridge least squares
over every position of the training queries, layer by layer, truncated to rank k. Each query is
then run <b>without</b> the context through the compiled model and compared, token by token
(teacher-forced on the full-context answer), with the model <b>with</b> the context and with the
unpatched model: retained effect R = 1 − TVD(full, compiled) / TVD(full, unpatched) (1: the
whole effect, 0: none; — where the context changes nothing).</p>
<p>{_esc(pooled_line(record))}. Training positions: {_esc(record.get('positions', '?'))};
largest training residual of a layer: {_esc(number(worst))} of its block output;
new tokens: {_esc(record.get('max_new_tokens', '?'))};
adapter: {_esc(adapter) if adapter else 'not exported'}.</p>
<table><tr>{head}</tr>{body}</table>
<h3>Answers side by side</h3>
<table><tr><th>set</th><th>query</th><th>compiled, without the context</th>
<th>full context</th></tr>{answers}</table>
{figure}
"""


def compile_page(record: dict[str, Any], images: dict[str, str], screen: bool = True) -> str:
    """A report of a compilation alone (``ctxpatch compile --report``)."""
    from datetime import datetime, timezone

    from ..core import __version__
    from .report import SCREEN_STYLE, STYLE

    context = record.get("context", "")
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>ctxpatch compile report</title>
<style>{STYLE}{SCREEN_STYLE if screen else ""}</style></head><body>
<h1>ctxpatch compile report</h1>
<p>Made by ctxpatch {_esc(__version__)} on
{_esc(datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC'))}. Model:
{_esc(record.get('model', '?'))}.</p>
<h2>Context</h2>
<div class="gen">{_esc(context)}</div>
{compile_html(record, images)}</body></html>
"""
