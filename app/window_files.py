"""What the window reads and writes: the run as JSON, CSV or a report; the run list (history,
reopened without recomputing, overlaid); sessions and the autosave offered back after a crash.

A mixin of `app.main_window.MainWindow`, whose panels, state and status it uses.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

from ctxpatch.app import dialogs

log = logging.getLogger("ctxpatch")
#: session files larger than this open on the worker (about 300 tokens a megabyte: a 9,000-token
#: run is some 30 MB and takes seconds to check and rebuild)
SYNC_BYTES = 2 << 20


class WindowFiles:
    """Exports, history and sessions for the main window."""

    # provided by MainWindow
    state: Any
    history: list[dict[str, Any]]
    history_index: int | None
    history_panel: Any
    input_panel: Any
    model_panel: Any
    plots: Any
    notice: Any
    status_label: Any
    banner: Any
    session_opened: Any
    _kind: str
    _pending_session: Any

    def _start(self, job: Any, kind: str, message: str) -> None:  # provided by MainWindow
        raise NotImplementedError

    @property
    def busy(self) -> bool:  # provided by MainWindow
        raise NotImplementedError

    def show_error(self, message: str) -> None:  # provided by MainWindow
        raise NotImplementedError

    # -- exports --------------------------------------------------------------------------------
    def current_record(self) -> dict[str, Any] | None:
        """The shown run as a run record (DESIGN.md "Run JSON"), or None before any run."""
        if not self.state.steps or self.state.started is None:
            return None
        if getattr(self.state.started, "record", None) is not None:
            return self.state.started.record  # a run reopened from a session
        from ctxpatch.core.compare import Settings
        from ctxpatch.core.runs import record_of

        started = self.state.started
        extras = ("context", "query", "chat_template", "image")
        known = {k: v for k, v in started.settings.items() if k not in extras}
        extra = {k: started.settings[k] for k in extras if k in started.settings}
        extra.update(model=started.model.get("id"), dtype=started.model.get("dtype"),
                     device=started.model.get("device"))
        return record_of(started.model, started.prompt, Settings.from_dict(known),
                         self.state.steps, extra, started.plan or None)

    def export(self, kind: str, path: str | None = None) -> bool:
        """Write the current run as JSON, CSV or a report (HTML, or PDF by the file's suffix);
        returns whether a file was written."""
        record = self.current_record()
        if record is None:
            self.show_error("nothing to export yet: run a comparison first")
            return False
        if path is None:
            filters = {"json": "Run JSON (*.json)", "csv": "Per-token CSV (*.csv)",
                       "report": "HTML report (*.html);;PDF report (*.pdf)"}
            default = {"json": "ctxpatch-run.json", "csv": "ctxpatch-run.csv",
                       "report": "ctxpatch-report.html"}[kind]
            path = dialogs.save_file(self, "export", "Export", default, filters[kind])
            if not path:
                return False
        from ctxpatch.core.errors import UserError
        from ctxpatch.core.export import steps_csv, write_json, write_text

        try:
            if kind == "json":
                write_json(path, record)
            elif kind == "csv":
                write_text(path, steps_csv(self.state.steps))
            else:
                from pathlib import Path

                from ctxpatch.app.report import write_report
                from ctxpatch.app.session import rebuild

                target = Path(path)
                self.status_label.setText(f"Writing the report {path}…")
                write_report(rebuild(record, "the run"), target,
                             target.with_name(f"{target.stem}_plots"))
        except UserError as exc:
            self.show_error(str(exc))
            return False
        except OSError as exc:
            self.show_error(f"cannot write {path}: {exc.strerror or exc}")
            return False
        self.status_label.setText(f"Saved {path}")
        return True

    # -- history and sessions -------------------------------------------------------------------
    def _remember_run(self) -> None:
        record = self.current_record()
        if record is None:
            return
        from ctxpatch.app.session import MAX_RUNS

        self.history = (self.history + [record])[-MAX_RUNS:]
        self.history_index = len(self.history) - 1
        self.history_panel.set_runs(self.history, self.history_index)
        self._update_overlays()
        self._autosave_session()

    def _update_overlays(self) -> None:
        import numpy as np

        from ctxpatch.app.panels.history_panel import short_label

        runs = []
        if self.plots.overlay.isChecked():
            for i, record in enumerate(self.history):
                if i == self.history_index:
                    continue
                steps = record.get("steps", [])
                series = {"linf": np.array([float(s["linf"] or 0.0) for s in steps]),
                          "tvd": np.array([float(s["tvd"] or 0.0) for s in steps]),
                          "match": np.array([float(bool(s["match"])) for s in steps])}
                runs.append((short_label(record, i), series))
        shown = (short_label(self.history[self.history_index], self.history_index)
                 if self.history_index is not None and self.history else "this run")
        self.plots.set_overlays(runs, shown)

    def show_run(self, index: int) -> None:
        """Reopen a run of the history (no recomputation)."""
        if self.busy or not 0 <= index < len(self.history):
            return
        from ctxpatch.app.session import rebuild
        from ctxpatch.core.errors import UserError

        try:
            run = rebuild(self.history[index], f"run #{index + 1}")
        except UserError as exc:
            self.show_error(str(exc))
            return
        self._show(index, run)

    def _show(self, index: int, run: Any) -> None:
        from ctxpatch.app.report import fill_state

        with self.state.batch():  # the views redraw once, not once per step
            fill_state(self.state, run)
        self.history_index = index
        self.history_panel.set_runs(self.history, index)
        self._update_overlays()
        self.status_label.setText(f"Showing run #{index + 1} (saved; not recomputed)")

    def _session(self) -> dict[str, Any]:
        from ctxpatch.app.session import session_dict

        return session_dict(self.input_panel.save(), self.model_panel.save(), self.history,
                            self.history_index)

    def _autosave_session(self) -> None:
        from ctxpatch.app.session import autosave_path, save_session
        from ctxpatch.core.errors import UserError

        try:
            save_session(autosave_path(), self._session())
        except (UserError, OSError) as exc:
            log.warning("autosave failed: %s", exc)

    def save_session(self, path: str | None = None) -> bool:
        if path is None:
            path = dialogs.save_file(self, "session", "Save session", "ctxpatch-session.json",
                                     "ctxpatch session (*.json)")
            if not path:
                return False
        from ctxpatch.app.session import save_session
        from ctxpatch.core.errors import UserError

        try:
            save_session(path, self._session())
        except (UserError, OSError) as exc:
            self.show_error(f"cannot save the session {path}: {exc}")
            return False
        self.status_label.setText(f"Saved the session {path}")
        return True

    def open_session(self, path: str | None = None) -> bool:
        """Open a session file: a small one at once, a large one (over `SYNC_BYTES`) on the worker
        with progress, Esc cancelling. Returns whether it opened or started opening;
        ``session_opened(outcome)`` follows either way. A bad file is one line in the banner,
        and the window keeps what it showed."""
        if self.busy:
            self.show_error("a job is running: cancel it (Esc) before opening a session")
            return False
        if path is None:
            path = dialogs.open_file(self, "session", "Open session",
                                     "ctxpatch session (*.json)")
            if not path:
                return False
        import os

        from ctxpatch.app.session import load_session, shown_run
        from ctxpatch.core.errors import UserError

        try:
            size = os.stat(path).st_size
        except (OSError, ValueError):
            size = 0  # load_session says what is wrong
        if size > SYNC_BYTES:
            from ctxpatch.app.jobs import session_job

            self._pending_session = None
            self._start(session_job(path), "session", f"Opening the session {path}…")
            return True
        try:
            data = load_session(path)
            index, run = shown_run(data, f"the session {path}")
        except UserError as exc:
            self.show_error(str(exc))
            self.session_opened.emit("failed")
            return False
        self.apply_session(data, index, run)
        self.status_label.setText(f"Opened the session {path}")
        self.session_opened.emit("completed")
        return True

    def _on_session_loaded(self, ready: Any) -> None:
        self._pending_session = ready  # applied once the job has ended (`_session_finished`)

    def _session_finished(self, outcome: str) -> None:
        ready, self._pending_session = self._pending_session, None
        if outcome == "completed" and ready is not None:
            self.banner.hide()
            self.apply_session(ready.data, ready.index, ready.run)
            self.status_label.setText(f"Opened the session {ready.path}")
        elif outcome == "cancelled":
            self.status_label.setText("Opening the session cancelled; nothing changed")
        self.session_opened.emit(outcome)

    def apply_session(self, data: dict[str, Any], index: int | None = None, run: Any = None,
                      source: str = "the session") -> None:
        """Show a session checked by `app.session.load_session`; ``run`` is its shown run
        (``index``), rebuilt before anything changes (`app.session.shown_run`) when not given.

        Raises:
            UserError: the shown run cannot be rebuilt (the window is unchanged).
        """
        from ctxpatch.app.session import NOT_FROM_SESSIONS, shown_run

        if run is None:
            index, run = shown_run(data, source)
        options = {k: v for k, v in (data.get("options") or {}).items()
                   if k not in NOT_FROM_SESSIONS}
        if options:
            self.model_panel.restore(options)
        if data.get("inputs"):
            self.input_panel.restore(data["inputs"])
        self.history = list(data.get("runs") or [])
        self.history_panel.set_runs(self.history, index)
        if index is not None and run is not None:
            self._show(index, run)

    def offer_autosave(self) -> None:
        """After a crash, the autosaved session is offered back (deleted on a clean exit). One
        that cannot be read is moved aside (``autosave.json.bad-<time>``) with a line in the
        banner: whatever is in it, the window starts."""
        from ctxpatch.app.session import SessionError, autosave_path, load_session, saved_when

        path = autosave_path()
        try:
            if not (path.exists() or path.is_symlink()):
                return
            data = load_session(path)
        except SessionError as exc:
            self._autosave_unreadable(path, exc.problem)
            return
        except Exception as exc:  # noqa: BLE001 - a bug here must not keep the window from starting
            log.error("reading the autosave failed\n%s", traceback.format_exc())
            self._autosave_unreadable(path, f"unreadable ({type(exc).__name__}; details in "
                                            "the log)")
            return
        if not data.get("runs"):
            return
        when = saved_when(data)

        def restore() -> None:
            from ctxpatch.core.errors import UserError

            if self.busy and self._kind != "load":  # a model may load meanwhile; not a run
                self.show_error("a job is running: cancel it (Esc) before restoring the autosave")
                return
            self.notice.hide()
            try:
                self.apply_session(data, source="the autosave")
            except UserError as exc:
                self.show_error(f"cannot restore the autosave: {exc}")
                return
            self.status_label.setText("Restored the autosave")

        self.notice.offer(f"ctxpatch did not close cleanly last time: restore its "
                          f"{len(data['runs'])} run(s) and inputs"
                          + (f" (saved {when})" if when else "") + "?", restore)

    def _autosave_unreadable(self, path: Any, problem: str) -> None:
        from ctxpatch.app.session import move_aside

        try:
            where = f"moved aside to {move_aside(path)}"
        except OSError as exc:  # left as it is: the next start says so again
            where = f"it could not be moved aside ({exc.strerror or exc})"
        log.warning("autosave %s is %s: %s", path, problem, where)
        self.show_error(f"The autosave of the last session is {problem} and cannot be "
                        f"restored: {where}")
