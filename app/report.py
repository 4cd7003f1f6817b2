"""Reports: one self-contained HTML file (plots embedded as PNG), or PDF through Qt's own
writer, plus every plot as PNG and SVG (pyqtgraph's exporters). Works offscreen.

The report is made from a run's JSON record (`core.export.run_record`), so the command line,
the window, sessions and ``ctxpatch reproduce`` all produce the same thing. All user text is
escaped.
"""

from __future__ import annotations

import base64
import html
import os
import shutil
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from app.jobs import RunStarted
from app.panels.generation_panel import COLORS, token_html
from app.state import RunState
from core import __version__
from core.errors import UserError
from core.records import Run

PLOT_SIZE = (1100, 760)
PDF_DPI = 110
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


def fill_state(state: RunState, run: Run) -> RunState:
    """Replay a finished run into a `RunState` (its views update as in a live run)."""
    layers = sorted({layer for s in run.steps for layer in s.patch_norms}) or sorted(
        {layer for s in run.steps for layer in s.layer_info})
    plan = _plans(run)
    state.reset(RunStarted(settings=run.settings, prompt=run.prompt, layers=tuple(layers),
                           num_layers=int(run.model.get("num_layers", len(layers))),
                           control=str(plan[0].control if plan else
                                       run.settings.get("output_control") or "default"),
                           model=run.model, plan=plan, record=run.record))
    for s in run.steps:
        state.add_step(s)
    state.finish()
    return state


def plot_images(run: Run) -> dict[str, tuple[bytes, bytes]]:
    """The run's plots as {name: (PNG bytes, SVG bytes)}: the per-token metrics, then the
    patch-norm heatmap and profile of every patched parameter ("patch-norms/<param>")."""
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QApplication

    from app.panels.patch_panel import QtPatchPanel
    from app.panels.plots_panel import QtPlotsPanel

    ensure_app()
    global _EXPORT
    if _EXPORT is None:  # made once and reused: see tests/app/conftest.py on destroying plots
        state = RunState()
        _EXPORT = (state, QtPlotsPanel(state), QtPatchPanel(state))
        for panel in _EXPORT[1:]:
            panel.setAttribute(Qt.WidgetAttribute.WA_DontShowOnScreen)
            panel.resize(*PLOT_SIZE)
    state, plots, patches = _EXPORT
    fill_state(state, run)
    for panel in (plots, patches):
        panel.show()  # lays the plots out; never on screen
    QApplication.processEvents()
    images: dict[str, tuple[bytes, bytes]] = {}
    images["per-token"] = _png(plots.graphics), _svg(plots.graphics)
    for key in state.param_keys():
        state.set_view(param=key)
        QApplication.processEvents()
        images[f"patch-norms/{key}"] = _png(patches.graphics), _svg(patches.graphics)
    for panel in (plots, patches):
        panel.hide()
    return images


def _png(graphics: Any) -> bytes:
    import pyqtgraph.exporters as exporters
    from PySide6.QtCore import QBuffer, QByteArray, QIODevice

    exporter = exporters.ImageExporter(graphics.ci)
    exporter.parameters()["width"] = PLOT_SIZE[0]
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
           cell: Any = str) -> str:
    """An HTML table; every cell is written by ``cell`` (``str``, or `_fmt` for numbers), then
    escaped."""
    head = "".join(f"<th>{_esc(h)}</th>" for h in header) if header else ""
    body = "".join("<tr>" + "".join(f"<td>{_esc(cell(c))}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table>{'<tr>' + head + '</tr>' if head else ''}{body}</table>"


def _tokens(run: Run, side: str) -> str:
    spans = []
    for s in run.steps:
        text = s.baseline_text if side == "baseline" else s.patched.text
        style = f" style=\"background-color:{COLORS['mismatch'][0]}\"" if not s.patched.match else ""
        spans.append(f"<span{style}>{token_html(text)}</span>")
    return "".join(spans)


def _fmt(x: Any) -> str:
    """A number for a table: 3 significant digits; a missing one as a dash."""
    if x is None:
        return "—"
    return f"{x:.3g}" if isinstance(x, float) else str(x)


THUMBNAIL = "context-image"


def thumbnail(run: Run, size: int = 256) -> bytes | None:
    """A PNG thumbnail of the run's context image, when the file is still there unchanged."""
    import io

    from core.images import ImageInfo, reopen

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


def _image_html(run: Run, images: dict[str, str]) -> str:
    info = run.record.get("prompt", {}).get("image")
    if not info:
        return ""
    caption = (f"Context image: {Path(info['path']).name}, {info.get('width')}x{info.get('height')} "
               f"{info.get('format')}, sha256 {str(info.get('sha256'))[:16]}…")
    if THUMBNAIL not in images:
        return f"<p>{_esc(caption)} (the file is no longer at {_esc(info['path'])})</p>"
    return f"<p><img src=\"{_esc(images[THUMBNAIL])}\"><br>{_esc(caption)}</p>"


def _plans(run: Run) -> tuple[Any, ...]:
    from core.controllability import LayerPlan

    plans = run.record.get("controllability", {}).get("plan", [])
    return tuple(LayerPlan(**{k: tuple(v) if isinstance(v, list) else v for k, v in p.items()})
                 for p in plans)


def _controllability_html(run: Run) -> str:
    """The conditioning line and, per patched layer, its mixer, controls and what happened."""
    from app.panels.control_panel import param_list, run_cell
    from core.controllability import conditioning_line, outcome

    line = conditioning_line(run.record.get("summary", {}).get("conditioning"))
    plans = _plans(run)
    if not plans:
        return f"<p>{_esc(line)}</p>"
    result = outcome(run.steps, plans)
    rows = [(p.layer, p.mixer, param_list(p.inputs, p.layer), param_list(p.outputs, p.layer),
             f"{result[p.layer]['max_entry_ratio']:.3g}", run_cell(result[p.layer]))
            for p in plans]
    head = ("layer", "mixer", "input control", "output control", "largest entry / weight's",
            "this run")
    return f"<p>{_esc(line)}</p>{_table(rows, head)}"


def report_html(run: Run, images: dict[str, str]) -> str:
    """The report's HTML; ``images`` maps each plot name (and the context image's thumbnail,
    `THUMBNAIL`) to its ``src`` (data URI or file)."""
    summary = run.record.get("summary", {})
    p, c = summary.get("patched") or {}, summary.get("control") or {}
    n = summary.get("tokens", len(run.steps))
    settings = [(k, v) for k, v in run.settings.items() if k not in ("context", "query")]
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
    faults = summary.get("faults", {})
    seconds = summary.get("seconds", {})
    titles = {"per-token": "Per-token metrics (patched vs unpatched control)"}
    titles.update({name: f"Patch norms of {name.split('/', 1)[1]}: layer x token, and the last "
                         "token's per-layer profile" for name in images if "/" in name})
    plots = "".join(
        f"<h3>{_esc(title)}</h3><p><img src=\"{_esc(images[name])}\" width=\"680\"></p>"
        for name, title in titles.items() if name in images)
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>ctxpatch report</title>
<style>
body {{ font-family: sans-serif; max-width: 60em; margin: 2em auto; line-height: 1.4; }}
table {{ border-collapse: collapse; margin: 0.5em 0; }}
td, th {{ border: 1px solid #999; padding: 2px 6px; text-align: left; vertical-align: top; }}
.gen {{ white-space: pre-wrap; font-family: monospace; border: 1px solid #999; padding: 6px; }}
</style></head><body>
<h1>ctxpatch report</h1>
<p>Context and parameter updates (Goldwaser et al., arXiv 2511.17864): the original model
<b>with</b> the context, and the same model <b>without</b> it but with token-specific weight
patches. Made by ctxpatch {_esc(__version__)} on
{_esc(datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC'))}.</p>
<h2>Model</h2>
{_table([(k, v) for k, v in run.model.items()])}
<h2>Settings</h2>
{_table(settings)}
<h2>Prompt</h2>
{_table(prompt_rows, ("segment", "text", "tokens"))}
{_image_html(run, images)}
<h2>Generations ({n} tokens; mismatches marked)</h2>
<p><b>With context</b> (original model)</p><div class="gen">{_tokens(run, "baseline")}</div>
<p><b>Without context, patched</b></p><div class="gen">{_tokens(run, "patched")}</div>
<h2>Pooled metrics</h2>
{_table(metrics, ("", "patched (no context)", "control (no context, unpatched)"))}
<p>Faults over all layers and steps: {_esc(', '.join(f'{k} {v}' for k, v in faults.items()))}.
Time: {_esc(', '.join(f'{k} {_fmt(v)} s' for k, v in seconds.items()))}.</p>
<h2>Controllability and conditioning</h2>
{_controllability_html(run)}
<h2>Verification</h2>
{verify_html}
<h2>Plots</h2>
{plots}
</body></html>
"""


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def write_report(run: Run, path: str | Path, plot_dir: str | Path | None = None) -> list[Path]:
    """Write the report as HTML, or PDF when ``path`` ends in .pdf; with ``plot_dir``, also
    every plot as PNG and SVG there. Returns the files written (all writes are atomic)."""
    from core.export import atomic_write, write_text

    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():  # (the plots' folder beside it must not create it silently)
        raise UserError(f"cannot write {path}: folder {parent} does not exist")
    images = plot_images(run)
    written = [path]
    if plot_dir is not None:
        folder = Path(plot_dir)
        if folder.exists() and not folder.is_dir():
            raise UserError(f"cannot write the plots into {folder}: a file has that name")
        created = not folder.exists()
        folder.mkdir(parents=True, exist_ok=True)
        try:
            for name, (png, svg) in images.items():
                for ext, data in (("png", png), ("svg", svg)):
                    target = folder / f"{name.replace('/', '-')}.{ext}"
                    atomic_write(target, lambda tmp, data=data: Path(tmp).write_bytes(data))
                    written.append(target)
        except BaseException:  # a half-written plots folder of ours goes (a user's stays)
            if created:
                shutil.rmtree(folder, ignore_errors=True)
            raise
    thumb = thumbnail(run)
    if path.suffix.lower() == ".pdf":
        atomic_write(path, lambda tmp: _write_pdf(run, images, tmp, thumb))
    else:
        uris = {name: _data_uri(png) for name, (png, _) in images.items()}
        if thumb is not None:
            uris[THUMBNAIL] = _data_uri(thumb)
        write_text(path, report_html(run, uris))
    return written


def report_document(run: Run, images: dict[str, tuple[bytes, bytes]],
                    thumb: bytes | None = None) -> Any:
    """The report as a QTextDocument, the plots (and the context image's thumbnail) as its
    image resources (for PDF and pages)."""
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
    doc.setHtml(report_html(run, {name: f"{name}.png" for name in pngs}))
    return doc


def _write_pdf(run: Run, images: dict[str, tuple[bytes, bytes]], path: str,
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
    doc.print_(writer)


def page_images(doc: Any, width: int = 800) -> list[Any]:
    """The document's pages as images, laid out like the PDF (to look at a report's pages)."""
    from PySide6.QtCore import QRectF, QSizeF
    from PySide6.QtGui import QColor, QImage, QPainter

    height = int(width * 297 / 210)
    doc.setPageSize(QSizeF(width, height))
    pages = []
    for i in range(doc.pageCount()):
        image = QImage(width, height, QImage.Format.Format_RGB32)
        image.fill(QColor("white"))
        painter = QPainter(image)
        painter.translate(0, -i * height)
        doc.drawContents(painter, QRectF(0, i * height, width, height))
        painter.end()
        pages.append(image)
    return pages
