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


def _figure4(rows: list[dict[str, Any]], records: dict[str, Any], prompts: int) -> Any:
    import numpy as np
    import pyqtgraph as pg

    from .report import ensure_app

    ensure_app()
    graphics = pg.GraphicsLayoutWidget()
    graphics.setBackground("w")
    labels = [(i, f"{r['dtype']} {r['method']}") for i, r in enumerate(rows)]
    tvd_plot = graphics.addPlot(row=0, col=0, title="TVD per token (log scale)")
    tvd_plot.setLogMode(y=True)
    rng = np.random.default_rng(0)
    for i, r in enumerate(rows):
        tvd = np.array([max(float(s["tvd"]), 1e-12) for p in range(prompts)
                        for s in records.get(f"{r['dtype']}-{r['method']}-p{p + 1}",
                                             {"steps": []})["steps"]])
        x = i + rng.uniform(-0.15, 0.15, len(tvd))
        tvd_plot.plot(x, tvd, pen=None, symbol="o", symbolSize=5,
                      symbolBrush=(40, 110, 220, 120), symbolPen=None)
        med = float(np.median(tvd)) if len(tvd) else math.nan
        tvd_plot.plot([i - 0.3, i + 0.3], [med, med], pen=pg.mkPen((200, 40, 40), width=3))
    match_plot = graphics.addPlot(row=0, col=1, title="token match rate")
    match_plot.addItem(pg.BarGraphItem(x=list(range(len(rows))),
                                       height=[r["match_rate"] for r in rows],
                                       width=0.6, brush=(40, 110, 220)))
    match_plot.setYRange(0, 1.05)
    for plot in (tvd_plot, match_plot):
        plot.getAxis("bottom").setTicks([labels])
        plot.showGrid(y=True, alpha=0.25)
    _black(graphics, (tvd_plot, match_plot))
    return graphics


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


def write_reproduction(out: Path, model: str, records: dict[str, Any], rows: list[dict[str, Any]],
                       sweep: list[dict[str, Any]], dtypes: list[str], prompts: int) -> Path:
    from ..core.export import atomic_write, write_json, write_text
    from ..core.record import read_record
    from .report import _data_uri, plot_images

    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    images: dict[str, tuple[bytes, bytes]] = {"figure4": _image(_figure4(rows, records, prompts))}
    if sweep:
        images["sweep"] = _image(_sweep_figure(sweep))
    if any(name.startswith("image-") for name in records):
        images["figure5"] = _image(_figure5(records, dtypes))
    for d in dtypes:
        for m in ex.METHODS:
            name = f"{d}-{m}-p1"
            if name in records:
                images[f"figure3-{name}"] = plot_images(read_record(records[name]))["per-token"]
    for name, (png, svg) in images.items():
        for ext, data in (("png", png), ("svg", svg)):
            atomic_write(plots / f"{name}.{ext}",
                         lambda tmp, data=data: Path(tmp).write_bytes(data))
    write_json(out / "summary.json", {"model": model, "summary": rows, "sweep": sweep})
    summary = _table([[r["dtype"], r["method"], f"{r['match_rate']:.1%}",
                       "/".join(map(str, r["per_prompt_matches"])), r["median_tvd"], r["mean_tvd"],
                       r["max_linf"], f"{r['control_match_rate']:.1%}", r["max_abs_scale_patch"],
                       r["seconds"]] for r in rows],
                     ["dtype", "method", "token match", "matches per prompt", "median TVD",
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
        f"<h3>{html.escape(name.removeprefix('figure3-'))} (prompt 1)</h3>"
        f"<p><img src=\"{_data_uri(png)}\" width=\"680\"></p>"
        for name, (png, _) in images.items() if name.startswith("figure3-"))
    prompts_list = "".join(f"<li>{html.escape(p)}</li>" for p in ex.PAPER_PROMPTS[:prompts])
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>ctxpatch reproduction</title>
<style>body {{ font-family: sans-serif; max-width: 62em; margin: 2em auto; }}
table {{ border-collapse: collapse; }} td, th {{ border: 1px solid #999; padding: 2px 6px; }}
</style></head><body>
<h1>The paper's experiments on {html.escape(model)}</h1>
<p>Absorb <b>all</b> (at every step the patched model sees only the current token at its
absolute position), greedy, teacher forcing on each precision's own baseline,
{html.escape(str(records and next(iter(records.values()))['summary']['tokens']))} tokens per
prompt. Prompts:</p><ol>{prompts_list}</ol>
<h2>Figure 4: TVD and token match per method and dtype</h2>
<p><img src="{_data_uri(images['figure4'][0])}" width="680"></p>
{summary}
<h2>Start-layer sweep (prompt 1, {html.escape(dtypes[0])}, direct)</h2>
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
    from ..core.errors import UserError

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file: give a folder (new, or an earlier "
                        "reproduction's, which resumes)")
    prompts = args.prompts
    if not 1 <= prompts <= len(ex.PAPER_PROMPTS):
        raise UserError(f"--prompts must be between 1 and {len(ex.PAPER_PROMPTS)}")
    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    sweep = _sweep(args.sweep)
    if sweep:
        _check_sweep_range(args.model, sweep)
    dtypes = list(args.dtypes.split(","))
    image = None
    if args.image is not None:
        from ..core.images import read_image
        from ..resources import sample_image_path

        image = sample_image_path() if args.image == "sample" else args.image
        read_image(image)  # a bad file fails before any run
        _image_model_check(args.model)
    out.mkdir(parents=True, exist_ok=True)
    records = ex.run_grid(args.model, out, ex.grid(prompts, dtypes, []), args.max_new_tokens,
                          args.device, say)
    num_layers = int(next(iter(records.values()))["model"]["num_layers"])
    sweep_layers = sweep if sweep is not None else ex.default_sweep(num_layers)
    if any(x >= num_layers for x in sweep_layers):
        raise UserError(f"--sweep {args.sweep}: the model has layers 0 to {num_layers - 1}")
    records.update(ex.run_grid(args.model, out, ex.grid(0, dtypes, sweep_layers),
                               args.max_new_tokens, args.device, say))
    if image is not None:
        records.update(ex.run_grid(args.model, out, ex.image_grid(dtypes), args.max_new_tokens,
                                   args.device, say, image=image))
    rows = ex.summary(records, dtypes, prompts)
    report = write_reproduction(out, args.model, records, rows,
                                ex.sweep_rows(records, sweep_layers), dtypes, prompts)
    say(f"wrote {report} (and summary.json, plots/, runs/)")
    for r in rows:
        print(f"{r['dtype']:9s} {r['method']:7s} match {r['match_rate']:.1%}  "
              f"median TVD {r['median_tvd']:.3g}  max L-inf {r['max_linf']:.3g}")
    return 0
