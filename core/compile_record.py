"""What every front end of ``compile`` shares (ANALYSIS.md A4): the request's checks, worded for
each front end, and the result's record (the JSON, the report, the window and its sessions),
with its schema. Torch-free: the command line checks a request before a model loads.

A request is refused in one line (`core.errors.UserError`) before any work when its rank is 0
or above the model's matrices (`check_rank`, once the model is known), its ridge is negative or
not finite, a sweep's rank is malformed, or it has no training or no held-out query: without a
held-out query the evaluation cannot say whether the compiled context generalises, which is what
compiling is for (`core.compile.compile_context` itself takes none, for tests and sweeps).

The record is `core.compile.Compiled.to_dict` plus ``curve``: one point per rank of a sweep
(``{rank, ridge, pooled: {train, held_out}}``), empty without one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import Field
from typing_extensions import NotRequired, TypedDict

from .errors import Cancelled, UserError
from .record import _STRICT, Int32, Real

#: how each front end names the request's inputs in a message
NAMES: dict[str, dict[str, str]] = {
    "cli": {"rank": "--rank", "ridge": "--ridge", "sweep": "--sweep", "query": "--query",
            "held_out": "--held-out", "max_new_tokens": "--max-new-tokens"},
    "python": {"rank": "rank", "ridge": "ridge", "sweep": "sweep", "query": "queries",
               "held_out": "held_out", "max_new_tokens": "max_new_tokens"},
    "window": {"rank": "Rank", "ridge": "Ridge", "sweep": "Sweep ranks",
               "query": "Training queries", "held_out": "Held-out queries",
               "max_new_tokens": "New tokens"},
}
Front = Literal["cli", "python", "window"]
MAX_SWEEP = 16  # ranks in one sweep: each is a whole fit


def parse_ranks(text: str, front: Front = "cli") -> list[int]:
    """A sweep's ranks from ``"1,2,4,8"`` (commas or spaces; sorted, repeats dropped)."""
    name = NAMES[front]["sweep"]
    parts = [p for p in text.replace(",", " ").split() if p]
    ranks = []
    for p in parts:
        try:
            ranks.append(int(p))
        except ValueError:
            raise UserError(f"{name}: {p!r} is not a rank: give whole numbers separated by "
                            "commas, e.g. 1,2,4,8,16") from None
    if not ranks and text.strip():
        raise UserError(f"{name}: give whole numbers separated by commas, e.g. 1,2,4,8,16")
    if len(set(ranks)) > MAX_SWEEP:
        raise UserError(f"{name}: {len(set(ranks))} ranks is too many for one sweep (each is a "
                        f"whole fit): give at most {MAX_SWEEP}")
    return sorted(set(ranks))


def check_request(queries: Sequence[str], held_out: Sequence[str], rank: int, ridge: float,
                  sweep: Sequence[int] = (), max_new_tokens: int = 8,
                  front: Front = "cli", context: str | None = None) -> None:
    """Refuse a bad request in one line before any work (the model's size: `check_rank`)."""
    n = NAMES[front]
    if context is not None and not context.strip():
        raise UserError("the context is empty: there is nothing to compile (type one)")
    for k in (rank, *sweep):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            what = n["rank"] if k == rank else n["sweep"]
            raise UserError(f"{what} must be at least 1, not {k}")
    if isinstance(ridge, bool) or not isinstance(ridge, int | float) or not math.isfinite(
            ridge) or ridge < 0:
        raise UserError(f"{n['ridge']} must be a finite number >= 0 (0: the exact fit), "
                        f"not {ridge}")
    if max_new_tokens < 1:
        raise UserError(f"{n['max_new_tokens']} must be at least 1, not {max_new_tokens}")
    if not [q for q in queries if q.strip()]:
        raise UserError(f"{n['query']}: give at least one training query")
    if not [q for q in held_out if q.strip()]:
        raise UserError(f"{n['held_out']}: give at least one held-out query (a question the fit "
                        "never sees), or nothing says whether the compiled context generalises")
    for q in (*queries, *held_out):
        if not q.strip():
            raise UserError(f"a query is empty (or only whitespace): remove it or fill it in "
                            f"({n['query']}, {n['held_out']})")


def check_rank(limit: int, rank: int, sweep: Sequence[int] = (), front: Front = "cli") -> None:
    """Refuse a rank above ``limit``, the smallest size of the matrices compiled
    (`core.compile.rank_limit`): a delta has no higher rank."""
    n = NAMES[front]
    for k in (rank, *sweep):
        if k > limit:
            what = n["rank"] if k == rank else n["sweep"]
            raise UserError(f"{what} {k} is above the size of this model's matrices (a delta's "
                            f"rank is at most {limit}): choose 1 to {limit}")


def curve_points(evaluations: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A sweep's points for the record: rank, ridge and the pooled scores of each."""
    return [{"rank": int(e["rank"]), "ridge": float(e["ridge"]), "pooled": e["pooled"]}
            for e in evaluations]


def compile_record(compiled: Any, sweep: Sequence[int] = (),
                   should_stop: Callable[[], bool] | None = None,
                   done: Callable[[int], None] | None = None) -> dict[str, Any]:
    """The record of a `core.compile.Compiled` (``to_dict``) with its sweep's ``curve``: each
    rank compiled anew at the compilation's ridge, in increasing order (``should_stop`` checked
    before each, ``done(rank)`` called after each)."""
    points = []
    for k in sorted(set(sweep)):
        if should_stop is not None and should_stop():
            raise Cancelled
        points.append(compiled.evaluate(ranks=[k])[0])
        if done is not None:
            done(k)
    record = dict(compiled.to_dict())
    record["curve"] = curve_points(points)
    return record


# -- the schema (sessions read it back: every field the window or a report reads) ---------------
class _Token(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    token: str
    match: bool
    linf: Real
    tvd: Real
    control_tvd: Real
    retained: Real


class _Score(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    query: str
    match: Int32
    tokens: Int32
    retained: Real
    linf: Real
    linf_relative: NotRequired[Real]
    tvd: Real
    control_tvd: NotRequired[Real]
    answer: str
    full_context_answer: str
    per_token: NotRequired[Annotated[list[_Token], Field(max_length=4096)]]


class _Pool(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    retained: Real
    match: Int32
    tokens: Int32


class _Pooled(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    train: _Pool
    held_out: _Pool


class _Point(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    rank: Annotated[int, Field(ge=1, lt=2**31)]
    ridge: Real
    pooled: _Pooled


class _Layer(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    layer: Int32
    residual: Real


class CompileRecord(TypedDict):
    """A compilation as `compile_record` writes it (sessions check theirs against it:
    `app.session.Session`)."""

    __pydantic_config__ = _STRICT  # type: ignore[misc]
    rank: Annotated[int, Field(ge=1, lt=2**31)]
    ridge: Real
    train: Annotated[list[_Score], Field(max_length=1024)]
    held_out: Annotated[list[_Score], Field(max_length=1024)]
    pooled: _Pooled
    layers: NotRequired[Annotated[list[_Layer], Field(max_length=100_000)]]
    adapter: NotRequired[str | None]
    context: NotRequired[str]
    positions: NotRequired[Int32]
    model: NotRequired[str | None]
    max_new_tokens: NotRequired[Int32]
    curve: NotRequired[Annotated[list[_Point], Field(max_length=MAX_SWEEP)]]
    seconds: NotRequired[Real]  # the window's: fit and evaluation, wall


def check_adapter_folder(folder: str, inputs: Sequence[str | None] = (),
                         empty_ok: bool = False, what: str = "--adapter") -> None:
    """Refuse, before any work, an adapter folder that would overwrite something: one that
    exists (``empty_ok``: one that exists and is not empty; the window's folder chooser makes
    empty ones), a file, one whose parent folder is missing, or one that is, lies in or holds
    an input of the run (the model's folder)."""
    import os
    from pathlib import Path

    from .outputs import _real, input_at

    if not folder.strip():
        raise UserError(f"{what} is empty: give a new folder's name")
    path = Path(os.path.expanduser(folder))
    source = input_at(path, inputs)
    if source is not None:
        raise UserError(f"{what} {folder} would overwrite {source}, which this run reads "
                        "(or holds it): choose a new folder elsewhere")
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            raise UserError(f"{what} {folder} is a file: give a new folder's name")
        if not empty_ok:
            raise UserError(f"{what} {folder} already exists: give a new folder's name (an "
                            "adapter is never written over another)")
        if any(path.iterdir()):
            raise UserError(f"{what} {folder} is not empty: choose an empty or new folder (an "
                            "adapter is never written over other files)")
        if not os.access(path, os.W_OK):
            raise UserError(f"cannot write {what} {folder}: the folder is not writable")
        return
    parent = _real(path).parent
    if not parent.is_dir():
        raise UserError(f"cannot write {what} {folder}: its parent folder {parent} does not "
                        "exist")
    if not os.access(parent, os.W_OK):
        raise UserError(f"cannot write {what} {folder}: folder {parent} is not writable")
