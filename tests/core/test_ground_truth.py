"""Ground truth per architecture, on tiny random models in float64 (STYLE.md 17).

(a) the hook-patched reduced run's logits equal the full-context logits at every step;
(b) the saved patches, written into the weights, reproduce them with plain transformers;
(c) dropping a required patch breaks the equality (negative control).
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from ctxpatch.core.compare import RunSpec, iter_token_patches
from ctxpatch.core.export import save_patches
from ctxpatch.core.prompt import build_prompt
from ctxpatch.core.results import conditioning
from ctxpatch.core.verify import read_patches, verify_patches
from tiny import TINY, gemma3_config, tiny_config, tiny_loaded

CONTEXT = "The quick brown fox jumps over the lazy dog."
QUERY = "Hello world!"
TOKENS = 5
EXACT = 1e-6  # of the logit scale

FAMILIES = {
    "gemma3": lambda: gemma3_config(layers=4),
    **{name: (lambda name=name: tiny_config(name)) for name in TINY},
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def loaded(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    return tiny_loaded(FAMILIES[request.param]())


def _run(loaded, **kw):  # type: ignore[no-untyped-def]
    prompt = build_prompt(loaded.tokenizer, CONTEXT, QUERY)
    settings = RunSpec(max_new_tokens=TOKENS, **kw)
    return prompt, settings, list(iter_token_patches(loaded, prompt, settings))


def _plain_logits(model: torch.nn.Module, ids: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([list(ids)])).logits[0, -1]


@pytest.mark.parametrize(
    "method,absorb,scope",
    list(itertools.product(["direct", "stable"], ["context", "all"], ["all-positions", "query"])),
)
def test_patched_equals_full_context(loaded, method: str, absorb: str, scope: str) -> None:  # type: ignore[no-untyped-def]
    _, _, steps = _run(loaded, method=method, absorb=absorb, scope=scope)
    assert len(steps) == TOKENS
    for s in steps:
        assert s.patched.match
        assert s.patched.linf <= EXACT * s.logit_scale, (s.step, s.patched.linf, s.logit_scale)
        # the context matters: the unpatched reduced model is clearly off
        assert s.control.linf > 1e3 * EXACT * s.logit_scale
        # every patched layer ended on its full-context block output
        assert max(i["block_error"] for i in s.layer_info.values()) < 1e-5


def test_baseline_is_plain_greedy_generation(loaded) -> None:  # type: ignore[no-untyped-def]
    prompt, _, steps = _run(loaded, absorb="context")
    ids = torch.tensor([list(prompt.full_ids)])
    config = copy.deepcopy(loaded.model.generation_config)
    config.update(eos_token_id=None, max_new_tokens=TOKENS, do_sample=False)  # no early stop,
    with torch.no_grad():  # and no EOS suppression either (min_new_tokens would change argmaxes)
        out = loaded.model.generate(ids, generation_config=config)
    assert [s.baseline_token for s in steps] == out[0, ids.shape[1]:].tolist()
    for s in steps:  # and the baseline logits scale is that of the plain full forward
        full = _plain_logits(loaded.model, s.full_input_ids)
        # (Gemma's norms compute in float32 even here: cached and full forwards round apart)
        assert abs(float(full.abs().max()) - s.logit_scale) <= EXACT * s.logit_scale


@pytest.mark.parametrize("absorb,scope", [("context", "all-positions"), ("context", "query"),
                                          ("all", "all-positions")])
@pytest.mark.parametrize("method", ["direct", "stable"])
def test_saved_patches_reproduce_with_plain_weights(loaded, tmp_path, absorb, scope,  # type: ignore[no-untyped-def]
                                                    method) -> None:
    """Float64 patches (saved as float64) written into the weights reproduce the run to 1e-6
    of the logit scale when they are bounded. The tolerance follows the conditioning the run
    reports, not the machine: an unbounded direct scale patch (``dm = dv / N(h)`` with a tiny
    ``N(h)_j``) multiplies the rounding of Gemma's float32 norms by up to its entry ratio,
    and the stable update stays bounded on post-norm-scale families whose scale is not
    near zero everywhere (tests/core/test_conditioning.py)."""
    _, settings, steps = _run(loaded, absorb=absorb, scope=scope, method=method, keep_patches=True)
    path = tmp_path / "p.safetensors"
    save_patches(path, steps, "tiny", "float64", settings)
    cond = conditioning(steps)
    if method == "stable" and loaded.adapter.norm_offset == 1.0:  # Gemma's m = 1 + w
        assert cond["unbounded_layers"] == 0, cond
    tol = EXACT * max(1.0, cond["max_entry_ratio"])
    before = {n: p.detach().clone() for n, p in loaded.model.named_parameters()}
    checks = verify_patches(loaded, read_patches(path))
    assert len(checks) == TOKENS
    for c in checks:
        assert c.match
        assert c.linf <= tol * c.scale, (c.step, c.linf / c.scale, cond["max_entry_ratio"])
    for n, p in loaded.model.named_parameters():  # the weights were restored
        assert torch.equal(p, before[n]), n


def _parallel(loaded) -> bool:  # type: ignore[no-untyped-def]
    layers = loaded.adapter.layers(loaded.model)
    return all(loaded.adapter.sites(layer).parallel for layer in layers)


def test_negative_controls(loaded) -> None:  # type: ignore[no-untyped-def]
    """Without the output patch the logits differ; without the input patches (direct) too,
    except in parallel blocks, whose MLP input no longer depends on the context once the
    layer input matches (PAPER.md section 4: no input patch is needed there)."""
    def worst(disabled: str) -> float:
        return max(s.patched.linf / s.logit_scale for absorb in ("context", "all")
                   for s in _run(loaded, method="direct", absorb=absorb,
                                 disabled=frozenset({disabled}))[2])

    assert worst("output") > 1e3 * EXACT
    if _parallel(loaded):
        assert worst("input") <= EXACT
    else:  # (some tiny models' MLPs barely react: 10x the tolerance still tells it apart)
        assert worst("input") > 10 * EXACT


def test_every_output_control_is_exact(loaded) -> None:  # type: ignore[no-untyped-def]
    sites = loaded.adapter.sites(loaded.adapter.layers(loaded.model)[0])
    for control in loaded.adapter.output_controls:
        if control == "bias" and getattr(sites.out_matrix, "bias", None) is None:
            continue
        if control == "matrix" and sites.out_norm is not None:
            continue  # the frozen-scale demonstration, inexact by design (test_controllability)
        for absorb in ("context", "all"):
            _, _, steps = _run(loaded, absorb=absorb, output_control=control)
            assert all(s.patched.match for s in steps)
            assert max(s.patched.linf / s.logit_scale for s in steps) <= EXACT, (control, absorb)


def test_verify_detects_a_missing_patch(loaded, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import re

    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    _, settings, steps = _run(loaded, absorb="context", keep_patches=True)
    path = tmp_path / "p.safetensors"
    save_patches(path, steps, "tiny", "float64", settings)
    with safe_open(str(path), framework="np") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    last = len(loaded.adapter.layers(loaded.model)) - 1
    dropped = {k: v for k, v in tensors.items()
               if not re.search(rf"(layers|h|blocks)\.{last}\.", k)}
    assert 0 < len(dropped) < len(tensors)
    save_file(dropped, str(path), metadata=meta)
    checks = verify_patches(loaded, read_patches(path))
    assert max(c.linf / c.scale for c in checks) > 1e-3


def test_layer_selection(loaded) -> None:  # type: ignore[no-untyped-def]
    """Patching layers s..L is exact (the first patched layer absorbs all upstream mismatch);
    a selection that leaves the last layer unpatched is not (its attention still differs)."""
    n = len(loaded.adapter.layers(loaded.model))
    for spec, chosen in ((f"{n - 2}:", {n - 2, n - 1}), (f"{n - 1}", {n - 1}), ("1,3", {1, 3})):
        _, _, steps = _run(loaded, absorb="all", layers=spec)
        for s in steps:
            assert set(s.layer_info) == chosen
            assert s.patched.linf <= 1e-5 * s.logit_scale, spec
    _, _, steps = _run(loaded, absorb="all", layers=f":{n - 1}")
    assert max(s.patched.linf / s.logit_scale for s in steps) > 1e-3


def test_hooks_are_removed_after_runs_and_cancel(loaded) -> None:  # type: ignore[no-untyped-def]
    calls = {"n": 0}

    def stop() -> bool:
        calls["n"] += 1
        return calls["n"] > 3  # stop inside the first step, between layers

    prompt = build_prompt(loaded.tokenizer, CONTEXT, QUERY)
    steps = list(iter_token_patches(loaded, prompt, RunSpec(max_new_tokens=3), should_stop=stop))
    assert steps == []
    for module in loaded.model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_lower_precisions_run_and_stay_close(family: str, dtype: torch.dtype) -> None:
    low = tiny_loaded(FAMILIES[family](), dtype=dtype)
    for method in ("direct", "stable"):
        _, _, steps = _run(low, method=method, scope="query")
        for s in steps:
            assert s.patched.match
            assert s.patched.linf < 0.05 * s.control.linf


def test_a_saved_moe_model_loads_and_runs_in_float64(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Loading picks the eager experts for float64 (the grouped kernel refuses it)."""
    from ctxpatch.core.loading import load_model
    from tiny import save_tiny_folder

    save_tiny_folder(tmp_path, tiny_config("mixtral"))
    loaded = load_model(str(tmp_path), dtype="float64", device="cpu")
    _, _, steps = _run(loaded, absorb="all")
    assert all(s.patched.match for s in steps)
    assert max(s.patched.linf / s.logit_scale for s in steps) <= EXACT


@pytest.mark.parametrize("absorb,scope", [("context", "query"), ("context", "all-positions"),
                                          ("all", "all-positions")])
def test_without_the_control_the_patched_run_is_unchanged(loaded, absorb: str, scope: str) -> None:  # type: ignore[no-untyped-def]
    """``RunSpec.control`` off skips the control (its forward, or its batch row: counted in
    test_control_row.py; scope query still builds the reduced prefix cache the patched pass
    needs): the patched side is the same, the control empty."""
    from ctxpatch.core.compare import NO_CONTROL, summarize

    _, _, on = _run(loaded, absorb=absorb, scope=scope)
    _, _, off = _run(loaded, absorb=absorb, scope=scope, control=False)
    for a, b in zip(on, off, strict=True):
        assert b.patched.token == a.patched.token and b.reduced_input_ids == a.reduced_input_ids
        assert abs(b.patched.linf - a.patched.linf) <= EXACT * a.logit_scale
        assert b.control is NO_CONTROL and a.control is not NO_CONTROL
    assert summarize(off)["control"] is None and summarize(on)["control"]["matches"] >= 0
