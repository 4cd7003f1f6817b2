"""The patch mathematics of Goldwaser et al., arXiv 2511.17864 (PAPER.md sections 2, 4, 5).

Pure functions on vectors at the query position; nothing here knows about modules or hooks.

Dimensions: ``d`` model width, ``f`` MLP width (or any matrix's input / output width).

- Input control (Theorem 1, Lemma ``input_controllability_mlp``): for a matrix ``W`` that reads
  ``z`` and should act as on ``z_C``, ``dW = W (z_C - z) z^T / |z|^2``. We get ``W z_C`` and
  ``W z`` as the module's recorded outputs, so ``u = y_C - y`` and ``a = z / |z|^2``.
- Output matrix (Table 1): ``dW' = dv h^T / |h|^2`` adds ``dv`` to ``W' h``.
- Output bias (Table 1): ``db = dv``.
- Output scale (Theorem 1): ``dm = dv / N(h)``, a division by zero replaced by one (and counted).
- Stable update (Appendix B, conditioned): most of the shift moves into the down matrix through an
  RMSNorm inversion, a bounded remainder into the scale (`stable_down_target`). The paper's fit
  (`solve_rms_fit`) puts ``N(h')_k = 0`` wherever ``m_k = 0``, and the remainder ``r_k / N(h')_k``
  then divides by zero; ours fits against ``m`` held away from zero (`conditioned_scale`) and keeps
  every ``|N(h')_k|`` above a floor, so ``|dm_k|`` stays within a few times ``RMS(m)`` times the
  size of the wanted branch output (`fit_down_target` is the paper's fit, for a frozen scale).

Patch vectors are computed in float32, or float64 for float64 models; the secular equation of
the stable update is always solved in float64 (on torch, or for CPU tensors compiled by numba
on the host where it is installed, the ``fast`` extra: `core.secular_jit`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from . import secular_jit


@dataclass(frozen=True)
class Rank1:
    """A rank-1 matrix patch ``dW = outer(u, a)`` in (out, in) orientation.

    Applied as an action, ``(W + dW) x = W x + u (a . x)``; never materialized during a run.
    """

    u: Tensor  # (out,)
    a: Tensor  # (in,)
    #: a 0-d bool tensor, True when the construction's condition failed (``z = 0``, ``h = 0``):
    #: then ``a = 0`` and the patch acts as nothing. A tensor, so deciding needs no host sync.
    void: Tensor | None = None

    def frobenius(self) -> Tensor:
        """``|outer(u, a)|_F = |u| |a|``, a 0-d tensor (no host sync)."""
        return self.u.norm() * self.a.norm()


@dataclass(frozen=True)
class Delta:
    """An additive patch of a vector parameter (a bias, or a norm weight)."""

    delta: Tensor  # (d,)


Patch = Rank1 | Delta


def either(flag: Any, more: Any) -> Any:
    """``flag or more`` for Python bools and 0-d bool tensors alike, without a host sync."""
    if isinstance(flag, Tensor) and isinstance(more, Tensor):
        return torch.logical_or(flag, more)
    if isinstance(flag, Tensor) or isinstance(more, Tensor):  # a Python bool: no tensor made
        tensor, plain = (flag, more) if isinstance(flag, Tensor) else (more, flag)
        return torch.ones_like(tensor, dtype=torch.bool) if plain else tensor.bool()
    return bool(flag or more)


def _along(u: Tensor, x: Tensor) -> Rank1:
    """``Rank1(u, x / |x|^2)``; with ``x = 0``, ``a = 0`` and ``void`` set (no host sync). For
    ``x`` a batch of rows ``(k, in)``, a batch of patches: row ``j`` of ``a`` along ``x[j]``,
    ``void`` per row."""
    if x.dim() == 1:
        xx = torch.dot(x, x)
        void = xx <= 0
        return Rank1(u=u, a=x / torch.where(void, 1.0, xx), void=void)  # (1.0 takes xx's dtype)
    xx = (x * x).sum(-1)
    void = xx <= 0
    return Rank1(u=u, a=x / torch.where(void, 1.0, xx).unsqueeze(-1), void=void)


def rank1_input_patch(y_target: Tensor, y: Tensor, z: Tensor) -> Rank1:
    """Rank-1 patch making a matrix map ``z`` to ``y_target`` (Theorem 1, Eqs. 2-3).

    Args:
        y_target: (out,) the matrix's output on the full-context input, ``W z_C (+ b)``.
        y: (out,) its output on the reduced input, ``W z (+ b)``.
        z: (in,) the reduced input.

    Returns:
        ``Rank1(u = y_target - y, a = z / |z|^2)``; when ``z = 0`` (the paper's condition fails:
        no rank-1 patch along ``z`` exists) ``a = 0`` and ``void`` is True.
    """
    return _along(y_target - y, z)


def matrix_output_patch(shift: Tensor, h: Tensor) -> Rank1:
    """Rank-1 output-matrix patch adding ``shift`` to ``W' h`` (Table 1, ``dW' = dv h^T/|h|^2``);
    ``void`` (and ``a = 0``) when ``h = 0``.

    Args:
        shift: (out,) the residual shift to add, ``dv``.
        h: (in,) the matrix's input at the query (the gated activation for SwiGLU MLPs).
    """
    return _along(shift, h)


def rms_normalize(x: Tensor, eps: float) -> Tensor:
    """``N(x) = x / sqrt(mean(x^2) + eps)``: the RMSNorm without its scale, in ``x``'s dtype."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def scale_patch(shift: Tensor, n: Tensor) -> tuple[Tensor, Tensor]:
    """Elementwise scale patch ``dm = shift / n`` adding ``shift`` to ``m * n``.

    A coordinate with ``n_j = 0`` is divided by one instead (the paper's rule); the count of such
    coordinates is returned so the run can report it.

    Args:
        shift: (d,) the wanted change of the branch output.
        n: (d,) the realised normalized input of the post-norm, ``N(h)``.

    Returns:
        ``(dm, zero_count)``, the count a 0-d tensor (no host sync).
    """
    zero = n == 0
    return shift / torch.where(zero, torch.ones_like(n), n), zero.sum()


@dataclass(frozen=True)
class RmsFit:
    """Solution of ``min |m * y - g|^2  s.t.  mean(y^2) = 1`` (Appendix B.2)."""

    y: Tensor  # (d,) float64, mean(y^2) = 1
    mu: Tensor  # () the Lagrange multiplier, below min(m^2)
    hard_case: Tensor  # () bool: no interior root, the fallback of PAPER.md section 5 was used


#: `solve_rms_fit`'s model steps, and the first of them that keep the bracket and bisect it
#: when the model root leaves it
STEPS = 6
_GUARDED = 3

#: CPU tensors' secular solves run compiled by numba on the host where it is installed (the
#: ``fast`` extra, `core.secular_jit`: one call per layer instead of about 170 small torch
#: kernels); off, or without numba, they run on torch as on an accelerator. `core.bench` turns
#: this off while it counts host syncs, so that it counts what an accelerator would do.
JIT = True


@dataclass(frozen=True)
class Poles:
    """What the secular solve on torch (`_secular`) needs of the scale ``m`` alone, computed once
    (a run keeps one per layer: the weights do not change meanwhile), as float64 tensors on
    ``m``'s device."""

    m: Tensor  # (d,)
    m_scaled: Tensor  # m / sqrt(d): g times it is the solve's g m / sqrt(d)
    m2: Tensor  # m^2
    m2_min: Tensor  # () min m^2, the pole
    at_min: Tensor  # 0/1 at the coordinates attaining it
    gap: Tensor  # m^2 - min m^2
    gap_out: Tensor  # the same, infinite at the minimisers (leaves them out of the edge sums)
    first_min: Tensor  # the mask of the first minimiser (the hard case puts the rest there)
    t_min: Tensor  # () the smallest distance to the pole kept (mu stays below min m^2)


@dataclass(frozen=True)
class HostPoles:
    """The same for the solve compiled on the host (`core.secular_jit`), as NumPy float64: the
    rows ``m / sqrt(d), m, m^2, gap, gap_out`` in one (5, d) ``table``, the minimisers'
    indices, the first one's, and the scalars as Python floats."""

    kernels: secular_jit.Kernels
    table: np.ndarray
    m: np.ndarray  # (d,) its row of m (a view)
    at_min: np.ndarray
    first: int
    m2_min: float
    t_min: float


def poles(m: Tensor) -> Poles | HostPoles:
    """The poles of ``m`` for `solve_rms_fit`, `fit_down_target` and `stable_down_target`; they
    also say where those solve: compiled on the host for a CPU ``m`` while `JIT` is on and
    numba is there (`HostPoles`), else on torch on ``m``'s device (`Poles`)."""
    kernels = secular_jit.kernel() if JIT and m.device.type == "cpu" else None
    if kernels is None:
        return _torch_poles(m.detach().double())
    m64 = _host_array(m)
    with np.errstate(all="ignore"):  # (IEEE results wanted: an overflowing m^2 is inf)
        m2 = m64 * m64
        m2_min = m2.min()
        at_min = m2 == m2_min
        gap = m2 - m2_min
        table = np.stack([m64 * (1.0 / math.sqrt(m64.shape[0])), m64, m2, gap,
                          np.where(at_min, math.inf, gap)])
    return HostPoles(kernels=kernels, table=table, m=table[1], at_min=np.flatnonzero(at_min),
                     first=int(np.argmin(m2)), m2_min=float(m2_min),
                     t_min=float(m2_min * 2.0**-52 + 2.0**-1074))


def _torch_poles(m64: Tensor) -> Poles:
    """`Poles` of the float64 ``m64``, on its device (no value crosses to the host)."""
    m2 = m64 * m64
    m2_min = m2.min()
    at_min = m2 == m2_min
    gap = m2 - m2_min
    return Poles(m=m64, m_scaled=m64 * (1.0 / math.sqrt(m64.shape[0])), m2=m2, m2_min=m2_min,
                 at_min=at_min.double(), gap=gap, gap_out=torch.where(at_min, math.inf, gap),
                 first_min=torch.arange(m2.numel(), device=m2.device) == m2.argmin(),
                 t_min=m2_min * 2.0**-52 + 2.0**-1074)


def _secular(p: Poles, g64: Tensor, steps: int) -> tuple[Tensor, Tensor, Tensor]:
    """`solve_rms_fit`'s ``(y, mu, hard_case)`` from float64 ``g`` on the poles' device: the
    scalars are 0-d tensors, the conditions masks, and all ``steps`` run, so that no value
    crosses to the host (about 170 small kernels). The sums of each stage are one ``@`` of a
    buffer's rows with itself. Python numbers in ``torch.where`` only beside a float64 tensor
    (torch makes a tensor of two Python floats float32)."""
    gap, gap_out = p.gap, p.gap_out
    n = g64.shape[0]
    rows = g64.new_empty((4, n))
    gms = torch.mul(g64, p.m_scaled, out=rows[0])  # g m / sqrt(n)
    # Hard case: F stays finite just below min m^2 only when every minimising coordinate has
    # g m = 0, and it is then the hard case when F there is at most 1.
    y_edge = torch.div(gms, gap_out, out=rows[1])  # the others' y at mu = min m^2, over sqrt(n)
    torch.div(y_edge, gap_out, out=rows[2])
    three = rows[:3]
    s00, _, _, _, s11, s12, _, _, _ = (three @ three.T).view(-1).unbind()
    short = n - n * s11  # n (1 - F_edge)
    # the minimisers' g m / sqrt(n), 0 elsewhere (a float64 g m so small that this rounds it to
    # 0 counts as 0 here; only from inputs beyond float32's range; an inf elsewhere gives NaN)
    gms_pole = gms * p.at_min
    hard = (short >= 0.0) & ~(gms_pole != 0).any()
    rest = torch.sqrt(torch.maximum(short, abs(0.0 * short)))  # (+0 for short < 0: -0 would
    # make pole / rest -inf; short itself is never -0)
    # The bracket [t_lo, t_hi] on t = min m^2 - mu (see `solve_rms_fit`).
    pole = torch.sqrt(n * (gms_pole @ gms_pole))  # sqrt(n a)
    t_hi = torch.maximum(torch.fmin(torch.sqrt(s00), pole / rest), p.t_min)
    tangent = short / (-2.0 * n * s12)
    t_lo = torch.maximum(torch.fmax((abs(gms) - gap).max(), tangent), p.t_min)
    t = torch.sqrt(t_lo) * torch.sqrt(t_hi)
    d, y, yd, pair = rows[3], rows[1], rows[2], rows[1:3]
    pair_t = pair.T
    for k in range(steps):
        torch.add(gap, t, out=d)
        torch.div(gms, d, out=y)
        torch.div(y, d, out=yd)
        f, s3, _, s4 = (pair @ pair_t).view(-1).unbind()  # F, -F'(t) / 2, F''(t) / 6
        s3s3 = s3 * s3
        t_next = t + (s3s3 * (s3s3 + s4 * (1.0 - f)) ** -0.5 - s3) / s4
        if k < _GUARDED:
            below = f < 1.0  # F decreases in t: t is then above the root
            t_hi = torch.where(below, t, t_hi)
            t_lo = torch.where(below, t_lo, t)
            inside = torch.fmin(torch.fmax(t_next, t_lo), t_hi)
            t = torch.where(abs(inside - t_next) <= t * 2.0**-30, inside,
                            torch.sqrt(t_lo) * torch.sqrt(t_hi))
        else:
            t = torch.fmax(torch.fmin(t_next, t_hi), t_lo)
    # The float64 at or below the root (F <= 1 there: y inside the sphere by rounding, not
    # outside, when the root lies within a few ulps of min m^2).
    mu = p.m2_min - t
    mu = torch.where(p.m2_min - mu < t, torch.nextafter(mu, torch.full_like(mu, -math.inf)), mu)
    gm = g64 * p.m
    y_hard = torch.where(p.first_min, rest, gm / p.gap_out)  # one minimiser takes the rest
    return (torch.where(hard, y_hard, gm / (p.m2 - mu)), torch.where(hard, p.m2_min, mu),
            hard)


def solve_rms_fit(g: Tensor, m: Tensor, steps: int = STEPS) -> RmsFit:
    """Fit ``m * y`` to ``g`` with ``y`` on the RMS sphere ``mean(y^2) = 1``.

    Stationarity gives ``y_k = g_k m_k / (m_k^2 - mu)`` with ``mu`` the root below ``min m^2`` of
    the secular equation ``F(mu) = 1``, ``F(mu) = mean((g m)^2 / (m^2 - mu)^2)``; on
    ``(-inf, min m^2)`` F rises monotonically from 0, so that root is unique and gives the global
    minimiser (as in trust-region theory).

    Solved in float64 in ``t = min m^2 - mu > 0`` (the distance to the pole; F is evaluated with
    the denominators ``(m^2 - min m^2) + t``, exact at the minimising coordinates however small
    ``t`` is), by a fixed number of steps (on an accelerator with no host round trip):

    - A bracket from bounds: ``F <= mean((g m)^2) / t^2`` and, when ``F_edge`` (the other
      coordinates' F at the pole) is below 1, ``F <= a / t^2 + F_edge`` (``a``: the minimisers'
      ``(g m)^2`` summed, over ``n``) bound the root above; ``F >= (g_j m_j)^2 / (n (m_j^2 -
      min m^2 + t)^2)`` for every j and the tangent at the pole of the other coordinates' F
      (convex) bound it below; ``t >= min m^2 2^-52 + 2^-1074`` keeps ``mu`` below ``min m^2``.
    - From ``t`` (the bracket's geometric middle first), a rational model: with ``S3``, ``S4``
      the means of ``(g m)^2 / d^3`` and ``/ d^4`` (``d = m^2 - mu``), F is modelled as one pole
      at distance ``u = S3 / S4`` holding ``C = S3^2 / S4`` of it plus a constant ``F - C``
      (it matches F, F' and F'' at ``t``; exact for one pole, so for one dominating coordinate,
      and for a small pole term over a flat rest, the near-hard case where Newton steps on
      ``F^(-1/2)`` stall). Its root is the next ``t``:
      ``t + (S3^2 / sqrt(S3^2 + S4 (1 - F)) - S3) / S4``.
    - The first `_GUARDED` steps keep the bracket (the sides where ``F < 1`` and ``F >= 1``) and
      take the bracket's geometric middle instead of a model root outside it (a root that
      leaves it by at most ``2^-30 t``, rounding at convergence, is moved onto it); the later
      steps only clamp the model root into the bracket (a NaN root, from a model with no root,
      becomes its upper end). Geometric bisection, as roots may lie many decades below the
      bounds (near-hard cases, ``g`` a few ulps at the minimiser).

    Six steps reach float64 resolution on tests/core/test_patches.py's sweep and on thousands of
    sweep-like random cases (the model converges cubically; the slowest, a tiny pole term next
    to other close poles, alternate sides for three steps). The result is the float64 at or
    below the root (``F(mu) <= 1`` up to rounding).

    One algorithm on torch (`_secular`), on every device: the scalars 0-d tensors and the
    conditions masks, so nothing crosses to the host (about 170 small kernels), each stage's
    sums (the bracket's three, each step's F, F', F'') one product of a buffer's rows with
    itself. For CPU tensors the same steps run compiled by numba where it is installed (`JIT`,
    `core.secular_jit`): one call, which also stops once ``t`` no longer moves (the model root
    within 4 ulps of ``t``), instead of small kernels that each pay a cold start in a run
    (docs/PERFORMANCE.md, sessions 9-11).

    Hard case: when every coordinate attaining ``min m^2`` has ``g_k m_k = 0``, F may stay below 1
    up to ``min m^2``. Then ``mu = min m^2``, the other coordinates take the regular formula and the
    remaining norm goes into one minimising coordinate (PAPER.md section 5, from the audit).

    Args:
        g: (d,) the target branch output.
        m: (d,) the post-norm scale (where it is, with `JIT`, says where the solve runs).
        steps: model steps (each one evaluation of F and its first two derivatives).

    Returns:
        An `RmsFit` in float64.
    """
    p = poles(m)
    if isinstance(p, Poles):
        y, mu, hard = _secular(p, g.detach().double(), steps)
        return RmsFit(y=y, mu=mu, hard_case=hard)
    h, root, flag = _host_fit(p, g, steps, 1.0, False, torch.float64)
    return RmsFit(y=h, mu=torch.tensor(root, dtype=torch.float64, device=g.device),
                  hard_case=torch.tensor(flag, device=g.device))


def fit_down_target(g: Tensor, m: Tensor, c_rms: Tensor, fitted: Poles | HostPoles | None = None
                    ) -> tuple[Tensor, Any]:
    """The down-projection output whose normalized, scaled value best matches ``g`` in L2
    (App. B.2, the paper's fit; what a frozen scale can reach at best, PAPER.md section 7).

    Args:
        g: (d,) target branch output ``dv + m * N(h_down,C)``.
        m: (d,) post-norm scale.
        c_rms: () the fixed RMS value, ``RMS(h_down,C)`` (keeps the down patch small).
        fitted: ``poles(m)`` when already computed (as for `stable_down_target`).

    Returns:
        ``(h_target, hard_case)`` with ``h_target = c_rms * y`` in ``g``'s dtype.
    """
    return _down_target(g, poles(m) if fitted is None else fitted, c_rms, raise_floor=False)


def _down_target(g: Tensor, p: Poles | HostPoles, c_rms: Tensor, raise_floor: bool
                 ) -> tuple[Tensor, Any]:
    """``c_rms`` times the secular fit of ``g`` against the poles' scale (its small coordinates
    raised, `_raised`, for the stable update), in ``g``'s dtype, and the hard-case flag."""
    if isinstance(p, Poles):
        y, _, hard = _secular(p, g.detach().double(), STEPS)
        c = c_rms.double()
        return (_raised(y, c) if raise_floor else c * y).to(g.dtype), hard
    h, _, flag = _host_fit(p, g, STEPS, float(c_rms), raise_floor, g.dtype)
    return h, flag


def _host_fit(p: HostPoles, g: Tensor, steps: int, scale: float, raise_floor: bool,
              dtype: torch.dtype) -> tuple[Tensor, float, bool]:
    """``(scale * y, mu, hard)`` of the compiled solve (`core.secular_jit`), ``y`` raised
    (`_raised`) when ``raise_floor``, as a tensor of ``dtype`` on ``g``'s device: it reads a
    CPU float32 or float64 ``g`` in place and writes the result in ``dtype`` where it can."""
    if g.shape != p.m.shape:  # (the compiled loops do not check bounds)
        raise ValueError(f"the target has shape {tuple(g.shape)}, the scale {p.m.shape}")
    direct = g.device.type == "cpu" and dtype in _HOST_DTYPES
    x = _host_array(g, dtype if direct else torch.float64)
    h = np.empty(x.shape[0], dtype=x.dtype)
    mu, hard = p.kernels.fit(x, p.table, p.at_min, p.first, p.m2_min, p.t_min, steps, _GUARDED,
                             scale, DIRECTION_FLOOR, raise_floor, h)
    out = torch.from_numpy(h)
    return (out if direct else out.to(g.device, dtype)), float(mu), bool(hard)


def down_patch_row(g: Tensor, down: Tensor, x: Tensor, y: Tensor, fitted: Poles | HostPoles,
                   raise_floor: bool) -> tuple[Rank1, Tensor, bool] | None:
    """The down matrix's patch of the stable update (``raise_floor``, `stable_down_target`) or
    of the fit (`fit_down_target`) at one row, and the row it makes, in one compiled call
    (`core.secular_jit`): what ``matrix_output_patch(target - y, x)`` and its action
    ``y + u (a . x)`` give, computed in float64 (a few cold operations less per layer than
    composing them from tensors). None where that call is not available: poles not compiled
    (`HostPoles`), or vectors that are not CPU float32 or float64 of one dtype.

    Args:
        g: (d,) target branch output, as for `stable_down_target`.
        down: (d,) the full context's down output ``h_down,C`` (its RMS is the target's).
        x: (f,) the down matrix's input at the row; y: (d,) its output there.
        fitted: the poles of the scale (`stable_poles`, or `poles` for the fit).

    Returns:
        ``(Rank1(u, a, void), row, hard_case)`` in the vectors' dtype.
    """
    vectors = (g, down, x, y)
    if not isinstance(fitted, HostPoles) or g.dtype not in _HOST_DTYPES or any(
            v.device.type != "cpu" or v.dtype != g.dtype or v.dim() != 1 or not v.numel()
            or not v.is_contiguous() for v in vectors) or not g.shape == y.shape == fitted.m.shape:
        return None  # (the compiled loops do not check bounds: the composition then raises)
    u, a, row = (torch.empty_like(y), torch.empty_like(x), torch.empty_like(y))
    _, hard, void = fitted.kernels.down_row(
        *(v.detach().numpy() for v in vectors), fitted.table, fitted.at_min, fitted.first,
        fitted.m2_min, fitted.t_min, STEPS, _GUARDED, DIRECTION_FLOOR, raise_floor, u.numpy(),
        a.numpy(), row.numpy())
    return Rank1(u=u, a=a, void=torch.tensor(void)), row, bool(hard)


#: the dtypes a CPU tensor shares with NumPy here
_HOST_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}


def _host_array(x: Tensor, dtype: torch.dtype = torch.float64) -> np.ndarray:
    """``x`` as a contiguous NumPy array of ``dtype`` (float32 or float64; the solve's float64
    by default), shared where it already is one on the CPU (the compiled functions exist for
    those two layouts: another would compile at the call)."""
    x = x.detach()
    if x.device.type != "cpu" or x.dtype != dtype or not x.is_contiguous():
        x = x.to("cpu", dtype).contiguous()
    return x.numpy()


#: `conditioned_scale` raises every ``|m_k|`` to at least this fraction of ``RMS(m)``
SCALE_FLOOR = 0.1
#: `stable_down_target` keeps every ``|N(h')_k|`` at least this (``N(h')`` has RMS 1)
DIRECTION_FLOOR = 1e-2


def conditioned_scale(m: Tensor, floor: float = SCALE_FLOOR) -> Tensor:
    """``m`` with every coordinate raised to at least ``floor * RMS(m)`` in magnitude (sign kept,
    zeros made positive); all ones when ``m = 0``. Used only to aim the down patch."""
    tau = floor * m.pow(2).mean().sqrt()
    sign = torch.where(m < 0, -torch.ones_like(m), torch.ones_like(m))
    raised = torch.where(m.abs() < tau, sign * tau, m)
    return torch.where(tau > 0, raised, torch.ones_like(m))


def stable_poles(m: Tensor) -> Poles | HostPoles:
    """The `poles` of `conditioned_scale` of ``m``, what `stable_down_target` fits against (they
    depend on the weights only: a run computes them once per layer)."""
    return poles(conditioned_scale(m.double()))


def stable_down_target(g: Tensor, m: Tensor, c_rms: Tensor,
                       fitted: Poles | HostPoles | None = None) -> tuple[Tensor, Any]:
    """The down-projection output of the conditioned stable update (App. B, done so that the
    remainder ``dm = g / N(h') - m`` stays bounded).

    Fits ``y = N(h')`` against `conditioned_scale` of ``m`` (the paper's secular equation, whose
    solution ``y_k = g_k m_k / (m_k^2 - mu)`` is 0 wherever ``m_k = 0``), then raises every
    ``|y_k|`` to at least `DIRECTION_FLOOR` (a zero ``y_k`` would leave ``dm_k = g_k / 0``) and puts
    ``y`` back on the RMS sphere. Where ``m`` needs no help, ``dm_k = -mu / m_k``: zero when the
    attention shift is zero, and ``|dm_k| <= |mu| / (SCALE_FLOOR RMS(m))`` everywhere, with ``mu``
    the secular root, of the order of ``RMS(m)^2`` times the branch output's size.

    Args:
        g: (d,) target branch output ``dv + m * N(h_down,C)``.
        m: (d,) post-norm scale.
        c_rms: () the fixed RMS value, ``RMS(h_down,C)`` (keeps the down patch small).
        fitted: ``stable_poles(m)`` when already computed; they also say where the solve runs
            (`poles`: compiled on the host for CPU tensors where numba is there, one transfer
            each way, where it costs nothing; else on torch).

    Returns:
        ``(h_target, hard_case)`` with ``h_target = c_rms * y`` in ``g``'s dtype; ``hard_case``
        a 0-d tensor, or a Python bool when solved compiled on the host.
    """
    return _down_target(g, stable_poles(m) if fitted is None else fitted, c_rms,
                        raise_floor=True)


def _raised(y: Tensor, scale: Tensor) -> Tensor:
    """``scale`` times ``y`` with every ``|y_k|`` raised to at least `DIRECTION_FLOOR` (a zero
    takes its sign bit) and put back on the RMS sphere."""
    y = torch.copysign(torch.clamp_min(abs(y), DIRECTION_FLOOR), y)
    return y * (scale * ((y @ y) / y.shape[0]) ** -0.5)


def reachable_shift_bound(m: Tensor) -> float:
    """PAPER.md section 7: with ``m`` frozen, the branch ``m * N(.)`` moves by at most
    ``2 sqrt(d) max|m|``; a larger attention shift cannot be absorbed upstream of the norm."""
    return float(2.0 * m.numel() ** 0.5 * m.abs().max())
