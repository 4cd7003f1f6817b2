"""Session files: the window's inputs, options and finished runs, to reopen without recomputing.

A session is data only: one JSON object (``format`` "ctxpatch-session", ``schema_version``),
written atomically, so a crash mid-save never corrupts an existing file. Runs are stored as their
run records (DESIGN.md "Run JSON"). The autosave is the same file in the user's state folder; it
is deleted on a clean exit, so finding it at start-up means the last session did not end well.

Reading one is checked against a pydantic schema (`Session` below, strict types, bounded ints,
nesting depth limited by pydantic-core's JSON parser) before anything in the window changes, so a
damaged, hostile or newer file is one `SessionError` naming what is wrong. Every field the window
or a report reads has a type here; the run options take theirs from `core.options`, so a value
added there is read here. Fields it only carries along (a newer writer's extras) are kept as they
are. Sessions of schema 0 (one run under ``run``) are read too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
)
from typing_extensions import NotRequired, TypedDict  # pydantic needs this TypedDict before 3.12

from ..core.errors import UserError
from ..core.options import (
    Absorb,
    DeviceMap,
    Dtype,
    Method,
    OnFault,
    OutputControl,
    PatchKind,
    Scope,
)

if TYPE_CHECKING:
    from ..core.records import Run

FORMAT = "ctxpatch-session"
SCHEMA_VERSION = 1
READS = (0, 1)  # the session schemas this ctxpatch opens
MAX_RUNS = 20
MAX_BYTES = 1 << 30  # a 9,000-token run of a 4-layer model takes about 30 MB
MAX_LAYERS = 1024


def autosave_path() -> Path:
    import platformdirs

    return Path(platformdirs.user_state_dir("ctxpatch", appauthor=False)) / "autosave.json"


def session_dict(inputs: dict[str, Any], options: dict[str, Any], runs: list[dict[str, Any]],
                 current: int | None) -> dict[str, Any]:
    return {"format": FORMAT, "schema_version": SCHEMA_VERSION,
            "saved": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "inputs": inputs, "options": options, "runs": runs[-MAX_RUNS:], "current": current}


def save_session(path: str | Path, session: dict[str, Any]) -> None:
    from ..core.export import write_json

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_json(path, session)


# -- the schema -----------------------------------------------------------------------------------
# TypedDicts, not models: the check keeps nothing (the data is used as read), and pydantic
# validates a 9,000-step run as dicts in a third of the time it takes to build models.
Int32 = Annotated[int, Field(ge=0, lt=2**31)]  # counts, positions, token ids (Qt and numpy ints)
TokenId = Annotated[int, Field(ge=-1, lt=2**31)]  # -1: a run without the unpatched control
Real = float | None  # JSON has no NaN or infinity: the writer stores them as null
LayerKey = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,5}$")]
#: strict types (no "1.5" for a number, no 1 for a boolean); unknown keys (a newer writer's) kept
_STRICT = ConfigDict(strict=True, extra="allow")


class _Token(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    id: TokenId
    text: str


class _Ranked(_Token):
    prob: Real


class _TopK(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    baseline: list[_Ranked]
    patched: list[_Ranked]
    control: list[_Ranked]


class _Control(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    token: _Token
    match: bool
    linf: Real
    tvd: Real


class _LayerInfo(TypedDict, total=False):  # core.compare._layer_info
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    entry_ratio: float
    unbounded: bool
    shift_norm: float
    block_error: Real
    div_by_one: Int32
    hard_case: bool
    zero_z: bool
    zero_h: bool
    zero_s: bool
    nonfinite: bool


class _Step(TypedDict):  # core.export.step_to_dict
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    step: Int32
    position: Int32
    baseline_token: _Token
    patched_token: _Token
    match: bool
    linf: Real
    tvd: Real
    logit_scale: Real
    control: _Control
    top_k: _TopK
    patch_norms: NotRequired[dict[LayerKey, dict[str, dict[str, Real]]]]
    layers: NotRequired[dict[LayerKey, _LayerInfo]]
    reduced_input_ids: list[Int32]
    reduced_position_ids: NotRequired[list[Int32] | None]
    seconds: NotRequired[dict[str, float]]


class _Segment(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    kind: str
    text: str
    ids: list[Int32]


class _Image(TypedDict):  # core.images.ImageInfo
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    path: str
    sha256: str
    width: Int32
    height: Int32
    format: str


class _Prompt(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    segments: list[_Segment]
    bos_id: NotRequired[Int32 | None]
    image: NotRequired[_Image | None]


def _run_settings() -> Any:
    """The run record's ``settings``: every `core.spec.RunSpec` field under its name, with its
    type as JSON carries it (each may be missing or null in an older record), and
    ``max_new_tokens``, which every writer has written."""
    from ..core.spec import json_types

    def constrained(hint: Any) -> Any:  # token counts are bounded like every count here
        return Int32 if hint is int else hint

    fields = {name: (Int32 if name == "max_new_tokens" else
                     NotRequired[constrained(hint) | None])  # type: ignore[valid-type]
              for name, hint in json_types().items()}
    schema = TypedDict("_RunSettings", fields)  # type: ignore[operator]
    schema.__pydantic_config__ = _STRICT  # type: ignore[attr-defined]
    return schema


class _ModelInfo(TypedDict, total=False):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    num_layers: Int32


class _Pooled(TypedDict, total=False):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    matches: Int32


class _Conditioning(TypedDict, total=False):  # core.results.conditioning, as shown in reports
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    max_abs_scale_patch: Real
    max_abs_scale_patch_at: dict[Literal["step", "layer"], Int32] | None
    max_entry_ratio: float
    bound: float
    unbounded_layers: Int32
    unbounded_steps: Int32
    hard_case_layers: Int32
    hard_case_steps: Int32


class _Summary(TypedDict, total=False):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    tokens: Int32
    patched: _Pooled | None
    control: _Pooled | None
    conditioning: _Conditioning | None


class _Plan(TypedDict):  # core.controllability.LayerPlan, rebuilt as LayerPlan(**plan)
    __pydantic_config__ = ConfigDict(strict=True, extra="forbid")  # type: ignore[misc]
    layer: Int32
    inputs: list[str]
    outputs: list[str]
    control: OutputControl
    conditions: list[str]
    warnings: list[str]
    frozen_bound: Real
    mixer: NotRequired[str]


class _Controllability(TypedDict, total=False):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    plan: list[_Plan]


def _steps_in_order(steps: list[_Step]) -> list[_Step]:
    """Steps are numbered 0, 1, 2, ... (the views index arrays by number), and name at most
    `MAX_LAYERS` layers between them (the views draw a layer x step matrix)."""
    for i, step in enumerate(steps):
        if step["step"] != i:
            raise ValueError(f"step {i} is numbered {step['step']}, not {i}")
    layers = set().union(*(s.get("patch_norms", {}) for s in steps),
                         *(s.get("layers", {}) for s in steps))
    if len(layers) > MAX_LAYERS:
        raise ValueError(f"the steps name {len(layers)} layers; a model has at most {MAX_LAYERS}")
    return steps


class _Run(TypedDict):  # DESIGN.md "Run JSON"
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    schema_version: Literal[1]
    settings: Any  # `_run_settings()`, set in `_schema`
    model: _ModelInfo
    prompt: _Prompt
    steps: Annotated[list[_Step], AfterValidator(_steps_in_order)]
    summary: NotRequired[_Summary]
    controllability: NotRequired[_Controllability | None]
    verification: NotRequired[dict[str, Any] | None]


class _Inputs(TypedDict, total=False):  # QtInputPanel.save()
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    context: str
    query: str
    max_new_tokens: Int32 | None
    chat_template: bool
    image: str | None


class _Options(TypedDict, total=False):  # QtModelPanel.save()
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    model: str | None
    recent: list[str]
    dtype: Dtype | None
    device: str | None  # DEVICES, or cuda:N
    method: Method | None
    absorb: Absorb | None
    scope: Scope | None
    layers: str | None
    output_control: OutputControl | None
    disabled: list[PatchKind]
    disable: list[PatchKind]
    on_fault: OnFault
    device_map: Literal["one device", DeviceMap] | None  # the panel's Placement
    max_memory: str | list[str] | None
    offload_folder: str | None


class Session(TypedDict):
    """A session file of schema 1, as this ctxpatch writes it (`session_dict`)."""

    __pydantic_config__ = _STRICT  # type: ignore[misc]
    format: Literal["ctxpatch-session"]
    schema_version: Literal[1]
    saved: NotRequired[str | None]
    inputs: NotRequired[_Inputs]
    options: NotRequired[_Options]
    runs: Annotated[list[_Run], Field(max_length=MAX_RUNS)]
    current: NotRequired[int | None]


_CHECK: dict[type, TypeAdapter[Session]] = {}  # per RunSpec class, built on first use (0.1 s)


def _check(data: dict[str, Any]) -> None:
    from ..core import spec

    cls = spec._current()
    if cls not in _CHECK:
        _Run.__annotations__["settings"] = _run_settings()
        _CHECK.clear()
        _CHECK[cls] = TypeAdapter(Session)
    _CHECK[cls].validate_python(data)


#: options a session never sets: they are given for one start only (QtModelPanel.restore)
NOT_FROM_SESSIONS = ("trust_remote_code", "allow_pickle")


# -- reading --------------------------------------------------------------------------------------
class SessionError(UserError):
    """A session that cannot be opened. ``problem`` completes "the session is ..." without the
    path, for messages that name the file their own way (the autosave)."""

    def __init__(self, path: str | Path, problem: str, advice: str = "") -> None:
        self.problem = problem
        super().__init__(f"the session {path} is {problem}" + (f": {advice}" if advice else ""))


def _where(loc: tuple[int | str, ...]) -> str:
    """pydantic's error location as a path into the file: ``runs[0].steps[12].linf``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "the top level"


def _first_problem(exc: ValidationError) -> str:
    """The first of pydantic's errors as "where: what, got what" (and how many more)."""
    error = exc.errors(include_url=False)[0]
    value = error.get("input")
    got = ""
    if value is None or isinstance(value, str | int | float) and error["type"] != "missing":
        got = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "…"
        got = f", got {got}"
    more = exc.error_count() - 1
    return (f"{_where(error['loc'])}: {error['msg'].removeprefix('Value error, ').rstrip('.')}"
            + got + (f"; and {more} more problem(s)" if more else ""))


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
        problem = _first_problem(exc)
        if legacy:  # name the run as that file does
            problem = problem.replace("runs[0]", "run", 1)
        raise SessionError(path, f"damaged ({problem})", ADVICE) from None
    return data


def rebuild(record: dict[str, Any], source: str) -> Run:
    """`core.records.run_from_record`, with the patch norms a record holds as null (NaN: JSON has
    none) read back as NaN, as the views and `core.results.conditioning` compute with floats."""
    from dataclasses import replace

    from ..core.records import run_from_record

    run = run_from_record(record, source)

    def floats(params: dict[str, Any]) -> dict[str, Any]:
        return {name: {k: math.nan if v is None else v for k, v in norms.items()}
                for name, norms in params.items()}

    if any(None in norms.values() for s in run.steps for params in s.patch_norms.values()
           for norms in params.values()):
        run = replace(run, steps=tuple(
            replace(s, patch_norms={layer: floats(p) for layer, p in s.patch_norms.items()})
            for s in run.steps))
    return run


def shown_run(data: dict[str, Any], source: str | Path) -> tuple[int | None, Run | None]:
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
