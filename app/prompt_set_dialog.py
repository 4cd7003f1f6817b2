"""File > Run a prompt set…: a prompt set's grid on the window's model, on the worker thread
with a progress bar and Cancel (a cancelled set keeps its finished runs and resumes when run
again into the same folder), then the statistics per setting and the report
(`app.reproduce_set.execute`, as ``ctxpatch reproduce --prompts FILE`` runs it).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt, QUrl, Signal
from PySide6.QtGui import QDesktopServices, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QCheckBox,
    QDialog,
    QFormLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from ..core.options import DTYPES, METHODS
from . import dialogs
from .jobs import ProgressFn, StopFn, Task
from .worker import Worker


@dataclass(frozen=True)
class SetDone:
    """A finished set's request and runs (plain data; its report is drawn on the GUI thread)."""

    request: Any  # app.reproduce_set.SetRequest
    run: Any  # app.reproduce_set.SetRun


def set_job(req: Any) -> Task:
    """The set's runs on the worker thread, progress per finished run; a stop keeps what
    finished. The report is not drawn here: Qt's widgets live on the GUI thread."""

    def job(should_stop: StopFn, progress: ProgressFn) -> Iterator[Any]:
        from ..core.errors import Cancelled
        from .reproduce_set import check, run_set

        total = len(check(req))  # (every check before any run, as the command line does)
        done = [0]

        def say(line: str) -> None:
            if ": match " in line or ": reusing " in line:
                done[0] += 1
            progress(line, min(done[0], total), total)

        try:
            result = run_set(req, say, should_stop)
        except KeyboardInterrupt:
            raise Cancelled from None
        yield SetDone(req, result)

    return job


class PromptSetDialog(QDialog):
    """The set's file, output folder and grid; Run, Cancel, the progress and the results."""

    set_finished = Signal(str)  # "completed", "cancelled" or "failed"

    def __init__(self, parent: QWidget | None = None, model: str = "demo",
                 device: str = "auto") -> None:
        super().__init__(parent)
        self.setWindowTitle("Run a prompt set")
        self.model, self.device = model, device
        self.worker: Worker | None = None
        self.report: str | None = None
        self._outcome, self._drawing, self._ended = "", False, False
        form = QFormLayout()
        self.prompts = QLineEdit("demo-set")
        self.prompts.setToolTip("a .jsonl or .csv file (query, and optionally context, image, "
                                "id per row), demo-set (34 bundled prompts) or 1-5 (the "
                                "paper's prompts)")
        form.addRow("Prompt set:", self._with_browse(self.prompts, self._browse_prompts))
        self.out = QLineEdit(str(Path.home() / "ctxpatch-sets" / "demo-set"))
        form.addRow("Output folder:", self._with_browse(self.out, self._browse_out))
        form.addRow("Model:", QLabel(f"{model} (on {device})"))
        self.methods = self._checks(METHODS, METHODS)
        form.addRow("Methods:", self.methods[0])
        self.dtypes = self._checks(DTYPES, ("float32", "bfloat16"))
        form.addRow("Precisions:", self.dtypes[0])
        self.absorbs = self._checks(("all", "context"), ("all",))
        form.addRow("Absorb:", self.absorbs[0])
        self.tokens = QSpinBox()
        self.tokens.setRange(1, 1000)
        self.tokens.setValue(20)
        form.addRow("Tokens per run:", self.tokens)
        self.progress = QProgressBar()
        self.progress.setFormat("%v / %m runs")
        self.progress.setRange(0, 1)
        self.progress.setValue(0)
        self.progress.setTextVisible(False)  # (until the set's size is known)
        self.status = QLabel("Choose a prompt set and press Run (Ctrl+Return).")
        self.status.setWordWrap(True)
        self.log = QPlainTextEdit()
        self.log.setReadOnly(True)
        self.log.setMaximumBlockCount(500)
        self.log.setMinimumHeight(90)
        self.table = QTableWidget(0, 5)
        self.table.setHorizontalHeaderLabels(["setting", "prompts", "token match [95% CI]",
                                              "mean TVD [95% CI]", "worst prompts"])
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setStretchLastSection(True)
        self.table.verticalHeader().hide()
        self.table.setMinimumHeight(130)
        buttons = QHBoxLayout()
        self.run_button = QPushButton("&Run")
        self.cancel_button = QPushButton("&Cancel")
        self.report_button = QPushButton("Open &report")
        close = QPushButton("Close")
        self.run_button.clicked.connect(self.start)
        self.cancel_button.clicked.connect(self.cancel)
        self.report_button.clicked.connect(self.open_report)
        close.clicked.connect(self.close)
        self.cancel_button.setEnabled(False)
        self.report_button.setEnabled(False)
        for b in (self.run_button, self.cancel_button, self.report_button):
            buttons.addWidget(b)
        buttons.addStretch(1)
        buttons.addWidget(close)
        QShortcut(QKeySequence("Ctrl+Return"), self, self.start)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.progress)
        layout.addWidget(self.status)
        layout.addWidget(self.log)
        layout.addWidget(self.table)
        layout.addLayout(buttons)
        self.resize(760, 640)

    # -- building ---------------------------------------------------------------------------
    def _with_browse(self, edit: QLineEdit, slot: Any) -> QWidget:
        box = QWidget()
        row = QHBoxLayout(box)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(edit, 1)
        button = QPushButton("Browse…")
        button.clicked.connect(slot)
        row.addWidget(button)
        return box

    def _checks(self, names: tuple[str, ...], on: tuple[str, ...]
                ) -> tuple[QWidget, dict[str, QCheckBox]]:
        box = QWidget()
        row = QHBoxLayout(box)
        row.setContentsMargins(0, 0, 0, 0)
        checks = {}
        for name in names:
            check = QCheckBox(name)
            check.setChecked(name in on)
            row.addWidget(check)
            checks[name] = check
        row.addStretch(1)
        return box, checks

    def _browse_prompts(self) -> None:
        path = dialogs.open_file(self, "prompt-set", "Open a prompt set",
                                 "Prompt sets (*.jsonl *.csv);;All files (*)")
        if path:
            self.prompts.setText(path)
            self.out.setText(str(Path(path).with_suffix("")) + "-results")

    def _browse_out(self) -> None:
        path = dialogs.open_folder(self, "prompt-set-out", "Output folder")
        if path:
            self.out.setText(path)

    # -- running ----------------------------------------------------------------------------
    def _chosen(self, checks: tuple[QWidget, dict[str, QCheckBox]]) -> list[str]:
        return [name for name, c in checks[1].items() if c.isChecked()]

    def request(self) -> Any:
        """The set's `SetRequest` from the controls (a bad one raises UserError)."""
        from .reproduce_set import request

        return request(self.prompts.text().strip() or "demo-set", model=self.model,
                       out=self.out.text().strip() or "ctxpatch-set", device=self.device,
                       dtypes=self._chosen(self.dtypes), methods=self._chosen(self.methods),
                       absorb=self._chosen(self.absorbs), max_new_tokens=self.tokens.value(),
                       sweep="none")

    def start(self) -> None:
        from ..core.errors import UserError

        if self.worker is not None:
            return
        try:
            req = self.request()
        except UserError as exc:
            self._failed(exc.words("window"))
            return
        self.log.clear()
        self.table.setRowCount(0)
        self.report = None
        self.report_button.setEnabled(False)
        worker = Worker(set_job(req), self)
        worker.progress.connect(self._on_progress)
        worker.token_done.connect(self._on_done)
        worker.failed.connect(self._failed)
        worker.cancelled.connect(self._on_cancelled)
        worker.finished.connect(self._on_worker_finished)
        self.worker = worker
        self._outcome = "completed"
        self.run_button.setEnabled(False)
        self.cancel_button.setEnabled(True)
        self.progress.setRange(0, 0)
        self.status.setText("Checking the set and loading the model…")
        worker.start()

    def cancel(self) -> None:
        if self.worker is not None:
            self.worker.requestInterruption()
            self.status.setText("Cancelling: the run in progress stops; finished runs are kept…")

    def _on_progress(self, line: str, done: int, total: int) -> None:
        self.log.appendPlainText(line)
        if total:
            self.progress.setTextVisible(True)
            self.progress.setRange(0, total)
            self.progress.setValue(done)
        self.status.setText(line)

    def _on_done(self, item: Any) -> None:
        from .reproduce_set import write_report

        if not isinstance(item, SetDone):
            return
        self.status.setText("Drawing the report…")
        self.show_statistics(item.run.statistics["settings"])
        self._drawing = True  # (drawing processes events: the worker's end may arrive)
        try:
            self.report = str(write_report(item.request, item.run).report)  # (GUI thread: Qt)
        except Exception as exc:  # noqa: BLE001 - a report that cannot be written: one line
            self._failed(f"the report could not be written: {exc}")
        else:
            self.report_button.setEnabled(True)
            self.status.setText(f"Done: the report is {self.report}")
        finally:
            self._drawing = False
        if self._ended:
            self._on_worker_finished()

    def show_statistics(self, settings: list[dict[str, Any]]) -> None:
        """Each setting's intervals in the table."""
        self.table.setRowCount(len(settings))
        for i, s in enumerate(settings):
            cells = [s["setting"], str(s["prompts"]), _ci(s["match"], True), _ci(s["tvd"]),
                     ", ".join(w["id"] for w in s["worst"][:3])]
            for j, text in enumerate(cells):
                cell = QTableWidgetItem(text)
                cell.setFlags(cell.flags() & ~Qt.ItemFlag.ItemIsEditable)
                self.table.setItem(i, j, cell)

    def _failed(self, message: str) -> None:
        self._outcome = "failed"
        self.status.setText(f"Error: {message}")
        if self.worker is None:
            self.set_finished.emit("failed")

    def _on_cancelled(self) -> None:
        self._outcome = "cancelled"
        self.status.setText("Cancelled: the finished runs are kept; Run again resumes the set.")

    def _on_worker_finished(self) -> None:
        self._ended = True
        if self._drawing:
            return  # (`_on_done` finishes when its report is drawn)
        self._ended = False
        self.worker = None
        self.run_button.setEnabled(True)
        self.cancel_button.setEnabled(False)
        if self.progress.maximum() == 0:
            self.progress.setRange(0, 1)
            self.progress.setValue(0)
        self.set_finished.emit(self._outcome)

    def open_report(self) -> None:
        if self.report:
            QDesktopServices.openUrl(QUrl.fromLocalFile(self.report))

    def stop_and_wait(self) -> None:
        """Stop a running set and wait for its thread (a QThread destroyed while running takes
        the process down): the finished runs are kept, the set resumes from them."""
        if self.worker is not None:
            self.worker.requestInterruption()
            self.worker.wait()

    def reject(self) -> None:  # noqa: D102 - Esc: cancel a running set (as Cancel), else close
        if self.worker is not None:
            self.cancel()
            return
        super().reject()

    def closeEvent(self, event: Any) -> None:  # noqa: N802 - Qt's name
        self.stop_and_wait()
        super().closeEvent(event)


def _ci(metric: dict[str, Any], pct: bool = False) -> str:
    f = (lambda x: f"{x:.1%}") if pct else (lambda x: f"{x:.2g}")
    if not math.isfinite(metric["ci_low"]):
        return f(metric["pooled"])
    return f"{f(metric['pooled'])} [{f(metric['ci_low'])}, {f(metric['ci_high'])}]"
