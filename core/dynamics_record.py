"""Reading a context-dynamics record back (`core.dynamics.Dynamics.to_dict`, the ``--json`` file
and what a window session stores): checked against a strict schema, then against itself (every
layer's curves as long as the context), and rebuilt as a `Dynamics` without recomputing.

A record from a file can hold anything: a wrong type, a missing key, curves of the wrong length
or an absurd size is one `UserError` naming the place, never a traceback and never a half-read
result. Null (a NaN or infinity when written) reads back as NaN.
"""

from __future__ import annotations

import threading
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError
from typing_extensions import NotRequired, TypedDict  # pydantic needs this TypedDict before 3.12

from .dynamics import SCHEMA, Dynamics
from .errors import UserError
from .record import _STRICT, Int32, LayerKey, Real, TokenId, first_problem

#: the longest context a record may hold (a dynamics run is one comparison step per token)
MAX_TOKENS = 100_000
_Curve = Annotated[list[Real], Field(max_length=MAX_TOKENS + 1)]


class _Answer(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    id: TokenId
    text: str


class _Layer(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    norm: _Curve  # (n + 1,)
    increment: _Curve  # (n,)
    lens_logit: _Curve  # (n + 1,)
    attribution: NotRequired[_Curve]  # (derived: not read back)
    lens_logit_increment: NotRequired[_Curve]


class DynamicsRecord(TypedDict):
    """A dynamics record as `Dynamics.to_dict` writes it (the derived keys are not read back:
    they are computed again from ``layers``)."""

    __pydantic_config__ = _STRICT  # type: ignore[misc]
    schema: Literal["ctxpatch-dynamics/1"]
    context_tokens: Annotated[list[str], Field(min_length=1, max_length=MAX_TOKENS)]
    context_ids: Annotated[list[Int32], Field(min_length=1, max_length=MAX_TOKENS)]
    answer: _Answer
    prefix_tokens: Annotated[list[str], Field(max_length=MAX_TOKENS)]
    layers: Annotated[dict[LayerKey, _Layer], Field(max_length=4096)]
    attribution: NotRequired[_Curve]
    attribution_by_layer: NotRequired[Any]
    lens_logit: NotRequired[_Curve]
    settings: dict[str, Any]
    seconds: dict[str, Any]
    model: NotRequired[dict[str, Any]]


class DynamicsError(UserError):
    """A dynamics record that cannot be read; ``problem`` says what is wrong without naming the
    record (for messages that name it their own way: a session)."""

    def __init__(self, source: str, problem: str) -> None:
        self.problem = problem
        super().__init__(f"{source} is {problem}")


_LOCK = threading.Lock()
_CHECK: list[TypeAdapter[DynamicsRecord]] = []


def check_dynamics(data: Any, source: str = "the dynamics record") -> None:
    """Check a dynamics record's types and lengths (`DynamicsRecord`, then each layer's curves
    against the context's length).

    Raises:
        DynamicsError: ``source`` and the first thing wrong, in one line (a `UserError`).
    """
    with _LOCK:
        if not _CHECK:
            _CHECK.append(TypeAdapter(DynamicsRecord))
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise DynamicsError(source, f"not a context-dynamics record ({SCHEMA}), found "
                            f"{found!r}: write it again with ctxpatch dynamics")
    try:
        _CHECK[0].validate_python(data)
    except ValidationError as exc:
        raise DynamicsError(source, f"damaged ({first_problem(exc)})") from None
    n = len(data["context_ids"])
    for key, want in (("context_tokens", n), ("prefix_tokens", n)):
        if len(data[key]) != want:
            raise DynamicsError(source, f"damaged ({key} has {len(data[key])} entries for {n} "
                                        "context tokens)")
    for layer, entry in data["layers"].items():
        for key, want in (("norm", n + 1), ("increment", n), ("lens_logit", n + 1)):
            if len(entry[key]) != want:
                raise DynamicsError(source, f"damaged (layers.{layer}.{key} has "
                                            f"{len(entry[key])} values, not {want} for {n} "
                                            "context tokens)")


def read_dynamics(data: Any, source: str = "the dynamics record") -> Dynamics:
    """A dynamics record checked (`check_dynamics`) and rebuilt as a `Dynamics` (the patches are
    not in a record: ``patches`` is empty).

    Raises:
        DynamicsError: ``source`` and the first thing wrong, in one line (a `UserError`).
    """
    import numpy as np

    check_dynamics(data, source)
    layers = sorted(int(k) for k in data["layers"])

    def rows(key: str) -> np.ndarray:
        width = len(data["context_ids"]) + (0 if key == "increment" else 1)
        return np.array([[np.nan if x is None else float(x)
                          for x in data["layers"][str(layer)][key]] for layer in layers],
                        dtype=np.float64).reshape(len(layers), width)

    answer = data["answer"]
    return Dynamics(
        context_ids=tuple(data["context_ids"]), context_tokens=tuple(data["context_tokens"]),
        layers=tuple(layers), norm=rows("norm"), increment=rows("increment"),
        lens=rows("lens_logit"), answer=(answer["id"], answer["text"]),
        prefix_tokens=tuple(data["prefix_tokens"]), settings=dict(data["settings"]),
        seconds=dict(data["seconds"]), model=dict(data.get("model") or {}))


__all__ = ["MAX_TOKENS", "DynamicsError", "DynamicsRecord", "check_dynamics", "read_dynamics"]
