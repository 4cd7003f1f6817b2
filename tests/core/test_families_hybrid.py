"""Family-specific checks of the hybrid adapters (issue 17, group C: Qwen 3.5, Falcon-H1, Jamba,
Granite 4.0 hybrid, Gemma 4, Gemma 3n), in float64 on the tiny random models of
tests/tiny_hybrid.py; tests/core/test_ground_truth.py covers the rest.

- The token mixer each layer names (attention, linear attention, state-space), and where the
  experts are.
- The reduced prefix cache of scope "query" rolls back after the patched pass, also for the
  conv and recurrent states that linear-attention and state-space layers update in place: the
  unpatched control is the same in both scopes, and a rolled-back cache goes on like a fresh one.
- Gemma 3n (AltUp streams): the ground-truth checks with every layer patched; a later start layer
  is not exact, since a layer's output streams depend on its input streams beyond ``T``.
- Gemma 4: per-layer inputs and KV sharing are on in the tiny model; its MoE block is refused.
"""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import pytest
import torch
from ctxpatch.core.compare import RunSpec, iter_token_patches
from ctxpatch.core.errors import UserError
from ctxpatch.core.export import save_patches
from ctxpatch.core.forward import extend_cache, last_logits, rolled_back
from ctxpatch.core.prompt import build_prompt
from ctxpatch.core.results import conditioning
from ctxpatch.core.verify import read_patches, verify_patches
from tiny import tiny_loaded
from tiny_hybrid import ALL_LAYERS_ONLY, FAMILIES

CONTEXT = "The quick brown fox jumps over the lazy dog."
QUERY = "Hello world!"
TOKENS = 3
EXACT = 1e-6  # of the logit scale

#: the families whose caches hold conv and recurrent states (updated in place)
RECURRENT = ["qwen3_5_text", "falcon_h1", "jamba", "granitemoehybrid"]


def _config(name: str):  # type: ignore[no-untyped-def]
    from transformers import AutoConfig

    model_type, overrides = {**FAMILIES, **ALL_LAYERS_ONLY}[name]
    return AutoConfig.for_model(model_type, vocab_size=320, **overrides)


@functools.cache
def _loaded(name: str):  # type: ignore[no-untyped-def]
    return tiny_loaded(_config(name))


def _run(loaded, tokens: int = TOKENS, **kw):  # type: ignore[no-untyped-def]
    prompt = build_prompt(loaded.tokenizer, CONTEXT, QUERY)
    settings = RunSpec(max_new_tokens=tokens, **kw)
    return prompt, settings, list(iter_token_patches(loaded, prompt, settings))


MIXERS = {
    "gemma4_text": ["attention"] * 4,
    "gemma3n_text": ["attention"] * 4,
    "qwen3_5_text": ["linear attention", "attention"] * 2,
    "falcon_h1": ["state-space + attention"] * 4,
    "jamba": ["state-space", "attention", "state-space", "state-space"],
    "granitemoehybrid": ["state-space", "attention"] * 2,
    "granitemoehybrid_dense": ["attention", "state-space"] * 2,
}
#: layers with routed experts, and with a shared expert beside them
EXPERTS = {"jamba": ([1, 3], []), "granitemoehybrid": ([0, 1, 2, 3], [0, 1, 2, 3])}


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_mixers_and_experts_per_layer(name: str) -> None:
    loaded = _loaded(name)
    sites = [loaded.adapter.sites(layer) for layer in loaded.adapter.layers(loaded.model)]
    assert [s.mixer for s in sites] == MIXERS[name]
    routed, shared = EXPERTS.get(name, ([], []))
    assert [i for i, s in enumerate(sites) if s.experts is not None] == routed
    assert [i for i, s in enumerate(sites) if s.shared] == shared
    for s in sites:  # a dense layer has its input matrices and output matrix
        assert s.experts is not None or (s.inputs and s.out_matrix is not None)


@pytest.mark.parametrize("name", RECURRENT)
def test_a_rolled_back_hybrid_cache_goes_on_like_a_fresh_one(name: str) -> None:
    """The comparison keeps each cache layer's attributes and restores them after the patched
    pass; the conv and recurrent states are updated in place by the model, so without fresh
    copies before each cached forward (`core.forward.fresh_states`) they would keep the pass."""
    from transformers import DynamicCache

    model, device = _loaded(name).model, torch.device("cpu")
    prefix, probe, nxt = [2, 40, 41, 42, 43, 44], 45, 46
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        extend_cache(model, prefix, device, cache)
        assert any(getattr(layer, "recurrent_states", None) for layer in cache.layers)
        with rolled_back(cache):
            last_logits(model, [probe], device, cache=cache)
        rolled = last_logits(model, [nxt], device, cache=cache)
        fresh = last_logits(model, [*prefix, nxt], device)
        wrong = last_logits(model, [*prefix, probe, nxt], device)
    scale = float(fresh.abs().max())
    # (chunked and step-wise recurrences, and float32 norms, round apart by ~1e-8)
    assert float((rolled - fresh).abs().max()) <= EXACT * scale
    assert float((wrong - fresh).abs().max()) > 1e-3 * scale  # (the probe token mattered)


@pytest.mark.parametrize("name", RECURRENT)
def test_scope_query_keeps_the_control_and_the_patched_run(name: str) -> None:
    """Scope "query" extends a reduced prefix cache and rolls it back after each patched pass:
    its unpatched control equals that of scope "all-positions" (which never patches a cached
    forward), and its saved patches verify."""
    loaded = _loaded(name)
    _, _, every = _run(loaded, absorb="context", scope="all-positions")
    _, _, query = _run(loaded, absorb="context", scope="query")
    for a, b in zip(every, query, strict=True):
        assert a.reduced_input_ids == b.reduced_input_ids
        assert abs(a.control.linf - b.control.linf) <= EXACT * a.logit_scale
        assert b.patched.match and b.patched.linf <= EXACT * b.logit_scale


@pytest.mark.parametrize("absorb,scope", [("context", "all-positions"), ("context", "query"),
                                          ("all", "all-positions")])
@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_text"])
def test_verify_feeds_its_caches_as_the_run_did(tmp_path: Path, name: str, absorb: str,
                                                scope: str) -> None:
    """Issue 16: transformers' gated delta rule computes in float32 even in a float64 model, and
    its chunked scan (a fresh forward) and recurrent step (a cached token) round apart, so the
    model's cached and fresh full-context logits differ by up to ~1e-6 of their scale (Qwen3-Next).
    Verify feeds its caches as the run did (`core.verify._Fed`), so float64 patches written into
    the weights reproduce the run far below that (against fresh forwards these runs were 4e-8
    (Qwen 3.5) and 5e-7 (Qwen3-Next; 1.7e-6 over 5 tokens) of the scale off)."""
    from tiny import tiny_config

    loaded = tiny_loaded(tiny_config(name)) if name == "qwen3_next" else _loaded(name)
    _, settings, steps = _run(loaded, absorb=absorb, scope=scope, keep_patches=True)
    path = tmp_path / "p.safetensors"
    save_patches(path, steps, "tiny", "float64", settings)
    checks = verify_patches(loaded, read_patches(path))
    assert len(checks) == TOKENS and all(c.match for c in checks)
    assert max(c.linf / c.scale for c in checks) <= EXACT / 100
    # the model's own cached and fresh forwards are further apart than that
    from transformers import DynamicCache

    model, device, gaps, fed = loaded.model, loaded.device, [], 0
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        for s in steps:
            ids = list(s.full_input_ids)
            cached, fed = last_logits(model, ids[fed:], device, cache=cache), len(ids)
            fresh = last_logits(model, ids, device)
            gaps.append(float((cached - fresh).abs().max() / fresh.abs().max()))
    assert max(gaps) > EXACT / 100, gaps


def test_gemma4_tiny_model_shares_kv_and_has_per_layer_inputs() -> None:
    model = _loaded("gemma4_text").model
    layers = model.model.layers
    assert [layer.self_attn.is_kv_shared_layer for layer in layers] == [False, False, True, True]
    assert model.model.hidden_size_per_layer_input == 8
    assert [layer.mlp.intermediate_size for layer in layers] == [64, 64, 128, 128]
    assert all(float(layer.layer_scalar) != 1.0 for layer in layers)  # (randomized)


def test_gemma4_moe_block_refuses_the_matrix_control() -> None:
    """Gemma 4's MoE layers have no output matrix under the post-norm: only its scale can
    absorb dv, so 'matrix' is refused before any work (the block itself is exact:
    tests/core/test_families_moe.py)."""
    from transformers import AutoConfig

    model_type, overrides = FAMILIES["gemma4_text"]
    config = AutoConfig.for_model(model_type, vocab_size=320, **overrides, enable_moe_block=True,
                                  num_experts=4, top_k_experts=2, moe_intermediate_size=16)
    loaded = tiny_loaded(config)
    with pytest.raises(UserError, match="use scale"):
        _run(loaded, tokens=1, output_control="matrix")


# -- Gemma 3n: exact with every layer patched ------------------------------------------------


def test_gemma3n_has_altup_streams() -> None:
    loaded = _loaded("gemma3n_text")
    ids = torch.tensor([[2, 40, 41]])
    seen = []
    layer = loaded.adapter.layers(loaded.model)[0]
    handle = layer.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    try:
        with torch.no_grad():
            loaded.model(input_ids=ids)
    finally:
        handle.remove()
    assert seen == [torch.Size([4, 1, 3, 32])]  # (streams, batch, seq, width)


@pytest.mark.parametrize(
    "method,absorb,scope",
    list(itertools.product(["direct", "stable"], ["context", "all"], ["all-positions", "query"])),
)
def test_gemma3n_patched_equals_full_context(method: str, absorb: str, scope: str) -> None:
    _, _, steps = _run(_loaded("gemma3n_text"), method=method, absorb=absorb, scope=scope)
    for s in steps:
        assert s.patched.match
        assert s.patched.linf <= EXACT * s.logit_scale, (s.step, s.patched.linf)
        assert s.control.linf > 1e3 * EXACT * s.logit_scale
        # every AltUp stream of every layer's output ended on its full-context value
        assert max(i["block_error"] for i in s.layer_info.values()) < 1e-5


@pytest.mark.parametrize("absorb,scope", [("context", "all-positions"), ("context", "query"),
                                          ("all", "all-positions")])
@pytest.mark.parametrize("method", ["direct", "stable"])
def test_gemma3n_saved_patches_reproduce(tmp_path: Path, absorb: str, scope: str,
                                         method: str) -> None:
    loaded = _loaded("gemma3n_text")
    _, settings, steps = _run(loaded, absorb=absorb, scope=scope, method=method,
                              keep_patches=True)
    path = tmp_path / "p.safetensors"
    save_patches(path, steps, "tiny", "float64", settings)
    if method == "stable":  # (as in test_ground_truth: the stable update stays bounded)
        assert conditioning(steps)["unbounded_layers"] == 0
    checks = verify_patches(loaded, read_patches(path))
    assert len(checks) == TOKENS
    for c in checks:
        assert c.match and c.linf <= 1e-6 * c.scale


def test_gemma3n_negative_controls_and_output_controls() -> None:
    loaded = _loaded("gemma3n_text")
    for disabled in ("output", "input"):
        worst = max(s.patched.linf / s.logit_scale for absorb in ("context", "all")
                    for s in _run(loaded, method="direct", absorb=absorb,
                                  disabled=frozenset({disabled}))[2])
        assert worst > 10 * EXACT, disabled
    assert loaded.adapter.output_controls == ("scale", "matrix")  # (matrix: frozen-scale demo)


def test_gemma3n_a_later_start_layer_is_not_exact() -> None:
    """A first patched layer after layer 0 gets AltUp input streams that differ from the full
    context's; its MLP patch matches ``T`` (the active stream's post-MLP residual) but not the
    other streams, which the layer's output also depends on."""
    loaded = _loaded("gemma3n_text")
    n = len(loaded.adapter.layers(loaded.model))
    _, _, every = _run(loaded, absorb="all", layers="all")
    assert max(s.patched.linf / s.logit_scale for s in every) <= EXACT
    for spec in (f"{n - 2}:", f"{n - 1}", "1,3"):
        _, _, steps = _run(loaded, absorb="all", layers=spec)
        assert max(s.patched.linf / s.logit_scale for s in steps) > 1e-3, spec
