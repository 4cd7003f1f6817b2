"""The stable update's per-layer host arithmetic, compiled by numba (`kernel`), where it is
installed (the optional ``fast`` extra: ``pip install "ctxpatch[fast]"``).

On a CPU the per-layer cost of the stable update is cold (docs/PERFORMANCE.md, session 9): each
layer's hooks run right after its weights have streamed through the caches, and every distinct
NumPy or torch operation then pays a cold start on its first call. `core.patches._secular`, the
solve on torch, runs about 170 small kernels per layer; compiled, the solve is one call, and
with the down matrix's patch and its patched row (`_down_row`) one call replaces about a dozen
torch operations more (session 10: the stable update's extra cost per layer on the demo, in
bfloat16, from about 260 us to about 110 against the NumPy solve of then; session 11 measures
the torch one).

- `_fit` is `core.patches._secular` followed by `core.patches._raised`, step for step, with the
  same IEEE conventions (``fmin``/``fmax`` ignore NaN, ``maximum`` propagates it, divisions by
  zero give infinities: numba's ``error_model="numpy"``); it also stops once ``t`` no longer
  moves, and the order of the sums differs (loops here, BLAS there), so the two agree to a few
  ulps.
- `_down_row` is `_fit` on the target's RMS, then `core.patches.matrix_output_patch` and
  `core.activations.rank1_row`, in float64 rounded once to the patch dtype.

tests/core/test_patches.py runs every solve test compiled and on torch and compares both
functions with what they replace; tests/core/test_control_row.py compares whole runs, and
tests/core/test_no_numba.py a run where numba cannot be imported. Compiled at first use (about
4 s: two functions, for float32 and float64), then cached on disk by numba (where no folder is
writable, compiled in every process). Where numba is missing, `kernel` returns None silently;
where it does not load or cannot compile, it says so in the log and returns None; the solve
then runs on torch.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_built: list[Any] = []  # [the compiled `Kernels`, or None]


# The scalar conventions of `core.patches._secular`'s torch calls, for `_fit` (compiled inline)
def fmin(a: float, b: float) -> float:
    """The smaller of two scalars, NaN ignored (as ``torch.fmin``)."""
    return b if a != a else a if b != b else min(a, b)


def fmax(a: float, b: float) -> float:
    """The larger of two scalars, NaN ignored (as ``torch.fmax``)."""
    return b if a != a else a if b != b else max(a, b)


def maximum(a: float, b: float) -> float:
    """The larger of two scalars, NaN propagated (as ``torch.maximum``)."""
    return a if (a != a or a > b) else b


def _fit(g: np.ndarray, table: np.ndarray, at_min: np.ndarray, first: int, m2_min: float,
         t_min: float, steps: int, guarded: int, scale: float, floor: float, raise_floor: bool,
         h: np.ndarray) -> tuple[float, bool]:
    """``(mu, hard)``, and into ``h`` (float32 or float64) ``scale`` times the fit ``y`` (raised
    to ``floor`` and put back on the RMS sphere when ``raise_floor``), as `core.patches._secular`
    and `_raised` in float64 (``g`` float32 or float64). ``table`` holds the poles' rows
    ``m / sqrt(n), m, m^2, gap, gap_out`` (`core.patches.HostPoles.table`)."""
    n = g.shape[0]
    m_scaled, m, m2, gap, gap_out = table[0], table[1], table[2], table[3], table[4]
    gms = np.empty(n)
    s00 = 0.0
    s11 = 0.0
    s12 = 0.0
    edge = -math.inf  # max(|g m| / sqrt(n) - gap), NaN propagated as torch's max
    for i in range(n):
        v = np.float64(g[i]) * m_scaled[i]
        gms[i] = v
        e = v / gap_out[i]
        e2 = e / gap_out[i]
        s00 += v * v
        s11 += e * e
        s12 += e * e2
        w = abs(v) - gap[i]
        if edge == edge and (w != w or w > edge):
            edge = w
    short = n - n * s11
    a = 0.0
    pole_nonzero = False
    for j in at_min:
        a += gms[j] * gms[j]
        pole_nonzero = pole_nonzero or gms[j] != 0.0
    hard = short >= 0.0 and not pole_nonzero
    rest = maximum(short, abs(0.0 * short)) ** 0.5
    pole = (n * a) ** 0.5
    t_hi = maximum(fmin(s00 ** 0.5, pole / rest), t_min)
    tangent = short / (-2.0 * n * s12)
    t_lo = maximum(fmax(edge, tangent), t_min)
    t = t_lo ** 0.5 * t_hi ** 0.5
    for k in range(steps):
        f = 0.0
        s3 = 0.0
        s4 = 0.0
        for i in range(n):
            d = gap[i] + t
            y = gms[i] / d
            yd = y / d
            f += y * y
            s3 += y * yd
            s4 += yd * yd
        s3s3 = s3 * s3
        t_next = t + (s3s3 * (s3s3 + s4 * (1.0 - f)) ** -0.5 - s3) / s4
        if k < guarded:
            below = f < 1.0
            if below:
                t_hi = t
            else:
                t_lo = t
            inside = fmin(fmax(t_next, t_lo), t_hi)
            t = inside if abs(inside - t_next) <= t * 2.0**-30 else t_lo ** 0.5 * t_hi ** 0.5
        else:
            settled = abs(t_next - t) <= t * 2.0**-50
            t = fmax(fmin(t_next, t_hi), t_lo)
            if settled:
                break
    mu = m2_min - t
    if m2_min - mu < t:
        mu = np.nextafter(mu, -math.inf)
    out = np.empty(n)
    for i in range(n):
        out[i] = np.float64(g[i]) * m[i] / (m2[i] - mu)
    if hard:
        mu = m2_min
        for i in range(n):
            out[i] = rest if i == first else np.float64(g[i]) * m[i] / gap_out[i]
    if raise_floor:
        ss = 0.0
        for i in range(n):
            v = math.copysign(maximum(abs(out[i]), floor), out[i])
            out[i] = v
            ss += v * v
        scale = scale * (ss / n) ** -0.5
    for i in range(n):
        h[i] = out[i] * scale  # (rounded to nearest where h is float32, as torch's .to)
    return mu, hard


def _down_row(g: np.ndarray, down: np.ndarray, x: np.ndarray, y: np.ndarray, table: np.ndarray,
              at_min: np.ndarray, first: int, m2_min: float, t_min: float, steps: int,
              guarded: int, floor: float, raise_floor: bool, u: np.ndarray, a: np.ndarray,
              row: np.ndarray) -> tuple[float, bool, bool]:
    """The down matrix's patch of the stable update (``raise_floor``) or the fit for one row,
    as `core.engine` composes it from `core.patches`: the target ``h = RMS(down) y`` of
    `_fit`, then into ``u``, ``a`` the rank-1 patch ``matrix_output_patch(h - y, x)`` (``a = 0``
    where ``x = 0``: void) and into ``row`` its action ``y + u (a . x)`` on the row, from the
    stored ``u`` and ``a``; ``(mu, hard, void)``. Arrays of the patch dtype (float32 or float64),
    computed in float64."""
    n = g.shape[0]
    ss = 0.0
    for i in range(down.shape[0]):
        ss += np.float64(down[i]) * np.float64(down[i])
    h = np.empty(n)
    mu, hard = _fit(g, table, at_min, first, m2_min, t_min, steps, guarded,
                    (ss / down.shape[0]) ** 0.5, floor, raise_floor, h)
    xx = 0.0
    for i in range(x.shape[0]):
        xx += np.float64(x[i]) * np.float64(x[i])
    a[0] = xx  # (|x|^2 rounded to the patch dtype, as the composed patch has it: void where
    xx = np.float64(a[0])  # it underflows there, not only where x = 0)
    void = xx <= 0.0
    inv = 1.0 / (1.0 if void else xx)
    dot = 0.0
    for i in range(x.shape[0]):
        a[i] = np.float64(x[i]) * inv
        dot += np.float64(a[i]) * np.float64(x[i])
    for i in range(n):
        u[i] = h[i] - np.float64(y[i])
        row[i] = np.float64(y[i]) + np.float64(u[i]) * dot
    return mu, hard, void


class Kernels(NamedTuple):
    fit: Callable[..., tuple[float, bool]]  # `_fit`
    down_row: Callable[..., tuple[float, bool, bool]]  # `_down_row`


def kernel() -> Kernels | None:
    """`_fit` and `_down_row` compiled by numba (built at the first call, cached on disk where
    numba can), or None where numba is missing, disabled or fails to compile (the caller then
    computes on torch)."""
    with _lock:
        if not _built:
            _built.append(_build())
        return _built[0]


def _build() -> Kernels | None:
    try:
        import numba
    except ModuleNotFoundError as e:
        if e.name != "numba":  # (installed, but what it needs is not: say so)
            _log.warning("numba does not load (%s): the stable update runs on torch", e)
        return None  # (not installed: the optional extra left out, nothing to say)
    except Exception as e:  # (an llvmlite that does not load)
        _log.warning("numba does not load (%s): the stable update runs on torch", e)
        return None
    if numba.config.DISABLE_JIT:  # (NUMBA_DISABLE_JIT: the loops would run as Python)
        return None
    failure: Exception | None = None
    for cache in (True, False):  # (caching needs a writable folder: numba's own, or none)
        try:
            scope = {f.__name__: numba.njit(inline="always", error_model="numpy")(f)
                     for f in (fmin, fmax, maximum)}
            jit = numba.njit(cache=cache, error_model="numpy", nogil=True)
            scope["_fit"] = fit = jit(_rebound(_fit, scope))
            down_row = jit(_rebound(_down_row, scope))
            poles = (np.ones((5, 2)), np.zeros(1, dtype=np.intp), 0, 1.0, 1e-300, 1, 1)
            for dtype in (np.float32, np.float64):  # (float32 patches; float64 models, fits)
                v = np.ones(2, dtype)
                fit(v, *poles, 1.0, 1e-2, True, np.empty(2, dtype))
                down_row(v, v, v, v, *poles, 1e-2, True, *(np.empty(2, dtype) for _ in "uar"))
            return Kernels(fit, down_row)
        except Exception as e:
            failure = e
    _log.warning("numba could not compile the stable update (%s): it runs on torch", failure)
    return None


def _rebound(f: Any, scope: dict[str, Any]) -> Any:
    """``f`` over a copy of its globals updated with ``scope`` (the compiled versions of what it
    calls), so that the plain ``f`` stays plain Python."""
    import types
    names = dict(f.__globals__)
    names.update(scope)
    return types.FunctionType(f.__code__, names, f.__name__, f.__defaults__)
