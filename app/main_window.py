"""The main window: it assembles the panels, owns the one worker thread, and keeps settings.

Data flows one way: the panels' inputs -> a job on the worker (app/jobs.py) -> plain results in
`RunState` -> the views. The window holds the loaded model only as an opaque handle to give back
to the next job; it never calls it. Exports, the run list and sessions are
`app.window_files.WindowFiles`, held as ``files``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QByteArray, QSettings, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QCloseEvent, QKeySequence
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QMenu,
    QProgressBar,
    QPushButton,
    QSplitter,
    QTabWidget,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from .jobs import (
    DynamicsReady,
    KnockoutReady,
    ModelReady,
    RunStarted,
    Task,
    dynamics_job,
    knockout_job,
    load_job,
    run_job,
)
from .panels.control_panel import QtControlPanel
from .panels.dynamics_panel import QtDynamicsPanel
from .panels.generation_panel import QtGenerationPanel, plural
from .panels.geometry_panel import QtGeometryPanel
from .panels.history_panel import QtHistoryPanel
from .panels.input_panel import QtInputPanel
from .panels.lens_panel import QtLensPanel
from .panels.model_panel import QtModelPanel
from .panels.patch_panel import QtPatchPanel
from .panels.plots_panel import QtPlotsPanel
from .panels.transfer_panel import QtTransferPanel
from .state import RunState
from .window_files import WindowFiles
from .worker import Worker

log = logging.getLogger("ctxpatch")
SETTINGS_VERSION = 1


class Banner(QWidget):
    """One clear line about what went wrong (or an offer, with its button); the window keeps
    working."""

    def __init__(self, action: str = "", colour: str = "#c62828") -> None:
        super().__init__()
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.button = QPushButton(action)
        self.button.setVisible(bool(action))
        self._callback: Callable[[], None] | None = None
        self.button.clicked.connect(lambda: self._callback and self._callback())
        self._declined: Callable[[], None] | None = None
        self.close_button = close = QToolButton()
        close.setText("✕")
        close.setToolTip("Dismiss")
        close.clicked.connect(self._dismiss)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(8, 4, 4, 4)
        layout.addWidget(self.label, 1)
        layout.addWidget(self.button)
        layout.addWidget(close)
        self.setStyleSheet(f"background-color:{colour}; color:white; border-radius:3px;")
        self.setAutoFillBackground(True)
        self.hide()

    def show_message(self, message: str) -> None:
        self.label.setText(message)
        self.show()

    def offer(self, message: str, callback: Callable[[], None],
              declined: Callable[[], None] | None = None,
              decline_tip: str = "No: discard it (removed when ctxpatch closes)") -> None:
        """Offer something: its button calls ``callback``; ✕, when ``declined`` is given,
        declines the offer (else it only hides the line)."""
        self._callback, self._declined = callback, declined
        self.close_button.setToolTip(decline_tip if declined is not None else "Dismiss")
        self.show_message(message)

    def _dismiss(self) -> None:
        declined, self._declined = self._declined, None
        self.hide()
        if declined is not None:
            declined()


class MainWindow(QMainWindow):
    #: a requested run ended: "completed", "cancelled" or "failed"
    run_finished = Signal(str)
    model_ready = Signal()
    #: a worker was created and is about to start (tests connect to it directly)
    worker_created = Signal(object)
    #: File > Open session ended: "completed", "cancelled" or "failed" (large files open on the
    #: worker, so `open_session` may return before this)
    session_opened = Signal(str)

    def __init__(self, model: str | None = None, settings: QSettings | None = None,
                 autoload: bool = True, options: dict[str, Any] | None = None,
                 persistent: bool = True) -> None:
        """``persistent`` False: a window that neither reads nor writes the user's files
        (``ctxpatch --screenshot``): it starts as a fresh profile does, so that what it runs is
        the command line's options over their documented defaults, never a setting left by the
        last session; it writes no settings, and neither writes, offers nor removes an
        autosave."""
        super().__init__()
        self.persistent = persistent
        self.setWindowTitle("ctxpatch — Context Patch Lab")
        self.settings = settings if settings is not None else QSettings("ctxpatch", "ctxpatch")
        self.state = RunState()
        self.model: ModelReady | None = None
        self.worker: Worker | None = None
        self._kind = ""
        self._run_after_load = False
        self._outcome = ""
        self.last_error = ""
        self.compile_dialog: Any = None  # Run > Compile the context… (made on first use)
        self._set_dialog: Any = None  # File > Run a prompt set… while it is open

        self.model_panel = QtModelPanel()
        self.input_panel = QtInputPanel()
        self.generation = QtGenerationPanel(self.state)
        self.plots = QtPlotsPanel(self.state)
        self.patches = QtPatchPanel(self.state)
        self.controls = QtControlPanel(self.state)
        self.lens = QtLensPanel()  # (both filled from the finished run's record: `_on_state`)
        self.geometry = QtGeometryPanel()
        self.transfer = QtTransferPanel()
        self.dynamics = QtDynamicsPanel()  # (run on demand: `run_dynamics`)
        self.banner = Banner()
        self.notice = Banner(action="Restore", colour="#1565c0")
        self.history_panel = QtHistoryPanel()
        self._build_layout()
        self._build_status_bar()
        self.files = WindowFiles(
            self, self.state, input_panel=self.input_panel, model_panel=self.model_panel,
            history_panel=self.history_panel, plots=self.plots, banner=self.banner,
            notice=self.notice, say=self.status_label.setText, show_error=self.show_error,
            running=lambda: self.job_kind, start=self._start,
            session_opened=self.session_opened.emit, reads=self.reads, persistent=persistent,
            dynamics=self.dynamics)
        self._build_actions()

        self.model_panel.load_requested.connect(self.load_model)
        self.input_panel.run_requested.connect(self.start_run)
        self.input_panel.cancel_requested.connect(self.cancel)
        self.input_panel.preset_chosen.connect(self._on_preset)
        self.input_panel.problem.connect(self.show_error)
        self.history_panel.chosen.connect(self.files.show_run)
        self.plots.overlay.toggled.connect(lambda _: self.files.update_overlays())
        self.lens.knockout_requested.connect(lambda step: self.knockout(step))
        self.dynamics.run_requested.connect(self.run_dynamics)
        self.state.subscribe(self._on_state)

        if persistent:
            self._restore(options)
        else:
            self._first_start(options)
        if model is not None:
            self.model_panel.model.setCurrentText(model)
        if options:
            self.apply_options(options)
        self._autosave = QTimer(self)
        self._autosave.timeout.connect(self.save_settings)
        if persistent:
            self._autosave.start(30_000)
        if autoload:
            QTimer.singleShot(0, self.load_model)

    # -- building -------------------------------------------------------------------------------
    def _build_layout(self) -> None:
        left = QWidget()
        lv = QVBoxLayout(left)
        lv.setContentsMargins(0, 0, 0, 0)
        lv.addWidget(self.model_panel)
        lv.addWidget(self.input_panel, 1)
        self.tabs = QTabWidget()
        self.tabs.addTab(self.plots, "Per-token plots")
        self.tabs.addTab(self.patches, "Patch explorer")
        self.tabs.addTab(self.controls, "Controllability")
        self.tabs.addTab(self.lens, "Context lens")
        self.tabs.addTab(self.geometry, "Geometry")
        self.tabs.addTab(self.dynamics, "Dynamics")
        self.tabs.addTab(self.transfer, "Transfer")
        right = QSplitter(Qt.Orientation.Vertical)
        top = QWidget()
        tv = QVBoxLayout(top)
        tv.setContentsMargins(0, 0, 0, 0)
        tv.addWidget(self.history_panel)
        tv.addWidget(self.generation, 1)
        right.addWidget(top)
        right.addWidget(self.tabs)
        right.setStretchFactor(0, 1)
        right.setStretchFactor(1, 1)
        self.right_splitter = right
        self.main_splitter = QSplitter()
        self.main_splitter.addWidget(left)
        self.main_splitter.addWidget(right)
        self.main_splitter.setStretchFactor(1, 1)
        self.main_splitter.setSizes([360, 1000])
        central = QWidget()
        cv = QVBoxLayout(central)
        cv.addWidget(self.banner)
        cv.addWidget(self.notice)
        cv.addWidget(self.main_splitter, 1)
        self.setCentralWidget(central)
        self.resize(1400, 900)

    def _build_status_bar(self) -> None:
        self.status_label = QLabel("Ready")
        self.progress = QProgressBar()
        self.progress.setMaximumWidth(260)
        self.progress.hide()
        self.device_label = QLabel("")
        bar = self.statusBar()
        bar.addWidget(self.status_label, 1)
        bar.addPermanentWidget(self.progress)
        bar.addPermanentWidget(self.device_label)

    def _action(self, menu: QMenu, text: str, shortcut: str | QKeySequence.StandardKey,
                slot: Callable[[], object]) -> QAction:
        action = QAction(text, self)
        action.setShortcut(QKeySequence(shortcut))
        action.triggered.connect(slot)
        menu.addAction(action)
        return action

    def _build_actions(self) -> None:
        bar = self.menuBar()
        file = bar.addMenu("&File")
        self._action(file, "&Open model folder…", QKeySequence.StandardKey.Open,
                     self._on_open_folder)
        files = self.files
        self._action(file, "Open &session…", "Ctrl+Shift+O", lambda: files.open_session())
        self._action(file, "Add &image to the context…", "Ctrl+I",
                     self.input_panel.choose_image)
        self.save_action = self._action(file, "&Save session…", QKeySequence.StandardKey.Save,
                                        lambda: files.save_session())
        self._action(file, "Save run as &JSON…", "Ctrl+Shift+S", lambda: files.export("json"))
        self.export_action = self._action(file, "&Export report (HTML or PDF)…", "Ctrl+E",
                                          lambda: files.export("report"))
        self._action(file, "Export per-token &CSV…", "Ctrl+Shift+E", lambda: files.export("csv"))
        file.addSeparator()
        self._action(file, "Run a prompt se&t…", "Ctrl+Shift+P", self.run_prompt_set)
        file.addSeparator()
        self._action(file, "&Quit", QKeySequence.StandardKey.Quit, self.close)
        run = bar.addMenu("&Run")
        self.run_action = self._action(run, "&Run comparison", "Ctrl+Return", self.start_run)
        self.cancel_action = self._action(run, "&Cancel", "Esc", self.cancel)
        self._action(run, "&Load model", "Ctrl+L", self.load_model)
        self._action(run, "&Knock out layers at the lens's token", "Ctrl+K",
                     lambda: self.knockout())
        self._action(run, "Co&mpile the context…", "Ctrl+Shift+C", self.open_compile)
        self._action(run, "Context &dynamics (the context read token by token)", "Ctrl+D",
                     self.run_dynamics)
        view = bar.addMenu("&View")
        self._action(view, "&Previous token", "Alt+Left", lambda: self._step_selection(-1))
        self._action(view, "&Next token", "Alt+Right", lambda: self._step_selection(+1))
        self._action(view, "Per-token &plots", "Ctrl+1", lambda: self.tabs.setCurrentIndex(0))
        self._action(view, "Patch &explorer", "Ctrl+2", lambda: self.tabs.setCurrentIndex(1))
        self._action(view, "&Controllability", "Ctrl+3", lambda: self.tabs.setCurrentIndex(2))
        self._action(view, "Context &lens", "Ctrl+4", lambda: self.tabs.setCurrentIndex(3))
        self._action(view, "&Geometry", "Ctrl+5", lambda: self.tabs.setCurrentIndex(4))
        self._action(view, "Context &dynamics", "Ctrl+6",
                     lambda: self.tabs.setCurrentWidget(self.dynamics))
        self._action(view, "&Transfer", "Ctrl+7",
                     lambda: self.tabs.setCurrentWidget(self.transfer))
        help_menu = bar.addMenu("&Help")
        self._action(help_menu, "&About ctxpatch", "F1", self.show_about)

    # -- model and runs -------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self.worker is not None

    @property
    def job_kind(self) -> str | None:
        """The kind of job on the worker: "load", "run" or "session"; None when idle."""
        return self._kind if self.worker is not None else None

    def load_model(self, run_after: bool = False) -> None:
        if self.busy:
            return
        from ..core.footprint import first_use

        key = self.model_panel.key()
        self.model = None  # free the old model's memory before loading the next
        if not self.model_panel.model.currentText().strip():  # (what loads, not the placeholder)
            self.model_panel.model.setCurrentText(key[0])
        said = first_use(key[0], short=True)  # (a demo's first use: size and time, said first)
        self.model_panel.set_loaded(f"loading {key[0]}…" + (f" ({said})" if said else ""))
        self.model_panel.loaded_label.setToolTip(first_use(key[0]) or "")
        self._run_after_load = run_after
        self._start(load_job(*key, **self.model_panel.trust_flags()), "load",
                    f"Loading {key[0]} ({key[1]}, {key[2]})…")

    def start_run(self) -> None:
        if self.busy:
            return
        self.banner.hide()
        self.save_settings()
        problem = self.input_panel.image_problem()  # before a model loads for it
        if problem is not None:
            self.show_error(problem)
            self.run_finished.emit("failed")
            return
        if self.model is None or self.model.key != self.model_panel.key():
            self.load_model(run_after=True)
            return
        inputs = self.input_panel.values()
        options = {**self.model_panel.spec_options(), "context": inputs["context"],
                   "query": inputs["query"], "chat_template": inputs["chat_template"],
                   "image": inputs["image"] or None, "max_new_tokens": inputs["max_new_tokens"]}
        job = run_job(self.model, options)  # (checked in the job, as one line)
        self._start(job, "run", "Running…")

    def run_prompt_set(self) -> Any:
        """File > Run a prompt set…: the set's grid on this window's model and device, in its
        own dialog (`app.prompt_set_dialog`); returns the dialog."""
        from .prompt_set_dialog import PromptSetDialog

        if self._set_dialog is not None:  # one set at a time per window: the open one
            self._set_dialog.show()
            self._set_dialog.activateWindow()
            return self._set_dialog
        key = self.model_panel.key()
        dialog = PromptSetDialog(self, model=key[0], device=key[2])
        dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        dialog.destroyed.connect(lambda *_: setattr(self, "_set_dialog", None))
        self._set_dialog = dialog
        dialog.show()
        return dialog

    def cancel(self) -> None:
        if self.worker is not None:
            self.worker.requestInterruption()
            self.status_label.setText("Cancelling: stopping before the next layer, token or pass…")

    def _start(self, job: Task, kind: str, message: str) -> None:
        worker = Worker(job, self)
        worker.loaded.connect(self._on_loaded)
        worker.session_loaded.connect(self.files.on_session_loaded)
        worker.knockout_ready.connect(self._on_knockout)
        worker.transfer_ready.connect(lambda ready: self.state.set_transfer(ready.section))
        worker.dynamics_ready.connect(self._on_dynamics)
        worker.analysis_ready.connect(self.files.set_analysis)
        worker.run_started.connect(self._on_run_started)
        worker.token_done.connect(self.state.add_step)
        worker.progress.connect(self._on_progress)
        worker.completed.connect(lambda: self._set_outcome("completed"))
        worker.cancelled.connect(lambda: self._set_outcome("cancelled"))
        worker.failed.connect(self._on_failed)
        worker.finished.connect(self._on_worker_finished)
        self.worker, self._kind, self._outcome = worker, kind, ""
        self.input_panel.set_busy(True)
        self.progress.setRange(0, 0)
        self.progress.show()
        self.status_label.setText(message)
        self.worker_created.emit(worker)
        worker.start()

    def _set_outcome(self, outcome: str) -> None:
        self._outcome = outcome

    def _on_progress(self, message: str, done: int, total: int) -> None:
        if total > 0:
            self.progress.setRange(0, total)
            self.progress.setValue(done)
        if self._kind in ("load", "session", "dynamics") or message:  # (a run's: its analyses')
            self.status_label.setText(message)

    def _on_loaded(self, ready: ModelReady) -> None:
        self.model = ready
        info = ready.info
        self.model_panel.remember(ready.key[0])
        self.model_panel.set_controls(ready.output_controls)
        self.model_panel.set_loaded(
            f"{info['class']}, {info['num_layers']} layers, {info['dtype']} on {info['device']}"
            + (f" ({info['placement']})" if info.get("placement") else ""))
        # (the time in the status bar and the tooltip: a third line did not fit the form)
        self.model_panel.loaded_label.setToolTip(f"family: {info['family']}; loaded in "
                                                 f"{ready.seconds:.1f}\u00a0s")
        self.input_panel.set_chat_template_available(ready.has_chat_template)
        self.input_panel.set_takes_images(ready.takes_images)
        self.device_label.setText(f"{info['device']} · {info['dtype']}")
        self.model_ready.emit()

    def _on_run_started(self, started: RunStarted) -> None:
        self.state.reset(started)
        self.progress.setRange(0, started.settings["max_new_tokens"])
        self.progress.setValue(0)

    def _on_failed(self, message: str) -> None:
        self._outcome = "failed"
        self.show_error(message)

    def _on_worker_finished(self) -> None:
        worker, kind, outcome = self.worker, self._kind, self._outcome or "failed"
        self.worker = None
        if worker is not None:
            worker.deleteLater()
        self.input_panel.set_busy(False)
        self.progress.hide()
        if kind == "session":
            self.files.on_session_job_finished(outcome)
            return
        if kind in ("compile", "adapter"):  # (the dialog's jobs: `open_compile`)
            self.compile_dialog.job_finished(kind, outcome)
            return
        if kind == "dynamics":
            self.status_label.setText({"completed": "Context dynamics done",
                                       "cancelled": "Context dynamics cancelled; the tab is "
                                                    "unchanged"}.get(
                                           outcome, "Context dynamics failed (see the message "
                                                    "above)"))
            return
        if kind == "knockout":
            self.status_label.setText({"completed": "Knock-out done",
                                       "cancelled": "Knock-out cancelled"}.get(
                                           outcome, "Knock-out failed (see the message above)"))
            return
        if kind == "load":
            if outcome != "completed" and self.model is None:
                self.model_panel.set_loaded("not loaded")
            if outcome == "completed":
                self.banner.hide()  # an earlier error is stale once a model is ready
                seconds = f" in {self.model.seconds:.1f}\u00a0s" if self.model else ""
                self.status_label.setText(f"Loaded {self.model_panel.spec()}{seconds}")
            elif outcome == "cancelled":
                self.status_label.setText("Loading cancelled")
            if self._run_after_load:
                self._run_after_load = False
                if outcome == "completed":
                    self.start_run()
                else:
                    self.run_finished.emit(outcome)
            return
        if self.state.running:
            self.state.finish()
        if outcome in ("completed", "cancelled") and self.state.steps:
            self.files.remember_run()
        self._report_run(outcome)
        self.run_finished.emit(outcome)

    def knockout_problem(self, step: int | None) -> str | None:
        """Why the knock-out cannot run at ``step`` now, in one line (None: it can)."""
        if self.busy:
            return "Knock-out: wait for the current job to end, or cancel it (Esc)"
        if step is None or not 0 <= step < len(self.state.steps):
            return "Knock-out: no token chosen: run a comparison with Lens ticked, then pick a cell"
        if getattr(self.state.steps[step], "patches", None) is None:
            return ("Knock-out: this run kept no patches (a run reopened from a session or the "
                    "list keeps none): tick Lens under Analyses and run it again")
        started = self.state.started
        if self.model is None or started is None or self.model.info != started.model:
            return "Knock-out: load the model this run used (Ctrl+L), then press K again"
        return None

    def knockout(self, step: int | None = None) -> None:
        """Knock out each patched layer at ``step`` (default: the lens tab's pinned token)."""
        step = self.lens.step if step is None else step
        problem = self.knockout_problem(step)
        if problem is not None:
            self.show_error(problem)
            return
        assert step is not None and self.model is not None
        self.banner.hide()
        scope = str((self.state.started.settings or {}).get("scope", "all-positions"))
        self._start(knockout_job(self.model, self.state.steps[step], scope), "knockout",
                    f"Knock-out at token {step + 1}…")

    def open_compile(self) -> Any:
        """Run > Compile the context…: the dialog (`app.compile_dialog`), made on first use."""
        if self.compile_dialog is None:
            from .compile_dialog import CompileDialog

            self.compile_dialog = CompileDialog(self)
        self.compile_dialog.open_for_window()
        return self.compile_dialog

    def _on_knockout(self, ready: KnockoutReady) -> None:
        self.lens.set_knockout(ready.result)

    def dynamics_problem(self) -> str | None:
        """Why the context dynamics cannot run now, in one line (None: it can)."""
        if self.busy:
            return "Dynamics: wait for the current job to end, or cancel it (Esc)"
        if self.input_panel.image_path:
            return ("Dynamics reads a text context token by token: remove the picture from the "
                    "context to run it")
        if not self.input_panel.values()["context"].strip():
            return ("Dynamics: the context is empty: type a context (it is read token by token, "
                    "the query fixed)")
        if self.model is None:
            return "Dynamics: no model loaded: load one (Ctrl+L), then press Ctrl+D again"
        if self.model.key != self.model_panel.key():
            return ("Dynamics: the model loaded is not the one chosen: load it (Ctrl+L), then "
                    "press Ctrl+D again")
        return None

    def run_dynamics(self) -> None:
        """The context dynamics of the window's context, query, model and options, on the
        worker (`app.jobs.dynamics_job`); the Dynamics tab shows it when it ends."""
        from ..core.dynamics import OPTIONS

        problem = self.dynamics_problem()
        if problem is not None:
            self.show_error(problem)
            return
        assert self.model is not None
        self.banner.hide()
        inputs = self.input_panel.values()
        options = {**self.model_panel.spec_options(), "context": inputs["context"],
                   "query": inputs["query"], "chat_template": inputs["chat_template"]}
        self.tabs.setCurrentWidget(self.dynamics)
        self._start(dynamics_job(self.model, {k: v for k, v in options.items()
                                              if k in OPTIONS}),
                    "dynamics", "Dynamics: reading the context…")

    def _on_dynamics(self, ready: DynamicsReady) -> None:
        self.dynamics.set_record(ready.record)
        self.files.remember_result()

    def _report_run(self, outcome: str) -> None:
        s = self.state.summary()
        if outcome == "failed":
            self.status_label.setText("Run failed (see the message above)")
            return
        word = "Done" if outcome == "completed" else "Cancelled"
        self.status_label.setText(
            f"{word}: {plural(s['tokens'], 'token')} in {s['seconds']:.1f} s — patched "
            f"{s['matches']}/{s['tokens']} match, max L∞ {s['max_linf']:.3g}; control "
            f"{s['control_matches']}/{s['tokens']}, max L∞ {s['control_max_linf']:.3g}")

    def show_error(self, message: str) -> None:
        self.last_error = message
        log.warning("%s", message)
        self.banner.show_message(message)
        self.status_label.setText("Error")

    # -- selection, presets, export -------------------------------------------------------------
    def _on_state(self, event: str) -> None:
        if event in ("reset", "finished"):
            self._fill_analyses()
        if event == "step" and self.state.started is not None:
            n = len(self.state.steps)
            self.progress.setRange(0, self.state.max_tokens)
            self.progress.setValue(n)
            self.status_label.setText(f"Running: token {n}/{self.state.max_tokens}")

    def _fill_analyses(self) -> None:
        """The analysis tabs from the shown run's record once it has ended (a run reopened
        from the list or a session arrives as one "reset" of a finished state); emptied while
        a run goes."""
        if self.state.running:
            asked = set((self.state.started.settings or {}).get("analyze") or ())
            waiting = "The {} appears here when the run ends."
            self.lens.clear(waiting.format("context lens") if "lens" in asked else None)
            self.geometry.clear(waiting.format("patch geometry") if "geometry" in asked
                                else None)
            self.transfer.clear(waiting.format("transfer") if "transfer" in asked else None)
            return
        record = self.files.current_record()
        self.lens.set_record(record)
        self.geometry.set_record(record)
        self.transfer.set_record(record)

    def _step_selection(self, delta: int) -> None:
        if not self.state.steps:
            return
        current = self.state.selected
        if current is None:
            self.state.select(len(self.state.steps) - 1 if delta < 0 else 0)
        else:
            self.state.select(current + delta)

    def _on_preset(self, preset: dict[str, Any]) -> None:
        if preset.get("absorb"):
            self.model_panel.absorb.setCurrentText(preset["absorb"])

    def _on_open_folder(self) -> None:
        self.model_panel.browse_folder()

    def reads(self) -> list[str | None]:
        """What the window reads now: the model typed, the picture chosen, and the loaded model
        (as asked for, and the folder it was found in), which its writes must not overwrite."""
        loaded = [self.model.key[0], self.model.info.get("id")] if self.model is not None else []
        return [self.model_panel.spec(), self.input_panel.image_path or None, *loaded]

    # -- files: the File menu's commands as the window's own (`app.gui` and tests call them) ---
    def current_record(self) -> dict[str, Any] | None:
        return self.files.current_record()

    def export(self, kind: str, path: str | None = None) -> bool:
        return self.files.export(kind, path)

    def save_session(self, path: str | None = None) -> bool:
        return self.files.save_session(path)

    def open_session(self, path: str | None = None) -> bool:
        return self.files.open_session(path)

    def offer_autosave(self) -> None:
        self.files.offer_autosave()

    # -- settings -------------------------------------------------------------------------------
    def apply_options(self, options: dict[str, Any]) -> None:
        """Fill the panels from command-line style options (model, dtype, query, ...)."""
        self.model_panel.restore({"recent": self.model_panel.recent(), **options},
                                 "the options given")
        if "model" in options:
            self.model_panel.model.setCurrentText(str(options["model"]))
        self.input_panel.restore(options, "the options given")

    def save_settings(self) -> None:
        if not self.persistent:
            return
        s = self.settings
        s.setValue("version", SETTINGS_VERSION)
        s.setValue("window/geometry", self.saveGeometry())
        s.setValue("window/main_splitter", self.main_splitter.saveState())
        s.setValue("window/right_splitter", self.right_splitter.saveState())
        s.setValue("panels/model", json.dumps(self.model_panel.save()))
        s.setValue("panels/input", json.dumps(self.input_panel.save()))
        s.sync()

    def _first_start(self, options: dict[str, Any] | None = None) -> None:
        """A fresh profile runs on the first click: the paper's Mars prompt (the first preset,
        named in the Presets box) with its absorb all, which needs no context. A prompt given
        on the command line is run over the documented defaults instead (absorb context), never
        over the preset's."""
        if options and any(options.get(k) for k in ("context", "query", "image")):
            return
        self.input_panel.choose_preset(0)

    def _restore(self, options: dict[str, Any] | None = None) -> None:
        """The window as it was left, from its settings. A settings file can hold anything (it
        is a text file anyone can edit, or one a newer or older ctxpatch wrote): a value of the
        wrong type or an absurd size is left out with a warning in the log, and its control
        keeps its default (the panels' values: `app.panels.values.checked`); the window starts."""
        s = self.settings
        if s.value("panels/input") is None and s.value("panels/model") is None:
            self._first_start(options)
        for key, restore in (("window/geometry", self.restoreGeometry),
                             ("window/main_splitter", self.main_splitter.restoreState),
                             ("window/right_splitter", self.right_splitter.restoreState)):
            value = s.value(key)
            if value is None:
                continue
            if not isinstance(value, QByteArray | bytes) or not restore(value):
                log.warning("the window settings: %s cannot be restored (%s): its default is "
                            "used", key, type(value).__name__)
        for key, panel in (("panels/model", self.model_panel), ("panels/input", self.input_panel)):
            raw = s.value(key)
            if raw is None:
                continue
            try:
                data = json.loads(raw) if isinstance(raw, str) else raw
            except (ValueError, RecursionError) as exc:
                log.warning("the window settings: %s is not JSON (%s): the defaults are used",
                            key, type(exc).__name__)
                continue
            panel.restore(data, f"the window settings ({key})")

    def about_text(self) -> str:
        """Versions of everything that decides a result, and where the model runs."""
        from importlib.metadata import PackageNotFoundError, version

        from PySide6 import __version__ as pyside
        from PySide6.QtCore import qVersion

        from ..core import __version__

        def v(name: str) -> str:
            try:
                return version(name)
            except PackageNotFoundError:
                return "not installed"

        model = self.model.info if self.model is not None else None
        where = (f"{model['id']} ({model['class']}) in {model['dtype']} on {model['device']}"
                 if model else "no model loaded")
        return (f"<h3>ctxpatch {__version__}</h3><p>Context Patch Lab: a prompt's effect, "
                "rewritten as exact token-specific weight patches (Goldwaser, Munn, Gonzalvo, "
                "Dherin, arXiv 2511.17864).</p>"
                f"<p>torch {v('torch')} · transformers {v('transformers')} · Qt {qVersion()} "
                f"(PySide6 {pyside}) · pyqtgraph {v('pyqtgraph')}<br>Model: {where}</p>")

    def show_about(self) -> None:
        from PySide6.QtWidgets import QMessageBox

        QMessageBox.about(self, "About ctxpatch", self.about_text())

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 - Qt override
        self.save_settings()
        self.files.closing()  # a clean exit: this window's autosave goes (never another's)
        if self.worker is not None:
            # a thread destroyed while running takes the process down: let it finish its layer
            self.status_label.setText("Stopping the background job…")
            self.worker.requestInterruption()
            self.worker.wait()
        if self._set_dialog is not None:  # (a prompt set's thread likewise)
            self._set_dialog.stop_and_wait()
        super().closeEvent(event)
