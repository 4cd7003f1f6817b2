"""Unit tests of the patch mathematics (PAPER.md sections 2, 4, 5, 7)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from ctxpatch.core import patches, secular_jit
from ctxpatch.core.patches import (
    down_patch_row,
    matrix_output_patch,
    rank1_input_patch,
    reachable_shift_bound,
    rms_normalize,
    scale_patch,
    solve_rms_fit,
    stable_down_target,
    stable_poles,
)

#: the secular solve compiled by numba on the host (CPU tensors' default where the ``fast``
#: extra is installed; skipped where it is not) and on torch (every device's, and CPU
#: tensors' without numba)
SOLVES = pytest.mark.parametrize("solve", ["compiled", "torch"], indirect=True)


@pytest.fixture
def solve(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Where the solve runs (`SOLVES`): `patches.JIT` set."""
    if request.param == "compiled":
        pytest.importorskip("numba")
        assert secular_jit.kernel() is not None, "numba is installed: the solve must compile"
    monkeypatch.setattr(patches, "JIT", request.param == "compiled")
    return str(request.param)


@pytest.fixture(autouse=True)
def _float64_by_default():  # type: ignore[no-untyped-def]
    """This module's tensors are float64 by default; restored after each test (set at import,
    it used to leak into every test of a whole run: GLM-4V's vision grid then broke)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _objective(m: torch.Tensor, y: torch.Tensor, g: torch.Tensor) -> float:
    return float(((m * y - g) ** 2).sum())


def _sphere(x: torch.Tensor) -> torch.Tensor:
    return x / x.pow(2).mean().sqrt()


def test_rank1_input_patch_maps_z_to_full_context_output() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(7, 5, generator=g)
    z, z_c = torch.randn(5, generator=g), torch.randn(5, generator=g)
    r = rank1_input_patch(w @ z_c, w @ z, z)
    assert r is not None
    patched = w + torch.outer(r.u, r.a)
    torch.testing.assert_close(patched @ z, w @ z_c, rtol=1e-12, atol=1e-12)
    # the paper's closed form W (z_C - z) z^T / |z|^2
    torch.testing.assert_close(torch.outer(r.u, r.a), w @ torch.outer(z_c - z, z) / z.dot(z))
    assert math.isclose(float(r.frobenius()), float(torch.outer(r.u, r.a).norm()), rel_tol=1e-12)


def test_a_zero_input_gives_a_void_patch_that_acts_as_nothing() -> None:
    """z = 0 (or h = 0): no rank-1 patch along it exists; the patch says so (``void``, a
    tensor: deciding needs no host sync) and is zero, so it changes nothing."""
    for r in (rank1_input_patch(torch.ones(3), torch.zeros(3), torch.zeros(4)),
              matrix_output_patch(torch.ones(3), torch.zeros(4))):
        assert isinstance(r.void, torch.Tensor) and bool(r.void)
        assert torch.equal(r.a, torch.zeros(4)) and torch.isfinite(r.u).all()
    ok = rank1_input_patch(torch.ones(3), torch.zeros(3), torch.ones(4))
    assert not bool(ok.void)


def test_matrix_output_patch_adds_shift() -> None:
    g = torch.Generator().manual_seed(2)
    w, h, dv = (torch.randn(4, 6, generator=g), torch.randn(6, generator=g),
                torch.randn(4, generator=g))
    r = matrix_output_patch(dv, h)
    assert r is not None
    torch.testing.assert_close((w + torch.outer(r.u, r.a)) @ h, w @ h + dv)


def test_scale_patch_divides_by_one_at_zeros() -> None:
    n = torch.tensor([2.0, 0.0, -4.0])
    dm, zeros = scale_patch(torch.tensor([1.0, 3.0, 2.0]), n)
    assert zeros == 1
    torch.testing.assert_close(dm, torch.tensor([0.5, 3.0, -0.5]))


@SOLVES
def test_rms_fit_recovers_a_reachable_target(solve: str) -> None:
    g = torch.Generator().manual_seed(3)
    m = torch.randn(64, generator=g).abs() + 0.2
    y_true = _sphere(torch.randn(64, generator=g))
    fit = solve_rms_fit(m * y_true, m)
    assert not fit.hard_case
    torch.testing.assert_close(fit.y, y_true, rtol=1e-9, atol=1e-9)
    assert abs(fit.mu) < 1e-9


@SOLVES
def test_rms_fit_is_the_global_minimiser(solve: str) -> None:
    g = torch.Generator().manual_seed(4)
    for trial in range(20):
        m = torch.randn(32, generator=g) * (0.1 + trial / 10)
        target = torch.randn(32, generator=g) * 3
        fit = solve_rms_fit(target, m)
        assert math.isclose(float(fit.y.pow(2).mean()), 1.0, rel_tol=1e-9)
        assert fit.mu < float((m * m).min())
        best = _objective(m, fit.y, target)
        for _ in range(200):  # no random feasible point does better
            other = _sphere(torch.randn(32, generator=g))
            assert best <= _objective(m, other, target) + 1e-9
        # and no nearby feasible point either (local optimality on the sphere)
        for _ in range(50):
            near = _sphere(fit.y + 1e-3 * torch.randn(32, generator=g))
            assert best <= _objective(m, near, target) + 1e-12


def _bisection_root(g: torch.Tensor, m: torch.Tensor) -> float:
    """The secular root by plain bisection (200 halvings of a bracket where F crosses 1): slow
    and obviously right, the reference for the Newton solve."""
    gm2, m2 = (g * m) ** 2, m * m
    live = gm2 > 0

    def f(mu: float) -> float:
        return float((gm2[live] / (m2[live] - mu) ** 2).sum()) / g.numel()

    hi = float(m2.min())
    lo = hi - float((g * m).abs().max()) - 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if f(mid) < 1 else (lo, mid)
    return lo


def _sphere_error(g: torch.Tensor, m: torch.Tensor, mu: float) -> float:
    d = m * m - mu
    y = g * m / torch.where(d == 0, torch.ones_like(d), d)
    return abs(float(y.pow(2).mean()) - 1)


@SOLVES
def test_rms_fit_matches_bisection_on_a_sweep(solve: str) -> None:
    """The secular solve lands on the sphere (within 1e-7, or as well as 200 bisection steps) over
    widths 4 to 640, scales 1e-3 to 1e2 of m and 1e-4 to 1e4 of g, zeros in m, all-positive m, and
    near-hard cases: the minimising coordinate's g almost zero, with the other coordinates' F at
    the pole 1 - delta (delta 1e-10 to 1e-1), or g there a few ulps, where only a finite fit below
    the pole is asked (a Newton solve tried in session 6 returned NaN there: its start rounded onto
    the pole; and stalled 1e-4 off the sphere in the first kind)."""
    gen = torch.Generator().manual_seed(11)
    checked = 0
    for trial in range(400):
        n = (4, 16, 64, 640)[trial % 4]
        m = (torch.randn(n, generator=gen)
             * 10 ** float(torch.empty(1).uniform_(-3, 2, generator=gen)))
        if trial % 3 == 0:
            m[torch.randint(n, (max(1, n // 10),), generator=gen)] = 0
        if trial % 5 == 0:
            m = m.abs() + 1e-3
        g = (torch.randn(n, generator=gen)
             * 10 ** float(torch.empty(1).uniform_(-4, 4, generator=gen)))
        k = int((m * m).argmin())
        if trial % 7 == 0:
            g[k] *= 1e-6
        if trial % 4 == 1:  # F at the pole from the other coordinates: 1 - delta
            others = (m * m) != (m * m)[k]
            gap = m * m - (m * m)[k]
            edge = float(((g * m)[others] / gap[others]).pow(2).sum()) / n
            if edge > 0:
                delta = 10 ** float(torch.empty(1).uniform_(-10, -1, generator=gen))
                g = torch.where(others, g * math.sqrt((1 - delta) / edge), g)
                g[k] *= 10 ** float(torch.empty(1).uniform_(-8, 0, generator=gen))
        ulps = trial % 11 == 0 and bool(m[k] != 0)
        if ulps:  # (the root is then within float64's resolution of the pole: finite is all)
            g[k] = 2e-16
        fit = solve_rms_fit(g, m)
        if fit.hard_case:
            continue
        checked += 1
        reference = _sphere_error(g, m, _bisection_root(g, m))
        assert torch.isfinite(fit.y).all(), trial
        assert float(fit.mu) < float((m * m).min())
        assert ulps or _sphere_error(g, m, float(fit.mu)) <= max(1e-7, 10 * reference), trial
    assert checked > 300


def _random_secular_cases() -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(kind, g, m) at widths 16, 64 and 640, other than the sweep's: 0 the scale conditioned as
    the stable update fits it (the root away from the pole); 1 near-hard (the minimiser's g m
    small, the other coordinates' F at the pole 1 - delta, delta 1e-9 to 1e-1); 2 no pole (m = 0
    at the minimiser) with the other coordinates' F there 1 + delta, delta 1e-9 to 1."""
    gen = torch.Generator().manual_seed(23)

    def power(lo: float, hi: float) -> float:  # 10^u, u uniform in [lo, hi]
        return 10 ** float(torch.empty(1).uniform_(lo, hi, generator=gen))

    for trial in range(120):
        kind, n = trial % 3, (16, 64, 640)[trial // 3 % 3]
        m = torch.randn(n, generator=gen) * power(-2, 1)
        g = torch.randn(n, generator=gen) * power(-2, 2)
        k = int((m * m).argmin())
        others = torch.arange(n) != k
        if kind == 0:
            tau = 0.1 * m.pow(2).mean().sqrt()
            m = torch.where(m.abs() < tau, torch.where(m < 0, -tau, tau), m)
        elif kind == 1:
            gap = m * m - (m * m)[k]
            edge = float(((g * m)[others] / gap[others]).pow(2).sum()) / n
            g = torch.where(others, g * math.sqrt((1 - power(-9, -1)) / edge), g)
            g[k] *= power(-9, -2)
        else:
            m[k] = 0.0
            edge = float(((g * m)[others] / (m * m)[others]).pow(2).sum()) / n
            g = g * math.sqrt((1 + power(-9, 0)) / edge)
        yield kind, g, m


@SOLVES
def test_rms_fit_agrees_with_bisection_on_random_cases(solve: str) -> None:
    """The fixed-step safeguarded solve against 200 float64 bisection steps: on the sphere as
    well as the bisection (the sweep's accuracy), mu on its side of the root (F <= 1), and the
    same distance to the pole: to 1e-12 where the root is away from the pole, to 1e-6 where F is
    nearly flat in mu near the root (near-hard, no pole). Fails with 4 steps instead of 6."""
    for trial, (kind, g, m) in enumerate(_random_secular_cases()):
        fit = solve_rms_fit(g, m)
        assert not fit.hard_case, trial
        pole = float((m * m).min())
        mu, reference = float(fit.mu), _bisection_root(g, m)
        assert mu < pole and torch.isfinite(fit.y).all(), trial
        assert fit.y.dtype == torch.float64 and fit.mu.dtype == torch.float64
        assert _sphere_error(g, m, mu) <= max(1e-7, 10 * _sphere_error(g, m, reference)), trial
        assert float(fit.y.pow(2).mean()) <= 1 + 1e-14, trial
        tol = 1e-12 if kind == 0 else 1e-6
        assert abs(mu - reference) <= tol * (pole - reference), (trial, mu, reference)


def test_rms_fit_makes_no_host_sync() -> None:
    """The solve and the stable target stay on the device (a fixed number of steps, conditions
    as tensors): no value crosses to the host, in the regular case or the hard one."""
    from ctxpatch.core.bench import counting_host_syncs

    gen = torch.Generator().manual_seed(29)
    g = torch.randn(640, generator=gen, dtype=torch.float32)
    m = torch.randn(640, generator=gen, dtype=torch.float32)
    with counting_host_syncs() as count:
        fits = [solve_rms_fit(g, m), solve_rms_fit(torch.tensor([5.0, 0.1, 0.1, 0.1]),
                                                   torch.tensor([0.0, 1.0, 2.0, 3.0]))]
        stable_down_target(g, m, torch.tensor(1.5))
    assert count[0] == 0
    assert not fits[0].hard_case and fits[1].hard_case


@SOLVES
def test_rms_fit_hard_case(solve: str) -> None:
    # m_0 = 0 attains min m^2 and g_0 m_0 = 0; the other coordinates are small, so F stays < 1.
    m = torch.tensor([0.0, 1.0, 2.0, 3.0])
    target = torch.tensor([5.0, 0.1, 0.1, 0.1])
    fit = solve_rms_fit(target, m)
    assert fit.hard_case
    assert fit.mu == 0.0
    assert torch.isfinite(fit.y).all()
    assert math.isclose(float(fit.y.pow(2).mean()), 1.0, rel_tol=1e-12)
    g = torch.Generator().manual_seed(5)
    best = _objective(m, fit.y, target)
    for _ in range(2000):
        assert best <= _objective(m, _sphere(torch.randn(4, generator=g)), target) + 1e-9


def test_stable_down_target_has_the_fixed_rms() -> None:
    g = torch.Generator().manual_seed(6)
    m, target = torch.randn(16, generator=g), torch.randn(16, generator=g)
    h, hard = stable_down_target(target, m, torch.tensor(2.5))
    assert not hard
    assert math.isclose(float(h.pow(2).mean().sqrt()), 2.5, rel_tol=1e-9)


def test_counterexample_frozen_scale_cannot_reach_large_shift() -> None:
    """PAPER.md section 7: with m frozen, m * N(.) is bounded, so a large dv is unreachable."""
    g = torch.Generator().manual_seed(7)
    d = 16
    m = torch.randn(d, generator=g)
    bound = reachable_shift_bound(m)
    assert math.isclose(bound, 2 * math.sqrt(d) * float(m.abs().max()))
    h_c = torch.randn(d, generator=g)
    base = m * rms_normalize(h_c, 1e-6)
    dv = torch.randn(d, generator=g)
    dv = dv / dv.norm() * (1.5 * bound)
    goal = base + dv
    # the best any upstream change (W_gate, W_up, W_down) can do: the optimal point on the RMS
    # sphere, whatever its RMS (the norm output is scale invariant)
    fit = solve_rms_fit(goal, m)
    residual = float((m * fit.y - goal).norm())
    assert residual >= float(dv.norm()) - bound > 0
    # while a shift inside the bound is reached exactly when it is of the branch's form
    reachable = m * _sphere(torch.randn(d, generator=g))
    fit2 = solve_rms_fit(reachable, m)
    assert float((m * fit2.y - reachable).norm()) < 1e-9


@SOLVES
def test_the_solve_takes_parameters(solve: str) -> None:
    """A scale straight from a module (a Parameter, or a target that requires grad) is solved as
    its values are: the device path writes into buffers, which autograd would refuse."""
    gen = torch.Generator().manual_seed(11)
    m = torch.nn.Parameter(torch.randn(24, generator=gen))
    g = torch.randn(24, generator=gen).requires_grad_()
    fit = solve_rms_fit(g, m)
    plain = solve_rms_fit(g.detach(), m.detach())
    assert torch.equal(fit.y, plain.y) and not fit.y.requires_grad
    h, _ = stable_down_target(g, m, torch.tensor(1.5))
    assert torch.equal(h, stable_down_target(g.detach(), m.detach(), torch.tensor(1.5))[0])


def _edge_secular_cases() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Inputs where the solve's IEEE conventions decide: zeros, NaN, infinities, overflowing
    squares, ties at the pole, one coordinate, the hard case."""
    yield torch.tensor([5.0, 0.1, 0.1, 0.1]), torch.tensor([0.0, 1.0, 2.0, 3.0])  # hard
    yield torch.tensor([0.1, 5.0, 0.1, 3.0]), torch.tensor([3.0, 0.0, 2.0, 0.0])  # hard, tied
    yield torch.zeros(6), torch.linspace(0.5, 2.0, 6)
    yield torch.ones(6), torch.ones(6)  # every coordinate a minimiser
    yield torch.tensor([2.0]), torch.tensor([0.5])
    yield torch.tensor([1.0, math.nan, 2.0]), torch.tensor([1.0, 2.0, 3.0])
    yield torch.tensor([1.0, math.inf, 2.0]), torch.tensor([1.0, 2.0, 3.0])
    yield torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1e200, 2.0, 3.0])  # m^2 overflows
    yield torch.tensor([1e-300, 2.0, 3.0]), torch.tensor([1e-160, 2.0, 3.0])
    yield torch.tensor([0.0, 1.0, -1.0, 0.0]), torch.tensor([0.0, 0.0, 1.0, 2.0])  # a tied pole
    for _, g, m in _random_secular_cases():
        yield g, m


def _same(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    """Equal NaN and infinity patterns, the finite entries within ``rel`` of the largest."""
    if not torch.equal(a.isnan(), b.isnan()) or not torch.equal(a.isinf(), b.isinf()):
        return False
    fin = a.isfinite()
    if not torch.equal(a[~fin & ~a.isnan()], b[~fin & ~b.isnan()]):
        return False
    size = float(a[fin].abs().max()) if bool(fin.any()) else 0.0
    return bool(((a[fin] - b[fin]).abs() <= rel * max(size, 1e-300)).all())


def test_the_compiled_solve_is_the_torch_solve(monkeypatch: pytest.MonkeyPatch) -> None:
    """`core.secular_jit` against `_secular` on torch: the fit, its root, the hard case and the
    stable target (floor, RMS), on regular inputs and on those where NaN, infinities and ties
    decide; only the order of the sums and the compiled solve's early stop differ."""
    pytest.importorskip("numba")
    assert secular_jit.kernel() is not None
    checked = 0
    for case, (g, m) in enumerate(_edge_secular_cases()):
        runs = {}
        for jit in (True, False):
            monkeypatch.setattr(patches, "JIT", jit)
            fitted = stable_poles(m)
            assert isinstance(fitted, patches.HostPoles) == jit
            with torch.no_grad():
                runs[jit] = (solve_rms_fit(g, m),
                             stable_down_target(g, m, torch.tensor(1.5), fitted))
        (fit, (h, hard)), (ref, (h_ref, hard_ref)) = runs[True], runs[False]
        assert bool(fit.hard_case) == bool(ref.hard_case) and hard == hard_ref, case
        # mu to 1e-6 of its distance to the pole where the root sits near it (F flat in mu
        # there: the sums' order moves it; the bisection test's tolerance), y to 1e-12
        mu, mu_ref, pole = float(fit.mu), float(ref.mu), float(m.double().pow(2).min())
        assert _same(torch.tensor([mu]), torch.tensor([mu_ref]), math.inf), (case, mu, mu_ref)
        assert not math.isfinite(mu) or abs(mu - mu_ref) <= 1e-6 * max(
            abs(mu_ref), pole - mu_ref), (case, mu, mu_ref)
        assert _same(fit.y, ref.y, 1e-12), (case, fit.y, ref.y)
        assert _same(h, h_ref, 1e-12), (case, h, h_ref)
        checked += 1
    assert checked > 100


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("raise_floor", [True, False], ids=["stable", "fit"])
def test_the_compiled_down_row_is_the_composed_one(dtype: torch.dtype, raise_floor: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`patches.down_patch_row` against the composition it replaces at a decoding step (the
    target of `stable_down_target` or `fit_down_target`, `matrix_output_patch` of its shift
    from the row, the patch's action on the row): the same vectors to the dtype's rounding; a
    zero input row is void (``a = 0``, the row unchanged); None where it cannot run."""
    pytest.importorskip("numba")
    gen = torch.Generator().manual_seed(3)
    rel = 1e-6 if dtype == torch.float32 else 1e-12
    for trial in range(30):
        m, g, down, y = (torch.randn(16, generator=gen) * s for s in (1.0, 2.0, 0.5, 3.0))
        m[trial % 16] *= 1e-3 if trial % 3 else 0.0  # (a scale the conditioning raises)
        x = torch.zeros(40) if trial == 0 else torch.randn(40, generator=gen)
        if trial == 1:  # (|x|^2 underflows in float32: void there, as the composed patch)
            x = torch.full((40,), 1e-41 if dtype == torch.float32 else 1e-300)
        if trial == 2 and not raise_floor:  # the hard case (a zero scale, no target there)
            m, g = torch.linspace(0.0, 3.0, 16), torch.full((16,), 0.01)
        g, down, x, y, m = (v.to(dtype) for v in (g, down, x, y, m))
        fitted = stable_poles(m) if raise_floor else patches.poles(m)
        out = down_patch_row(g, down, x, y, fitted, raise_floor)
        assert out is not None
        r, row, hard = out
        target = stable_down_target if raise_floor else patches.fit_down_target
        h, hard_ref = target(g, m, down.pow(2).mean().sqrt(), fitted)
        ref = matrix_output_patch(h - y, x)
        size = float(torch.maximum(h.abs().max(), y.abs().max()))
        assert hard == bool(hard_ref) and hard == (trial == 2 and not raise_floor)
        assert bool(r.void) == bool(ref.void) == (trial < 2)
        assert r.u.dtype == r.a.dtype == row.dtype == dtype
        assert float((r.u - ref.u).abs().max()) <= rel * size, trial
        assert torch.allclose(r.a, ref.a, rtol=rel, atol=0.0), trial
        assert float((row - (y + (x @ ref.a) * ref.u)).abs().max()) <= 4 * rel * size, trial
        if trial < 2:  # (a is x over 1 there, as in `_along`: it acts as nothing on x)
            assert torch.equal(row, y) and torch.equal(r.a, ref.a)
    assert down_patch_row(g, down.double() if dtype == torch.float32 else down.float(), x, y,
                          fitted, raise_floor) is None
    # lengths that do not match: None here, so the composition raises (the compiled loops do
    # not check bounds); the solve itself says so in one line
    assert down_patch_row(g, down, x, y[:-1], fitted, raise_floor) is None
    assert down_patch_row(g[:-1], down, x, y[:-1], fitted, raise_floor) is None
    assert down_patch_row(g, down, x[::2], y, fitted, raise_floor) is None  # (a strided view)
    with pytest.raises(ValueError, match="shape"):
        solve_rms_fit(torch.ones(17, dtype=dtype), m)
    monkeypatch.setattr(patches, "JIT", False)  # (poles on torch: no compiled call)
    assert down_patch_row(g, down, x, y, patches.poles(m), raise_floor) is None
