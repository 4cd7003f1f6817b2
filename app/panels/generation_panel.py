"""Side-by-side generation: the model with the context, and the patched model without it.

Tokens are shown faithfully (spaces kept, newlines and tabs drawn as ↵ and →, every script as
is), alternately tinted so their boundaries show; a mismatching step is marked in both panes.
Hovering or clicking a token selects it: the details below show both top-k lists and the step's
metrics, and the plots and the patch explorer follow.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from PySide6.QtCore import QEvent, Qt, QUrl
from PySide6.QtWidgets import QLabel, QSplitter, QTextBrowser, QVBoxLayout, QWidget

from ..state import RunState
from ..theme import is_dark

THUMB_HEIGHT = 64  # the context image in the with-context pane


def token_html(text: str, breaks: bool = True) -> str:
    """A token's text as rich text that keeps every character visible and in place; without
    ``breaks``, a newline is only drawn (↵), for a token in a table cell."""
    if text == "":
        return '<span style="color:gray">∅</span>'
    out = html.escape(text, quote=False)
    out = out.replace("\r", "␍").replace("\t", "→\t").replace("\n", "↵<br>" if breaks else "↵")
    return out


def cell_token(text: str) -> str:
    """A token in a table cell: on one line, never wrapped inside ("annoye/d"), spaces kept."""
    return f'<span style="white-space:pre">{token_html(text, breaks=False)}</span>'


def plural(n: int, word: str) -> str:
    """ "1 token", "2 tokens"."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


COLORS = {  # (light palette, dark palette)
    "mismatch": ("#ffb3b3", "#8a2b2b"),
    "selected": ("#ffe97a", "#7a6a00"),
    "tint": ("#e9eef7", "#2b3442"),
}


class _Pane(QWidget):
    def __init__(self, title: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.title = QLabel(title)
        self.view = QTextBrowser()
        self.view.setOpenLinks(False)
        self.view.setOpenExternalLinks(False)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.title)
        layout.addWidget(self.view)


class QtGenerationPanel(QWidget):
    def __init__(self, state: RunState, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self.baseline = _Pane("<b>With context</b> (original model)")
        self.patched = _Pane("<b>Without context, patched</b>")
        self.details = QTextBrowser()
        self.details.setMinimumHeight(120)
        self.details.setLineWrapMode(QTextBrowser.LineWrapMode.NoWrap)  # tables scroll, not wrap
        self.details.setHtml(HINT)  # (as text: a placeholder hides once a document was set)
        self.details.setToolTip(LOGIT_SCALE + "\nTVD: half the L1 distance of the two softmaxes. "
                                "Control: the same model without the context, unpatched.")
        self.details.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
        panes = QSplitter()
        panes.addWidget(self.baseline)
        panes.addWidget(self.patched)
        outer = QSplitter(Qt.Orientation.Vertical)
        outer.addWidget(panes)
        outer.addWidget(self.details)
        outer.setStretchFactor(0, 1)
        outer.setStretchFactor(1, 1)
        self.splitter = outer
        self._sized_by_user = False  # once the user moves the divider, it stays where they put it
        outer.splitterMoved.connect(self._on_divider_moved)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(outer)
        for pane in (self.baseline, self.patched):
            pane.view.anchorClicked.connect(self._on_anchor)
            pane.view.highlighted.connect(self._on_anchor)
        state.subscribe(self._on_state)

    # -- events ---------------------------------------------------------------------------------
    def _on_anchor(self, url: QUrl) -> None:
        text = url.toString()
        if text.startswith("#t"):
            self.state.select(int(text[2:]))

    def _on_state(self, event: str) -> None:
        if event in ("reset", "step", "selection", "finished"):
            self._render()
        if event in ("reset", "selection", "step"):
            self._render_details()
        if event == "step" and len(self.state.steps) == 1:
            # room for a token's details from the first token on, so that the first hover
            # does not shrink the panes (and give them a scroll bar)
            self._fit_details(step_details_html(self.state.steps[0]))

    # -- rendering ------------------------------------------------------------------------------
    def _prefixes(self) -> tuple[str, str]:
        """The prompt each side sees, in grey: all of it with the context; without it, the
        reduced prompt (template and query), or nothing when the whole prompt is absorbed."""
        started = self.state.started
        if started is None:
            return "", ""
        from ...core.prompt import ABSORBED

        segments = started.prompt.segments
        image = started.prompt.image
        name = Path(image.path).name if image is not None else ""

        picture = ""
        if image is not None and Path(image.path).is_file():  # a thumbnail, drawn by Qt
            url = QUrl.fromLocalFile(image.path).toString()
            picture = f'<img src="{html.escape(url)}" height="{THUMB_HEIGHT}"> '

        def grey(seg_kind: str, text: str) -> str:
            if seg_kind == "image":  # a picture's soft tokens: shown and named, not spelled out
                return (f'{picture}<span style="color:gray"><i>[image: {html.escape(name)}]'
                        '</i></span>')
            return f'<span style="color:gray">{token_html(text)}</span>' if text else ""

        full = "".join(grey(seg.kind, seg.text) for seg in segments)
        if started.settings.get("absorb") == "all":
            note = "<i>[the whole prompt is in the patches]</i> "
            return full, f'<span style="color:gray">{note}</span>'
        return full, "".join(grey(seg.kind, seg.text) for seg in segments
                             if seg.kind not in ABSORBED)

    def _spans(self, texts: list[str], prefix: str) -> str:
        dark = int(is_dark(self.palette()))
        parts = [prefix]
        for s, text in zip(self.state.steps, texts, strict=True):
            if s.step == self.state.selected:
                bg = COLORS["selected"][dark]
            elif not s.patched.match:
                bg = COLORS["mismatch"][dark]
            else:
                bg = COLORS["tint"][dark] if s.step % 2 else "transparent"
            color = self.palette().text().color().name()
            style = f"background-color:{bg}; color:{color}; text-decoration:none"
            if not s.patched.match:
                style += "; font-weight:bold"
            parts.append(f'<a href="#t{s.step}" style="{style}">{token_html(text)}</a>')
        return '<div style="white-space:pre-wrap">' + "".join(parts) + "</div>"

    def _render(self) -> None:
        steps = self.state.steps
        full, reduced = self._prefixes()
        for pane, texts, prefix in (
            (self.baseline, [s.baseline_text for s in steps], full),
            (self.patched, [s.patched.text for s in steps], reduced),
        ):
            bar = pane.view.verticalScrollBar()
            at_end = bar.value() >= bar.maximum() - 2
            keep = bar.value()
            pane.view.setHtml(self._spans(texts, prefix))
            bar.setValue(bar.maximum() if at_end and self.state.running else keep)
        n, total = len(steps), self.state.max_tokens
        if steps:
            matches = sum(s.patched.match for s in steps)
            self.patched.title.setText(
                f"<b>Without context, patched</b> — {matches}/{plural(n, 'token')} match")
            self.baseline.title.setText(
                f"<b>With context</b> (original model) — {n}/{plural(total, 'token')}")
        else:
            self.baseline.title.setText("<b>With context</b> (original model)")
            self.patched.title.setText("<b>Without context, patched</b>")

    def _render_details(self) -> None:
        i = self.state.selected
        if i is None or i >= len(self.state.steps):
            self.details.setHtml(HINT)
            return
        self.details.setHtml(step_details_html(self.state.steps[i]))
        self._fit_details()

    def _on_divider_moved(self, *_: Any) -> None:
        self._sized_by_user = True

    def _fit_details(self, text: str | None = None) -> None:
        """Room for the whole detail (every top-k row; ``text``: a detail not shown yet)
        without scrolling, when the panes above can give it (they keep at least a few lines),
        until the user moves the divider."""
        if self._sized_by_user:
            return
        doc = self.details.document()
        if text is not None:
            doc = doc.clone()
            doc.setHtml(text)
        doc.adjustSize()
        needed = int(doc.size().height()) + 2 * self.details.frameWidth() + 4
        sizes = self.splitter.sizes()
        total = sum(sizes)
        if len(sizes) == 2 and total > 0 and sizes[1] < needed:
            below = min(needed, total - 110)
            if below > sizes[1]:
                self.splitter.setSizes([total - below, below])

    def changeEvent(self, event: QEvent) -> None:  # noqa: N802 - Qt override
        if event.type() == QEvent.Type.PaletteChange:
            self._render()
        super().changeEvent(event)

    def pane_texts(self) -> tuple[str, str]:
        """The two panes' plain text (for tests and copy)."""
        return self.baseline.view.toPlainText(), self.patched.view.toPlainText()


#: what the details box says before a token is selected (every run, the first included)
HINT = ("<p style='color:gray'>Hover or click a generated token: its metrics and top-k lists "
        "appear here.</p>")

#: "logit scale", explained where it appears (briefly in the text, fully in the tooltip)
LOGIT_SCALE = ("Logit scale: the largest |logit| of the model with context at this token; the L∞ "
               "logit differences are read relative to it (in float64 the patched run is exact "
               "to about 1e-8 of it, PAPER.md).")


def _topk_rows(s: Any) -> str:
    rows = []
    lists = (s.baseline_top_k, s.patched.top_k, s.control.top_k)
    for r in range(len(s.baseline_top_k.ids)):
        cells = []
        for tk in lists:
            if r < len(tk.ids):
                cells.append(f"<td nowrap>{cell_token(tk.texts[r])}</td>"
                             f"<td align=right nowrap>{tk.probs[r]:.3f}</td>")
            else:
                cells.append("<td></td><td></td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return "".join(rows)


def step_details_html(s: Any) -> str:
    """The step's metrics beside the three top-k lists."""
    mark = "match" if s.patched.match else "<b style='color:#d03030'>MISMATCH</b>"
    table = "<table cellspacing=0 cellpadding=3 border=1 style='border-collapse:collapse'>"
    metrics = (
        table + "<tr><th></th><th>token</th><th nowrap>L∞ logit diff</th><th>TVD</th></tr>"
        f"<tr><td nowrap>with context</td><td nowrap>{cell_token(s.baseline_text)}</td>"
        "<td>—</td><td>—</td></tr>"
        f"<tr><td nowrap>patched</td><td nowrap>{cell_token(s.patched.text)}</td>"
        f"<td nowrap>{s.patched.linf:.3g}</td><td nowrap>{s.patched.tvd:.3g}</td></tr>"
        f"<tr><td nowrap>control (unpatched)</td><td nowrap>{cell_token(s.control.text)}</td>"
        f"<td nowrap>{s.control.linf:.3g}</td><td nowrap>{s.control.tvd:.3g}</td></tr></table>"
    )
    topk = (
        table + "<tr><th colspan=2 nowrap>with context</th><th colspan=2>patched</th>"
        "<th colspan=2>control</th></tr>" + _topk_rows(s) + "</table>"
    )
    return (
        f"<p><b>Token {s.step + 1}</b> (position {s.position}) — {mark}. "
        f"Logit scale {s.logit_scale:.3g} (max |logit| with context).</p>"
        f"<table><tr><td valign=top>{metrics}</td><td width=24></td>"
        f"<td valign=top>{topk}</td></tr></table>"
    )
