"""Transfer (../shared/ANALYSIS.md A3): does the patch set of one token work at another?

For a finished run that kept its patches, every source step s and target step t: step s's whole
patch set, unchanged, acts on step t's reduced input (step t's ids and positions; scope "query"
as `core.verify` does it: the reduced prefix runs unpatched into a KV cache, the last token
patched), giving logits ``q_{s->t}``. With ``p_t`` the full-context distribution at t
(recomputed along the run by a cached full-context forward, one token per step, as verify feeds
it) and ``q_{0,t}`` the unpatched control at t:

    R(s->t) = 1 - TVD(p_t, q_{s->t}) / TVD(p_t, q_{0,t})

(1: the context's whole effect, 0: none, negative: harm), with the token match (argmax equal to
the full-context argmax) and the L-inf (max |logit difference|, also relative to the logit scale
max |p_t logits|). Two more rows: the **mean patch** (the average of every step's patch set;
rank-1 patches average as matrices, ``sum_s u_s a_s^T / T``) and the **previous step's** patch
(s = t - 1, none at t = 0), as curves over t.

Two paths give the same numbers (to rounding):

- batched (the default): for a target t, the T sources, the mean patch and the control run as
  the batch rows of one forward (chunks of `ROWS`); forward hooks apply each row's own patches:
  ``y[b] += u_b (x[b] . a_b)`` for a matrix (nn.Linear, and transformers' Conv1D whose weight is
  stored (in, out): the patch's u runs along its input there), ``+ delta_b`` for a Linear's
  bias, and for any other vector (a norm's scale or bias, Gemma's post-norms) the module's own
  forward again on that row with its parameter ``+ delta_b`` (`torch.func.functional_call`, so
  ``N(h)`` is the norm's own normalisation, rounding included). T passes instead of T^2.
  (An additive ``+ dm_b * N(h)[b]`` for the post-norm scales was tried: on the float64 Gemma 3
  test it put the diagonal ~1e-6 of the logit scale off the full-context logits, against ~4e-8
  this way, since Gemma's RMSNorm computes in float32 inside a float64 model; on float32 runs
  whose scale patches are unbounded, |dm| up to 3e7 on the demo with method "direct", neither
  reproduces even the diagonal: upstream rounding of N(h) times such dm is O(1), which the
  run's conditioning line warns of, and verify fails there too. Method "stable" bounds them.)
- written weights (`core.verify.materialized`): one pass per (source, target), the patches
  written into the parameters and restored in ``finally``. The reference the tests compare the
  batched path with, and the fallback wherever the hooks cannot act: patches of a slice of a
  fused parameter (MoE experts' stacked weights, ``name[e]``: tokens are routed across the batch
  there, so no per-row action exists), any other matrix parameter, and, with scope "query", a
  cache that is not attention only (recurrent states cannot be repeated per row). The fallback
  is exact, only slower (T^2 + 2T passes).

Progress (``progress(done, total)``) and cancel (``should_stop``, `Cancelled`) between passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from .errors import Cancelled, UserError
from .forward import (
    attention_only,
    last_logits,
    rolled_back,
)
from .loading import LoadedModel
from .results import StepResult
from .verify import _Fed, materialized, patches_of_steps

#: the most batch rows of one batched forward (T sources + the mean patch + the control)
ROWS = 32

Patches = dict[tuple[str, int | None], dict[str, Tensor]]


class _Unbatchable(Exception):
    """A hook met a batch it cannot split by rows (tokens flattened across rows)."""


def mean_patches(sets: Sequence[Patches]) -> Patches:
    """The average of patch sets as written weights: a rank-1 patch's matrix ``u v^T`` summed
    over the sets and divided by their count (a dense ``delta``, not one rank-1 factor), a
    vector delta averaged; a parameter missing from a set counts as zero there."""
    n = len(sets)
    out: Patches = {}
    for patches in sets:
        for key, parts in patches.items():
            d = (parts["delta"] if "delta" in parts
                 else torch.outer(parts["u"], parts["v"]))
            slot = out.setdefault(key, {"delta": torch.zeros_like(d)})
            slot["delta"] = slot["delta"] + d
    return {key: {"delta": parts["delta"] / n} for key, parts in out.items()}


def _is_conv1d(module: torch.nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def hookable(model: torch.nn.Module, patches: Patches) -> bool:
    """Whether the batched hooks can apply every one of these patches (see the module's
    docstring for what they cannot)."""
    for name, index in patches:
        if index is not None or "." not in name:
            return False
        owner, pname = name.rsplit(".", 1)
        try:
            module = model.get_submodule(owner)
        except AttributeError:
            return False
        param = getattr(module, pname, None)
        if not isinstance(param, torch.Tensor):
            return False
        if param.ndim == 2 and not (pname == "weight" and (
                isinstance(module, torch.nn.Linear) or _is_conv1d(module))):
            return False
        if param.ndim not in (1, 2):
            return False
    return True


class _ModuleRows:
    """One module's per-row patches: rank-1 terms of its weight, an added bias, and vector
    parameters re-run through the module's own forward."""

    def __init__(self, module: torch.nn.Module, rows: int) -> None:
        self.module, self.rows = module, rows
        self.terms: dict[int, list[tuple[Tensor, Tensor]]] = {}  # row -> [(a (in), u (out))]
        self.bias: dict[int, Tensor] = {}
        self.vectors: dict[int, dict[str, Tensor]] = {}  # row -> {param: patched value}
        self.inside = False

    def prepare(self, dtype: torch.dtype, device: torch.device) -> None:
        k = max((len(v) for v in self.terms.values()), default=0)
        self.a = self.u = None
        if k:
            first = next(iter(self.terms.values()))[0]
            a = torch.zeros(self.rows, k, first[0].shape[0], dtype=dtype, device=device)
            u = torch.zeros(self.rows, k, first[1].shape[0], dtype=dtype, device=device)
            for b, items in self.terms.items():
                for j, (x, y) in enumerate(items):
                    a[b, j], u[b, j] = x.to(device, dtype), y.to(device, dtype)
            self.a, self.u = a, u
        self.d = None
        if self.bias:
            first_bias = next(iter(self.bias.values()))
            self.d = torch.zeros(self.rows, first_bias.shape[0], dtype=dtype, device=device)
            for b, delta in self.bias.items():
                self.d[b] = delta.to(device, dtype)

    def hook(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             out: Any) -> Any:
        if self.inside:
            return None
        y = out[0] if isinstance(out, tuple) else out
        if not isinstance(y, Tensor) or y.shape[0] != self.rows:
            raise _Unbatchable
        if self.vectors:
            y = y.clone()
            self.inside = True
            try:
                for b, values in self.vectors.items():
                    row_args = tuple(_row(v, b, self.rows) for v in args)
                    row_kwargs = {k: _row(v, b, self.rows) for k, v in kwargs.items()}
                    got = torch.func.functional_call(module, values, row_args, row_kwargs)
                    y[b] = (got[0] if isinstance(got, tuple) else got)[0]
            finally:
                self.inside = False
        if self.a is not None:
            x = args[0] if args else kwargs["input"]
            if x.shape[0] != self.rows:
                raise _Unbatchable
            coef = torch.einsum("b...i,bki->b...k", x, self.a)
            y = y + torch.einsum("b...k,bko->b...o", coef, self.u)
        if self.d is not None:
            y = y + self.d.view(self.rows, *([1] * (y.ndim - 2)), -1)
        return (y, *out[1:]) if isinstance(out, tuple) else y


def _row(value: Any, b: int, rows: int) -> Any:
    if isinstance(value, Tensor) and value.ndim and value.shape[0] == rows:
        return value[b:b + 1]
    return value


@contextmanager
def row_patches(model: torch.nn.Module, rows: Sequence[Patches]) -> Iterator[None]:
    """Forward hooks that give batch row ``b`` the patches ``rows[b]`` (`hookable` ones), as
    actions on the module outputs; removed in ``finally``. A patch whose every entry is zero
    adds nothing (the row stays the unpatched computation)."""
    per: dict[str, _ModuleRows] = {}
    n = len(rows)
    for b, patches in enumerate(rows):
        for (name, _), parts in patches.items():
            terms = parts.get("terms") or ([(parts["u"], parts["v"])] if "u" in parts else [])
            if not any(bool(t.any()) for pair in terms for t in pair) and not (
                    "delta" in parts and bool(parts["delta"].any())):
                continue
            owner, pname = name.rsplit(".", 1)
            module = model.get_submodule(owner)
            slot = per.setdefault(owner, _ModuleRows(module, n))
            param = getattr(module, pname)
            if "delta" in parts and parts["delta"].ndim == 2:  # (a dense mean: not hookable)
                raise ValueError("row_patches takes rank-1 factors, not dense deltas")
            if param.ndim == 2:
                for first, second in terms:  # (u along the stored weight's shape[0])
                    slot.terms.setdefault(b, []).append(
                        (first, second) if _is_conv1d(module) else (second, first))
            elif pname == "bias" and (isinstance(module, torch.nn.Linear) or _is_conv1d(module)):
                slot.bias[b] = slot.bias[b] + parts["delta"] if b in slot.bias else parts["delta"]
            else:
                values = slot.vectors.setdefault(b, {})
                base = values.get(pname, param.detach())
                values[pname] = (base.to(parts["delta"].dtype) + parts["delta"].to(base.device)
                                 ).to(param.dtype)
    handles = []
    try:
        for slot in per.values():
            ref = next(slot.module.parameters())
            slot.prepare(ref.dtype, ref.device)
            handles.append(slot.module.register_forward_hook(slot.hook, with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


class _Target:
    """Runs patch sets on one step's reduced input (its ids and positions, the run's scope)."""

    def __init__(self, loaded: LoadedModel, scope: str) -> None:
        self.model, self.device, self.scope = loaded.model, loaded.device, scope
        self.prefix = _Fed(self.model, self.device)

    def _split(self, red: Sequence[int], pos: Sequence[int] | None) -> bool:
        if self.scope == "query" and len(red) > 1:
            self.prefix.feed(red[:-1], None if pos is None else pos[:-1], logits=False)
            return True
        return False

    def written(self, red: Sequence[int], pos: Sequence[int] | None,
                patches: Patches) -> Tensor:
        """The reduced input's last logits with ``patches`` written into the weights."""
        model, device = self.model, self.device
        if self._split(red, pos):
            with rolled_back(self.prefix.cache), materialized(model, patches):
                return last_logits(model, red[-1:], device, self.prefix.cache,
                                   None if pos is None else pos[-1:])
        with materialized(model, patches):
            return last_logits(model, red, device, positions=None if pos is None else list(pos))

    def batched(self, red: Sequence[int], pos: Sequence[int] | None,
                rows: Sequence[Patches]) -> Tensor | None:
        """The reduced input's last logits with row b patched by ``rows[b]`` (hooks), ``(len
        (rows), vocabulary)``; None where this target needs the written-weights path."""
        model, device, n = self.model, self.device, len(rows)
        if self._split(red, pos):
            cache = self.prefix.cache
            if not attention_only(cache):
                return None
            with rolled_back(cache):
                cache.batch_repeat_interleave(n)
                with row_patches(model, rows):
                    return last_logits(model, red[-1:], device, cache,
                                       None if pos is None else pos[-1:], rows=n)
        with row_patches(model, rows):
            return last_logits(model, red, device, positions=pos, rows=n)


def iter_transfer(loaded: LoadedModel, steps: Sequence[StepResult], scope: str,
                  batched: bool = True, pixels: dict[str, Any] | None = None,
                  progress: Callable[[int, int], None] | None = None,
                  should_stop: Callable[[], bool] | None = None
                  ) -> Iterator[tuple[int, Tensor, Tensor, bool]]:
    """Per target step t: ``(t, p_t's logits (V), rows (T + 2, V), batched)`` with rows the T
    sources' logits ``q_{s->t}``, the mean patch's and the unpatched control's, all float64;
    ``batched``: whether the hooks ran them (else the patches were written into the weights).

    Args:
        batched: False: the written-weights reference path for every entry.
        pixels: the image's processor inputs when the full ids hold one (the full-context run).

    Raises:
        UserError: a step kept no patches.
        Cancelled: ``should_stop`` said so between passes.
    """
    if any(s.patches is None for s in steps):
        raise UserError("the transfer applies each step's patches at every other step, and "
                        "this run kept none: run it again with analyze transfer")
    pf = patches_of_steps(steps, scope)
    sets = [pf.patches.get(s.step, {}) for s in steps]
    n = len(steps)
    model = loaded.model
    rows = [*sets, "mean", {}]  # (the mean: factors when batched, dense when written)
    use_hooks = batched and all(hookable(model, p) for p in sets)
    mean_dense: Patches | None = None
    empty = [s for s, p in enumerate(sets)
             if not any(bool(t.any()) for parts in p.values() for t in parts.values())]
    total = n * (-(-(n + 2) // ROWS)) if use_hooks else n * (n + 2)
    done = 0
    full_run, target = _Fed(model, loaded.device), _Target(loaded, scope)

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    def stop() -> None:
        if should_stop is not None and should_stop():
            raise Cancelled

    with torch.inference_mode():
        for t, step in enumerate(steps):
            stop()
            full = full_run.feed(step.full_input_ids, pixels=pixels,
                                 prompt_length=len(steps[0].full_input_ids))
            assert full is not None
            red, pos = list(step.reduced_input_ids), step.reduced_position_ids
            out: Tensor | None = None
            if use_hooks:
                factors = [_mean_factors(sets) if r == "mean" else r for r in rows]
                chunks = []
                try:
                    for i in range(0, len(factors), ROWS):
                        stop()
                        got = target.batched(red, pos, factors[i:i + ROWS])
                        if got is None:
                            break
                        chunks.append(got)
                        tick()
                    else:
                        out = torch.cat(chunks)
                        for s in empty:  # (batch rows of one GEMM may round differently: a
                            out[s] = out[-1]  # patch set of zeros is the control, exactly)
                except _Unbatchable:
                    use_hooks, total = False, done + (n - t) * (n + 2)
            if out is None:
                if mean_dense is None:
                    mean_dense = mean_patches(sets)
                logits = []
                for r in rows:
                    stop()
                    logits.append(target.written(red, pos, mean_dense if r == "mean" else r))
                    tick()
                out = torch.stack(logits)
                yield t, full, out, False
            else:
                yield t, full, out, True


def _mean_factors(sets: Sequence[Patches]) -> Patches:
    """The mean patch as the batched hooks take it: every set's rank-1 factors, u divided by
    the count (one row with T terms per matrix), vector deltas averaged."""
    n = len(sets)
    out: dict[tuple[str, int | None], dict[str, Any]] = {}
    for patches in sets:
        for key, parts in patches.items():
            slot = out.setdefault(key, {})
            if "delta" in parts:
                slot["delta"] = slot.get("delta", 0) + parts["delta"] / n
            else:
                slot.setdefault("terms", []).append((parts["u"] / n, parts["v"]))
    return out  # type: ignore[return-value]


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _tvd(p: Tensor, q: Tensor) -> Tensor:
    return 0.5 * (p - q).abs().sum(-1)


def transfer(loaded: LoadedModel, steps: Sequence[StepResult], scope: str,
             batched: bool = True, pixels: dict[str, Any] | None = None,
             progress: Callable[[int, int], None] | None = None,
             should_stop: Callable[[], bool] | None = None) -> dict[str, Any]:
    """The record's ``analysis.transfer`` (`iter_transfer`), JSON-ready (NaN and infinities as
    None): ``retained``, ``match``, ``linf``, ``relative_linf``: T x T, rows = source step,
    columns = target step; ``scale``: [T] (max |p_t logits|); ``mean``, ``mean_match``: [T]
    (the mean patch); ``previous``, ``previous_match``: [T] (s = t - 1; None at t = 0);
    ``batched``: whether every target ran through the batched hooks."""
    n = len(steps)
    retained = [[None] * n for _ in range(n)]
    match = [[False] * n for _ in range(n)]
    linf = [[None] * n for _ in range(n)]
    rel = [[None] * n for _ in range(n)]
    mean: list[float | None] = [None] * n
    mean_match = [False] * n
    scale: list[float | None] = [None] * n
    every = True
    for t, full, rows, was_batched in iter_transfer(loaded, steps, scope, batched, pixels,
                                                    progress, should_stop):
        every = every and was_batched
        p = torch.softmax(full, -1)
        # (row by row: a reduction over a batch may round its rows differently, and a row equal
        # to the control's must give R = 0 exactly)
        tvd = [float(_tvd(p, torch.softmax(row, -1))) for row in rows]
        control = tvd[-1]
        argmax = int(full.argmax())
        tokens = rows.argmax(-1).tolist()
        gaps = (rows - full).abs().amax(-1).tolist()
        s_t = float(full.abs().max())
        scale[t] = _finite(s_t)
        ratios = [1.0 - v / control if control > 0 else math.nan for v in tvd[:-1]]
        for s in range(n):
            retained[s][t] = _finite(ratios[s])
            match[s][t] = tokens[s] == argmax
            linf[s][t] = _finite(gaps[s])
            rel[s][t] = _finite(gaps[s] / s_t) if s_t > 0 else None
        mean[t] = _finite(ratios[n])
        mean_match[t] = tokens[n] == argmax
    return {
        "retained": retained, "match": match, "linf": linf, "relative_linf": rel,
        "scale": scale, "mean": mean, "mean_match": mean_match,
        "previous": [None] + [retained[t - 1][t] for t in range(1, n)],
        "previous_match": [None] + [match[t - 1][t] for t in range(1, n)],
        "batched": every,
    }


__all__ = ["ROWS", "hookable", "iter_transfer", "mean_patches", "row_patches", "transfer"]
