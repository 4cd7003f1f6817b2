"""The run history: every finished run of the session, to reopen without recomputing."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QWidget


def cut_short(record: dict[str, Any]) -> str:
    """How a run ended before its tokens: "cancelled", "stopped" (it may have reached the end
    of sequence, or been cancelled: a run that stops at EOS cannot tell) or "" (complete)."""
    s, summary = record.get("settings", {}), record.get("summary", {})
    if "cancelled" in (record.get("outcome"), summary.get("outcome")) or record.get("cancelled"):
        return "cancelled"
    try:
        tokens, asked = int(summary.get("tokens")), int(s.get("max_new_tokens"))
    except (TypeError, ValueError):
        return ""
    if tokens >= asked:
        return ""
    # without stop-at-EOS a run ends early only when cancelled (a failed run is not kept)
    return "stopped" if s.get("stop_at_eos") else "cancelled"


def run_label(record: dict[str, Any]) -> str:
    s, summary = record.get("settings", {}), record.get("summary", {})
    p = summary.get("patched", {})
    query = str(s.get("query", "")).strip().replace("\n", " ")
    query = query if len(query) <= 40 else query[:39] + "…"
    tokens = summary.get("tokens", "?")
    ended = cut_short(record)
    count = f"{p.get('matches', '?')}/{tokens} match"
    if ended:
        count += f", {ended} after {tokens} of {s.get('max_new_tokens')} tokens"
    return (f"{s.get('model', '?')} · {s.get('dtype', '?')} {s.get('method', '?')} · "
            f"absorb {s.get('absorb', '?')} · {count} · {query!r}")


def short_label(record: dict[str, Any], index: int) -> str:
    s = record.get("settings", {})
    ended = cut_short(record)
    return (f"#{index + 1} {s.get('dtype', '?')} {s.get('method', '?')}, absorb "
            f"{s.get('absorb', '?')}, layers {s.get('layers', 'all')}"
            + (f" ({ended})" if ended else ""))


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
        for i, r in enumerate(records):
            label = f"#{i + 1} {run_label(r)}"
            self.runs.addItem(label)
            self.runs.setItemData(i, label, Qt.ItemDataRole.ToolTipRole)
        if current is not None and records:
            self.runs.setCurrentIndex(current)
        self.runs.blockSignals(False)
