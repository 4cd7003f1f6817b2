"""Run > Compile the context… (ANALYSIS.md A4): the window's context compiled into one weight
delta per layer, evaluated on training and held-out queries without the context, exported as a
PEFT LoRA adapter.

The dialog is a thin client: the request is checked by `core.compile_record.check_request` (the
command line's own checks, worded for the window), the work runs on the window's one worker
(`app.compile_jobs`, progress and cancel as for a run), and what it shows is the plain record
(`app.compile_view`), kept by the window's files for sessions and reports
(`app.window_files.WindowFiles.compiled`). It uses from the window: its model, inputs, worker
(``_start``, ``cancel``, ``worker_created``), banner (``show_error``) and files.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from PySide6.QtCore import Qt
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDialog,
    QFormLayout,
    QGridLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from .compile_view import HEADER, CurveFigure, pooled_line, table_rows

if TYPE_CHECKING:
    from .main_window import MainWindow

#: the table's columns that hold numbers (their exact values are kept as the cells' data)
NUMBERS = {3: "retained", 4: "linf", 5: "tvd"}


class CompileDialog(QDialog):
    """Inputs, progress and cancel, the results table, the rank curve, and Export adapter…"""

    def __init__(self, window: MainWindow) -> None:
        super().__init__(window)
        self.window_ = window
        self.setWindowTitle("Compile the context")
        self.setModal(False)
        self.record: dict[str, Any] | None = None
        self._handle: Any = None  # the Compiled of the record shown (None: reopened, or stale)

        self.context_label = QLabel()
        self.context_label.setWordWrap(True)
        self.context_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.queries = QPlainTextEdit()
        self.queries.setPlaceholderText("one per line (default: the window's query)")
        self.held_out = QPlainTextEdit()
        self.held_out.setPlaceholderText("one per line: questions the fit never sees "
                                         "(at least one)")
        for edit in (self.queries, self.held_out):
            edit.setTabChangesFocus(True)
            edit.setFixedHeight(self.fontMetrics().lineSpacing() * 4 + 12)
        self.rank = QSpinBox()
        self.rank.setRange(1, 1_000_000)
        self.rank.setValue(8)
        self.rank.setToolTip("rank of each layer's delta (at most the model's width)")
        self.ridge = QLineEdit("1e-3")
        self.ridge.setToolTip("ridge lambda of the least squares (0: the exact fit)")
        self.sweep = QLineEdit()
        self.sweep.setPlaceholderText("e.g. 1,2,4,8,16 (optional)")
        self.sweep.setToolTip("also compile at each of these ranks: the retained effect "
                              "against the rank")
        self.tokens = QSpinBox()
        self.tokens.setRange(1, 256)
        self.tokens.setValue(8)
        self.tokens.setToolTip("the full-context answer's tokens per query (teacher-forced)")
        self.compile_button = QPushButton("Compile")
        self.compile_button.setToolTip("Compile and evaluate (Ctrl+Return)")
        self.compile_button.setDefault(True)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setToolTip("Stop before the next layer (Esc)")
        self.cancel_button.setEnabled(False)
        self.export_button = QPushButton("Export adapter…")
        self.export_button.setToolTip("Write the PEFT LoRA adapter into a new or empty folder "
                                      "(Ctrl+E)")
        self.export_button.setEnabled(False)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1)
        self.progress.setValue(0)
        self.status = QLabel("Give the queries, then Compile (Ctrl+Return).")
        self.status.setWordWrap(True)
        self.pooled = QLabel()
        self.pooled.setWordWrap(True)
        self.table = QTableWidget(0, len(HEADER))
        self.table.setHorizontalHeaderLabels(list(HEADER))
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setWordWrap(True)
        self.table.verticalHeader().setVisible(False)
        head = self.table.horizontalHeader()
        for col in range(len(HEADER)):
            head.setSectionResizeMode(col, QHeaderView.ResizeMode.ResizeToContents)
        for col in (1, 6, 7):
            head.setSectionResizeMode(col, QHeaderView.ResizeMode.Stretch)
        self.figure = CurveFigure()
        self.figure.graphics.setMinimumHeight(240)
        self.no_curve = QLabel("Give sweep ranks (e.g. 1,2,4,8,16) to draw the retained effect "
                               "against the rank.")
        self.no_curve.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self._build()
        self.compile_button.clicked.connect(lambda: self.compile())
        self.cancel_button.clicked.connect(window.cancel)
        self.export_button.clicked.connect(lambda: self.export_adapter())
        QShortcut(QKeySequence("Ctrl+Return"), self, activated=lambda: self.compile())
        QShortcut(QKeySequence("Ctrl+E"), self, activated=lambda: self.export_adapter())
        window.worker_created.connect(self._on_worker)
        window.model_ready.connect(self._on_model_ready)
        window.session_opened.connect(self._on_session_opened)
        self.resize(1100, 780)

    def _build(self) -> None:
        queries = QGridLayout()
        queries.addWidget(QLabel("Training queries"), 0, 0)
        queries.addWidget(QLabel("Held-out queries"), 0, 1)
        queries.addWidget(self.queries, 1, 0)
        queries.addWidget(self.held_out, 1, 1)
        form = QHBoxLayout()
        for label, widget in (("Rank", self.rank), ("Ridge", self.ridge),
                              ("Sweep ranks", self.sweep), ("New tokens", self.tokens)):
            pair = QFormLayout()
            pair.addRow(label, widget)
            form.addLayout(pair)
        form.addStretch(1)
        for button in (self.compile_button, self.cancel_button, self.export_button):
            form.addWidget(button)
        running = QHBoxLayout()
        running.addWidget(self.progress, 1)
        running.addWidget(self.status, 3)
        self.results = results = QSplitter(Qt.Orientation.Vertical)
        top = QWidget()
        tv = QVBoxLayout(top)
        tv.setContentsMargins(0, 0, 0, 0)
        tv.addWidget(self.pooled)
        tv.addWidget(self.table, 1)
        bottom = QWidget()
        bv = QVBoxLayout(bottom)
        bv.setContentsMargins(0, 0, 0, 0)
        bv.addWidget(self.figure.graphics, 1)
        bv.addWidget(self.no_curve, 1)
        results.addWidget(top)
        results.addWidget(bottom)
        results.setStretchFactor(0, 3)
        results.setStretchFactor(1, 2)
        layout = QVBoxLayout(self)
        layout.addWidget(self.context_label)
        layout.addLayout(queries)
        layout.addLayout(form)
        layout.addLayout(running)
        layout.addWidget(results, 1)
        self.figure.graphics.hide()

    # -- opening and the request ----------------------------------------------------------------
    def open_for_window(self) -> None:
        """Show the dialog with the window's context; the training queries default to the
        window's query; a record the window holds (a reopened session) is shown."""
        w = self.window_
        context = w.input_panel.values()["context"]
        shown = context if len(context) <= 300 else context[:297] + "…"
        self.context_label.setText(f"<b>Context</b> (the window's): {_html(shown)}"
                                   if context.strip() else
                                   "<b>Context</b>: none: type one in the window's Context box")
        if not self.queries.toPlainText().strip():
            self.queries.setPlainText(w.input_panel.values()["query"])
        if w.files.compiled is not self.record:
            self.show_record(w.files.compiled, handle=None)
        self.show()
        from PySide6.QtGui import QGuiApplication

        if QGuiApplication.platformName() != "offscreen":  # (it has no window stacking)
            self.raise_()
            self.activateWindow()

    def _lines(self, edit: QPlainTextEdit) -> list[str]:
        return [line.strip() for line in edit.toPlainText().splitlines() if line.strip()]

    def request(self) -> dict[str, Any]:
        """The request as typed, checked (`core.compile_record.check_request`).

        Raises:
            UserError: one line naming the input and what to do.
        """
        import math

        from ..core.compile_record import check_request, parse_ranks
        from ..core.errors import UserError

        text = self.ridge.text().strip()
        try:
            ridge = float(text)
        except ValueError:
            raise UserError(f"Ridge: {text!r} is not a number: give one such as 1e-3, "
                            "or 0 for the exact fit") from None
        if not math.isfinite(ridge) or ridge < 0:
            raise UserError(f"Ridge must be a finite number >= 0 (0: the exact fit), not {text}")
        sweep = parse_ranks(self.sweep.text(), front="window")
        out = {"context": self.window_.input_panel.values()["context"],
               "queries": self._lines(self.queries), "held_out": self._lines(self.held_out),
               "rank": self.rank.value(), "ridge": ridge, "sweep": sweep,
               "max_new_tokens": self.tokens.value()}
        check_request(out["queries"], out["held_out"], out["rank"], ridge, sweep,
                      out["max_new_tokens"], front="window", context=out["context"])
        return out

    def problem(self) -> str | None:
        """Why nothing can be compiled now, in one line (None: it can)."""
        w = self.window_
        if w.busy:
            return "Compile: wait for the current job to end, or cancel it (Esc)"
        if w.model is None or w.model.key != w.model_panel.key():
            return "Compile: load the model first (Run > Load model, Ctrl+L)"
        return None

    def compile(self) -> bool:
        """Start compiling (returns whether a job started); a bad input is one line in the
        window's banner (and here), and nothing starts."""
        from ..core.errors import UserError
        from .compile_jobs import compile_job

        try:
            problem = self.problem()
            if problem is not None:
                raise UserError(problem)
            r = self.request()
        except UserError as exc:
            self._refuse(exc.words("window"))
            return False
        assert self.window_.model is not None
        self.window_.banner.hide()
        self.window_._start(compile_job(self.window_.model, r["context"], r["queries"],
                                        r["held_out"], r["rank"], r["ridge"], r["sweep"],
                                        r["max_new_tokens"]),
                            "compile", "Compiling the context…")
        return True

    def _refuse(self, message: str) -> None:
        self.window_.show_error(message)
        self.status.setText(message)

    # -- the worker -----------------------------------------------------------------------------
    def _on_worker(self, worker: Any) -> None:
        if self.window_.job_kind not in ("compile", "adapter"):
            return
        worker.compile_ready.connect(self._on_ready)
        worker.progress.connect(self._on_progress)
        self._set_busy(True)
        self.progress.setRange(0, 0)
        self.status.setText("Compiling…" if self.window_.job_kind == "compile" else
                            "Writing the adapter…")

    def _on_progress(self, message: str, done: int, total: int) -> None:
        if total > 0:
            self.progress.setRange(0, total)
            self.progress.setValue(done)
        self.status.setText(message)
        self.window_.status_label.setText(message)

    def _on_ready(self, item: Any) -> None:
        from .compile_jobs import AdapterSaved, CompileReady

        if isinstance(item, CompileReady):
            self.show_record(item.record, item.handle)
            self.window_.files.remember_result()  # (the session's autosave holds it)
        elif isinstance(item, AdapterSaved) and self.record is not None:
            self.record = {**self.record, "adapter": item.folder}
            self.window_.files.compiled = self.record
            self.window_.files.remember_result()

    def job_finished(self, kind: str, outcome: str) -> None:
        """The window's worker ended a "compile" or "adapter" job."""
        self._set_busy(False)
        self.progress.setRange(0, 1)
        self.progress.setValue(1 if outcome == "completed" else 0)
        what = "Compile" if kind == "compile" else "Export adapter"
        if outcome == "completed":
            text = (f"Compiled in {self.record.get('seconds', 0):.1f} s"
                    if kind == "compile" and self.record and self.record.get("seconds") else
                    "Compiled" if kind == "compile" else
                    f"Wrote the adapter {self.record.get('adapter') if self.record else ''}")
        elif outcome == "cancelled":
            text = f"{what} cancelled; the window is as it was"
        else:
            text = f"{what} failed: {self.window_.last_error}"
        self.status.setText(text)
        self.window_.status_label.setText(text)

    def _set_busy(self, busy: bool) -> None:
        self.compile_button.setEnabled(not busy)
        self.cancel_button.setEnabled(busy)
        self.export_button.setEnabled(not busy and self._handle is not None)

    def _on_session_opened(self, outcome: str) -> None:
        """A session opened while the dialog is open: show its compile result (or none)."""
        if outcome == "completed" and self.isVisible():
            self.show_record(self.window_.files.compiled, handle=None)

    def _on_model_ready(self) -> None:
        """Another model: the compilation shown no longer belongs to the window's model."""
        self._handle = None
        self.export_button.setEnabled(False)
        self.export_button.setToolTip("Compile again to export: the model has changed")

    # -- the results ----------------------------------------------------------------------------
    def show_record(self, record: dict[str, Any] | None, handle: Any = None) -> None:
        """Show a compile record (its Compiled ``handle``, None for one reopened from a
        session: its adapter cannot be exported without compiling again)."""
        self.record, self._handle = record, handle
        self.window_.files.compiled = record
        self.export_button.setEnabled(handle is not None and not self.window_.busy)
        self.export_button.setToolTip(
            "Write the PEFT LoRA adapter into a new or empty folder (Ctrl+E)" if handle is not None
            else "Compile (again) to export the adapter: a reopened result keeps no weights")
        rows = table_rows(record) if record else []
        self.table.setRowCount(len(rows))
        values = ([*record.get("train", []), *record.get("held_out", [])] if record else [])
        for i, row in enumerate(rows):
            for j, text in enumerate(row):
                item = QTableWidgetItem(text)
                if j in NUMBERS:
                    item.setData(Qt.ItemDataRole.UserRole, values[i][NUMBERS[j]])
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight
                                          | Qt.AlignmentFlag.AlignVCenter)
                if j in (6, 7):  # (the answer as decoded, its control characters shown)
                    key = "answer" if j == 6 else "full_context_answer"
                    item.setData(Qt.ItemDataRole.UserRole, values[i][key])
                if j in (1, 6, 7):
                    item.setToolTip(text)
                self.table.setItem(i, j, item)
        self.table.resizeRowsToContents()
        self.pooled.setText(pooled_line(record) if record else "")
        curve = (record or {}).get("curve") or []
        has_curve = len(curve) >= 2
        self.figure.graphics.setVisible(has_curve)
        self.no_curve.setVisible(not has_curve)
        if has_curve:
            self.figure.draw(curve)
        table = min(420, 40 + sum(self.table.rowHeight(i) for i in range(len(rows))))
        total = max(self.results.height(), 500)
        self.results.setSizes([table + 24, total - table - 24] if has_curve
                              else [total - 40, 40])

    def table_values(self) -> list[dict[str, Any]]:
        """The table as data: per row, its set, query, match and exact numbers (tests, and
        anything that reads the dialog)."""
        out = []
        for i in range(self.table.rowCount()):
            row = {"set": self.table.item(i, 0).text(), "query": self.table.item(i, 1).text(),
                   "match": self.table.item(i, 2).text(),
                   "answer": self.table.item(i, 6).data(Qt.ItemDataRole.UserRole),
                   "full_context_answer": self.table.item(i, 7).data(Qt.ItemDataRole.UserRole)}
            for j, key in NUMBERS.items():
                row[key] = self.table.item(i, j).data(Qt.ItemDataRole.UserRole)
            out.append(row)
        return out

    # -- the adapter ----------------------------------------------------------------------------
    def export_adapter(self, folder: str | None = None) -> bool:
        """Write the shown compilation's adapter into ``folder`` (asked for when None): a new
        or empty folder that holds no input; refused in one line, writing nothing, otherwise."""
        from ..core.compile_record import check_adapter_folder
        from ..core.errors import UserError
        from ..core.outputs import run_inputs
        from .compile_jobs import adapter_job

        try:
            if self.window_.busy:
                raise UserError("Export adapter: wait for the current job to end, or cancel it "
                                "(Esc)")
            if self._handle is None:
                raise UserError("Export adapter: nothing compiled with the loaded model: "
                                "Compile first (a result reopened from a session keeps no "
                                "weights)")
            if folder is None:
                from . import dialogs

                folder = dialogs.open_folder(self, "adapter", "Export the adapter into a new "
                                             "or empty folder")
                if not folder:
                    return False
            inputs = [p for r in self.window_.reads() if isinstance(r, str)
                      for p in run_inputs(r, None) if p]
            check_adapter_folder(folder, inputs, empty_ok=True, what="the adapter folder")
        except UserError as exc:
            self._refuse(exc.words("window"))
            return False
        self.window_.banner.hide()
        self.window_._start(adapter_job(self._handle, folder), "adapter",
                            f"Writing the adapter {folder}…")
        return True

    def reject(self) -> None:  # noqa: D102 - Esc: cancel a job of this dialog, else close
        if self.window_.job_kind in ("compile", "adapter"):
            self.window_.cancel()
            return
        super().reject()


def _html(text: str) -> str:
    import html

    return html.escape(text)
