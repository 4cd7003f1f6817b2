"""The controllability report: per patched layer, which parameters carry the input and output
controls, what the construction needs at every token, what the weights already show, and, as
the run goes, how often a condition failed and what was done (PAPER.md sections 4 and 7)."""

from __future__ import annotations

import html
from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QHeaderView,
    QLabel,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from ...core.controllability import conditioning_line, outcome
from ...core.results import conditioning
from ..state import RunState

COLUMNS = ("layer", "mixer", "input control", "output control", "seen in the weights",
           "this run")


def param_list(names: tuple[str, ...], layer: int) -> str:
    from ..state import param_key

    return ", ".join(param_key(n, layer) for n in names) or "—"


def run_cell(row: dict[str, Any]) -> str:
    parts = []
    if row["zero_z"]:
        parts.append(f"z = 0 at {row['zero_z']} step(s): input patch skipped")
    if row["zero_h"]:
        parts.append(f"h = 0 at {row['zero_h']} step(s): output patch skipped")
    if row["zero_s"]:
        parts.append(f"S = 0 at {row['zero_s']} step(s): experts cannot absorb")
    if row["div_by_one_steps"]:
        parts.append(f"N(h)_j = 0 in {row['div_by_one_coordinates']} coordinate(s) over "
                     f"{row['div_by_one_steps']} step(s): divided by one")
    if row["hard_case"]:
        parts.append(f"stable hard case at {row['hard_case']} step(s): fallback used")
    if row.get("unbounded_steps"):
        steps = ", ".join(str(s + 1) for s in row["unbounded_steps"][:8])
        parts.append(f"patch entries up to {row['max_entry_ratio']:.3g}x the weight's largest "
                     f"(unbounded) at token(s) {steps}")
    if row.get("beyond_bound_steps"):
        steps = ", ".join(str(s + 1) for s in row["beyond_bound_steps"][:8])
        parts.append(f"|dv| beyond the frozen bound {row['bound']:.3g} at token(s) {steps}")
    elif "bound" in row:
        parts.append(f"|dv| ≤ {row['max_shift']:.3g}, within the frozen bound {row['bound']:.3g}")
    return "; ".join(parts) or "all conditions held"


class QtControlPanel(QWidget):
    def __init__(self, state: RunState, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self.summary = QLabel("Run a comparison to see which controls each layer uses.")
        self.summary.setWordWrap(True)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(list(COLUMNS))
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.setWordWrap(True)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.Interactive)
        header.setStretchLastSection(True)
        for col, width in enumerate((44, 90, 200, 250, 230)):
            self.table.setColumnWidth(col, width)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.summary)
        layout.addWidget(self.table)
        state.subscribe(self._on_state)

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
                item.setTextAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
                self.table.setItem(r, c, item)
        self.table.resizeRowsToContents()

    def _fill_outcome(self) -> None:
        started = self.state.started
        if started is None or not started.plan:
            return
        result = outcome(self.state.steps, started.plan)
        failing = 0
        for r, p in enumerate(started.plan):
            text = run_cell(result[p.layer]) if self.state.steps else ""
            failing += bool(text) and text != "all conditions held" and "within" not in text
            self.table.item(r, len(COLUMNS) - 1).setText(text.replace("; ", "\n"))
        n = len(self.state.steps)
        needs = dict.fromkeys(c for p in started.plan for c in p.conditions)
        after = (f"After {n} token(s): " + (f"a condition failed in {failing} layer(s)."
                                             if failing else "every condition held.")
                 if n else "Conditions are checked at every token.")
        cond = (f"<br>{html.escape(conditioning_line(conditioning(self.state.steps)))}."
                if n else "")
        self.summary.setText(
            f"<b>{len(started.plan)} patched layer(s), output control "
            f"'{started.output_control}'.</b> "
            f"{after}{cond}<br>Needs at every token: {'; '.join(needs)}.")
        self.table.resizeRowsToContents()

    def rows(self) -> list[list[str]]:
        """The table's text (for tests and export)."""
        return [[self.table.item(r, c).text() for c in range(self.table.columnCount())]
                for r in range(self.table.rowCount())]
