"""``ctxpatch reproduce``: the paper's experiments, one report (PAPER.md section 6).

The grid runs in core (`core.experiments`); this module draws Figure 4 (TVD on a log scale and
token match per method and dtype) and the start-layer sweep with pyqtgraph, and writes
``report.html`` with those, Figure-3-style per-token plots of the first prompt per setting, and
a table of every number. Qt is imported only once the runs are done.
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

from ..core import experiments as ex


def _figure4(rows: list[dict[str, Any]], records: dict[str, Any], jobs: list[Any],
             stats: dict[str, Any]) -> Any:
    """Figure 4 per setting: every token's TVD (log scale) with the median (red) and the pooled
    mean's bootstrap 95% interval (black); the token match rate with its interval."""
    import numpy as np
    import pyqtgraph as pg

    from .report import ensure_app

    ensure_app()
    graphics = pg.GraphicsLayoutWidget()
    graphics.setBackground("w")
    labels = [(i, _short(r)) for i, r in enumerate(rows)]
    intervals = {s["setting"]: s for s in stats["settings"]}
    tvd_plot = graphics.addPlot(row=0, col=0, title="TVD per token (log scale)")
    tvd_plot.setLogMode(y=True)
    rng = np.random.default_rng(0)
    for i, r in enumerate(rows):
        tvd = np.array([max(float(s["tvd"]), 1e-12) for j in jobs
                        if j.setting == r["setting"] and j.name in records
                        for s in records[j.name]["steps"]])
        x = i + rng.uniform(-0.15, 0.15, len(tvd))
        tvd_plot.plot(x, tvd, pen=None, symbol="o", symbolSize=5,
                      symbolBrush=(40, 110, 220, 120), symbolPen=None)
        med = float(np.median(tvd)) if len(tvd) else math.nan
        tvd_plot.plot([i - 0.3, i + 0.3], [med, med], pen=pg.mkPen((200, 40, 40), width=3))
        _interval(tvd_plot, i + 0.3, intervals.get(r["setting"], {}).get("tvd"), log=True)
    match_plot = graphics.addPlot(row=0, col=1, title="token match rate (95% interval)")
    match_plot.addItem(pg.BarGraphItem(x=list(range(len(rows))),
                                       height=[r["match_rate"] for r in rows],
                                       width=0.6, brush=(40, 110, 220)))
    for i, r in enumerate(rows):
        _interval(match_plot, i, intervals.get(r["setting"], {}).get("match"))
    match_plot.setYRange(0, 1.05)
    for plot in (tvd_plot, match_plot):
        plot.getAxis("bottom").setTicks([labels])
        plot.showGrid(y=True, alpha=0.25)
    _black(graphics, (tvd_plot, match_plot))
    return graphics


def _short(row: dict[str, Any]) -> str:
    extra = [row["absorb"]] if row.get("absorb", "all") != "all" else []
    extra += [f"L{row['layers']}"] if row.get("layers", "all") != "all" else []
    return " ".join([row["dtype"].replace("float", "f"), row["method"],
                     *extra])


def _interval(plot: Any, x: float, metric: dict[str, Any] | None, log: bool = False) -> None:
    """A black bar from the interval's low to its high, a dot at the pooled value."""
    import numpy as np
    import pyqtgraph as pg

    if not metric or not all(math.isfinite(metric[k]) for k in ("pooled", "ci_low", "ci_high")):
        return
    lo, mid, hi = metric["ci_low"], metric["pooled"], metric["ci_high"]
    if log:
        lo, mid, hi = (math.log10(max(v, 1e-12)) for v in (lo, mid, hi))
    pen = pg.mkPen((0, 0, 0), width=2)
    plot.addItem(pg.ErrorBarItem(x=np.array([x]), y=np.array([mid]), top=np.array([hi - mid]),
                                 bottom=np.array([mid - lo]), beam=0.12, pen=pen))
    plot.plot([x], [10 ** mid if log else mid], pen=None, symbol="d", symbolSize=8,
              symbolBrush=(0, 0, 0), symbolPen=None)


def _black(graphics: Any, plots: Any) -> None:
    """Print colours: black axes and titles on white, whatever the screen's palette."""
    for plot in plots:
        for name in ("left", "bottom"):
            plot.getAxis(name).setPen("k")
            plot.getAxis(name).setTextPen("k")
        plot.titleLabel.setAttr("color", "k")
        plot.setTitle(plot.titleLabel.text)


def _sweep_figure(rows: list[dict[str, Any]]) -> Any:
    import pyqtgraph as pg

    from .report import ensure_app

    ensure_app()
    graphics = pg.GraphicsLayoutWidget()
    graphics.setBackground("w")
    xs = [r["start_layer"] for r in rows]
    match = graphics.addPlot(row=0, col=0, title="token match vs first patched layer")
    match.plot(xs, [r["matches"] / r["tokens"] for r in rows], symbol="o",
               pen=pg.mkPen((40, 110, 220), width=2))
    match.setYRange(0, 1.05)
    scale = [(x, r["max_abs_scale_patch"]) for x, r in zip(xs, rows, strict=True)
             if r["max_abs_scale_patch"]]
    norm = graphics.addPlot(row=0, col=1, title="largest |scale patch| (log)")
    norm.setLogMode(y=True)
    if scale:
        norm.plot([x for x, _ in scale], [y for _, y in scale], symbol="o",
                  pen=pg.mkPen((200, 40, 40), width=2))
    for plot in (match, norm):
        plot.setLabel("bottom", "first patched layer s (layers s..L-1)")
        plot.showGrid(x=True, y=True, alpha=0.25)
    _black(graphics, (match, norm))
    return graphics


def _figure5(records: dict[str, Any], dtypes: list[str]) -> Any:
    """The image run: logit L-infinity per token, one line per dtype and method, mismatches
    marked (the paper's Figure 5, top panel)."""
    import numpy as np
    import pyqtgraph as pg

    from .report import ensure_app

    ensure_app()
    graphics = pg.GraphicsLayoutWidget()
    graphics.setBackground("w")
    plot = graphics.addPlot(row=0, col=0, title="image run: logit L∞ per token (log scale)")
    plot.setLogMode(y=True)
    plot.addLegend(offset=(-10, 10), labelTextColor="k")
    colours = iter([(40, 110, 220), (240, 140, 30), (40, 160, 70), (200, 40, 40)])
    for d in dtypes:
        for m in ex.METHODS:
            record = records.get(f"image-{d}-{m}")
            if record is None:
                continue
            steps = record["steps"]
            x = np.arange(1, len(steps) + 1, dtype=float)
            y = np.array([max(float(s["linf"] or 0.0), 1e-12) for s in steps])
            colour = next(colours)
            plot.plot(x, y, pen=pg.mkPen(colour, width=2), symbol="o", symbolSize=5,
                      symbolBrush=colour, name=f"{d} {m}")
            bad = np.array([not s["match"] for s in steps])
            if bad.any():
                plot.plot(x[bad], y[bad], pen=None, symbol="x", symbolSize=12,
                          symbolBrush=(200, 0, 0), symbolPen=(200, 0, 0))
    plot.setLabel("bottom", "generated token")
    plot.showGrid(x=True, y=True, alpha=0.25)
    _black(graphics, (plot,))
    return graphics


def _image(graphics: Any, size: tuple[int, int] = (1100, 420)) -> tuple[bytes, bytes]:
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QApplication

    from .report import _png, _svg

    graphics.setAttribute(Qt.WidgetAttribute.WA_DontShowOnScreen)
    graphics.resize(*size)
    graphics.show()
    QApplication.processEvents()
    out = _png(graphics), _svg(graphics)
    graphics.hide()
    return out


def _table(rows: list[list[Any]], header: list[str]) -> str:
    from .report import _fmt
    from .report import _table as table

    return table(rows, header, cell=_fmt)


def write_reproduction(req: Any, records: dict[str, Any], rows: list[dict[str, Any]],
                       sweep: list[dict[str, Any]], stats: dict[str, Any], jobs: list[Any]
                       ) -> Path:
    """report.html and plots/ (PNG and SVG) of a reproduction (`app.reproduce_set.execute`
    writes summary.json and the tables)."""
    from ..core.export import atomic_write, write_text
    from ..core.record import read_record
    from .report import _data_uri, plot_images

    out, model, dtypes = req.out, req.model, req.dtypes
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    images: dict[str, tuple[bytes, bytes]] = {
        "figure4": _image(_figure4(rows, records, jobs, stats),
                          (max(1100, 140 * len(rows) * 2), 420))}
    if sweep:
        images["sweep"] = _image(_sweep_figure(sweep))
    if any(name.startswith("image-") for name in records):
        images["figure5"] = _image(_figure5(records, dtypes))
    first = req.rows[0].id
    for r in rows:
        name = f"{r['setting']}-{first}"
        if name in records:
            images[f"figure3-{name}"] = plot_images(read_record(records[name]))["per-token"]
    for name, (png, svg) in images.items():
        for ext, data in (("png", png), ("svg", svg)):
            atomic_write(plots / f"{name}.{ext}",
                         lambda tmp, data=data: Path(tmp).write_bytes(data))
    summary = _table([[_short(r), f"{r['match_rate']:.1%}",
                       "/".join(map(str, r["per_prompt_matches"])), r["median_tvd"], r["mean_tvd"],
                       r["max_linf"], f"{r['control_match_rate']:.1%}", r["max_abs_scale_patch"],
                       r["seconds"]] for r in rows],
                     ["setting", "token match", "matches per prompt", "median TVD",
                      "mean TVD", "max logit L∞", "control match", "max |scale patch|",
                      "seconds"])
    sweep_table = _table([[r["start_layer"], f"{r['matches']}/{r['tokens']}", r["max_linf"],
                           r["median_tvd"], r["max_abs_scale_patch"]] for r in sweep],
                         ["first patched layer", "token match", "max logit L∞", "median TVD",
                          "max |scale patch|"])
    runs = _table([[name, r["summary"]["patched"]["matches"], r["summary"]["patched"]["max_linf"],
                    r["summary"]["patched"]["median_tvd"], r["summary"]["control"]["max_linf"]]
                   for name, r in sorted(records.items())],
                  ["run", "matches", "max logit L∞", "median TVD", "control max L∞"])
    figure3 = "".join(
        f"<h3>{html.escape(name.removeprefix('figure3-'))} (prompt {html.escape(first)})</h3>"
        f"<p><img src=\"{_data_uri(png)}\" width=\"680\"></p>"
        for name, (png, _) in images.items() if name.startswith("figure3-"))
    if req.paper:
        prompts_html = ("<ol>" + "".join(f"<li>{html.escape(r.query)}</li>" for r in req.rows)
                        + "</ol>")
    else:
        prompts_html = _table([[r.id, _clip(r.context), _clip(r.query),
                                Path(r.image).name if r.image else ""] for r in req.rows],
                              ["id", "context", "query", "image"])
    title = ("The paper's experiments" if req.paper
             else f"A prompt set ({len(req.rows)} prompts)")
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>ctxpatch reproduction</title>
<style>body {{ font-family: sans-serif; max-width: 62em; margin: 2em auto; }}
table {{ border-collapse: collapse; }} td, th {{ border: 1px solid #999; padding: 2px 6px; }}
</style></head><body>
<h1>{html.escape(title)} on {html.escape(model)}</h1>
<p>Absorb <b>{html.escape(", ".join(req.absorbs))}</b> (with <i>all</i>, at every step the
patched model sees only the current token at its absolute position), greedy, teacher forcing on
each precision's own baseline, {req.tokens} tokens per prompt. Prompts
({html.escape(req.where)}):</p>{prompts_html}
<h2>Figure 4: TVD and token match per setting</h2>
<p><img src="{_data_uri(images['figure4'][0])}" width="680"></p>
<p>Blue dots: every token's TVD; red: their median; black: the pooled mean with its bootstrap
95% interval (below: the method).</p>
{summary}
{_statistics_html(stats)}
<h2>Start-layer sweep (prompt {html.escape(first)}, {html.escape(dtypes[0])}, direct)</h2>
{f'<p><img src="{_data_uri(images["sweep"][0])}" width="680"></p>' if sweep else ''}
{sweep_table}
<h2>Figure 3: per-token metrics</h2>
{figure3}
{_figure5_html(records, images)}
<h2>Every run</h2>
{runs}
</body></html>
"""
    write_text(out / "report.html", page)
    return out / "report.html"


def _clip(text: str, n: int = 90) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _statistics_html(stats: dict[str, Any]) -> str:
    """The intervals' table, the per-prompt spread and the worst prompts, with the bootstrap's
    method, resamples and seed stated."""
    def ci(m: dict[str, Any], pct: bool = False) -> str:
        f = (lambda x: f"{x:.1%}") if pct else (lambda x: f"{x:.3g}")
        if not math.isfinite(m["ci_low"]):
            return f(m["pooled"])
        return f"{f(m['pooled'])} [{f(m['ci_low'])}, {f(m['ci_high'])}]"

    b = stats["bootstrap"]
    rows = [[s["setting"], s["prompts"], s["tokens"], ci(s["match"], True), ci(s["tvd"]),
             ci(s["linf"]), s["linf"]["max"],
             f"{s['match']['per_prompt']['min']:.0%} / {s['match']['per_prompt']['median']:.0%}",
             ", ".join(f"{w['id']} ({w['match']:.0%})" for w in s["worst"][:3])]
            for s in stats["settings"]]
    table = _table(rows, ["setting", "prompts", "tokens", "token match [95% CI]",
                          "mean TVD [95% CI]", "mean logit L∞ [95% CI]", "max logit L∞",
                          "prompt match min / median", "worst prompts"])
    return (f"<h2>Statistics over the prompts</h2><p>Pooled over every token of the set's "
            f"prompts; 95% intervals by a percentile bootstrap that resamples whole prompts "
            f"with replacement ({b['resamples']} resamples, seed {b['seed']}). The per-prompt "
            f"spread and the worst prompts (lowest token match, then highest mean TVD) follow; "
            f"summary.csv and prompts.csv hold every number.</p>{table}")


def _figure5_html(records: dict[str, Any], images: dict[str, tuple[bytes, bytes]]) -> str:
    from .report import _data_uri

    runs = {name: r for name, r in sorted(records.items()) if name.startswith("image-")}
    if not runs:
        return ""
    first = next(iter(runs.values()))
    info = first.get("prompt", {}).get("image") or {}
    rows = _table([[name.removeprefix("image-"),
                    f"{r['summary']['patched']['matches']}/{r['summary']['tokens']}",
                    r["summary"]["patched"]["max_linf"], r["summary"]["patched"]["median_tvd"]]
                   for name, r in runs.items()],
                  ["dtype, method", "token match", "max logit L∞", "median TVD"])
    baseline = html.escape("".join(s["baseline_token"]["text"] for s in first["steps"]))
    return (f"<h2>Figure 5: a picture in the context</h2><p>Query "
            f"<i>{html.escape(ex.IMAGE_QUERY)}</i> with the picture "
            f"{html.escape(Path(info.get('path', '?')).name)} (sha256 "
            f"{html.escape(str(info.get('sha256', '?'))[:16])}…); the baseline of the first run: "
            f"<i>{baseline}</i></p>"
            f"<p><img src=\"{_data_uri(images['figure5'][0])}\" width=\"680\"></p>{rows}")


def _image_model_check(model: str) -> None:
    """The image runs need an image+text model: say so before any run."""
    from ..core.footprint import DEMOS
    from ..core.images import text_only

    if model in DEMOS:
        raise text_only(f"the {model} model")
    from ..core.loading import _resolve_source, load_config

    source, local_only = _resolve_source(model, None, None)
    if getattr(load_config(source, local_only), "vision_config", None) is None:
        raise text_only(model)


def _sweep(text: str | None) -> list[int] | None:
    """``--sweep``'s layers, checked before any run (their range once the model is known)."""
    from ..core.errors import UserError

    if text is None:
        return None
    try:
        layers = [int(part) for part in text.split(",")]
    except ValueError:
        raise UserError(f"--sweep {text!r}: give first layers as whole numbers separated by "
                        "commas, e.g. 0,4,9") from None
    if any(x < 0 for x in layers):
        raise UserError(f"--sweep {text!r}: layers start at 0")
    return layers


def _check_sweep_range(model: str, sweep: list[int]) -> None:
    """Refuse a sweep layer beyond the model's before any run (from its config alone)."""
    from ..core.errors import UserError
    from ..core.footprint import DEMOS

    if model in DEMOS:
        return  # checked after the first run (the demo's config comes with its conversion)
    from ..core.loading import _resolve_source, load_config

    source, local_only = _resolve_source(model, None, None)
    config = load_config(source, local_only)
    config = getattr(config, "text_config", None) or config
    n = getattr(config, "num_hidden_layers", None)
    if isinstance(n, int) and any(x >= n for x in sweep):
        raise UserError(f"--sweep {','.join(map(str, sweep))}: the model has layers 0 to {n - 1}")


def run(args: Any, say: Any) -> int:
    from .reproduce_set import execute, request_of

    req = request_of(args)
    result = execute(req, say)
    say(f"wrote {result.report} (and summary.json, summary.csv, prompts.csv, plots/, runs/)")
    for s in result.statistics["settings"]:
        m, t = s["match"], s["tvd"]
        interval = (f" [{m['ci_low']:.1%}, {m['ci_high']:.1%}]" if math.isfinite(m["ci_low"])
                    else "")
        print(f"{s['setting']:24s} match {m['pooled']:.1%}{interval}  mean TVD {t['pooled']:.3g}"
              f"  max L-inf {s['linf']['max']:.3g}")
    return 0
