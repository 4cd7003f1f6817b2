"""Session files: the window's inputs, options and finished runs, to reopen without recomputing.

A session is data only: one JSON object (``format`` "ctxpatch-session", ``schema_version``),
written atomically, so a crash mid-save never corrupts an existing file. Runs are stored as their
run records (DESIGN.md "Run JSON"). The autosave is the same file in the user's state folder; it
is deleted on a clean exit, so finding it at start-up means the last session did not end well.
It is kept, and offered back at each start, until its user restores or declines it; a window that
starts meanwhile writes its own beside it (`autosave_files`, `new_autosave_path`).

Reading one is checked against a pydantic schema (`Session` below, strict types, bounded ints,
nesting depth limited by pydantic-core's JSON parser) before anything in the window changes, so a
damaged, hostile or newer file is one `SessionError` naming what is wrong. Every field the window
or a report reads has a type here; the run options take theirs from `core.options`, so a value
added there is read here. Fields it only carries along (a newer writer's extras) are kept as they
are. Sessions of schema 0 (one run under ``run``) are read too.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError
from typing_extensions import NotRequired, TypedDict  # pydantic needs this TypedDict before 3.12

from ..core.compile_record import CompileRecord
from ..core.dynamics_record import DynamicsRecord
from ..core.errors import UserError
from ..core.options import DeviceMap, PatchKind
from ..core.record import _STRICT, SCHEMA_LOCK, Int32, _Run, first_problem, record_schema

if TYPE_CHECKING:
    from ..core.record import RunRecord

FORMAT = "ctxpatch-session"
SCHEMA_VERSION = 1
READS = (0, 1)  # the session schemas this ctxpatch opens
MAX_RUNS = 20
MAX_BYTES = 1 << 30  # a 9,000-token run of a 4-layer model takes about 30 MB


def autosave_path() -> Path:
    import platformdirs

    return Path(platformdirs.user_state_dir("ctxpatch", appauthor=False)) / "autosave.json"


def autosave_files() -> list[Path]:
    """The autosaves beside `autosave_path`, newest first: each is a session that did not close
    cleanly (``autosave.json``, and ``autosave-<time>.json``, written by a window that started
    while an older one waited for its user to decide: `new_autosave_path`)."""
    folder = autosave_path().parent
    try:
        found = [p for p in folder.iterdir()
                 if p.name == "autosave.json" or (p.name.startswith("autosave-")
                                                  and p.name.endswith(".json"))]
    except OSError:  # no folder yet
        return []

    def when(p: Path) -> float:
        try:
            return p.lstat().st_mtime
        except OSError:
            return 0.0

    return sorted(found, key=lambda p: (when(p), p.name), reverse=True)


def new_autosave_path() -> Path:
    """Where a window writes its first autosave: `autosave_path` when it is free, else a new
    ``autosave-<time>.json`` beside it (a file there is another session's, kept until its user
    restores or declines it)."""
    import os

    path = autosave_path()
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    n = 0
    while path.exists() or path.is_symlink():
        n += 1
        path = path.with_name(f"autosave-{stamp}-{os.getpid()}" + (f"-{n}" if n > 1 else "")
                              + ".json")
    return path


def session_dict(inputs: dict[str, Any], options: dict[str, Any], runs: list[dict[str, Any]],
                 current: int | None, dynamics: dict[str, Any] | None = None,
                 compiled: dict[str, Any] | None = None) -> dict[str, Any]:
    """A session; ``dynamics``: the Dynamics tab's result (`core.dynamics.Dynamics.to_dict`),
    left out when there is none (a session without it opens with the tab empty); ``compiled``:
    the last compilation's record (`core.compile_record`), likewise."""
    return {"format": FORMAT, "schema_version": SCHEMA_VERSION,
            "saved": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "inputs": inputs, "options": options, "runs": runs[-MAX_RUNS:], "current": current,
            **({"dynamics": dynamics} if dynamics is not None else {}),
            **({"compile": compiled} if compiled else {})}


def save_session(path: str | Path, session: dict[str, Any]) -> None:
    from ..core.export import write_json

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_json(path, session)


# -- the schema -----------------------------------------------------------------------------------
# A run is checked by core's run-record schema (`core.record`); the window's own parts are here.
class _Inputs(TypedDict, total=False):  # QtInputPanel.save()
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    context: str
    query: str
    max_new_tokens: Int32 | None
    chat_template: bool
    image: str | None


def _options() -> Any:
    """The model panel's saved options (`QtModelPanel.save`): its `core.spec.RunSpec` fields
    with their types (null allowed where the panel may leave one empty), and the panel's own:
    the recent models, its placement ("one device" or a device map), max memory as typed."""
    from ..core.spec import json_types

    types = json_types()
    fields: dict[str, Any] = {name: NotRequired[types[name] | None]  # type: ignore[valid-type]
                              for name in ("model", "dtype", "device", "method", "absorb",
                                           "scope", "layers", "output_control",
                                           "offload_folder")}
    fields.update(disabled=NotRequired[types["disabled"]],
                  on_fault=NotRequired[types["on_fault"]],
                  disable=NotRequired[list[PatchKind]],  # (what 0.1 wrote for disabled)
                  recent=NotRequired[list[str]],
                  device_map=NotRequired[Literal["one device", DeviceMap] | None],
                  max_memory=NotRequired[str | list[str] | None])
    schema = TypedDict("_Options", fields)  # type: ignore[operator]
    schema.__pydantic_config__ = _STRICT  # type: ignore[attr-defined]
    return schema


class Session(TypedDict):
    """A session file of schema 1, as this ctxpatch writes it (`session_dict`)."""

    __pydantic_config__ = _STRICT  # type: ignore[misc]
    format: Literal["ctxpatch-session"]
    schema_version: Literal[1]
    saved: NotRequired[str | None]
    inputs: NotRequired[_Inputs]
    options: NotRequired[Any]  # `_options()`, set in `_check`
    runs: Annotated[list[_Run], Field(max_length=MAX_RUNS)]
    current: NotRequired[int | None]
    compile: NotRequired[CompileRecord | None]  # Run > Compile the context…'s last result
    #: the Dynamics tab's result (`core.dynamics_record.DynamicsRecord`, its lengths checked
    #: after: `_check_dynamics`); absent from sessions written before it existed
    dynamics: NotRequired[DynamicsRecord | None]


_CHECK: dict[type, TypeAdapter[Session]] = {}  # per RunSpec class, built on first use (0.1 s)


def _check(data: dict[str, Any]) -> None:
    from ..core import spec

    cls = spec._current()
    with SCHEMA_LOCK:  # (a session is read on the worker, a record checked on the GUI thread)
        if cls not in _CHECK:
            record_schema()  # (its settings from the current RunSpec)
            Session.__annotations__["options"] = NotRequired[_options()]
            _CHECK.clear()
            _CHECK[cls] = TypeAdapter(Session)
        check = _CHECK[cls]
    check.validate_python(data)


#: options a session never sets: they are given for one start only (QtModelPanel.restore)
NOT_FROM_SESSIONS = ("trust_remote_code", "allow_pickle")


# -- reading --------------------------------------------------------------------------------------
class SessionError(UserError):
    """A session that cannot be opened. ``problem`` completes "the session is ..." without the
    path, for messages that name the file their own way (the autosave)."""

    def __init__(self, path: str | Path, problem: str, advice: str = "") -> None:
        self.problem = problem
        super().__init__(f"the session {path} is {problem}" + (f": {advice}" if advice else ""))


def _upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """A schema-0 session (ctxpatch 0.0: one run under "run", no options) as schema 1."""
    run = data.get("run")
    return {**{k: v for k, v in data.items() if k != "run"}, "schema_version": 1,
            "runs": [run] if run else [], "options": {}, "current": 0 if run else None}


ADVICE = "open another session or an autosave"


def load_session(path: str | Path,
                 should_stop: Callable[[], bool] | None = None) -> dict[str, Any]:
    """Read a session file and check it against `Session`; returns it as schema 1 (the JSON data
    as written, so that a reopened run exports exactly as it was saved).

    Args:
        should_stop: checked between reading and checking (the window's worker: Esc cancels).

    Raises:
        SessionError: the file cannot be read, is not a session, is newer, or is damaged.
        Cancelled: ``should_stop()`` answered True.
    """
    import pydantic_core

    p = Path(path)
    try:
        if not p.is_file():  # a folder, a FIFO (reading would block), a device
            raise SessionError(path, "missing" if not p.exists() else "not a file")
        size = p.stat().st_size
        if size > MAX_BYTES:
            raise SessionError(path, f"too large to be a session ({size >> 20} MB)")
        raw = p.read_bytes()
    except OSError as exc:
        raise SessionError(path, f"unreadable ({exc.strerror or exc})") from None
    try:  # in Rust: not UTF-8, truncated, or nested too deeply is a ValueError, never a crash
        data = pydantic_core.from_json(raw.removeprefix(b"\xef\xbb\xbf"))
    except ValueError as exc:
        what = "nested too deeply" if "recursion" in str(exc) else f"not JSON: {exc}"
        raise SessionError(path, f"damaged ({what})", ADVICE) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise SessionError(path, f'not a ctxpatch session (no "format": "{FORMAT}")')
    version = data.get("schema_version")
    if type(version) is not int or version not in READS:
        reads = " and ".join(map(str, READS))
        if type(version) is int and version > SCHEMA_VERSION:
            raise SessionError(path, f"of session schema {version}, newer than this ctxpatch "
                               f"reads ({reads})", "update ctxpatch to open it")
        raise SessionError(path, f"of session schema {version!r}, which no ctxpatch writes "
                           f"(this one reads {reads})", ADVICE)
    legacy = version == 0
    if legacy:
        data = _upgrade(data)
    if should_stop is not None and should_stop():
        from ..core.errors import Cancelled

        raise Cancelled
    try:
        _check(data)
    except ValidationError as exc:
        problem = first_problem(exc)
        if legacy:  # name the run as that file does
            problem = problem.replace("runs[0]", "run", 1)
        raise SessionError(path, f"damaged ({problem})", ADVICE) from None
    if data.get("dynamics") is not None:
        from ..core.dynamics_record import DynamicsError, check_dynamics

        try:
            check_dynamics(data["dynamics"], "its dynamics")
        except DynamicsError as exc:
            raise SessionError(path, f"{exc.problem.replace('(', '(dynamics: ', 1)}",
                               ADVICE) from None
    return data


def rebuild(record: dict[str, Any], source: str) -> RunRecord:
    """A checked session's run rebuilt (`core.record.read_record`; the session's check has
    checked it)."""
    from ..core.record import read_record

    return read_record(record, source, checked=True)


def shown_run(data: dict[str, Any], source: str | Path
              ) -> tuple[int | None, RunRecord | None]:
    """The index of the run a checked session shows, and that run rebuilt (`rebuild`), or
    (None, None) for a session without runs."""
    index = current_index(data)
    if index is None:
        return None, None
    return index, rebuild(data["runs"][index], f"run {index + 1} of {source}")


def current_index(data: dict[str, Any]) -> int | None:
    """Which run of a checked session is shown: ``current`` when it names one, else the last."""
    runs, current = data.get("runs") or [], data.get("current")
    if not runs:
        return None
    return current if isinstance(current, int) and 0 <= current < len(runs) else len(runs) - 1


def saved_when(data: dict[str, Any]) -> str:
    """The session's "saved" time for a message ("" when missing or not a time)."""
    try:
        when = datetime.fromisoformat(str(data.get("saved")))
        return (when.astimezone() if when.tzinfo else when).strftime("%Y-%m-%d %H:%M")
    except (ValueError, OverflowError):  # not a time, or year 1 in a timezone west of UTC
        return ""


def move_aside(path: Path) -> Path:
    """Rename an unreadable autosave to ``autosave.json.bad-<time>`` beside it, so that it stops
    getting in the way but is still there to look at; returns the new path.

    Raises:
        OSError: it cannot be renamed (it is then left as it is).
    """
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.bad-{stamp}")
    n = 1
    while target.exists() or target.is_symlink():
        n += 1
        target = path.with_name(f"{path.name}.bad-{stamp}-{n}")
    path.rename(target)
    return target
