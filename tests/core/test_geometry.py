"""Patch geometry (ANALYSIS.md section A2, `ctxpatch.core.geometry`): everything the module
computes from the factors equals what the materialised patches give (float64), the spectrum's
summaries behave as their definitions say on patches built to have a known answer, and the
output is plain JSON."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ctxpatch.core.geometry import (
    effective_rank,
    energy,
    layer_of,
    patch_geometry,
    role_of,
    singular_values,
    summed_rank,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAME = "model.layers.3.mlp.gate_proj.weight"
SCALE = "model.layers.3.post_feedforward_layernorm.weight"


def _matrices(steps, name, shape):
    """The materialised patches of ``name``, one per step (zero where it is missing)."""
    out = []
    for step in steps:
        if f"{name}.u" in step:
            out.append(np.outer(step[f"{name}.u"].astype(np.float64),
                                step[f"{name}.v"].astype(np.float64)))
        elif f"{name}.delta" in step:
            out.append(np.asarray(step[f"{name}.delta"], dtype=np.float64))
        else:
            out.append(np.zeros(shape))
    return out


def _dense_gram(mats):
    x = np.stack([m.ravel() for m in mats])
    inner = x @ x.T
    norms = np.linalg.norm(x, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = inner / np.outer(norms, norms)
    return inner, cos, x


def _as_array(gram):
    return np.array([[math.nan if c is None else c for c in row] for row in gram])


def _rank1_steps(us, vs, name=NAME):
    return [{f"{name}.u": u, f"{name}.v": v} for u, v in zip(us, vs, strict=True)]


def test_layer_and_role_come_from_the_name() -> None:
    cases = {
        NAME: (3, "model.layers.{}.mlp.gate_proj.weight"),
        "transformer.h.11.attn.c_attn.weight": (11, "transformer.h.{}.attn.c_attn.weight"),
        "encoder.blocks.0.ff.bias": (0, "encoder.blocks.{}.ff.bias"),
        "bert.encoder.layer.7.output.dense.weight":
            (7, "bert.encoder.layer.{}.output.dense.weight"),
        "model.layers.2.mlp.experts.gate_up_proj[5]":
            (2, "model.layers.{}.mlp.experts.gate_up_proj[5]"),
        "model.language_model.layers.12.mlp.down_proj.weight":
            (12, "model.language_model.layers.{}.mlp.down_proj.weight"),
        "lm_head.weight": (None, None),
        "model.norm.weight": (None, None),
        "model.layers_extra.3.weight": (None, None),
        "model.layers.x3.weight": (None, None),
    }
    for name, (layer, role) in cases.items():
        assert (layer_of(name), role_of(name)) == (layer, role), name


def test_factor_gram_equals_the_materialised_one_with_zero_and_missing_patches() -> None:
    rng = np.random.default_rng(0)
    m, n, t = 7, 11, 6
    steps = _rank1_steps(rng.standard_normal((t, m)), rng.standard_normal((t, n)))
    steps[2][f"{NAME}.u"] = np.zeros(m)  # a zero patch (u = 0)
    del steps[4][f"{NAME}.u"], steps[4][f"{NAME}.v"]  # missing at step 4 (an inactive expert)
    entry = patch_geometry(steps)["params"][NAME]
    inner, cos, _ = _dense_gram(_matrices(steps, NAME, (m, n)))
    assert entry["shape"] == [m, n] and entry["kind"] == "rank1" and entry["layer"] == 3
    np.testing.assert_allclose(entry["inner"], inner, rtol=1e-12, atol=1e-12 * abs(inner).max())
    got = _as_array(entry["gram"])
    for zero in (2, 4):
        assert all(entry["gram"][zero][j] is None for j in range(t))
        assert all(entry["gram"][i][zero] is None for i in range(t))
    np.testing.assert_allclose(got, cos, rtol=1e-12, atol=1e-12)  # NaN where NaN
    assert not np.isnan(np.delete(np.delete(got, [2, 4], 0), [2, 4], 1)).any()


def test_factor_gram_is_computed_in_float64_from_float32_patches() -> None:
    rng = np.random.default_rng(1)
    us = rng.standard_normal((5, 300)).astype(np.float32)
    vs = rng.standard_normal((5, 200)).astype(np.float32)
    entry = patch_geometry(_rank1_steps(us, vs))["params"][NAME]
    inner, cos, _ = _dense_gram(_matrices(_rank1_steps(us, vs), NAME, (300, 200)))
    np.testing.assert_allclose(entry["inner"], inner, rtol=1e-12)
    np.testing.assert_allclose(entry["gram"], cos, rtol=1e-12, atol=1e-13)


def test_delta_gram_equals_the_materialised_one_with_zero_and_missing_patches() -> None:
    rng = np.random.default_rng(2)
    d, t = 9, 5
    steps = [{f"{SCALE}.delta": rng.standard_normal(d)} for _ in range(t)]
    steps[1][f"{SCALE}.delta"] = np.zeros(d)
    steps[3] = {}
    entry = patch_geometry(steps)["params"][SCALE]
    inner, cos, x = _dense_gram(_matrices(steps, SCALE, (d,)))
    assert entry["kind"] == "delta" and entry["shape"] == [d]
    np.testing.assert_allclose(entry["inner"], inner, rtol=1e-12, atol=1e-12 * abs(inner).max())
    np.testing.assert_allclose(_as_array(entry["gram"]), cos, rtol=1e-12, atol=1e-12)
    assert entry["gram"][1][0] is None and entry["gram"][0][3] is None
    assert entry["gram"][1][1] is None and entry["gram"][0][0] == 1.0
    assert entry["summed_rank"] == 1
    np.testing.assert_allclose(entry["singular_values"], np.linalg.svd(x, compute_uv=False),
                               atol=1e-12 * np.linalg.norm(x))


def test_deltas_summing_to_zero_have_summed_rank_zero() -> None:
    d = np.array([1.0, -2.0, 0.5])
    entry = patch_geometry([{f"{SCALE}.delta": d}, {f"{SCALE}.delta": -d}])["params"][SCALE]
    assert entry["summed_rank"] == 0
    assert entry["gram"][0][1] == pytest.approx(-1.0, abs=1e-15)
    assert entry["effective_rank"] == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize(("t", "m", "n"), [(2, 5, 7), (5, 40, 30), (20, 300, 2000),
                                           (50, 64, 64)])
def test_identical_patches_have_effective_rank_one(t: int, m: int, n: int) -> None:
    rng = np.random.default_rng(t + m)
    u, v = rng.standard_normal(m), rng.standard_normal(n)
    same = patch_geometry(_rank1_steps([u] * t, [v] * t))["params"][NAME]
    a, b = rng.uniform(0.1, 10.0, t), rng.uniform(0.1, 10.0, t)
    scaled = patch_geometry(_rank1_steps([x * u for x in a], [y * v for y in b]))["params"][NAME]
    for entry in (same, scaled):
        assert entry["effective_rank"] == pytest.approx(1.0, abs=1e-9)
        assert entry["summed_rank"] == 1
        assert entry["energy"][0] == pytest.approx(1.0, abs=1e-12)
        np.testing.assert_allclose(entry["gram"], np.ones((t, t)), atol=1e-12)
        assert np.abs(entry["gram"]).max() <= 1.0  # a cosine, rounding included
    assert same["singular_values"][0] == pytest.approx(math.sqrt(t) * np.linalg.norm(u)
                                                       * np.linalg.norm(v), rel=1e-12)


@pytest.mark.parametrize(("t", "m", "n"), [(2, 5, 7), (6, 6, 9), (20, 300, 2000), (40, 50, 45)])
def test_orthogonal_patches_of_equal_norm_have_effective_rank_t(t: int, m: int, n: int) -> None:
    rng = np.random.default_rng(t * m)
    q, _ = np.linalg.qr(rng.standard_normal((m, t)))  # orthonormal u's
    vs = rng.standard_normal((t, n))
    vs /= np.linalg.norm(vs, axis=1, keepdims=True)
    entry = patch_geometry(_rank1_steps(3.0 * q.T, vs))["params"][NAME]
    assert entry["effective_rank"] == pytest.approx(t, abs=1e-9)
    assert entry["summed_rank"] == t
    np.testing.assert_allclose(entry["singular_values"], np.full(t, 3.0), rtol=1e-12)
    np.testing.assert_allclose(entry["energy"], np.arange(1, t + 1) / t, rtol=1e-12)
    np.testing.assert_allclose(entry["gram"], np.eye(t), atol=1e-12)


def _deficient_cases():
    rng = np.random.default_rng(3)
    m, n = 8, 10
    u1, u2, v = rng.standard_normal(m), rng.standard_normal(m), rng.standard_normal(n)
    yield "u3 = u1 + u2, one v", [u1, u2, u1 + u2], [v, v, v]  # the sum is (2 u1 + 2 u2) vᵀ
    w = rng.standard_normal(n)
    yield "cancelling", [u1, u1, u2], [v, -v, w]  # u2 wᵀ: rank 1
    yield "u's in a plane", [a * u1 + b * u2 for a, b in rng.standard_normal((6, 2))], list(
        rng.standard_normal((6, n)))  # u1 (sum a_t v_t)ᵀ + u2 (sum b_t v_t)ᵀ: rank 2
    yield "low-rank V", list(rng.standard_normal((7, m))), list(
        rng.standard_normal((7, 3)) @ rng.standard_normal((3, n)))
    yield "more steps than dims", list(rng.standard_normal((12, 3))), list(
        rng.standard_normal((12, 5)))
    yield "all zero", [np.zeros(m)] * 3, list(rng.standard_normal((3, n)))
    yield "full", list(rng.standard_normal((5, m))), list(rng.standard_normal((5, n)))
    # a true direction 1e-9 of the largest: above matrix_rank's tolerance (~1e-15), counted
    yield "tiny but real", [u1, 1e-9 * u2], [v, w]


@pytest.mark.parametrize("case", list(_deficient_cases()), ids=lambda c: c[0])
def test_summed_rank_equals_matrix_rank_of_the_materialised_sum(case) -> None:
    _, us, vs = case
    t, m, n = len(us), len(us[0]), len(vs[0])
    steps = _rank1_steps(us, vs)
    total = sum(_matrices(steps, NAME, (m, n)))
    entry = patch_geometry(steps)["params"][NAME]
    assert entry["summed_rank"] == np.linalg.matrix_rank(total)
    assert entry["summed_rank"] <= min(t, m, n)


def test_the_deficient_cases_are_deficient() -> None:
    """The cases above reach below min(T, M, N), so the rank is not just counted steps."""
    ranks = {}
    for label, us, vs in _deficient_cases():
        ranks[label] = patch_geometry(_rank1_steps(us, vs))["params"][NAME]["summed_rank"]
    assert ranks == {"u3 = u1 + u2, one v": 1, "cancelling": 1, "u's in a plane": 2,
                     "low-rank V": 3, "more steps than dims": 3, "all zero": 0, "full": 5,
                     "tiny but real": 2}


@FAST
@given(t=st.integers(1, 12), m=st.integers(1, 9), n=st.integers(1, 9), ru=st.integers(1, 9),
       rv=st.integers(1, 9), seed=st.integers(0, 2**32 - 1), missing=st.integers(-1, 11))
def test_rank_and_spectrum_equal_the_materialised_ones(t, m, n, ru, rv, seed, missing) -> None:
    """Random factors of chosen ranks (U = A B with A of ru columns, V likewise), one step
    possibly missing: summed rank and singular values equal NumPy's on the dense matrices."""
    rng = np.random.default_rng(seed)
    us = rng.standard_normal((t, ru)) @ rng.standard_normal((ru, m))
    vs = rng.standard_normal((t, rv)) @ rng.standard_normal((rv, n))
    steps = _rank1_steps(us, vs)
    if missing < t and t > 1:
        steps[missing] = {}
    mats = _matrices(steps, NAME, (m, n))
    entry = patch_geometry(steps)["params"][NAME]
    assert entry["summed_rank"] == np.linalg.matrix_rank(sum(mats))
    assert entry["summed_rank"] <= min(t, m, n)
    _, _, x = _dense_gram(mats)
    dense = np.linalg.svd(x, compute_uv=False)
    dense = np.concatenate([dense, np.zeros(t - len(dense))])
    got = np.array(entry["singular_values"])
    assert len(got) == t and (np.diff(got) <= 0).all() and (got >= 0).all()
    np.testing.assert_allclose(got, dense, rtol=1e-9, atol=1e-7 * max(dense[0], 1e-300))


@pytest.mark.parametrize("seed", range(5))
def test_singular_values_equal_the_svd_of_the_materialised_stack(seed: int) -> None:
    rng = np.random.default_rng(seed)
    t, m, n = 9, 12, 15
    us = rng.standard_normal((t, m)) * rng.uniform(0.01, 100.0, (t, 1))
    vs = rng.standard_normal((t, n))
    us[4] = us[1] + 2 * us[2]  # a dependent step: the stack still has rank T (v's differ)
    vs[7] = vs[6]
    us[7] = -us[6]  # P_7 = -P_6: the stack loses one rank
    steps = _rank1_steps(us, vs)
    _, _, x = _dense_gram(_matrices(steps, NAME, (m, n)))
    dense = np.linalg.svd(x, compute_uv=False)
    entry = patch_geometry(steps)["params"][NAME]
    np.testing.assert_allclose(entry["singular_values"], dense, rtol=1e-9, atol=1e-9 * dense[0])
    assert entry["singular_values"][-1] == 0.0  # below the Gram's rounding: exactly zero
    p = dense[:-1] / dense[:-1].sum()
    assert entry["effective_rank"] == pytest.approx(math.exp(-(p * np.log(p)).sum()), rel=1e-9)
    share = np.cumsum(dense**2) / (dense**2).sum()
    np.testing.assert_allclose(entry["energy"], share, rtol=1e-9)


def test_effective_rank_and_energy_by_their_definitions() -> None:
    assert effective_rank([1.0, 1.0, 1.0, 1.0]) == pytest.approx(4.0, abs=1e-12)
    assert effective_rank([5.0, 0.0, 0.0]) == 1.0
    assert effective_rank([0.0, 0.0]) == 0.0 and effective_rank([]) == 0.0
    h = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))  # p = (3, 1) / 4
    assert effective_rank([3.0, 1.0]) == pytest.approx(math.exp(h), rel=1e-12)
    assert effective_rank([1.0, 3.0, 0.0]) == pytest.approx(math.exp(h), rel=1e-12)
    with pytest.raises(ValueError):
        effective_rank([1.0, -0.5])
    with pytest.raises(ValueError):
        effective_rank([1.0, math.nan])
    assert energy([3.0, 1.0]) == pytest.approx([0.9, 1.0], rel=1e-15)
    assert energy([0.0, 0.0]) == [0.0, 0.0]


def test_singular_values_drop_rounding_but_not_small_true_values() -> None:
    g = np.diag([1.0, 1e-8, 0.0])
    np.testing.assert_allclose(singular_values(g), [1.0, 1e-4, 0.0], rtol=1e-12)
    noisy = np.ones((3, 3)) + np.diag([1e-17, -2e-16, 0.0])  # rank 1 up to rounding
    assert singular_values(noisy).tolist()[1:] == [0.0, 0.0]


def test_summed_rank_of_zero_factors_and_no_steps() -> None:
    assert summed_rank(np.zeros((3, 4)), np.ones((3, 5))) == 0
    assert summed_rank(np.zeros((0, 4)), np.zeros((0, 5))) == 0
    assert patch_geometry([]) == {"params": {}, "across_layers": {}}


def test_the_storage_orientation_does_not_matter() -> None:
    """Conv1D-style weights store (in, out): the patch is outer(v, u) there; cosines, inner
    products, spectrum and summed rank stay the same."""
    rng = np.random.default_rng(4)
    us, vs = rng.standard_normal((6, 5)), rng.standard_normal((6, 8))
    us[3] = us[0]
    a = patch_geometry(_rank1_steps(us, vs))["params"][NAME]
    b = patch_geometry(_rank1_steps(vs, us))["params"][NAME]
    assert b["shape"] == [8, 5]
    _, cos, _ = _dense_gram(_matrices(_rank1_steps(vs, us), NAME, (8, 5)))
    np.testing.assert_allclose(b["gram"], cos, rtol=1e-12, atol=1e-13)
    for key in ("gram", "inner", "singular_values", "energy"):
        np.testing.assert_allclose(a[key], b[key], rtol=1e-12, atol=1e-13)
    assert a["summed_rank"] == b["summed_rank"] == 5  # min(T, M, N)
    assert a["effective_rank"] == pytest.approx(b["effective_rank"], rel=1e-12)


def _layered_run(rng, t=4, layers=(4, 0, 2, 1)):
    m, n, d = 6, 5, 7
    steps = []
    for _ in range(t):
        step = {}
        for layer in layers:
            base = f"model.layers.{layer}"
            step[f"{base}.mlp.gate_proj.weight.u"] = rng.standard_normal(m)
            step[f"{base}.mlp.gate_proj.weight.v"] = rng.standard_normal(n)
            step[f"{base}.mlp.down_proj.weight.u"] = rng.standard_normal(n)
            step[f"{base}.mlp.down_proj.weight.v"] = rng.standard_normal(m)
            step[f"{base}.post_feedforward_layernorm.weight.delta"] = rng.standard_normal(d)
        step["model.layers.2.mlp.only_here.weight.delta"] = rng.standard_normal(d)
        step["lm_head.bias.delta"] = rng.standard_normal(d)
        steps.append(step)
    return steps


def test_across_layers_equals_the_materialised_cosines() -> None:
    rng = np.random.default_rng(5)
    steps = _layered_run(rng)
    gate = "model.layers.{}.mlp.gate_proj.weight"
    # layer 1 has no gate patch at step 2, and a zero one at step 3
    del steps[2]["model.layers.1.mlp.gate_proj.weight.u"]
    del steps[2]["model.layers.1.mlp.gate_proj.weight.v"]
    steps[3]["model.layers.1.mlp.gate_proj.weight.v"] = np.zeros(5)
    across = patch_geometry(steps)["across_layers"]
    assert set(across) == {gate, "model.layers.{}.mlp.down_proj.weight",
                           "model.layers.{}.post_feedforward_layernorm.weight"}
    for role, entry in across.items():
        assert entry["layers"] == [0, 1, 2, 4]
        assert len(entry["steps"]) == len(steps)
        for t, matrix in enumerate(entry["steps"]):
            names = [role.format(layer) for layer in entry["layers"]]
            shape = (7,) if "norm" in role else None
            mats = [_matrices([steps[t]], name, shape or (1, 1))[0] for name in names]
            if shape is None:  # rank-1: the missing one takes the others' shape
                full = next(x.shape for x in mats if x.shape != (1, 1))
                mats = [x if x.shape == full else np.zeros(full) for x in mats]
            _, cos, _ = _dense_gram(mats)
            got = _as_array(matrix)
            np.testing.assert_allclose(got, cos, rtol=1e-12, atol=1e-12)
            np.testing.assert_array_equal(got, got.T)
            zero = np.isnan(np.diag(cos))
            assert (np.diag(got)[~zero] == 1.0).all()
    gates = across[gate]["steps"]
    assert all(gates[2][1][j] is None for j in range(4)) and gates[2][0][1] is None
    assert all(gates[3][i][1] is None for i in range(4))
    assert gates[1][1][1] == 1.0


def test_a_role_with_layers_of_two_shapes_splits_by_shape() -> None:
    rng = np.random.default_rng(6)
    step = {f"model.layers.{i}.mlp.up_proj.weight.{p}": rng.standard_normal(k)
            for i, dims in enumerate([(4, 3), (4, 3), (6, 3), (6, 3), (8, 3)])
            for p, k in zip("uv", dims, strict=True)}
    across = patch_geometry([step, step])["across_layers"]
    assert sorted(across) == ["model.layers.{}.mlp.up_proj.weight 4x3",
                              "model.layers.{}.mlp.up_proj.weight 6x3"]
    assert across["model.layers.{}.mlp.up_proj.weight 6x3"]["layers"] == [2, 3]


def _plain(x) -> bool:
    if isinstance(x, dict):
        return all(type(k) is str and _plain(v) for k, v in x.items())
    if isinstance(x, list):
        return all(_plain(v) for v in x)
    return x is None or type(x) in (int, float, str)


def test_the_output_is_plain_json() -> None:
    rng = np.random.default_rng(7)
    steps = _layered_run(rng, t=3)
    steps[1]["model.layers.0.mlp.gate_proj.weight.u"] = np.zeros(6)  # a zero patch
    del steps[0]["model.layers.2.mlp.down_proj.weight.u"]  # a missing one
    del steps[0]["model.layers.2.mlp.down_proj.weight.v"]
    bad = rng.standard_normal(6).astype(np.float32)
    bad[2] = np.nan  # a faulted step (on_fault continue)
    steps[2]["model.layers.4.mlp.gate_proj.weight.u"] = bad
    steps[2]["model.layers.4.post_feedforward_layernorm.weight.delta"] = np.full(7, np.inf)
    out = patch_geometry(steps)
    assert _plain(out)
    back = json.loads(json.dumps(out, allow_nan=False))
    assert back == out
    faulted = out["params"]["model.layers.4.mlp.gate_proj.weight"]
    assert faulted["effective_rank"] is None and faulted["summed_rank"] is None
    assert faulted["gram"][2][0] is None and faulted["gram"][0][1] is not None
    assert out["params"]["lm_head.bias"]["layer"] is None
    assert isinstance(out["params"]["model.layers.0.mlp.gate_proj.weight"]["summed_rank"], int)


@pytest.mark.parametrize(("step", "message"), [
    ({f"{NAME}.u": np.ones(3)}, "expected u and v"),
    ({f"{NAME}.u": np.ones(3), f"{NAME}.v": np.ones(2), f"{NAME}.delta": np.ones(2)},
     "expected u and v"),
    ({f"{NAME}.w": np.ones(3)}, "not named"),
    ({f"{NAME}.u": np.ones((3, 1)), f"{NAME}.v": np.ones(2)}, "not a vector"),
])
def test_malformed_patches_are_refused(step, message) -> None:
    with pytest.raises(ValueError, match=message):
        patch_geometry([step])


def test_a_parameter_changing_shape_or_kind_is_refused() -> None:
    first = {f"{NAME}.u": np.ones(3), f"{NAME}.v": np.ones(2)}
    with pytest.raises(ValueError, match="shape"):
        patch_geometry([first, {f"{NAME}.u": np.ones(4), f"{NAME}.v": np.ones(2)}])
    with pytest.raises(ValueError, match="delta"):
        patch_geometry([first, {f"{NAME}.delta": np.ones(3)}])


def test_the_module_imports_no_torch() -> None:
    code = ("import sys; import ctxpatch.core.geometry; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
