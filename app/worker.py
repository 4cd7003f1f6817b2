"""The one worker thread: it drives a job (see `app.jobs`) and forwards what it yields.

Signals carry plain data (STYLE.md 3-4): ``run_started(RunStarted)``, ``token_done(StepResult)``,
``loaded(ModelReady)``, ``session_loaded(SessionReady)``, ``knockout_ready(KnockoutReady)``,
``dynamics_ready(DynamicsReady)``, ``transfer_ready(TransferReady)``,
``analysis_ready(AnalysisReady)``, ``progress(message, done, total)``; the job then ends with
exactly one of ``completed()``, ``cancelled()`` or ``failed(message)``, and QThread's own
``finished()`` follows. Cancel is cooperative: `requestInterruption()` is the job's
``should_stop`` (core checks it between layers and tokens); the thread is never terminated.
"""

from __future__ import annotations

import logging
import traceback

from PySide6.QtCore import QObject, QThread, Signal

from ..core.errors import Cancelled, UserError
from .compile_jobs import AdapterSaved, CompileReady
from .jobs import (
    AnalysisReady,
    DynamicsReady,
    KnockoutReady,
    ModelReady,
    RunStarted,
    SessionReady,
    Task,
    TransferReady,
)

log = logging.getLogger("ctxpatch")


class Worker(QThread):
    run_started = Signal(object)
    token_done = Signal(object)
    loaded = Signal(object)
    session_loaded = Signal(object)
    knockout_ready = Signal(object)
    compile_ready = Signal(object)  # a CompileReady or an AdapterSaved (app.compile_jobs)
    transfer_ready = Signal(object)
    dynamics_ready = Signal(object)
    analysis_ready = Signal(object)
    progress = Signal(str, int, int)
    completed = Signal()
    cancelled = Signal()
    failed = Signal(str)

    def __init__(self, job: Task, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._job = job

    def _emit(self, item: object) -> None:
        if isinstance(item, ModelReady):
            self.loaded.emit(item)
        elif isinstance(item, RunStarted):
            self.run_started.emit(item)
        elif isinstance(item, SessionReady):
            self.session_loaded.emit(item)
        elif isinstance(item, KnockoutReady):
            self.knockout_ready.emit(item)
        elif isinstance(item, CompileReady | AdapterSaved):
            self.compile_ready.emit(item)
        elif isinstance(item, TransferReady):
            self.transfer_ready.emit(item)
        elif isinstance(item, DynamicsReady):
            self.dynamics_ready.emit(item)
        elif isinstance(item, AnalysisReady):
            self.analysis_ready.emit(item)
        else:
            self.token_done.emit(item)

    def run(self) -> None:  # runs on the worker thread
        stop = self.isInterruptionRequested
        try:
            for item in self._job(stop, self.progress.emit):
                if stop():
                    break
                self._emit(item)
                if stop():
                    break
        except Cancelled:
            self.cancelled.emit()
            return
        except UserError as exc:
            self.failed.emit(exc.words("window"))
            return
        except Exception as exc:  # noqa: BLE001 - every failure reaches the window as one line
            if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
                self.failed.emit("out of memory: choose bfloat16, a smaller model, fewer new "
                                 "tokens, a shorter context or the CPU, and run again")
                return
            log.error("worker failed\n%s", traceback.format_exc())
            self.failed.emit(f"internal error: {type(exc).__name__}: {exc} (details in the log)")
            return
        if stop():
            self.cancelled.emit()
        else:
            self.completed.emit()
