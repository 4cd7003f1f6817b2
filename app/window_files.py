"""What the window reads and writes: the run as JSON, CSV or a report; the run list (history,
reopened without recomputing, overlaid); sessions and the autosave offered back after a crash.

A mixin of `app.main_window.MainWindow`, whose panels, state and status it uses.
"""

from __future__ import annotations

import logging
from typing import Any

from PySide6.QtWidgets import QFileDialog

log = logging.getLogger("ctxpatch")


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
        from core.compare import Settings
        from core.controllability import record_section
        from core.export import run_record

        started = self.state.started
        extras = ("context", "query", "chat_template", "image")
        known = {k: v for k, v in started.settings.items() if k not in extras}
        extra = {k: started.settings[k] for k in extras if k in started.settings}
        extra.update(model=started.model.get("id"), dtype=started.model.get("dtype"),
                     device=started.model.get("device"))
        record = run_record(started.model, started.prompt, Settings.from_dict(known),
                            self.state.steps, extra)
        if started.plan:
            record["controllability"] = record_section(started.plan, self.state.steps)
        return record

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
            path, _ = QFileDialog.getSaveFileName(self, "Export", default, filters[kind])
            if not path:
                return False
        from core.errors import UserError
        from core.export import steps_csv, write_json, write_text

        try:
            if kind == "json":
                write_json(path, record)
            elif kind == "csv":
                write_text(path, steps_csv(self.state.steps))
            else:
                from pathlib import Path

                from app.report import write_report
                from core.records import run_from_record

                target = Path(path)
                self.status_label.setText(f"Writing the report {path}…")
                write_report(run_from_record(record), target,
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
        from app.session import MAX_RUNS

        self.history = (self.history + [record])[-MAX_RUNS:]
        self.history_index = len(self.history) - 1
        self.history_panel.set_runs(self.history, self.history_index)
        self._update_overlays()
        self._autosave_session()

    def _update_overlays(self) -> None:
        import numpy as np

        from app.panels.history_panel import short_label

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
        from app.report import fill_state
        from core.records import run_from_record

        fill_state(self.state, run_from_record(self.history[index]))
        self.history_index = index
        self.history_panel.set_runs(self.history, index)
        self._update_overlays()
        self.status_label.setText(f"Showing run #{index + 1} (saved; not recomputed)")

    def _session(self) -> dict[str, Any]:
        from app.session import session_dict

        return session_dict(self.input_panel.save(), self.model_panel.save(), self.history,
                            self.history_index)

    def _autosave_session(self) -> None:
        from app.session import autosave_path, save_session
        from core.errors import UserError

        try:
            save_session(autosave_path(), self._session())
        except (UserError, OSError) as exc:
            log.warning("autosave failed: %s", exc)

    def save_session(self, path: str | None = None) -> bool:
        if path is None:
            path, _ = QFileDialog.getSaveFileName(self, "Save session", "ctxpatch-session.json",
                                                  "ctxpatch session (*.json)")
            if not path:
                return False
        from app.session import save_session
        from core.errors import UserError

        try:
            save_session(path, self._session())
        except (UserError, OSError) as exc:
            self.show_error(f"cannot save the session {path}: {exc}")
            return False
        self.status_label.setText(f"Saved the session {path}")
        return True

    def open_session(self, path: str | None = None) -> bool:
        if self.busy:
            self.show_error("a job is running: cancel it (Esc) before opening a session")
            return False
        if path is None:
            path, _ = QFileDialog.getOpenFileName(self, "Open session", "",
                                                  "ctxpatch session (*.json)")
            if not path:
                return False
        from app.session import load_session
        from core.errors import UserError

        try:
            data = load_session(path)
        except UserError as exc:
            self.show_error(str(exc))
            return False
        self.apply_session(data)
        self.status_label.setText(f"Opened the session {path}")
        return True

    def apply_session(self, data: dict[str, Any]) -> None:
        if data.get("options"):
            self.model_panel.restore(data["options"])
        if data.get("inputs"):
            self.input_panel.restore(data["inputs"])
        self.history = list(data.get("runs", []))
        current = data.get("current")
        index = current if isinstance(current, int) and 0 <= current < len(self.history) else (
            len(self.history) - 1)
        self.history_panel.set_runs(self.history, index if self.history else None)
        if self.history:
            self.show_run(index)

    def offer_autosave(self) -> None:
        """After a crash, the autosaved session is offered back (deleted on a clean exit)."""
        from app.session import autosave_path, load_session
        from core.errors import UserError

        path = autosave_path()
        if not path.is_file():
            return
        try:
            data = load_session(path)
        except UserError as exc:
            log.warning("unreadable autosave: %s", exc)
            return
        if not data.get("runs"):
            return

        def restore() -> None:
            self.apply_session(data)
            self.notice.hide()

        self.notice.offer(f"ctxpatch did not close cleanly last time: restore its "
                          f"{len(data['runs'])} run(s) and inputs (saved {data.get('saved')})?",
                          restore)
