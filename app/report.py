"""Reports: one self-contained HTML file (plots embedded as PNG), or PDF through Qt's own
writer, plus every plot as PNG and SVG (pyqtgraph's exporters). Works offscreen.

The report is made from a run's JSON record (`core.record.record_of`), so the command line,
the window, sessions and ``ctxpatch reproduce`` all produce the same thing. All user text is
escaped.
"""

from __future__ import annotations

import base64
import html
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..core import __version__
from ..core.errors import UserError
from ..core.record import RunRecord
from .compile_view import compile_images
from .jobs import RunStarted
from .panels.generation_panel import COLORS, token_html
from .report_analysis import analysis_html, analysis_images
from .report_dynamics import dynamics_html, dynamics_images
from .report_print import keep_with_next
from .state import RunState

#: the figures' size in the report, in CSS pixels (96 to the inch): the page's width between
#: A4's 15 mm margins, less the document's own margin; the plots are laid out at this size, with
#: `FIGURE_PT` text, so that a tick label prints at FIGURE_PT (drawn at `PNG_SCALE` x for print).
#: An A4 page between the margins is 1009 px high: the per-token plots and one patch-norm figure
#: share a page with the Plots heading, and two patch-norm figures share the next ones
PLOT_SIZE = (670, 440)  # the per-token plots
NORMS_SIZE = (670, 350)  # a patch-norm heatmap and its profile
FIGURE_PT = 10.0
PNG_SCALE = 2.5
#: the PDF's layout unit: one CSS pixel, so an image's width="670" is the same 177 mm as in HTML
PDF_DPI = 96
_EXPORT: tuple[Any, Any, Any] | None = None  # (state, per-token panel, patch panel)


def ensure_app() -> Any:
    """A QApplication for exporting (offscreen when there is no display)."""
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance()
    if app is None:
        if not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
            os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
        from PySide6.QtCore import qInstallMessageHandler

        def quiet(kind: Any, context: Any, message: str) -> None:
            if "propagateSizeHints" not in message:  # the offscreen platform's only complaint
                print(message, file=sys.stderr)

        qInstallMessageHandler(quiet)
        app = QApplication([])
    return app


def fill_state(state: RunState, run: RunRecord) -> RunState:
    """Replay a finished run into a `RunState` (its views update as in a live run)."""
    layers = sorted({layer for s in run.steps for layer in s.patch_norms}) or sorted(
        {layer for s in run.steps for layer in s.layer_info})
    plan = _plans(run)
    state.reset(RunStarted(settings=run.settings, prompt=run.prompt, layers=tuple(layers),
                           num_layers=int(run.model.get("num_layers", len(layers))),
                           output_control=str(plan[0].control if plan else
                                              run.settings.get("output_control") or "default"),
                           model=run.model, plan=plan, record=run.record))
    for s in run.steps:
        state.add_step(s)
    state.finish()
    return state


def plot_images(run: RunRecord, selected: int | None = None) -> dict[str, tuple[bytes, bytes]]:
    """The run's plots as {name: (PNG bytes, SVG bytes)}: the per-token metrics, then the
    patch-norm heatmap and profile of every patched parameter ("patch-norms/<param>"), then the
    analyses' figures when the record has them (`app.report_analysis`: "lens",
    "geometry/<role>", "transfer"). ``selected``: the token (0-based step) whose per-layer
    profile the patch-norm figures draw, as the window shows it (default: the last)."""
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QApplication

    from .panels.patch_panel import QtPatchPanel
    from .panels.plots_panel import QtPlotsPanel

    ensure_app()
    global _EXPORT
    if _EXPORT is None:  # made once and reused: see tests/app/conftest.py on destroying plots
        state = RunState()
        _EXPORT = (state, QtPlotsPanel(state, point_size=FIGURE_PT),
                   QtPatchPanel(state, point_size=FIGURE_PT))
        for panel, size in zip(_EXPORT[1:], (PLOT_SIZE, NORMS_SIZE), strict=True):
            panel.setAttribute(Qt.WidgetAttribute.WA_DontShowOnScreen)
            panel.graphics.setFixedSize(*size)  # the figure is exactly its size in the report
    state, plots, patches = _EXPORT
    fill_state(state, run)
    state.select(selected)
    for panel in (plots, patches):
        panel.show()  # lays the plots out; never on screen
        panel.adjustSize()
    QApplication.processEvents()
    plots._fit()  # the log axes' margins follow the laid-out height
    images: dict[str, tuple[bytes, bytes]] = {}
    images["per-token"] = _png(plots.graphics), _svg(plots.graphics)
    for key in state.param_keys():
        state.set_view(param=key)
        QApplication.processEvents()
        images[f"patch-norms/{key}"] = _png(patches.graphics), _svg(patches.graphics)
    for panel in (plots, patches):
        panel.hide()
    images.update(analysis_images(run.record.get("analysis"), _png, _svg, FIGURE_PT, run.record))
    return images


def _png(graphics: Any, scale: float = PNG_SCALE) -> bytes:
    """The figure as PNG, drawn ``scale`` times its size (text and lines scaled with it), to be
    shown at its size: sharp in print, every label at the point size it was laid out in."""
    import pyqtgraph.exporters as exporters
    from PySide6.QtCore import QBuffer, QByteArray, QIODevice

    exporter = exporters.ImageExporter(graphics.ci)
    exporter.parameters()["width"] = int(round(graphics.ci.boundingRect().width() * scale))
    image = exporter.export(toBytes=True)
    data = QByteArray()
    buffer = QBuffer(data)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    image.save(buffer, "PNG")
    return bytes(data.data())


def _svg(widget: Any) -> bytes:
    """A widget drawn as SVG by Qt's own generator. (pyqtgraph's SVGExporter cannot parse the
    paths current Qt writes: pyqtgraph issues #3485 and #2661.)"""
    from PySide6.QtCore import QBuffer, QByteArray, QIODevice, QRect
    from PySide6.QtGui import QPainter
    from PySide6.QtSvg import QSvgGenerator

    data = QByteArray()
    buffer = QBuffer(data)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    generator = QSvgGenerator()
    generator.setOutputDevice(buffer)
    generator.setSize(widget.size())
    generator.setViewBox(QRect(0, 0, widget.width(), widget.height()))
    generator.setTitle("ctxpatch plot")
    painter = QPainter(generator)
    try:
        widget.render(painter)
    finally:
        painter.end()
    return bytes(data.data())


def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _table(rows: Sequence[Sequence[Any]], header: Sequence[str] | None = None,
           cell: Any = str, raw: Sequence[int] = ()) -> str:
    """An HTML table; every cell is written by ``cell`` (``str``, or `_fmt` for numbers), then
    escaped (the columns in ``raw``: already HTML). The header is a ``thead``: a table that
    runs over a page repeats it on the next."""
    head = "".join(f"<th>{_esc(h)}</th>" for h in header) if header else ""
    body = "".join("<tr>" + "".join(
        f"<td>{c if i in raw else _esc(cell(c))}</td>" for i, c in enumerate(row)) + "</tr>"
        for row in rows)
    return f"<table>{'<thead><tr>' + head + '</tr></thead>' if head else ''}{body}</table>"


def breakable(name: str, screen: bool) -> str:
    """A parameter's dotted name as HTML that may wrap after its dots and underscores (never
    mid-word: "mlp.gate_proj.weigh / t"): ``<wbr>`` for a browser, a zero-width space for Qt's
    layout (the PDF), which knows no ``<wbr>``."""
    mark = "<wbr>" if screen else "\u200b"
    out = _esc(name)
    for sep in (".", "_"):
        out = out.replace(sep, sep + mark)
    return out


def _tokens(run: RunRecord, side: str) -> str:
    """The generated tokens in a row, mismatches marked; a newline is drawn (↵) where it is,
    not obeyed: a generation's newlines would otherwise leave lines holding a lone ↵."""
    spans = []
    for s in run.steps:
        text = s.baseline_text if side == "baseline" else s.patched.text
        style = (f" style=\"background-color:{COLORS['mismatch'][0]}\""
                 if not s.patched.match else "")
        spans.append(f"<span{style}>{token_html(text, breaks=False)}</span>")
    return "".join(spans)


def _fmt(x: Any) -> str:
    """A number for a table: 3 significant digits; a missing one as a dash."""
    if x is None:
        return "—"
    return f"{x:.3g}" if isinstance(x, float) else str(x)


THUMBNAIL = "context-image"


def thumbnail(run: RunRecord, size: int = 256) -> bytes | None:
    """A PNG thumbnail of the run's context image, when the file is still there unchanged."""
    import io

    from ..core.images import ImageInfo, reopen

    info = run.record.get("prompt", {}).get("image")
    if not info:
        return None
    try:
        image, _ = reopen(ImageInfo.from_dict(info))
    except (UserError, KeyError):  # gone, changed or unreadable: the report says so instead
        return None
    image.thumbnail((size, size))
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def _image_html(run: RunRecord, images: dict[str, str]) -> str:
    info = run.record.get("prompt", {}).get("image")
    if not info:
        return ""
    caption = (f"Context image: {Path(info['path']).name}, "
               f"{info.get('width')}x{info.get('height')} "
               f"{info.get('format')}, sha256 {str(info.get('sha256'))[:16]}…")
    if THUMBNAIL not in images:
        return f"<p>{_esc(caption)} (the file is no longer at {_esc(info['path'])})</p>"
    return f"<p><img src=\"{_esc(images[THUMBNAIL])}\"><br>{_esc(caption)}</p>"


#: the run's settings as the report names them: key -> (name, what it means); in this order,
#: then any others under their own key
SETTINGS = {
    "model": ("Model", "hub id, folder or demo"),
    "dtype": ("Precision", "weights and activations"),
    "device": ("Device", "where the model ran"),
    "method": ("Method", "direct: Theorem 1's controls; stable: Appendix B, most of the output "
                         "correction in the down matrix through RMSNorm inversion"),
    "absorb": ("Absorbed tokens", "all: everything before the current token (the paper's "
                                  "protocol); context: the context segments only"),
    "scope": ("Patch scope", "all-positions: patches act on every reduced position; query: on "
                             "the current one only"),
    "layers": ("Patched layers", "the first patched layer absorbs all upstream mismatch"),
    "output_control": ("Output control", "which parameter takes the output correction"),
    "disabled": ("Patches left out", "negative controls: a patch kind switched off"),
    "keep_bos": ("Keep BOS", "absorb all: the reduced sequence keeps BOS at position 0"),
    "max_new_tokens": ("New tokens", "generated greedily with teacher forcing, at most"),
    "stop_at_eos": ("Stop at end of sequence", "when the model with the context emits EOS"),
    "top_k": ("Top-k kept", "candidates kept per token and side"),
    "control": ("Unpatched control", "the reduced model without patches, run beside"),
    "keep_patches": ("Patches kept", "every step's patch vectors, for export"),
    "on_fault": ("On a NaN or infinity", "stop the run, or continue and count it"),
    "chat_template": ("Chat template", "the prompt wrapped in the model's chat template"),
    "image": ("Context image", "a picture in the context"),
    "control_row": ("Control run's pass", "batched: a batch row of the patched pass; "
                                          "separate: a forward of its own"),
    "analyze": ("Analyses", "further readings of the patches (docs/ANALYSES.md)"),
    "device_map": ("Layer placement", "layers spread over devices and disk (accelerate)"),
    "max_memory": ("Memory per device", "for the layer placement"),
    "offload_folder": ("Offload folder", "where the placement puts layers that fit nowhere"),
    "trust_remote_code": ("Model code from the checkpoint", "run code shipped with the model"),
    "allow_pickle": ("Pickled weights accepted", "pytorch_model.bin, loaded weights-only"),
}
#: a setting's value None in words (default: a dash)
_NONE = {"output_control": "the family's default", "image": "none", "device_map": "one device",
         "max_memory": "no limit", "offload_folder": "none"}
#: the model table's rows as the report names them (then any others under their own key)
MODEL = {"id": "model", "source": "loaded from", "class": "class", "family": "family",
         "dtype": "precision", "device": "device", "num_layers": "layers"}
#: the run's fault counts in words: key -> (what, where it happened)
FAULTS = {"zero_z_layers": ("z = 0: input patch skipped", "layer-steps"),
          "zero_h_layers": ("h = 0: output patch skipped", "layer-steps"),
          "div_by_one": ("N(h)_j = 0: divided by one", "coordinates"),
          "hard_case_layers": ("stable update's hard case: fallback used", "layer-steps")}
#: the run's times in words
SECONDS = {"baseline": "the model with the context", "patched": "the patched model",
           "control": "the control run", "total": "together", "wall": "start to end"}
_SHOWN_ELSEWHERE = ("context", "query")  # the prompt table shows them in full


def _setting_value(key: str, value: Any) -> str:
    """A setting's value in words: yes/no, "none", the family's default."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None:
        return _NONE.get(key, "—")
    if isinstance(value, list | tuple | set | frozenset):
        return ", ".join(map(str, value)) if value else "none"
    if isinstance(value, dict):  # an image's description
        return ", ".join(f"{k} {v}" for k, v in value.items() if k != "sha256")
    return str(value)


def settings_rows(settings: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The settings as (name, value, meaning) rows: known ones first in a reading order."""
    keys = [k for k in SETTINGS if k in settings]
    keys += [k for k in settings if k not in SETTINGS and k not in _SHOWN_ELSEWHERE]
    return [(SETTINGS.get(k, (k, ""))[0], _setting_value(k, settings[k]),
             SETTINGS.get(k, ("", ""))[1]) for k in keys]


def _plural(n: Any, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


#: the report's style. Browsers follow the break rules when printing; Qt's PDF writer knows only
#: page-break-before/after, so `keep_with_next` does the rest there: a heading never ends a page,
#: and a figure that does not fit the rest of a page starts the next one with its heading
STYLE = """
body { font-family: sans-serif; line-height: 1.4; }
table { border-collapse: collapse; margin: 0.5em 0; }
td, th { border: 1px solid #999; padding: 2px 6px; text-align: left; vertical-align: top; }
th { background-color: #eeeeee; }
td.value { font-weight: bold; }
td.note { color: #555555; }
.gen { white-space: pre-wrap; font-family: monospace; border: 1px solid #999; padding: 6px; }
h1, h2, h3 { page-break-after: avoid; break-after: avoid; }
div.figure { page-break-inside: avoid; break-inside: avoid; margin: 0 0 1em 0; }
p.figure { line-height: 100%; margin: 0; }
div.figure h3 { margin-top: 10px; margin-bottom: 6px; }
tr { page-break-inside: avoid; break-inside: avoid; }
@page { size: A4; margin: 15mm; }
"""
#: a browser's page only: Qt's text layout would take the margin as a page-wide indent
SCREEN_STYLE = "body { max-width: 60em; margin: 2em auto; }"


def _plans(run: RunRecord) -> tuple[Any, ...]:
    from ..core.controllability import LayerPlan

    plans = run.record.get("controllability", {}).get("plan", [])
    return tuple(LayerPlan(**{k: tuple(v) if isinstance(v, list) else v for k, v in p.items()})
                 for p in plans)


def _span(layers: Sequence[int]) -> str:
    return str(layers[0]) if len(layers) == 1 else f"{layers[0]}–{layers[-1]}"


def _controllability_html(run: RunRecord, screen: bool = True) -> str:
    """The conditioning line; the controls, one row per run of consecutive layers that share
    them (a model's layers mostly do); then per patched layer what happened in this run."""
    from ..core.controllability import conditioning_line, conditions_line, outcome
    from .panels.control_panel import run_cell
    from .state import param_key

    line = conditioning_line(run.record.get("summary", {}).get("conditioning"))
    plans = _plans(run)
    if not plans:  # (a record from before the controllability report: its fault counts)
        return f"<p>{_esc(_faults_line(run.record.get('summary', {})))}</p><p>{_esc(line)}</p>"
    result = outcome(run.steps, plans)  # (the verdict the command line and the window give)
    line = f"{_esc(conditions_line(result))}.<br>{_esc(line)}"

    def names(params: Sequence[str], layer: int) -> str:
        return ", ".join(breakable(param_key(n, layer), screen) for n in params) or "—"

    groups: list[tuple[list[int], tuple[str, str, str]]] = []
    for p in plans:
        key = (_esc(p.mixer), names(p.inputs, p.layer), names(p.outputs, p.layer))
        if groups and groups[-1][1] == key and groups[-1][0][-1] == p.layer - 1:
            groups[-1][0].append(p.layer)
        else:
            groups.append(([p.layer], key))
    controls = _table([(_span(layers), *key) for layers, key in groups],
                      ("layers", "mixer", "input control", "output control"), raw=(1, 2, 3))
    rows = [(p.layer, f"{result[p.layer]['max_entry_ratio']:.3g}", run_cell(result[p.layer]))
            for p in plans]
    return (f"<p>{line}</p>{controls}<p>Per patched layer: the largest patch entry as a "
            "multiple of the patched weight's largest entry, and the conditions the "
            "construction needs (z ≠ 0, h ≠ 0, every N(h)<sub>j</sub> ≠ 0, S ≠ 0) in this "
            "run.</p>" + _table(rows, ("layer", "largest entry / weight's", "this run")))


def _faults_line(summary: dict[str, Any]) -> str:
    """The fault counts of a record made before the controllability report, in words (newer
    records give `conditions_line`'s verdict instead)."""
    faults = {k: v for k, v in (summary.get("faults") or {}).items() if v}
    if not faults:
        return ("No fault: at every layer and step z ≠ 0, h ≠ 0 and every N(h)_j ≠ 0, "
                "and the stable update (if used) found its root.")
    said = "; ".join(f"{FAULTS.get(k, (k, ''))[0]} at {v} {FAULTS.get(k, ('', ''))[1]}"
                     .rstrip() for k, v in faults.items())
    return f"Faults over all layers and steps: {said}."


def _times_line(summary: dict[str, Any]) -> str:
    """The run's times in words."""
    seconds = summary.get("seconds") or {}
    said = ", ".join(f"{SECONDS.get(k, k)} {v:.1f} s" for k, v in seconds.items()
                     if isinstance(v, int | float))
    return f"Time: {said}." if said else ""


def _settings_table(settings: dict[str, Any]) -> str:
    rows = "".join(f"<tr><td>{_esc(name)}</td><td class=\"value\">{_esc(value)}</td>"
                   f"<td class=\"note\">{_esc(note)}</td></tr>"
                   for name, value, note in settings_rows(settings))
    return ("<table class=\"settings\"><thead><tr><th>setting</th><th>value</th>"
            f"<th>meaning</th></tr></thead>{rows}</table>")


def report_html(run: RunRecord, images: dict[str, str], screen: bool = True,
                dynamics: dict[str, Any] | None = None,
                compiled: dict[str, Any] | None = None) -> str:
    """The report's HTML; ``images`` maps each plot name (and the context image's thumbnail,
    `THUMBNAIL`) to its ``src`` (data URI or file); ``screen``: for a browser (the PDF's page
    has its own margins); ``dynamics``: a context-dynamics record, its section at the end;
    ``compiled``: a compile record (`core.compile_record`), its section after that."""
    from .compile_view import compile_html

    summary = run.record.get("summary", {})
    p, c = summary.get("patched") or {}, summary.get("control") or {}
    n = summary.get("tokens", len(run.steps))
    prompt_rows = [(seg.kind, seg.text, len(seg.ids)) for seg in run.prompt.segments]
    metrics = [
        ("token match", f"{p.get('matches', '?')}/{n}", f"{c.get('matches', '?')}/{n}"),
        ("max logit L∞", _fmt(p.get("max_linf")), _fmt(c.get("max_linf"))),
        ("median logit L∞", _fmt(p.get("median_linf")), _fmt(c.get("median_linf"))),
        ("mean TVD", _fmt(p.get("mean_tvd")), _fmt(c.get("mean_tvd"))),
        ("max TVD", _fmt(p.get("max_tvd")), _fmt(c.get("max_tvd"))),
    ]
    verification = run.record.get("verification")
    verify_html = (_table([(k, _fmt(v)) for k, v in verification.items() if k != "steps"])
                   if isinstance(verification, dict) else
                   "<p>Not verified in this run (<code>ctxpatch compare --verify</code>, or "
                   "<code>ctxpatch verify</code> on saved patches).</p>")
    titles = {"per-token": "Per-token metrics (patched vs unpatched control)"}
    titles.update({name: f"Patch norms: {name.split('/', 1)[1]}" for name in images
                   if name.startswith("patch-norms/")})
    sizes = {name: PLOT_SIZE if name == "per-token" else NORMS_SIZE for name in titles}
    plots = "".join(
        f"<div class=\"figure\"><h3>{_esc(title)}</h3><p class=\"figure\">"
        f"<img src=\"{_esc(images[name])}\" width=\"{sizes[name][0]}\"></p></div>"
        for name, title in titles.items() if name in images)
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>ctxpatch report</title>
<style>{STYLE}{SCREEN_STYLE if screen else ""}</style></head><body>
<h1>ctxpatch report</h1>
<p>Context and parameter updates (Goldwaser et al., arXiv 2511.17864): the original model
<b>with</b> the context, and the same model <b>without</b> it but with token-specific weight
patches. Made by ctxpatch {_esc(__version__)} on
{_esc(datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC'))}.</p>
<h2>Model</h2>
{_table([(MODEL.get(k, k.replace("_", " ")), v) for k, v in run.model.items()])}
<h2>Settings</h2>
{_settings_table(run.settings)}
<h2>Prompt</h2>
{_table(prompt_rows, ("segment", "text", "tokens"))}
{_image_html(run, images)}
<h2>Generations ({_esc(_plural(n, "token"))}; mismatches marked)</h2>
<p><b>With context</b> (original model)</p><div class="gen">{_tokens(run, "baseline")}</div>
<p><b>Without context, patched</b></p><div class="gen">{_tokens(run, "patched")}</div>
<h2>Pooled metrics</h2>
{_table(metrics, ("", "patched (no context)", "control (no context, unpatched)"))}
<p>{_esc(_times_line(summary))}</p>
<h2>Verification</h2>
{verify_html}
<h2>Controllability and conditioning</h2>
{_controllability_html(run, screen)}
<h2>Plots</h2>
<p>The per-token metrics on log scales, with the unpatched control; then, for each patched
parameter, the norm of its patch per layer and token (log10) and one token's per-layer profile:
the token selected in the window when it wrote the report, else the last.</p>
{plots}
{analysis_html(run.record.get("analysis"), images, run.record)}
{dynamics_html(dynamics, images)}{compile_html(compiled, images)}</body></html>
"""


def dynamics_report_html(record: dict[str, Any], images: dict[str, str],
                         screen: bool = True, compiled: dict[str, Any] | None = None) -> str:
    """The report of a context-dynamics run alone (``ctxpatch dynamics --report``): its model,
    settings and context, then the "Context dynamics" section (and, from the window, its
    compile result's section)."""
    from .compile_view import compile_html

    settings = {k: v for k, v in (record.get("settings") or {}).items()}
    model = record.get("model") or {}
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>ctxpatch report: context dynamics</title>
<style>{STYLE}{SCREEN_STYLE if screen else ""}</style></head><body>
<h1>ctxpatch report: context dynamics</h1>
<p>Context and parameter updates (Goldwaser et al., arXiv 2511.17864): the context's effect on
the model rewritten as exact token-specific weight patches, here followed as the context is read
token by token. Made by ctxpatch {_esc(__version__)} on
{_esc(datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC'))}.</p>
{"<h2>Model</h2>" + _table([(k, v) for k, v in model.items()]) if model else ""}
<h2>Settings</h2>
{_settings_table(settings)}
<h2>Prompt</h2>
{_table([("context", settings.get("context", "")), ("query", settings.get("query", ""))],
        ("segment", "text"))}
{dynamics_html(record, images)}{compile_html(compiled, images)}</body></html>
"""


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def write_report(run: RunRecord, path: str | Path, plot_dir: str | Path | None = None,
                 inputs: Sequence[str | None] = (), selected: int | None = None,
                 dynamics: dict[str, Any] | None = None,
                 compiled: dict[str, Any] | None = None) -> list[Path]:
    """Write the report as HTML, or PDF when ``path`` ends in .pdf; with ``plot_dir``, also
    every plot as PNG and SVG there; ``selected``: the token whose per-layer profiles the
    patch-norm figures draw (the window's selection; default the last); with ``dynamics`` (a
    context-dynamics record), its section and figures too; likewise ``compiled`` (a compile
    record, `core.compile_record`). Returns the files written.

    Everything is made first in temporaries beside the report, then moved into place; Ctrl+C
    and SIGTERM wait until the report is whole (`core.export.signals_held`: the seconds of its
    drawing), and a failure midway puts any previous report and plots back. ``inputs``: the
    run's files, which the plots must not replace (`core.outputs.check_report`)."""
    def draw() -> tuple[dict[str, tuple[bytes, bytes]], bytes | None]:
        images = plot_images(run, selected)
        images.update(dynamics_images(dynamics, _png, _svg, FIGURE_PT))
        images.update(compile_images(compiled, _png, _svg, FIGURE_PT))
        return images, thumbnail(run)

    return _checked_report(path, plot_dir, inputs, draw, lambda srcs, screen: report_html(
        run, srcs, screen, dynamics, compiled))


def write_compile_report(record: dict[str, Any], path: str | Path,
                         plot_dir: str | Path | None = None,
                         inputs: Sequence[str | None] = ()) -> list[Path]:
    """Write the report of a compile record alone (``ctxpatch compile --report``), as
    `write_report` writes a run's: HTML or PDF, the rank curve as PNG and SVG in ``plot_dir``,
    staged and moved into place with the signals held."""
    from .compile_view import compile_page

    return _checked_report(path, plot_dir, inputs,
                           lambda: (compile_images(record, _png, _svg, FIGURE_PT), None),
                           lambda srcs, screen: compile_page(record, srcs, screen))


def write_dynamics_report(record: dict[str, Any], path: str | Path,
                          plot_dir: str | Path | None = None,
                          inputs: Sequence[str | None] = (),
                          compiled: dict[str, Any] | None = None) -> list[Path]:
    """Write the report of a context-dynamics record (`core.dynamics.Dynamics.to_dict`) alone,
    as `write_report` writes a run's: HTML or PDF, the figures as PNG and SVG in ``plot_dir``,
    staged and moved into place with the signals held; ``compiled``: a compile result (the
    window's), its section too.

    Raises:
        UserError: the path cannot be written or names an input, or the record is damaged.
    """
    from ..core.dynamics_record import check_dynamics

    check_dynamics(record)

    def draw() -> tuple[dict[str, tuple[bytes, bytes]], None]:
        images = dynamics_images(record, _png, _svg, FIGURE_PT)
        images.update(compile_images(compiled, _png, _svg, FIGURE_PT))
        return images, None

    return _checked_report(path, plot_dir, inputs, draw, lambda srcs, screen: (
        dynamics_report_html(record, srcs, screen, compiled)))


def _checked_report(path: str | Path, plot_dir: str | Path | None,
                    inputs: Sequence[str | None],
                    draw: Callable[[], tuple[dict[str, tuple[bytes, bytes]], bytes | None]],
                    html_of: Callable[[dict[str, str], bool], str]) -> list[Path]:
    """What every report writer shares: refuse a path whose folder is missing or whose plots
    would replace an input (`core.outputs.check_report`), then, with Ctrl+C and SIGTERM held
    (`core.export.signals_held`: the drawing too, so an exception cannot leave a Qt paint
    override), ``draw()`` the figures (and the thumbnail) and stage the report (`_write_report`)."""
    from ..core.export import signals_held
    from ..core.outputs import check_report

    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():  # (the plots' folder beside it must not create it silently)
        raise UserError(f"cannot write {path}: folder {parent} does not exist")
    check_report(str(path), inputs)
    with signals_held():
        ensure_app()
        images, thumb = draw()
        return _write_report(path, parent, plot_dir, images, thumb, html_of)


def _write_report(path: Path, parent: Path, plot_dir: str | Path | None,
                  images: dict[str, tuple[bytes, bytes]], thumb: bytes | None,
                  html_of: Callable[[dict[str, str], bool], str]) -> list[Path]:
    """Stage the plots and the report (``html_of(image sources, screen)``) beside ``path``,
    then move them into place (`_commit`)."""
    try:
        staged = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent))
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    folder = None if plot_dir is None else Path(plot_dir)
    try:
        plots: list[str] = []
        if folder is not None:
            if folder.exists() and not folder.is_dir():
                raise UserError(f"cannot write the plots into {folder}: a file has that name")
            (staged / "plots").mkdir()
            for name, (png, svg) in images.items():
                for ext, data in (("png", png), ("svg", svg)):
                    plots.append(f"{name.replace('/', '-')}.{ext}")
                    (staged / "plots" / plots[-1]).write_bytes(data)
        body = staged / "report"
        if path.suffix.lower() == ".pdf":
            _write_pdf(html_of, images, str(body), thumb)
        else:
            uris = {name: _data_uri(png) for name, (png, _) in images.items()}
            if thumb is not None:
                uris[THUMBNAIL] = _data_uri(thumb)
            body.write_text(html_of(uris, True), encoding="utf-8", newline="")
        _commit(staged, folder, plots, path)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return [path, *(folder / p for p in plots if folder is not None)]


def _commit(staged: Path, folder: Path | None, plots: Sequence[str], path: Path) -> None:
    """Move the staged plots and report into place; on a failure midway, undo what was moved
    (a previous report's plots come back), so the outputs are whole or as they were."""
    from ..core.export import install

    undo: list[Callable[[], None]] = []
    try:
        if folder is not None and not folder.exists():  # a new folder: one rename
            os.rename(staged / "plots", folder)
            undo.append(lambda: os.rename(folder, staged / "plots"))
        elif folder is not None:  # the user's folder: our files replaced, anything else kept
            (staged / "old").mkdir()
            for name in plots:
                final, old = folder / name, staged / "old" / name
                if final.exists():
                    os.replace(final, old)
                    undo.append(lambda final=final, old=old: os.replace(old, final))
                else:
                    undo.append(lambda final=final: final.unlink(missing_ok=True))
                install(staged / "plots" / name, final)
        install(staged / "report", path)
    except BaseException:
        for step in reversed(undo):
            try:
                step()
            except OSError:
                pass
        raise


def report_document(run: RunRecord | Callable[[dict[str, str], bool], str],
                    images: dict[str, tuple[bytes, bytes]], thumb: bytes | None = None) -> Any:
    """The report as a QTextDocument, the plots (and the context image's thumbnail) as its
    image resources (for PDF and pages); ``run``: a run, or the function that writes the HTML
    from the images' sources (``html_of(sources, screen)``)."""
    from PySide6.QtCore import QUrl
    from PySide6.QtGui import QImage, QTextDocument

    ensure_app()
    doc = QTextDocument()
    pngs = {name: png for name, (png, _) in images.items()}
    if thumb is not None:
        pngs[THUMBNAIL] = thumb
    for name, png in pngs.items():
        doc.addResource(QTextDocument.ResourceType.ImageResource, QUrl(f"{name}.png"),
                        QImage.fromData(png, "PNG"))
    html_of = run if callable(run) else (
        lambda srcs, screen: report_html(run, srcs, screen))  # type: ignore[arg-type]
    doc.setHtml(html_of({name: f"{name}.png" for name in pngs}, False))
    return doc


def _write_pdf(run: RunRecord | Callable[[dict[str, str], bool], str],
               images: dict[str, tuple[bytes, bytes]], path: str,
               thumb: bytes | None = None) -> None:
    """Qt's own PDF writer renders the same HTML (QTextDocument), plots as image resources."""
    from PySide6.QtCore import QMarginsF
    from PySide6.QtGui import QPageLayout, QPageSize, QPdfWriter

    doc = report_document(run, images, thumb)
    writer = QPdfWriter(path)
    writer.setPageLayout(QPageLayout(QPageSize(QPageSize.PageSizeId.A4),
                                     QPageLayout.Orientation.Portrait, QMarginsF(15, 15, 15, 15),
                                     QPageLayout.Unit.Millimeter))
    writer.setResolution(PDF_DPI)
    writer.setTitle("ctxpatch report")
    doc.setPageSize(writer.pageLayout().paintRectPixels(writer.resolution()).size().toSizeF())
    keep_with_next(doc)
    doc.print_(writer)
