"""The run record (DESIGN.md "Run JSON"): one writer, one schema, one reader.

- `record_of` writes it, whichever front end ran the run (the command line, the Python API, the
  window, reproduce): the options resolved, the model, the prompt, every step, the summary, the
  controllability section and the wall time.
- `RECORD` is its schema (pydantic, strict types, bounded numbers), checked by `check_record`
  wherever a record is read back: a run's JSON, a session's runs, a reproduction's saved runs.
- `read_record` checks a record, migrates an older schema version (`MIGRATIONS`) and rebuilds
  it as a `RunRecord`: the prompt and frozen `StepResult`s (without patch vectors), so a saved
  run reopens without recomputing.

JSON has no NaN or infinity: the writer stores them as null and the reader gives them back as
NaN (`core.results.nan_max`'s rule: a NaN anywhere makes a summary NaN, never 0).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_type_hints

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
)
from typing_extensions import NotRequired, TypedDict  # pydantic needs this TypedDict before 3.12

from .errors import UserError
from .export import _finite
from .images import ImageInfo
from .options import OutputControl
from .prompt import Prompt, Segment
from .results import LayerInfo, Side, StepResult, TopK, summarize

if TYPE_CHECKING:
    from .controllability import LayerPlan
    from .spec import RunSpec

SCHEMA_VERSION = 1
#: older schema versions and how each becomes the next (none yet: 1 is the first)
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}
SUPPORTED_SCHEMAS = (*MIGRATIONS, SCHEMA_VERSION)
MAX_LAYERS = 1024


# -- the writer ------------------------------------------------------------------------------
def record_of(model: dict[str, Any], prompt: Prompt, spec: RunSpec,
              steps: Sequence[StepResult], plans: Sequence[LayerPlan] | None = None,
              wall: float | None = None, analysis: dict[str, Any] | None = None
              ) -> dict[str, Any]:
    """The run record, the same from every front end: the options resolved (``settings``: the
    spec, with the device the model ran on), the controllability section when the plan is
    known, the wall time when measured, and the analyses asked for (`core.analysis`).
    JSON-ready (NaN and infinities as null)."""
    from .controllability import record_section

    resolved = replace(spec, device=str(model.get("device", spec.device)))
    record = {
        "schema_version": SCHEMA_VERSION,
        "settings": resolved.to_dict(recorded=True),
        "model": model,
        "prompt": prompt.to_dict(),
        "steps": [step_to_dict(s) for s in steps],
        "summary": summarize(steps),
    }
    if plans is not None:
        record["controllability"] = record_section(plans, steps)
    if wall is not None:
        record["summary"]["seconds"]["wall"] = wall
    if analysis is not None:
        record["analysis"] = analysis
    return dict(_finite(record))


def step_to_dict(s: StepResult) -> dict[str, Any]:
    return {
        "step": s.step,
        "position": s.position,
        "baseline_token": {"id": s.baseline_token, "text": s.baseline_text},
        "patched_token": {"id": s.patched.token, "text": s.patched.text},
        "match": s.patched.match,
        "linf": s.patched.linf,
        "logit_scale": s.logit_scale,
        "tvd": s.patched.tvd,
        "control": {
            "token": {"id": s.control.token, "text": s.control.text},
            "match": s.control.match,
            "linf": s.control.linf,
            "tvd": s.control.tvd,
        },
        "top_k": {
            "baseline": s.baseline_top_k.to_list(),
            "patched": s.patched.top_k.to_list(),
            "control": s.control.top_k.to_list(),
        },
        "patch_norms": {str(k): v for k, v in s.patch_norms.items()},
        "layers": {str(k): v for k, v in s.layer_info.items()},
        "reduced_input_ids": list(s.reduced_input_ids),
        "reduced_position_ids": (None if s.reduced_position_ids is None
                                 else list(s.reduced_position_ids)),
        "seconds": s.seconds,
    }


# -- the schema ------------------------------------------------------------------------------
# TypedDicts, not models: the check keeps nothing (the data is used as read), and pydantic
# validates a 9,000-step run as dicts in a third of the time it takes to build models.
Int32 = Annotated[int, Field(ge=0, lt=2**31)]  # counts, positions, token ids (Qt and numpy ints)
TokenId = Annotated[int, Field(ge=-1, lt=2**31)]  # -1: a run without the unpatched control
Real = float | None  # JSON has no NaN or infinity: the writer stores them as null
#: a layer number as str(int) writes it ("01" would pass, then miss the lookups by str(layer))
LayerKey = Annotated[str, StringConstraints(pattern=r"^(0|[1-9][0-9]{0,4})$")]
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
    entry_ratio: Real  # (null: a NaN or infinity, as the writer stores them)
    unbounded: bool
    shift_norm: Real
    block_error: Real
    div_by_one: Int32
    hard_case: bool
    zero_z: bool
    zero_h: bool
    zero_s: bool
    nonfinite: bool


class _Step(TypedDict):  # step_to_dict
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


class _Place(TypedDict):  # a step and a layer, both (conditioning_line names them)
    __pydantic_config__ = ConfigDict(strict=True, extra="forbid")  # type: ignore[misc]
    step: Int32
    layer: Int32


class _Conditioning(TypedDict, total=False):  # core.results.conditioning, as shown in reports
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    max_abs_scale_patch: Real
    max_abs_scale_patch_at: _Place | None
    max_entry_ratio: Real
    bound: Real
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


class _LensPart(TypedDict):  # core.lens.lens_step: one part of one layer at one step
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    promoted: list[list[Any]]  # [text, logit, id]
    suppressed: list[list[Any]]
    emitted: Real


class _LensStep(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    step: Int32
    token: str
    layers: dict[LayerKey, dict[str, _LensPart | None]]


class _Lens(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    s: list[Real]
    steps: list[_LensStep]


class _Transfer(TypedDict):  # core.transfer.transfer; rows = source step, columns = target
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    retained: list[list[Real]]
    match: list[list[bool]]
    linf: list[list[Real]]
    relative_linf: list[list[Real]]
    scale: list[Real]
    mean: list[Real]
    mean_match: list[bool]
    previous: list[Real]  # (None at step 0)
    previous_match: list[bool | None]
    batched: bool


class _Analysis(TypedDict, total=False):  # core.analysis.analysis_section
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    lens: _Lens
    geometry: dict[str, Any]
    transfer: _Transfer


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
    analysis: NotRequired[_Analysis | None]

_RECORDS: dict[type, TypeAdapter[Any]] = {}  # per RunSpec class, built on first use (0.1 s)
#: held while a schema is built (the window's worker and its GUI thread both check records)
SCHEMA_LOCK = threading.RLock()


def record_schema() -> Any:
    """The run record's schema, with ``settings`` from the current `RunSpec` (`_run_settings`)."""
    _record_adapter()  # (builds it for the current RunSpec)
    return _Run


def _record_adapter() -> TypeAdapter[Any]:
    from . import spec

    cls = spec._current()
    with SCHEMA_LOCK:
        if cls not in _RECORDS:
            _Run.__annotations__["settings"] = _run_settings()
            _RECORDS.clear()
            _RECORDS[cls] = TypeAdapter(_Run)
        return _RECORDS[cls]


def _where(loc: tuple[int | str, ...]) -> str:
    """pydantic's error location as a path into the file: ``runs[0].steps[12].linf``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "the top level"


def first_problem(exc: ValidationError, prefix: str = "") -> str:
    """The first of pydantic's errors as "where: what, got what" (and how many more)."""
    error = exc.errors(include_url=False)[0]
    value = error.get("input")
    got = ""
    if value is None or isinstance(value, str | int | float) and error["type"] != "missing":
        got = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "…"
        got = f", got {got}"
    more = exc.error_count() - 1
    where = _where(error["loc"])
    where = f"{prefix}.{where}" if prefix and where != "the top level" else (prefix or where)
    return (f"{where}: {error['msg'].removeprefix('Value error, ').rstrip('.')}"
            + got + (f"; and {more} more problem(s)" if more else ""))


def check_record(record: Any, source: str = "the record") -> dict[str, Any]:
    """A record checked against its schema and migrated to `SCHEMA_VERSION`.

    Raises:
        UserError: not a run record, a newer or unknown schema, or a damaged one (naming the
            first problem and where it is).
    """
    if not isinstance(record, dict) or "schema_version" not in record:
        raise UserError(f"{source} is not a ctxpatch run (no schema_version)")
    version = record["schema_version"]
    if type(version) is not int or version not in SUPPORTED_SCHEMAS:
        raise UserError(f"{source} has run schema {version!r}; this ctxpatch reads "
                        f"{', '.join(map(str, SUPPORTED_SCHEMAS))}: update ctxpatch to open it")
    while version in MIGRATIONS:
        record = MIGRATIONS[version](record)
        version = record["schema_version"]
    try:
        _record_adapter().validate_python(record)
    except ValidationError as exc:
        raise UserError(f"{source} is damaged or incomplete ({first_problem(exc)}): re-export "
                        "it from the run, or open another file") from None
    return record


# -- the reader ------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunRecord:
    """A run read back, as the views and reports need it: settings, model description, prompt
    and steps (plain data, no patch vectors), and the record itself."""

    settings: dict[str, Any]
    model: dict[str, Any]
    prompt: Prompt
    steps: tuple[StepResult, ...]
    record: dict[str, Any]  # the record as read (summary, controllability, verification, ...)

    @property
    def spec(self) -> RunSpec:
        """The run's options (unknown keys of a newer writer dropped, with a warning)."""
        from .spec import RunSpec

        return RunSpec.from_dict(self.settings)


def _float(x: Any) -> float:
    return math.nan if x is None else float(x)


def _topk(items: list[dict[str, Any]]) -> Any:
    return TopK(tuple(int(i["id"]) for i in items), tuple(str(i["text"]) for i in items),
                tuple(_float(i["prob"]) for i in items))


def _side(token: dict[str, Any], match: bool, linf: Any, tvd: Any, top: list[Any]) -> Any:
    return Side(int(token["id"]), str(token["text"]), bool(match), _float(linf), _float(tvd),
                _topk(top))


#: a layer measure an older (or partial) record lacks: not measured (NaN), none counted
_UNMEASURED: dict[str, Any] = {name: {bool: False, int: 0}.get(kind, math.nan)
                               for name, kind in get_type_hints(LayerInfo).items()}


def step_from_dict(d: dict[str, Any], full_ids: tuple[int, ...]) -> Any:
    """One step of a record; ``full_ids`` is the full-context sequence up to this step."""
    c, top = d["control"], d["top_k"]
    return StepResult(
        step=int(d["step"]),
        position=int(d["position"]),
        baseline_token=int(d["baseline_token"]["id"]),
        baseline_text=str(d["baseline_token"]["text"]),
        baseline_top_k=_topk(top["baseline"]),
        logit_scale=_float(d["logit_scale"]),
        patched=_side(d["patched_token"], d["match"], d["linf"], d["tvd"], top["patched"]),
        control=_side(c["token"], c["match"], c["linf"], c["tvd"], top["control"]),
        full_input_ids=full_ids,
        reduced_input_ids=tuple(int(i) for i in d["reduced_input_ids"]),
        reduced_position_ids=(None if d.get("reduced_position_ids") is None
                              else tuple(int(i) for i in d["reduced_position_ids"])),
        patch_norms={int(k): {name: {m: _float(x) for m, x in norms.items()}
                              for name, norms in params.items()}
                     for k, params in d.get("patch_norms", {}).items()},
        layer_info={int(k): {**_UNMEASURED, **{f: math.nan if x is None else x
                                               for f, x in v.items()}}
                    for k, v in d.get("layers", {}).items()},
        seconds={k: float(v) for k, v in d.get("seconds", {}).items()},
    )


def read_record(record: Any, source: str = "the record", checked: bool = False) -> RunRecord:
    """Rebuild a run from its JSON record (`check_record` first, unless ``checked``: a session's
    runs are checked with the session).

    Raises:
        UserError: a record of another schema, or one with missing or malformed fields.
    """
    if not checked:
        record = check_record(record, source)
    try:
        segments = tuple(Segment(str(s["kind"]), str(s["text"]), tuple(int(i) for i in s["ids"]))
                         for s in record["prompt"]["segments"])
        bos = record["prompt"].get("bos_id")
        image = record["prompt"].get("image")
        prompt = Prompt(segments, bos_id=None if bos is None else int(bos),
                        image=None if image is None else ImageInfo.from_dict(image))
        full = list(prompt.full_ids)
        steps = []
        for d in record["steps"]:
            steps.append(step_from_dict(d, tuple(full)))
            full.append(int(d["baseline_token"]["id"]))
        return RunRecord(dict(record["settings"]), dict(record["model"]), prompt, tuple(steps),
                         record)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UserError(f"{source} is damaged or incomplete ({type(exc).__name__}: {exc}): "
                        "re-export it from the run, or open another file") from None
