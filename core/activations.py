"""What the engine's hooks read and write: a module's input or output tensor, and the query
(last) position of an activation. Shared by the dense and the mixture-of-experts hooks."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def first_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    if args and isinstance(args[0], Tensor):
        return args[0]
    if isinstance(kwargs.get("hidden_states"), Tensor):
        return kwargs["hidden_states"]
    return next(v for v in kwargs.values() if isinstance(v, Tensor))


def first_output(output: Any) -> Tensor:
    return output[0] if isinstance(output, tuple | list) else output


def replace_output(output: Any, new: Tensor) -> Any:
    if isinstance(output, tuple):
        return (new, *output[1:])
    if isinstance(output, list):
        return [new, *output[1:]]
    return new


def query_row(x: Tensor, dtype: torch.dtype) -> Tensor:
    """The query (last) position of a (1, seq, width) or (seq, width) activation, as a (width,)
    copy (batch is 1: MoE modules see the same rows flattened); of a (streams, 1, seq, width) one
    (Gemma 3n's AltUp streams, a decoder layer's output) every stream's, concatenated."""
    if x.dim() > 3:
        return x[..., -1, :].reshape(-1).detach().to(dtype).clone()
    return x.reshape(-1, x.shape[-1])[-1].detach().to(dtype).clone()


def last_rows(original: Any, patched: Any, last_only: bool) -> Any:
    """With ``last_only``, keep every row of a (seq, ...) output but the last from ``original``."""
    if not last_only:
        return patched
    if isinstance(original, tuple):
        return tuple(last_rows(o, p, True) for o, p in zip(original, patched, strict=True))
    if original.shape[0] <= 1:
        return patched
    out = original.clone()
    out[-1:] = patched[-1:]
    return out
