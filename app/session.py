"""Session files: the window's inputs, options and finished runs, to reopen without recomputing.

A session is data only: one JSON object (``format`` "ctxpatch-session", ``schema_version``),
written atomically, so a crash mid-save never corrupts an existing file. Runs are stored as their
run records (DESIGN.md "Run JSON"). The autosave is the same file in the user's state folder; it
is deleted on a clean exit, so finding it at start-up means the last session did not end well.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from core.errors import UserError

FORMAT = "ctxpatch-session"
SCHEMA_VERSION = 1
MAX_RUNS = 20


def autosave_path() -> Path:
    import platformdirs

    return Path(platformdirs.user_state_dir("ctxpatch", appauthor=False)) / "autosave.json"


def session_dict(inputs: dict[str, Any], options: dict[str, Any], runs: list[dict[str, Any]],
                 current: int | None) -> dict[str, Any]:
    return {"format": FORMAT, "schema_version": SCHEMA_VERSION,
            "saved": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "inputs": inputs, "options": options, "runs": runs[-MAX_RUNS:], "current": current}


def save_session(path: str | Path, session: dict[str, Any]) -> None:
    from core.export import write_json

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_json(path, session)


def load_session(path: str | Path) -> dict[str, Any]:
    """Read a session file; any problem is one `UserError` naming the file and what to do."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot read the session {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except ValueError:
        raise UserError(f"the session {path} is damaged (not complete JSON): open another "
                        "session or an autosave") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UserError(f"{path} is not a ctxpatch session")
    version = data.get("schema_version")
    if version == 0:  # sessions of ctxpatch 0.0: one run under "run", no options
        data = {**data, "schema_version": 1, "runs": [data["run"]] if data.get("run") else [],
                "options": {}, "current": 0 if data.get("run") else None}
    elif version != SCHEMA_VERSION:
        raise UserError(f"{path} has session schema {version!r}; this ctxpatch reads "
                        f"{SCHEMA_VERSION}: update ctxpatch to open it")
    runs = data.get("runs")
    if not isinstance(runs, list):
        raise UserError(f"the session {path} is damaged (no list of runs)")
    from core.records import run_from_record

    for i, record in enumerate(runs):  # check every run now, not when it is shown
        run_from_record(record, f"run {i + 1} of the session {path}")
    return data
