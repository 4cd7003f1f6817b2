"""What the window reads and writes: the run as JSON, CSV or a report; the run list (history,
reopened without recomputing, overlaid); sessions and the autosave offered back after a crash.

`WindowFiles` is built by `app.main_window.MainWindow` with the panels it reads and fills and the
few window functions it calls; the window's File menu, the history panel and the worker's session
signals call into it. It owns the run list (``history``) and nothing else of the window's.
"""

from __future__ import annotations

import logging
import math
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import dialogs

if TYPE_CHECKING:
    from PySide6.QtWidgets import QWidget

    from ..core.record import RunRecord
    from .jobs import RunStarted, SessionReady, Task
    from .main_window import Banner
    from .panels.dynamics_panel import QtDynamicsPanel
    from .panels.history_panel import QtHistoryPanel
    from .panels.input_panel import QtInputPanel
    from .panels.model_panel import QtModelPanel
    from .panels.plots_panel import QtPlotsPanel
    from .state import RunState

log = logging.getLogger("ctxpatch")
#: session files larger than this open on the worker (about 300 tokens a megabyte: a 9,000-token
#: run is some 30 MB and takes seconds to check and rebuild)
SYNC_BYTES = 2 << 20


def _real(x: Any) -> float:
    """A record's number: JSON's null (a NaN or infinity when written) is NaN."""
    return math.nan if x is None else float(x)


class WindowFiles:
    """Exports, the run list and sessions of one window.

    Args:
        window: the parent of the file dialogs.
        state: the shown run (read for exports, filled when a saved run is shown).
        input_panel, model_panel: saved into sessions, restored from them.
        history_panel, plots: the run list and the overlays of the other runs.
        dynamics: the Dynamics tab: its result is saved in sessions, restored from them, and
            added to exported reports.
        banner: the error line, hidden when a large session has opened.
        notice: the line that offers the autosave back.
        say: sets the status line.
        show_error: one line in the banner.
        running: the kind of job on the worker ("load", "run", "session"), None when idle.
        start: starts a job on the worker (job, kind, status message); a "session" job's
            payload comes back through `on_session_loaded`, its end through
            `on_session_job_finished`.
        session_opened: called with the outcome of every File > Open session ("completed",
            "cancelled" or "failed").
        reads: the model and picture the window reads now (the loaded model, the one typed,
            the chosen picture), which no write of the window may overwrite (`check_writes`).
        persistent: False for a window that must leave the user's files alone (``ctxpatch
            --screenshot``): it neither writes, offers nor removes an autosave.
    """

    def __init__(self, window: QWidget, state: RunState, *, input_panel: QtInputPanel,
                 model_panel: QtModelPanel, history_panel: QtHistoryPanel, plots: QtPlotsPanel,
                 banner: Banner, notice: Banner, say: Callable[[str], None],
                 show_error: Callable[[str], None], running: Callable[[], str | None],
                 start: Callable[[Task, str, str], None],
                 session_opened: Callable[[str], None],
                 reads: Callable[[], list[str | None]] = list, persistent: bool = True,
                 dynamics: QtDynamicsPanel | None = None) -> None:
        self._window = window
        self._state = state
        self._input_panel = input_panel
        self._model_panel = model_panel
        self._history_panel = history_panel
        self._plots = plots
        self._banner = banner
        self._notice = notice
        self._say = say
        self._show_error = show_error
        self._running = running
        self._start = start
        self._session_opened = session_opened
        self._reads = reads
        self._persistent = persistent
        self._dynamics = dynamics
        # the autosave: this window's own (once written), the crashed sessions found at start
        # waiting to be offered, the one offered now, and those declined (removed at a clean
        # exit); one neither restored nor declined is kept, and offered again at the next start
        self._autosave_file: Path | None = None
        self._waiting: list[tuple[Path, dict[str, Any]]] = []
        self._offered: Path | None = None
        self._declined: list[Path] = []
        self.history: list[dict[str, Any]] = []  # finished runs' records, oldest first
        self.history_index: int | None = None  # the one shown
        self._pending_session: SessionReady | None = None  # applied when its job has ended
        #: the shown run's analyses: (its RunStarted, its steps, its transfer, the section), see
        #: `_analysis`
        self._analysis_cache: tuple[Any, int, Any, dict[str, Any] | None] | None = None
        #: the last compilation's record (`core.compile_record`): sessions and reports keep it
        self.compiled: dict[str, Any] | None = None

    # -- exports --------------------------------------------------------------------------------
    def current_record(self) -> dict[str, Any] | None:
        """The shown run as a run record (DESIGN.md "Run JSON"), or None before any run."""
        started: RunStarted | None = self._state.started
        if not self._state.steps or started is None:
            return None
        if started.record is not None:
            return started.record  # a run reopened from a session
        from ..core.record import record_of
        from ..core.spec import RunSpec

        spec = RunSpec.from_dict(started.settings)
        return record_of(started.model, started.prompt, spec, self._state.steps,
                         started.plan or None, self._state.wall, self._analysis(spec))

    def set_analysis(self, ready: Any) -> None:
        """The running run's analyses, computed on the worker (`app.jobs.AnalysisReady`): the
        record of the run uses them (`_analysis`), so the GUI thread does not compute them."""
        self._analysis_cache = (self._state.started, ready.steps, ready.transfer, ready.section)

    def _analysis(self, spec: Any) -> dict[str, Any] | None:
        """The shown run's analyses (`core.analysis.analysis_section`), once per run and
        length: exports, the run list and the analysis tabs all ask for the record. A finished
        run's come from the worker (`set_analysis`); a cancelled run's are computed here."""
        if not spec.analyze:
            return None
        started, n, transfer = self._state.started, len(self._state.steps), self._state.transfer
        cache = self._analysis_cache
        if cache is None or cache[0] is not started or cache[1] != n or cache[2] is not transfer:
            from ..core.analysis import analysis_section

            cache = self._analysis_cache = (started, n, transfer, analysis_section(
                self._state.steps, spec.analyze, transfer))
        return cache[3]

    def export(self, kind: str, path: str | None = None) -> bool:
        """Write the current run as JSON, CSV or a report (HTML, or PDF by the file's suffix);
        returns whether a file was written."""
        record = self.current_record()
        dynamics = self._dynamics.record if self._dynamics is not None else None
        if record is None and not (kind == "report" and (dynamics is not None or self.compiled)):
            self._show_error("nothing to export yet: run a comparison first")
            return False
        if path is None:
            filters = {"json": "Run JSON (*.json)", "csv": "Per-token CSV (*.csv)",
                       "report": "HTML report (*.html);;PDF report (*.pdf)"}
            default = {"json": "ctxpatch-run.json", "csv": "ctxpatch-run.csv",
                       "report": "ctxpatch-report.html"}[kind]
            path = dialogs.save_file(self._window, "export", "Export", default, filters[kind])
            if not path:
                return False
        from ..core.errors import UserError
        from ..core.export import steps_csv, write_json, write_text

        try:
            self.check_writes({"json": "the run JSON", "csv": "the CSV",
                               "report": "the report"}[kind], path, report=kind == "report")
            if kind == "json" and record is not None:
                write_json(path, record)
            elif kind == "csv":
                write_text(path, steps_csv(self._state.steps))
            else:
                from .report import write_compile_report, write_dynamics_report, write_report
                from .session import rebuild

                target = Path(path)
                self._say(f"Writing the report {path}…")
                if record is None and dynamics is not None:  # the context dynamics alone
                    write_dynamics_report(dynamics, target,
                                          target.with_name(f"{target.stem}_plots"),
                                          compiled=self.compiled)
                elif record is None:  # the compilation alone
                    write_compile_report(self.compiled, target,
                                         target.with_name(f"{target.stem}_plots"))
                else:
                    write_report(rebuild(record, "the run"), target,
                                 target.with_name(f"{target.stem}_plots"), dynamics=dynamics,
                                 selected=self._state.selected, compiled=self.compiled)
        except UserError as exc:
            self._show_error(exc.words("window"))
            return False
        except OSError as exc:
            self._show_error(f"cannot write {path}: {exc.strerror or exc}")
            return False
        self._say(f"Saved {path}")
        return True

    def check_writes(self, what: str, path: str, report: bool = False) -> None:
        """Refuse, before anything is written, a file the window cannot write or one that would
        overwrite what its runs read: the model (a folder, a file, or the demo's cache folder)
        and the picture of the shown run, of the runs of the list, and those the window reads
        now (`core.outputs.check_outputs`, the command line's own check). ``report``: ``path``
        is a report, written with its plots folder beside it (`core.outputs.check_report`).

        Raises:
            UserError: one line naming ``what``, the path and what to do.
        """
        from ..core.outputs import check_outputs, check_report, run_inputs

        read: list[Any] = list(self._reads())
        shown = self.current_record()
        for record in [*self.history, *([shown] if shown is not None else [])]:
            settings, prompt = record.get("settings") or {}, record.get("prompt") or {}
            read += [settings.get("model"), settings.get("image"),
                     (record.get("model") or {}).get("id"), (prompt.get("image") or {}).get("path")]
        # (each as a model or a picture: run_inputs names a demo's cache folder)
        inputs = [p for r in read if isinstance(r, str) for p in run_inputs(r, None) if p]
        check_outputs({what: path}, inputs)
        if report:  # its plots folder beside it: a file of that name, or one holding an input
            check_report(path, inputs)

    # -- history and sessions -------------------------------------------------------------------
    def remember_run(self) -> None:
        """Add the run just ended to the run list, and autosave the session."""
        record = self.current_record()
        if record is None:
            return
        from .session import MAX_RUNS

        self.history = (self.history + [record])[-MAX_RUNS:]
        self.history_index = len(self.history) - 1
        self._history_panel.set_runs(self.history, self.history_index)
        self.update_overlays()
        self._autosave_session()

    def update_overlays(self) -> None:
        """The other runs of the list on the plots, when their overlay is ticked."""
        import numpy as np

        from .panels.history_panel import short_label

        def prompt(record: dict[str, Any]) -> tuple[Any, ...]:
            s = record.get("settings", {})
            return tuple(s.get(k) for k in ("model", "context", "image", "query", "chat_template"))

        shown_prompt = (prompt(self.history[self.history_index])
                        if self.history_index is not None and self.history else None)
        runs = []
        if self._plots.overlay.isChecked():
            for i, record in enumerate(self.history):
                if i == self.history_index:
                    continue
                steps = record.get("steps", [])
                # (null in a record is NaN: the NaN rule of the summaries, never 0.0)
                series = {"linf": np.array([_real(s["linf"]) for s in steps]),
                          "tvd": np.array([_real(s["tvd"]) for s in steps]),
                          "match": np.array([float(bool(s["match"])) for s in steps])}
                other = shown_prompt is not None and prompt(record) != shown_prompt
                # (another prompt or model: its tokens are not this run's, said in its label)
                runs.append((short_label(record, i) + (" · other prompt" if other else ""),
                             series))
        shown = (short_label(self.history[self.history_index], self.history_index)
                 if self.history_index is not None and self.history else "this run")
        self._plots.set_overlays(runs, shown)

    def show_run(self, index: int) -> None:
        """Reopen a run of the history (no recomputation)."""
        if self._running() is not None or not 0 <= index < len(self.history):
            return
        from ..core.errors import UserError
        from .session import rebuild

        try:
            run = rebuild(self.history[index], f"run #{index + 1}")
        except UserError as exc:
            self._show_error(exc.words("window"))
            return
        self._show(index, run)

    def _show(self, index: int, run: RunRecord) -> None:
        from .report import fill_state

        with self._state.batch():  # the views redraw once, not once per step
            fill_state(self._state, run)
        self.history_index = index
        self._history_panel.set_runs(self.history, index)
        self.update_overlays()
        self._say(f"Showing run #{index + 1} (saved; not recomputed)")

    def remember_result(self) -> None:
        """The Dynamics tab or the Compile dialog has a new result: autosave the session (it
        holds them)."""
        self._autosave_session()

    def _session(self) -> dict[str, Any]:
        from .session import session_dict

        return session_dict(self._input_panel.save(), self._model_panel.save(), self.history,
                            self.history_index,
                            self._dynamics.record if self._dynamics is not None else None,
                            compiled=self.compiled)

    def _autosave_session(self) -> bool:
        """Write this window's autosave (never another session's: its first goes where no
        autosave is, `app.session.new_autosave_path`); returns whether it was written."""
        if not self._persistent:
            return False
        from ..core.errors import UserError
        from .session import new_autosave_path, save_session

        try:
            if self._autosave_file is None:
                self._autosave_file = new_autosave_path()
            save_session(self._autosave_file, self._session())
        except (UserError, OSError) as exc:
            log.warning("autosave failed: %s", exc)
            return False
        return True

    def closing(self) -> None:
        """A clean exit: this window's autosave goes, and those its user declined; a crashed
        session's that is still waiting for an answer stays, to be offered at the next start."""
        if not self._persistent:
            return
        for path in [self._autosave_file, *self._declined]:
            try:
                if path is not None:
                    path.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("cannot remove the autosave %s: %s", path, exc.strerror or exc)

    def save_session(self, path: str | None = None) -> bool:
        if path is None:
            path = dialogs.save_file(self._window, "session", "Save session",
                                     "ctxpatch-session.json", "ctxpatch session (*.json)")
            if not path:
                return False
        from ..core.errors import UserError
        from .session import save_session

        try:
            self.check_writes("the session", path)
        except UserError as exc:
            self._show_error(exc.words("window"))
            return False
        try:
            save_session(path, self._session())
        except (UserError, OSError) as exc:
            self._show_error(f"cannot save the session {path}: {exc}")
            return False
        self._say(f"Saved the session {path}")
        return True

    def open_session(self, path: str | None = None) -> bool:
        """Open a session file: a small one at once, a large one (over `SYNC_BYTES`) on the worker
        with progress, Esc cancelling. Returns whether it opened or started opening;
        ``session_opened(outcome)`` follows either way. A bad file is one line in the banner,
        and the window keeps what it showed."""
        if self._running() is not None:
            self._show_error("a job is running: cancel it (Esc) before opening a session")
            return False
        if path is None:
            path = dialogs.open_file(self._window, "session", "Open session",
                                     "ctxpatch session (*.json)")
            if not path:
                return False
        import os

        from ..core.errors import UserError
        from .session import load_session, shown_run

        try:
            size = os.stat(path).st_size
        except (OSError, ValueError):
            size = 0  # load_session says what is wrong
        if size > SYNC_BYTES:
            from .jobs import session_job

            self._pending_session = None
            self._start(session_job(path), "session", f"Opening the session {path}…")
            return True
        try:
            data = load_session(path)
            index, run = shown_run(data, f"the session {path}")
        except UserError as exc:
            self._show_error(exc.words("window"))
            self._session_opened("failed")
            return False
        self.apply_session(data, index, run)
        self._say(f"Opened the session {path}")
        self._session_opened("completed")
        return True

    def on_session_loaded(self, ready: SessionReady) -> None:
        """A large session, read and checked on the worker (``start``'s "session" job)."""
        self._pending_session = ready  # applied once the job has ended

    def on_session_job_finished(self, outcome: str) -> None:
        """The "session" job ended: show what it read, or say why nothing changed."""
        ready, self._pending_session = self._pending_session, None
        if outcome == "completed" and ready is not None:
            self._banner.hide()
            self.apply_session(ready.data, ready.index, ready.run)
            self._say(f"Opened the session {ready.path}")
        elif outcome == "cancelled":
            self._say("Opening the session cancelled; nothing changed")
        self._session_opened(outcome)

    def apply_session(self, data: dict[str, Any], index: int | None = None,
                      run: RunRecord | None = None, source: str = "the session") -> None:
        """Show a session checked by `app.session.load_session`; ``run`` is its shown run
        (``index``), rebuilt before anything changes (`app.session.shown_run`) when not given.

        Raises:
            UserError: the shown run cannot be rebuilt (the window is unchanged).
        """
        from .session import NOT_FROM_SESSIONS, shown_run

        if run is None:
            index, run = shown_run(data, source)
        options = {k: v for k, v in (data.get("options") or {}).items()
                   if k not in NOT_FROM_SESSIONS}
        if options:
            self._model_panel.restore(options, source)
        if data.get("inputs"):
            self._input_panel.restore(data["inputs"], source)
        self.history, self.history_index = list(data.get("runs") or []), index
        self.compiled = data.get("compile")  # (shown by Run > Compile the context…)
        self._history_panel.set_runs(self.history, index)
        if self._dynamics is not None:  # (checked with the session: `load_session`)
            self._dynamics.set_record(data.get("dynamics"))
        if index is not None and run is not None:
            self._show(index, run)

    def offer_autosave(self) -> None:
        """After a crash, the autosaved sessions are offered back, newest first, one at a time:
        each is kept until its user restores it (Restore) or declines it (the notice's ✕; it
        is then removed at a clean exit), so a session that crashes before its user answered
        loses neither. One that cannot be read is moved aside (``autosave.json.bad-<time>``)
        with a line in the banner: whatever is in it, the window starts."""
        if not self._persistent:
            return
        from .session import SessionError, autosave_files, load_session

        self._waiting, self._offered = [], None
        for path in autosave_files():
            if path == self._autosave_file:
                continue
            try:
                data = load_session(path)
            except SessionError as exc:
                self._autosave_unreadable(path, exc.problem)
                continue
            except Exception as exc:  # noqa: BLE001 - a bug here must not keep the window from starting
                log.error("reading the autosave failed\n%s", traceback.format_exc())
                self._autosave_unreadable(path, f"unreadable ({type(exc).__name__}; details in "
                                                "the log)")
                continue
            if data.get("runs"):
                self._waiting.append((path, data))
            elif path not in self._declined:  # nothing to restore: removed at a clean exit
                self._declined.append(path)
        self._offer_next()

    def _offer_next(self) -> None:
        from .session import saved_when

        self._offered = None
        if not self._waiting:
            return
        path, data = self._waiting.pop(0)
        self._offered = path
        when = saved_when(data)
        more = f" (then {len(self._waiting)} more)" if self._waiting else ""
        self._notice.offer(f"ctxpatch did not close cleanly last time: restore its "
                           f"{len(data['runs'])} run(s) and inputs"
                           + (f" (saved {when})" if when else "") + f"?{more}",
                           lambda: self._restore_autosave(path, data),
                           declined=lambda: self._decline(path))

    def _decline(self, path: Path) -> None:
        if path not in self._declined:
            self._declined.append(path)
        self._offer_next()

    def _restore_autosave(self, path: Path, data: dict[str, Any]) -> None:
        """Restore an autosave offered back, keeping the runs this window made meanwhile (the
        restored ones first, the list's last `app.session.MAX_RUNS`); the window's own
        autosave then holds them, and the restored file is no longer needed."""
        from ..core.errors import UserError
        from .session import MAX_RUNS, current_index

        if self._running() not in (None, "load"):  # a model may load meanwhile; not a run
            self._show_error("a job is running: cancel it (Esc) before restoring the autosave")
            return
        if data.get("dynamics") is None and self._dynamics is not None:
            data = {**data, "dynamics": self._dynamics.record}  # (this window's, kept)
        if data.get("compile") is None and self.compiled is not None:
            data = {**data, "compile": self.compiled}  # (likewise)
        if self.history:
            runs = list(data["runs"]) + self.history
            cut = max(0, len(runs) - MAX_RUNS)
            shown = (current_index(data) or 0) - cut
            data = {**data, "runs": runs[cut:], "current": shown if shown >= 0 else None}
        self._notice.hide()
        try:
            self.apply_session(data, source="the autosave")
        except UserError as exc:
            from .session import move_aside

            try:
                where = f"kept as {move_aside(path)}"
            except OSError as err:
                where = f"left as it is ({err.strerror or err})"
            self._show_error(f"cannot restore the autosave: {exc.words('window')}; {where}")
            self._offer_next()
            return
        self._say("Restored the autosave")
        if self._autosave_file is None:
            self._autosave_file = path  # this window's own from now on
        if self._autosave_session() and path != self._autosave_file:
            try:  # (its runs are in this window's autosave now)
                path.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("cannot remove the restored autosave %s: %s", path, exc)
        self._offer_next()

    def _autosave_unreadable(self, path: Path, problem: str) -> None:
        from .session import move_aside

        try:
            where = f"moved aside to {move_aside(path)}"
        except OSError as exc:  # left as it is: the next start says so again
            where = f"it could not be moved aside ({exc.strerror or exc})"
        log.warning("autosave %s is %s: %s", path, problem, where)
        self._show_error(f"The autosave of the last session is {problem} and cannot be "
                        f"restored: {where}")
