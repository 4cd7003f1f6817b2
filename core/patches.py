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
the stable update is always solved in float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


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
    xx = torch.dot(x, x) if x.dim() == 1 else (x * x).sum(-1)
    void = xx <= 0
    a = x / torch.where(void, torch.ones_like(xx), xx).unsqueeze(-1)
    return Rank1(u=u, a=a, void=void)


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


#: `solve_rms_fit`'s first steps that keep the bracket and bisect it when the model root leaves it
_GUARDED = 3


def solve_rms_fit(g: Tensor, m: Tensor, steps: int = 6) -> RmsFit:
    """Fit ``m * y`` to ``g`` with ``y`` on the RMS sphere ``mean(y^2) = 1``.

    Stationarity gives ``y_k = g_k m_k / (m_k^2 - mu)`` with ``mu`` the root below ``min m^2`` of
    the secular equation ``F(mu) = 1``, ``F(mu) = mean((g m)^2 / (m^2 - mu)^2)``; on
    ``(-inf, min m^2)`` F rises monotonically from 0, so that root is unique and gives the global
    minimiser (as in trust-region theory).

    Solved in float64 in ``t = min m^2 - mu > 0`` (the distance to the pole; F is evaluated with
    the denominators ``(m^2 - min m^2) + t``, exact at the minimising coordinates however small
    ``t`` is), by a fixed number of steps with no host round trip:

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
    to other close poles, alternate sides for three steps). About 180 operations on 0-d tensors
    and 640-vectors: 0.21 ms at 640 coordinates on this CPU under inference mode (0.26 ms
    outside it), against 0.64 ms (0.75 ms) for the 12 rounds of the 63-point bracketed search
    it replaced. The result is the float64 at or below the root (``F(mu) <= 1`` up to
    rounding), as that search's was.

    Hard case: when every coordinate attaining ``min m^2`` has ``g_k m_k = 0``, F may stay below 1
    up to ``min m^2``. Then ``mu = min m^2``, the other coordinates take the regular formula and the
    remaining norm goes into one minimising coordinate (PAPER.md section 5, from the audit).

    Args:
        g: (d,) the target branch output.
        m: (d,) the post-norm scale.
        steps: model steps (each one evaluation of F and its first two derivatives).

    Returns:
        An `RmsFit` in float64.
    """
    g64, m64 = g.double(), m.double()
    n = g64.numel()
    gm = g64 * m64
    m2 = m64 * m64
    m2_min = m2.min()
    at_min = m2 == m2_min
    gap = m2 - m2_min
    gap_out = gap.masked_fill(at_min, math.inf)  # leaves the minimisers out of the edge sums
    # Hard case (decided on the device, no host round trip): F stays finite just below min m^2
    # only when every minimising coordinate has g m = 0, and it is then the hard case when F
    # there is at most 1.
    y_edge = gm / gap_out  # the other coordinates' y at mu = min m^2 (0 at the minimisers)
    s_edge = torch.dot(y_edge, y_edge)  # n F_edge
    short = float(n) - s_edge
    gm_pole = gm * at_min
    hard = (short >= 0.0) > gm_pole.any()  # on bools, a > b is a and not b
    rest = short.clamp_min(0.0).sqrt_()
    y_hard = y_edge.scatter(0, m2.argmin().reshape(1), rest.reshape(1))  # one minimiser: the rest
    # The bracket [t_lo, t_hi] on t = min m^2 - mu (see the docstring).
    gms = gm * (1.0 / math.sqrt(n))
    pole = torch.dot(gm_pole, gm_pole).sqrt_()  # sqrt(n a)
    t_min = m2_min * 2.0**-52 + 2.0**-1074
    t_hi = torch.fmin(torch.dot(gms, gms).sqrt_(), pole / rest).clamp_min_(t_min)
    tangent = short / (-2.0 * torch.dot(y_edge, y_edge / gap_out))
    t_lo = torch.fmax((gms.abs() - gap).max(), tangent).clamp_min_(t_min)
    one = torch.ones_like(m2_min)
    t = t_lo.sqrt() * t_hi.sqrt()
    for k in range(steps):
        d = gap + t
        y = gms / d
        yd = y / d
        f = torch.dot(y, y)  # F
        s3 = torch.dot(y, yd)  # -F'(t) / 2
        s4 = torch.dot(yd, yd)  # F''(t) / 6
        s3s3 = s3 * s3
        t_next = torch.addcdiv(t, torch.addcmul(s3s3, s4, one - f).rsqrt_().mul_(s3s3).sub_(s3), s4)
        if k < _GUARDED:
            below = f < one  # F decreases in t: t is then above the root
            t_hi = torch.where(below, t, t_hi)
            t_lo = torch.where(below, t_lo, t)
            inside = t_next.clamp(t_lo, t_hi)
            t = torch.where((inside - t_next).abs_() <= t * 2.0**-30, inside,
                            t_lo.sqrt() * t_hi.sqrt())
        else:
            t = torch.fmin(t_next, t_hi).fmax(t_lo)
    # The float64 at or below the root, as the bracketed search returned (F <= 1 there: y inside
    # the sphere by rounding, not outside, when the root lies within a few ulps of min m^2).
    mu = m2_min - t
    mu = torch.where(m2_min - mu < t, torch.nextafter(mu, torch.full_like(mu, -math.inf)), mu)
    y = gm / (m2 - mu)
    return RmsFit(y=torch.where(hard, y_hard, y), mu=torch.where(hard, m2_min, mu),
                  hard_case=hard)


def fit_down_target(g: Tensor, m: Tensor, c_rms: Tensor) -> tuple[Tensor, Tensor]:
    """The down-projection output whose normalized, scaled value best matches ``g`` in L2
    (App. B.2, the paper's fit; what a frozen scale can reach at best, PAPER.md section 7).

    Args:
        g: (d,) target branch output ``dv + m * N(h_down,C)``.
        m: (d,) post-norm scale.
        c_rms: () the fixed RMS value, ``RMS(h_down,C)`` (keeps the down patch small).

    Returns:
        ``(h_target, hard_case)`` with ``h_target = c_rms * y`` in ``g``'s dtype.
    """
    fit = solve_rms_fit(g, m)
    return (c_rms.double() * fit.y).to(g.dtype), fit.hard_case


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


def stable_down_target(g: Tensor, m: Tensor, c_rms: Tensor, conditioned: Tensor | None = None
                       ) -> tuple[Tensor, Tensor]:
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
        conditioned: ``conditioned_scale(m.double())`` when already computed (it depends on
            the weights only: a run computes it once per layer).

    Returns:
        ``(h_target, hard_case)`` with ``h_target = c_rms * y`` in ``g``'s dtype.
    """
    fit = solve_rms_fit(g, conditioned_scale(m.double()) if conditioned is None else conditioned)
    y = fit.y
    floor = torch.full_like(y, DIRECTION_FLOOR)
    y = torch.where(y.abs() < DIRECTION_FLOOR, torch.where(y < 0, -floor, floor), y)
    y = y * torch.rsqrt((y * y).mean())
    return (c_rms.double() * y).to(g.dtype), fit.hard_case


def reachable_shift_bound(m: Tensor) -> float:
    """PAPER.md section 7: with ``m`` frozen, the branch ``m * N(.)`` moves by at most
    ``2 sqrt(d) max|m|``; a larger attention shift cannot be absorbed upstream of the norm."""
    return float(2.0 * m.numel() ** 0.5 * m.abs().max())
