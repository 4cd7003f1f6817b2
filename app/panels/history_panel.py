"""The run history: every finished run of the session, to reopen without recomputing."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QWidget


def run_label(record: dict[str, Any]) -> str:
    s, summary = record.get("settings", {}), record.get("summary", {})
    p = summary.get("patched", {})
    query = str(s.get("query", "")).strip().replace("\n", " ")
    query = query if len(query) <= 40 else query[:39] + "…"
    return (f"{s.get('model', '?')} · {s.get('dtype', '?')} {s.get('method', '?')} · "
            f"absorb {s.get('absorb', '?')} · {p.get('matches', '?')}/{summary.get('tokens', '?')}"
            f" · {query!r}")


def short_label(record: dict[str, Any], index: int) -> str:
    s = record.get("settings", {})
    return (f"#{index + 1} {s.get('dtype', '?')} {s.get('method', '?')}, absorb "
            f"{s.get('absorb', '?')}, layers {s.get('layers', 'all')}")


class QtHistoryPanel(QWidget):
    chosen = Signal(int)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.runs = QComboBox()
        self.runs.setToolTip("Reopen a finished run of this session (no recomputation)")
        self.runs.setPlaceholderText("no runs yet")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(QLabel("Run"))
        layout.addWidget(self.runs, 1)
        self.runs.activated.connect(self.chosen)

    def set_runs(self, records: list[dict[str, Any]], current: int | None) -> None:
        self.runs.blockSignals(True)
        self.runs.clear()
        self.runs.addItems([f"#{i + 1} {run_label(r)}" for i, r in enumerate(records)])
        if current is not None and records:
            self.runs.setCurrentIndex(current)
        self.runs.blockSignals(False)
