"""Patch geometry over a run (ANALYSIS.md section A2): how the patches of one parameter align
across the steps, how many directions their stack spans, the rank of their sum, and how one
parameter's patches align across layers at one step.

Pure NumPy, from the factors only: a rank-1 patch ``u vᵀ`` is never materialised (its dims may
be 10^4 x 10^5). Its Frobenius inner products are ``<u_s v_sᵀ, u_t v_tᵀ>_F = (u_s . u_t)
(v_s . v_t)``, so the T x T Gram of a parameter is the elementwise product of two matmuls.
Everything computes in float64, whatever the patches' dtype.

The input is each step's ``StepResult.patches`` (``core.compare._patch_arrays``): ``P.u`` and
``P.v`` (the patch of parameter ``P`` is ``outer(u, v)``, in the stored orientation) or
``P.delta`` (a vector delta: a norm scale, a bias). A parameter missing at a step (an MoE
expert not active then) is a zero patch there.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

_EPS = float(np.finfo(np.float64).eps)
_SUFFIXES = ("u", "v", "delta")
#: the layer index in a parameter's name: the integer after "layers.", "h.", "blocks." or
#: "layer." (the first such component)
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)(?=\.|\[|$)")


def layer_of(name: str) -> int | None:
    """The layer index in a parameter's name (``model.layers.3.mlp.up_proj.weight`` -> 3).

    Args:
        name: a parameter's name, an expert slice ``...experts.gate_up_proj[5]`` included.

    Returns:
        The integer after the first ``layers.``, ``h.``, ``blocks.`` or ``layer.`` component;
        None if there is none.
    """
    found = _LAYER.search(name)
    return int(found.group(1)) if found else None


def role_of(name: str) -> str | None:
    """A parameter's role: its name with the layer index replaced by ``{}``
    (``model.layers.{}.mlp.up_proj.weight``); None where `layer_of` finds no index."""
    found = _LAYER.search(name)
    return name[:found.start(1)] + "{}" + name[found.end(1):] if found else None


def singular_values(inner: np.ndarray, terms: int = 1) -> np.ndarray:
    """Singular values of a stack ``[vec P_1 ... vec P_T]`` from its T x T Gram of inner products.

    The eigenvalues of the Gram are the squared singular values; an eigenvalue at or below the
    Gram's own rounding bound ``lambda_max * max(T, terms) * eps`` counts as 0 (its square root
    would otherwise turn rounding noise of order eps into singular values of order sqrt(eps)).

    Args:
        inner: (T, T) symmetric, finite, float64: ``inner[s, t] = <P_s, P_t>_F``.
        terms: the length of the dot products behind each entry (``M + N`` for rank-1 patches
            of an M x N matrix, ``d`` for vector deltas of length d).

    Returns:
        (T,) float64, descending, non-negative.
    """
    inner = np.asarray(inner, dtype=np.float64)
    if inner.size == 0:
        return np.zeros(0)
    lam = np.linalg.eigvalsh(inner)[::-1]
    top = max(float(lam[0]), 0.0)
    lam = np.where(lam > top * max(len(lam), terms) * _EPS, lam, 0.0)
    return np.sqrt(lam)


def effective_rank(sigma: Sequence[float] | np.ndarray) -> float:
    """Effective rank (Roy and Vetterli 2007): ``exp(H(p))``, ``p = sigma / sum(sigma)``.

    Args:
        sigma: singular values, non-negative, finite, in any order.

    Returns:
        Between 1 and the count of nonzero values; 0.0 when all are zero (or there are none).
    """
    s = np.asarray(sigma, dtype=np.float64).ravel()
    if not np.isfinite(s).all() or (s < 0).any():
        raise ValueError("effective_rank needs finite, non-negative singular values")
    total = s.sum()
    if total == 0:
        return 0.0
    p = s[s > 0] / total
    return float(np.exp(-(p * np.log(p)).sum()))


def energy(sigma: Sequence[float] | np.ndarray) -> list[float]:
    """Cumulative energy: the share of ``sum sigma^2`` that the first k values capture.

    Args:
        sigma: singular values, non-negative, descending.

    Returns:
        One share per k = 1..len (the last 1.0); all 0.0 when every value is zero.
    """
    c = np.cumsum(np.asarray(sigma, dtype=np.float64) ** 2)
    if c.size == 0 or c[-1] == 0:
        return [0.0] * c.size
    return (c / c[-1]).tolist()


def summed_rank(us: np.ndarray, vs: np.ndarray) -> int:
    """Rank of the summed rank-1 patches ``sum_t u_t v_tᵀ = U Vᵀ``, without forming it.

    Thin QR of ``U`` and ``V``, then the SVD of ``R_u R_vᵀ`` (at most T x T); a singular value
    counts above ``S.max() * max(M, N) * eps``, the default rule of `numpy.linalg.matrix_rank`
    on the M x N sum.

    Args:
        us: (T, M) float64, one step's ``u`` a row (zero for a step without the patch).
        vs: (T, N) float64, the matching ``v``.

    Returns:
        The rank, at most ``min(T, M, N)``.
    """
    (_, m), n = us.shape, vs.shape[1]
    if us.size == 0 or vs.size == 0:
        return 0
    ru = np.linalg.qr(us.T, mode="r")
    rv = np.linalg.qr(vs.T, mode="r")
    s = np.linalg.svd(ru @ rv.T, compute_uv=False)
    top = float(s.max()) if s.size else 0.0
    return int((s > top * max(m, n) * _EPS).sum())


def _cosines(gram: np.ndarray) -> np.ndarray:
    """Cosines from a Gram of vectors: NaN in the rows and columns of zero vectors, the diagonal
    exactly 1 elsewhere, rounding clipped to [-1, 1]."""
    norms = np.sqrt(np.diag(gram))
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.clip(gram / np.outer(norms, norms), -1.0, 1.0)
    np.fill_diagonal(cos, np.where(norms > 0, 1.0, np.nan))  # elsewhere a zero norm gives 0/0
    return cos


def _json(a: np.ndarray) -> list[Any]:
    """An array as nested Python lists of floats, NaN and infinities as None."""
    finite = np.isfinite(a)
    if finite.all():
        return a.tolist()
    out = a.astype(object)
    out[~finite] = None
    return out.tolist()


@dataclass(frozen=True)
class _Param:
    kind: str  # "rank1" | "delta"
    shape: tuple[int, ...]  # (M, N) for rank-1 patches, (d,) for deltas


def _vectors(step: Mapping[str, np.ndarray], index: int) -> dict[str, dict[str, np.ndarray]]:
    """One step's arrays grouped by parameter: ``{name: {"u": .., "v": ..} or {"delta": ..}}``."""
    grouped: dict[str, dict[str, np.ndarray]] = {}
    for key, array in step.items():
        name, _, suffix = key.rpartition(".")
        if not name or suffix not in _SUFFIXES:
            raise ValueError(f"step {index}: patch array {key!r} is not named P.u, P.v or "
                             "P.delta")
        a = np.asarray(array)
        if a.ndim != 1:
            raise ValueError(f"step {index}: patch array {key!r} has shape {a.shape}, not a "
                             "vector")
        grouped.setdefault(name, {})[suffix] = a
    for name, parts in grouped.items():
        if set(parts) not in ({"u", "v"}, {"delta"}):
            raise ValueError(f"step {index}: parameter {name!r} has arrays "
                             f"{sorted(parts)}: expected u and v, or delta")
    return grouped


def _index(steps: Sequence[dict[str, dict[str, np.ndarray]]]) -> dict[str, _Param]:
    """Every parameter of the run (first appearance first), its kind and shape; a
    parameter must keep its kind and shape over the run."""
    params: dict[str, _Param] = {}
    for t, step in enumerate(steps):
        for name, parts in step.items():
            kind = "delta" if "delta" in parts else "rank1"
            shape = ((len(parts["delta"]),) if kind == "delta"
                     else (len(parts["u"]), len(parts["v"])))
            p = params.setdefault(name, _Param(kind, shape))
            if (p.kind, p.shape) != (kind, shape):
                raise ValueError(f"parameter {name!r} is a {kind} patch of shape {list(shape)} "
                                 f"at step {t} but a {p.kind} patch of shape {list(p.shape)} "
                                 "before")
    return params


def _stack(steps: Sequence[dict[str, dict[str, np.ndarray]]], name: str, part: str,
           rows: Sequence[int], length: int) -> np.ndarray:
    """(len(rows), length) float64: row i the vector ``part`` of ``name`` at step ``rows[i]``,
    zero where that step has no patch of ``name``."""
    out = np.zeros((len(rows), length))
    for i, t in enumerate(rows):
        parts = steps[t].get(name)
        if parts is not None:
            out[i] = parts[part]
    return out


def _param_geometry(steps: Sequence[dict[str, dict[str, np.ndarray]]], name: str,
                    p: _Param) -> dict[str, Any]:
    """One parameter's entry of `patch_geometry`'s ``params``."""
    every = range(len(steps))
    if p.kind == "rank1":
        us = _stack(steps, name, "u", every, p.shape[0])
        vs = _stack(steps, name, "v", every, p.shape[1])
        gu, gv = us @ us.T, vs @ vs.T
        inner, cos = gu * gv, _cosines(gu) * _cosines(gv)
        terms = p.shape[0] + p.shape[1]
    else:
        ds = _stack(steps, name, "delta", every, p.shape[0])
        inner = ds @ ds.T
        cos = _cosines(inner)
        terms = p.shape[0]
    entry: dict[str, Any] = {"layer": layer_of(name), "kind": p.kind, "shape": list(p.shape),
                             "gram": _json(cos), "inner": _json(inner)}
    if not np.isfinite(inner).all():  # a NaN or infinite patch: no spectrum, no rank
        nothing: list[Any] = [None] * len(steps)
        entry.update(singular_values=nothing, effective_rank=None, energy=nothing,
                     summed_rank=None)
        return entry
    sigma = singular_values(inner, terms)
    if p.kind == "rank1":
        rank = summed_rank(us, vs)
    else:
        rank = int(bool((ds.sum(axis=0) != 0).any()))
    entry.update(singular_values=sigma.tolist(), effective_rank=effective_rank(sigma),
                 energy=energy(sigma), summed_rank=rank)
    return entry


def _part(step: dict[str, dict[str, np.ndarray]], name: str, part: str,
          length: int) -> np.ndarray:
    """(length,) float64: the vector ``part`` of ``name`` at one step, zero if it is missing."""
    parts = step.get(name)
    return np.zeros(length) if parts is None else parts[part].astype(np.float64)


def _across_layers(steps: Sequence[dict[str, dict[str, np.ndarray]]],
                   params: dict[str, _Param]) -> dict[str, Any]:
    """`patch_geometry`'s ``across_layers``: per role (and kind and shape), the L x L cosines
    between the layers' patches at each step."""
    groups: dict[tuple[str, str, tuple[int, ...]], dict[int, str]] = {}
    for name, p in params.items():
        role, layer = role_of(name), layer_of(name)
        if role is not None and layer is not None:
            groups.setdefault((role, p.kind, p.shape), {})[layer] = name
    shapes: dict[str, int] = {}
    for role, _, _ in groups:
        shapes[role] = shapes.get(role, 0) + 1
    out: dict[str, Any] = {}
    for (role, kind, shape), by_layer in groups.items():
        if len(by_layer) < 2:
            continue
        layers = sorted(by_layer)
        names = [by_layer[layer] for layer in layers]
        per_step = []
        for step in steps:
            if kind == "rank1":
                us = np.stack([_part(step, n, "u", shape[0]) for n in names])
                vs = np.stack([_part(step, n, "v", shape[1]) for n in names])
                cos = _cosines(us @ us.T) * _cosines(vs @ vs.T)
            else:
                ds = np.stack([_part(step, n, "delta", shape[0]) for n in names])
                cos = _cosines(ds @ ds.T)
            per_step.append(_json(cos))
        key = role if shapes[role] == 1 else f"{role} {'x'.join(map(str, shape))}"
        out[key] = {"layers": layers, "steps": per_step}
    return out


def patch_geometry(steps: Sequence[Mapping[str, np.ndarray]]) -> dict[str, Any]:
    """The geometry of a run's patches (ANALYSIS.md section A2), ready for JSON.

    Args:
        steps: per generated step, its patches as ``StepResult.patches`` holds them
            (``P.u`` and ``P.v``, or ``P.delta``; float32 or float64). A parameter missing at a
            step is a zero patch there.

    Returns:
        ``{"params": {name: entry}, "across_layers": {role: {"layers", "steps"}}}``, plain
        Python numbers and lists, NaN and infinities as None. An entry: ``layer`` (`layer_of`),
        ``kind`` ("rank1" or "delta"), ``shape``, ``gram`` (T x T Frobenius cosines, None
        where a patch is zero), ``inner`` (T x T inner products), ``singular_values`` (T, of
        the stack of the T patches, descending; `singular_values`), ``effective_rank``,
        ``energy`` (cumulative share of ``sum sigma^2`` by rank k = 1..T), ``summed_rank``
        (rank of the sum over the steps: `summed_rank`; for a delta 1 if the summed vector is
        nonzero, else 0). Where a patch is NaN or infinite (or its inner products overflow),
        ``singular_values`` and ``energy`` are T Nones and ``effective_rank`` and
        ``summed_rank`` None. ``across_layers``
        holds each role (`role_of`) that two or more layers have with one kind and shape (a
        role with layers of several shapes: one entry per shape, keyed ``"{role} MxN"``):
        ``layers`` ascending and ``steps``, per step the L x L cosines between the layers'
        patches (None for a layer without a nonzero patch at that step).

    Raises:
        ValueError: an array not named ``P.u``, ``P.v`` or ``P.delta``, or not a vector; a
            ``u`` without its ``v``; a parameter changing kind or shape over the run.
    """
    grouped = [_vectors(step, t) for t, step in enumerate(steps)]
    params = _index(grouped)
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite patches come out as None
        return {"params": {name: _param_geometry(grouped, name, p)
                           for name, p in params.items()},
                "across_layers": _across_layers(grouped, params)}


__all__ = ["effective_rank", "energy", "layer_of", "patch_geometry", "role_of",
           "singular_values", "summed_rank"]
