"""Conditioning of the output control (issue 16): the direct update's ``dm = dv / N(h)`` explodes
where ``N(h)_j`` is tiny or ``m_j = 0``; the stable update keeps every entry bounded, and both stay
exact in float64. The saved patches of a float64 run are float64 and verify to 1e-6 of the
logit scale."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from ctxpatch.core.compare import RunSpec, iter_token_patches
from ctxpatch.core.export import PATCHES_FORMAT, save_patches
from ctxpatch.core.patches import conditioned_scale, fit_down_target, stable_down_target
from ctxpatch.core.prompt import build_prompt
from ctxpatch.core.results import ENTRY_BOUND, conditioning
from ctxpatch.core.verify import read_patches, verify_patches
from tiny import gemma3_config, tiny_loaded

EXACT = 1e-6


def _ill_conditioned() -> object:
    """A tiny Gemma 3 whose down projections make ``N(h)_0`` tiny (row 0 scaled by 1e-9) and
    whose post-FF scale ``m = 1 + w`` is exactly 0 in coordinate 1, in every layer."""
    loaded = tiny_loaded(gemma3_config(layers=4))
    with torch.no_grad():
        for layer in loaded.model.model.layers:
            layer.mlp.down_proj.weight[0] *= 1e-9
            layer.post_feedforward_layernorm.weight[1] = -1.0
    return loaded


@pytest.fixture(scope="module")
def ill() -> object:
    return _ill_conditioned()


def _run(loaded, method: str, **kw):  # type: ignore[no-untyped-def]
    prompt = build_prompt(loaded.tokenizer, "The quick brown fox jumps over the lazy dog.",
                          "Hello world!")
    settings = RunSpec(max_new_tokens=4, method=method, **kw)
    return settings, list(iter_token_patches(loaded, prompt, settings))


@pytest.mark.parametrize("absorb", ["context", "all"])
def test_direct_explodes_where_stable_stays_bounded_both_exact(ill, absorb: str) -> None:  # type: ignore[no-untyped-def]
    _, direct = _run(ill, "direct", absorb=absorb)
    _, stable = _run(ill, "stable", absorb=absorb)
    for steps in (direct, stable):  # both exact in float64 (rank-1 actions)
        assert all(s.patched.match for s in steps)
        assert max(s.patched.linf / s.logit_scale for s in steps) <= EXACT
    d, s = conditioning(direct), conditioning(stable)
    # the direct update divides by N(h)_0 ~ 1e-9: its scale patch is huge and flagged
    assert d["max_abs_scale_patch"] > 1e6
    assert d["max_entry_ratio"] > 1e5 and d["unbounded_layers"] > 0
    # the stable update aims the down patch away from the tiny and zero coordinates
    assert s["max_entry_ratio"] < 10 and s["unbounded_layers"] == 0
    assert s["max_abs_scale_patch"] < 1e-4 * d["max_abs_scale_patch"]


def test_stable_patches_of_an_ill_conditioned_model_verify_in_float64(ill, tmp_path) -> None:  # type: ignore[no-untyped-def]
    settings, steps = _run(ill, "stable", absorb="context", keep_patches=True)
    path = tmp_path / "p.safetensors"
    save_patches(path, steps, "tiny", "float64", settings)
    pf = read_patches(path)
    assert pf.metadata["format"] == PATCHES_FORMAT == "ctxpatch-patches/2"
    assert pf.conditioning is not None and pf.conditioning["unbounded_layers"] == 0
    assert all(t.dtype == torch.float64 for s in pf.patches.values() for p in s.values()
               for t in p.values())
    checks = verify_patches(ill, pf)
    assert all(c.match for c in checks)
    assert max(c.linf / c.scale for c in checks) <= EXACT


def test_the_conditioned_target_is_bounded_where_the_papers_fit_divides_by_zero() -> None:
    """Unit level: with ``m_k = 0`` the paper's fit puts ``y_k = 0`` (so ``dm_k = g_k / 0``);
    the conditioned target keeps ``|y_k|`` above the floor, and with no attention shift
    (``g = m * y_C``) and no small ``m`` it is the full-context direction itself."""
    g64 = torch.float64
    gen = torch.Generator().manual_seed(3)
    m = torch.rand(64, generator=gen, dtype=g64) + 0.5
    m[:3] = 0.0
    g = torch.randn(64, generator=gen, dtype=g64)
    c = torch.tensor(2.0, dtype=g64)
    paper, _ = fit_down_target(g, m, c)
    ours, _ = stable_down_target(g, m, c)
    assert torch.all(paper[:3] == 0)
    for h in (paper, ours):  # both on the RMS sphere of radius c
        assert torch.isclose(h.pow(2).mean().sqrt(), c)
    y = ours / c
    dm = g / y - m
    assert float(y.abs().min()) >= 1e-2 * 0.99
    assert float(dm.abs().max()) < 1e3 * float(m.pow(2).mean().sqrt())
    # no shift and no small m: the target is the full-context direction, so dm = 0
    m2 = torch.rand(64, generator=gen, dtype=g64) + 0.5
    y_c = torch.randn(64, generator=gen, dtype=g64)
    y_c = y_c / y_c.pow(2).mean().sqrt()
    y_c = torch.where(y_c.abs() < 0.05, torch.full_like(y_c, 0.05), y_c)
    y_c = y_c / y_c.pow(2).mean().sqrt()
    h, _ = stable_down_target(m2 * y_c, m2, c)
    assert torch.allclose(h / c, y_c, atol=1e-10)
    assert torch.equal(conditioned_scale(m2), m2)


def test_bound_flag_follows_the_entry_ratio(ill) -> None:  # type: ignore[no-untyped-def]
    _, steps = _run(ill, "direct", absorb="all")
    for s in steps:
        for layer, info in s.layer_info.items():
            worst = max(v["entry_ratio"] for v in s.patch_norms[layer].values())
            assert info["entry_ratio"] == worst
            assert info["unbounded"] == (worst > ENTRY_BOUND)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_patch_sizes_a_step_shows_are_measured_in_float64(dtype: torch.dtype) -> None:
    """Each patch's norms and its ratios to its parameter (a post-norm scale counts as
    ``offset + weight``) against float64 references computed here from the saved vectors and
    the weights: the step's norms come from float32 block norms (no float64 copy of a matrix)
    and must still agree to 1e-6."""
    import math

    loaded = tiny_loaded(gemma3_config(layers=2), dtype=dtype)
    params = dict(loaded.model.named_parameters())
    _, steps = _run(loaded, "stable", absorb="all", keep_patches=True)
    offset = loaded.adapter.norm_offset
    checked = 0
    for step in steps:
        assert step.patches is not None
        for norms in step.patch_norms.values():
            for name, n in norms.items():
                p = params[name].detach().double()
                p = p + offset if "norm" in name else p
                if "frobenius" in n:
                    u = torch.from_numpy(step.patches[f"{name}.u"]).double()
                    v = torch.from_numpy(step.patches[f"{name}.v"]).double()
                    size, top = float(u.norm() * v.norm()), float(u.abs().max() * v.abs().max())
                    assert math.isclose(n["frobenius"], size, rel_tol=1e-6)
                else:
                    d = torch.from_numpy(step.patches[f"{name}.delta"]).double()
                    size, top = float(d.norm()), float(d.abs().max())
                    assert math.isclose(n["l2"], size, rel_tol=1e-6)
                assert math.isclose(n["relative"], size / float(p.norm()), rel_tol=1e-6), name
                assert math.isclose(n["entry_ratio"], top / float(p.abs().max()), rel_tol=1e-6)
                checked += 1
    assert checked >= 8 * len(steps)


def test_a_patched_bias_of_zeros_reports_no_ratio(tmp_path: Path) -> None:
    """A patch of an all-zero bias has no entry ratio (infinite; the record stores null): the
    command line still prints its conditioning line, and the record validates (issue 36 #27)."""
    from ctxpatch.app.cli import main
    from ctxpatch.core.controllability import conditioning_line
    from ctxpatch.core.record import check_record
    from tiny import tiny_config

    config = tiny_config("starcoder2")
    loaded = tiny_loaded(config, dtype=torch.float32)
    for block in loaded.model.model.layers:
        torch.nn.init.zeros_(block.mlp.c_proj.bias)
    loaded.model.save_pretrained(tmp_path / "m")
    loaded.tokenizer.save_pretrained(tmp_path / "m")
    out = tmp_path / "run.json"
    err = io.StringIO()
    with contextlib.redirect_stdout(err), contextlib.redirect_stderr(err):
        assert main(["compare", "--model", str(tmp_path / "m"), "--context", "a b c",
                     "--query", "d e", "--max-new-tokens", "2", "--output-control", "bias",
                     "--json", str(out)]) == 0
    assert "largest patch entry without a ratio" in err.getvalue()
    record = json.loads(out.read_text())
    assert record["summary"]["conditioning"]["max_entry_ratio"] is None
    check_record(record)
    assert "without a ratio" in conditioning_line({"max_entry_ratio": float("nan")})
