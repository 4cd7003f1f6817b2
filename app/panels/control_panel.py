"""The controllability report: per patched layer, which parameters carry the input and output
controls, what the construction needs at every token, what the weights already show, and, as
the run goes, how often a condition failed and what was done (PAPER.md sections 4 and 7)."""

from __future__ import annotations

import html
from typing import Any

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import (
    QHeaderView,
    QLabel,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from ...core.controllability import FAILED, SYMBOLS, conditioning_line, conditions_line, outcome
from ...core.results import conditioning
from ..state import RunState

COLUMNS = ("layer", "mixer", "input control", "output control", "seen in the weights",
           "this run")


def param_list(names: tuple[str, ...], layer: int) -> str:
    from ..state import param_key

    return ", ".join(param_key(n, layer) for n in names) or "—"


def run_cell(row: dict[str, Any]) -> str:
    """What happened at one layer over the run: each failed condition and what was done, then
    its conditioning (an unbounded patch is no failed condition, `conditions_line`)."""
    parts = []
    for k, what, done in FAILED:
        if k == "div_by_one_steps" and row.get(k):  # (with the coordinates)
            parts.append(f"N(h)_j = 0 in {row['div_by_one_coordinates']} coordinate(s) over "
                         f"{row[k]} token(s): {done}")
        elif row.get(k):
            parts.append(f"{what} at {row[k]} token(s): {done}")
    if row.get("beyond_bound_steps"):
        steps = ", ".join(str(s + 1) for s in row["beyond_bound_steps"][:8])
        parts.append(f"|dv| beyond the frozen bound {row['bound']:.3g} at token(s) {steps}")
    held = "; ".join(parts) or "all conditions held"
    if row.get("unbounded_steps"):
        steps = ", ".join(str(s + 1) for s in row["unbounded_steps"][:8])
        more = "…" if len(row["unbounded_steps"]) > 8 else ""
        held += (f"; unbounded (conditioning): entries up to {row['max_entry_ratio']:.3g}x the "
                 f"weight's largest at token(s) {steps}{more}")
    elif "bound" in row and not row.get("beyond_bound_steps"):
        held += f"; |dv| ≤ {row['max_shift']:.3g}, within the frozen bound {row['bound']:.3g}"
    return held


#: the columns' tooltips (what each says, and the symbols it uses)
HEADER_TIPS = (
    "the patched layer",
    "the layer's token mixer (attention, or a recurrent/state-space mixer)",
    "the matrices that carry the rank-1 input patch (they see z at the query)",
    "the parameters that carry the output shift dv (the down matrix h, or the post-norm scale "
    "m via dm = dv / N(h))",
    "what the weights already show before any run (exact zeros of the scale m, say)",
    "per layer over this run: each failed condition and what was done, then the patches' "
    "conditioning (unbounded: exact as rank-1 actions, but large when written into weights)",
)


def symbols_in(text: str) -> str:
    """One line per symbol the text uses (`SYMBOLS`), for a tooltip."""
    import re

    return "\n".join(line for name, line in SYMBOLS.items()
                     if re.search(rf"(?<!\w){re.escape(name)}(?!\w)", text)
                     or (name == "dm" and "unbounded" in text)
                     or (name == "division by one" and "divided by one" in text))


class QtControlPanel(QWidget):
    def __init__(self, state: RunState, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self.summary = QLabel("Run a comparison to see which controls each layer uses.")
        self.summary.setWordWrap(True)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(list(COLUMNS))
        for col, tip in enumerate(HEADER_TIPS):
            self.table.horizontalHeaderItem(col).setToolTip(tip)
        self.table.setVerticalScrollMode(QTableWidget.ScrollMode.ScrollPerPixel)
        self.legend = QLabel(" · ".join(SYMBOLS[k] for k in ("z", "N(h)_j", "dm",
                                                           "division by one", "unbounded")))
        self.legend.setWordWrap(True)
        self.legend.setStyleSheet("color: palette(placeholder-text);")
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.setWordWrap(True)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.Interactive)
        header.setStretchLastSection(True)
        for col in range(4):  # (layer, mixer and the parameter names: as wide as they are)
            header.setSectionResizeMode(col, QHeaderView.ResizeMode.ResizeToContents)
        self.table.setColumnWidth(4, 170)
        self.table.setTextElideMode(Qt.TextElideMode.ElideNone)  # (wrapped, never cut)
        # rows follow their cells' wrapped height whenever a column's width changes
        header.sectionResized.connect(lambda *_: self.table.resizeRowsToContents())
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.summary)
        layout.addWidget(self.table, 1)
        layout.addWidget(self.legend)
        state.subscribe(self._on_state)

    def resizeEvent(self, event: Any) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(event)
        # (after the header has stretched its last column to the new width)
        QTimer.singleShot(0, self.table.resizeRowsToContents)

    def _on_state(self, event: str) -> None:
        if event == "reset":
            self._fill_plan()
        if event in ("reset", "step", "finished"):
            self._fill_outcome()

    def _fill_plan(self) -> None:
        plans = self.state.started.plan if self.state.started is not None else ()
        self.table.setRowCount(len(plans))
        for r, p in enumerate(plans):
            cells = (str(p.layer), p.mixer, param_list(p.inputs, p.layer).replace(", ", "\n"),
                     param_list(p.outputs, p.layer).replace(", ", "\n"),
                     "\n".join(p.warnings) or "—", "")
            for c, text in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setToolTip("\n".join(filter(None, (text, symbols_in(text)))))
                item.setTextAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
                self.table.setItem(r, c, item)
        self.table.resizeRowsToContents()

    def _fill_outcome(self) -> None:
        started = self.state.started
        if started is None or not started.plan:
            return
        result = outcome(self.state.steps, started.plan)
        for r, p in enumerate(started.plan):
            text = run_cell(result[p.layer]) if self.state.steps else ""
            item = self.table.item(r, len(COLUMNS) - 1)
            item.setText(text.replace("; ", "\n"))
            item.setToolTip("\n".join(filter(None, (text.replace("; ", "\n"),
                                                      symbols_in(text)))))
        n = len(self.state.steps)
        needs = dict.fromkeys(c for p in started.plan for c in p.conditions)
        after = (f"After {n} token(s): {conditions_line(result)}." if n
                 else "Conditions are checked at every token.")
        cond = (f"<br>{html.escape(conditioning_line(conditioning(self.state.steps)))}."
                if n else "")
        self.summary.setText(
            f"<b>{len(started.plan)} patched layer(s), output control "
            f"'{started.output_control}'.</b> "
            f"{html.escape(after)}{cond}<br>Needs at every token: {html.escape('; '.join(needs))}.")
        self.table.resizeRowsToContents()

    def rows(self) -> list[list[str]]:
        """The table's text (for tests and export)."""
        return [[self.table.item(r, c).text() for c in range(self.table.columnCount())]
                for r in range(self.table.rowCount())]
