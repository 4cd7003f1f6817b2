"""What the engine's hooks read and write: a module's input or output tensor, and the query
(last) position of an activation. Shared by the dense and the mixture-of-experts hooks."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .patches import Rank1


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
        return x[..., -1, :].reshape(-1).detach().to(dtype, copy=True)
    return x.reshape(-1, x.shape[-1])[-1].detach().to(dtype, copy=True)


def first_row_query(x: Tensor, dtype: torch.dtype, rows: int) -> Tensor:
    """The query (last) position of batch row 0 of a ``(rows, seq, width)`` activation (or its
    ``(rows * seq, width)`` flattening), as a (width,) copy: the full-context row of a step
    that runs every row in one pass (`core.compare`)."""
    return x.reshape(rows, -1, x.shape[-1])[0, -1].detach().to(dtype, copy=True)


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


def keep_patched_rows(original: Tensor, patched: Tensor, last_only: bool, batch: int = 1
                      ) -> Tensor:
    """``patched`` where a patch acts, ``original`` elsewhere.

    With ``batch`` 1: every row, or with ``last_only`` the query (last) position only (of every
    stream of a (streams, 1, seq, width) activation). With a larger ``batch`` (the unpatched
    control batched before the patched row, `core.compare`), the rows are flattened to
    ``(batch * seq, width)`` and only the last element's rows (its last row with ``last_only``)
    take the patched values.
    """
    if batch > 1:
        o2, p2 = original.reshape(-1, original.shape[-1]), patched.reshape(-1, patched.shape[-1])
        tail = 1 if last_only else o2.shape[0] // batch
        out = o2.clone()
        out[-tail:] = p2[-tail:]
        return out.reshape(original.shape)
    if last_only and patched.shape[-2] > 1:  # (rows last but one: OPT flattens them)
        out = original.clone()
        out[..., -1:, :] = patched[..., -1:, :]
        return out
    return patched


def acts_on_one_row(y: Tensor, last_only: bool, batch: int = 1) -> bool:
    """Whether a patch acts on one row of ``y`` only, its last once flattened to ``(-1, width)``
    (the query of the last batch element: the decoding steps, or scope "query"), as
    `rank1_action` decides for a ``y`` whose leading dimensions are the run's ``batch`` rows
    (`keep_patched_rows` with ``batch`` 1 and ``last_only`` would take every leading element's
    last row of a (several, seq, width) one; the engine's activations have one). Not for
    (streams, 1, seq, width) ones."""
    if y.dim() > 3:
        return False
    return last_only or y.numel() // y.shape[-1] == batch


def with_last_row(original: Tensor, row: Tensor) -> Tensor:
    """A copy of ``original`` whose last row (flattened to ``(-1, width)``) is ``row``, cast to
    ``original``'s dtype: `keep_patched_rows` where `acts_on_one_row` holds, given the patched
    row alone."""
    out = original.clone(memory_format=torch.contiguous_format)
    out.view(-1, out.shape[-1])[-1] = row.reshape(-1)
    return out


def rank1_row(x_q: Tensor, y_q: Tensor, r: Rank1) -> Tensor:
    """``y_q + u (a . x_q)`` for one row in the patch dtype (what `rank1_action` writes there)."""
    return y_q + (x_q @ r.a) * r.u


def rank1_action(x: Tensor, y: Tensor, r: Rank1, last_only: bool, batch: int = 1,
                 rows: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """``y + u (a . x)`` on every row of a ``(..., rows, width)`` activation (batch is 1; MoE
    and OPT modules see the rows flattened), or on the last row only (the query, as in
    `query_row`); with ``batch`` > 1 on the last batch element's rows only (the others are the
    unpatched control's, `keep_patched_rows`). Computed in the patch dtype, cast back to ``y``'s
    dtype. ``rows``: the query rows of ``x`` and ``y`` in the patch dtype, when the caller has
    them (used where the patch acts on that row alone)."""
    if rows is not None and acts_on_one_row(y, last_only, batch):
        return with_last_row(y, rank1_row(*rows, r))
    ct = r.u.dtype
    x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
    if batch > 1:
        tail = 1 if last_only else y2.shape[0] // batch
        out = y2.clone()
        out[-tail:] = (y2[-tail:].to(ct) + (x2[-tail:].to(ct) @ r.a)[:, None] * r.u).to(y.dtype)
    elif last_only:
        out = y2.clone()
        out[-1] = (y2[-1].to(ct) + (x2[-1].to(ct) @ r.a) * r.u).to(y.dtype)
    else:
        out = (y2.to(ct) + (x2.to(ct) @ r.a)[:, None] * r.u).to(y.dtype)
    return out.reshape(y.shape)
