"""The input panel: context, query, presets, how many tokens, and the Run and Cancel buttons."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

import resources


class QtInputPanel(QGroupBox):
    run_requested = Signal()
    cancel_requested = Signal()
    preset_chosen = Signal(dict)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Input", parent)
        self.presets = resources.presets()
        self.preset = QComboBox()
        self.preset.addItem("Presets…")
        self.preset.addItems([p["name"] for p in self.presets])
        self.context = QPlainTextEdit()
        self.context.setPlaceholderText("The context to absorb into the weights "
                                        "(empty with absorb 'all': the whole prompt is absorbed)")
        self.query = QPlainTextEdit()
        self.query.setPlaceholderText("The query the patched model sees")
        self.query.setMaximumHeight(90)
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(1, 4096)
        self.max_tokens.setValue(20)
        self.chat_template = QCheckBox("Chat template")
        self.chat_template.setToolTip("Wrap context and query in the tokenizer's chat template")
        self.chat_template.setEnabled(False)
        self.run = QPushButton("Run")
        self.run.setToolTip("Run the comparison (Ctrl+Return)")
        self.run.setDefault(True)
        self.cancel = QPushButton("Cancel")
        self.cancel.setToolTip("Stop before the next layer or token (Esc)")
        self.cancel.setEnabled(False)
        layout = QVBoxLayout(self)
        layout.addWidget(self.preset)
        layout.addWidget(QLabel("Context"))
        layout.addWidget(self.context, 2)
        layout.addWidget(QLabel("Query"))
        layout.addWidget(self.query, 1)
        form = QFormLayout()
        form.addRow("New tokens", self.max_tokens)
        form.addRow(self.chat_template)
        layout.addLayout(form)
        buttons = QHBoxLayout()
        buttons.addWidget(self.run, 1)
        buttons.addWidget(self.cancel)
        layout.addLayout(buttons)
        self.preset.activated.connect(self._on_preset)
        self.run.clicked.connect(self.run_requested)
        self.cancel.clicked.connect(self.cancel_requested)

    def _on_preset(self, index: int) -> None:
        if index <= 0:
            return
        preset = self.presets[index - 1]
        self.context.setPlainText(preset.get("context", ""))
        self.query.setPlainText(preset.get("query", ""))
        self.preset.setCurrentIndex(0)
        self.preset_chosen.emit(preset)

    def set_busy(self, busy: bool) -> None:
        self.run.setEnabled(not busy)
        self.cancel.setEnabled(busy)

    def set_chat_template_available(self, available: bool) -> None:
        self.chat_template.setEnabled(available)
        if not available:
            self.chat_template.setChecked(False)

    def values(self) -> dict[str, Any]:
        return {
            "context": self.context.toPlainText(),
            "query": self.query.toPlainText(),
            "max_new_tokens": self.max_tokens.value(),
            "chat_template": self.chat_template.isChecked() and self.chat_template.isEnabled(),
        }

    def save(self) -> dict[str, Any]:
        return {**self.values(), "chat_template": self.chat_template.isChecked()}

    def restore(self, data: dict[str, Any]) -> None:
        if "context" in data:
            self.context.setPlainText(str(data["context"]))
        if "query" in data:
            self.query.setPlainText(str(data["query"]))
        if data.get("max_new_tokens"):
            self.max_tokens.setValue(int(data["max_new_tokens"]))
        self.chat_template.setChecked(bool(data.get("chat_template")))
