"""The context lens (ANALYSIS.md A1) against its ground truths, in float64 on tiny random models.

- The parts of the patched stream read through the frozen final norm add up to the full-context
  logits before any softcap: ``lens(r^0) + sum_l lens(T_0,l - r^{l-1}) + sum_l lens(delta_l) +
  the biases' logits``; the model's own logits are computed here by plain transformers.
- ``delta_mix + delta_mlp = delta``, each measured on its own (the mixer's ``v``, the branch's
  output), where the family's block is ``T = v + branch``; None (not zeros) where it is not.
- An empty context writes nothing; a planted layer that copies a context word into the residual
  is found by the lens at that layer.
"""

from __future__ import annotations

import pytest
import torch
from ctxpatch.core import lens as lens_module
from ctxpatch.core.compare import RunSpec, iter_token_patches
from ctxpatch.core.prompt import build_prompt
from lens_case import pre_softcap, stream_spy
from tiny import gemma3_config, llama_config, tiny_config, tiny_loaded

CONTEXT = "The quick brown fox jumps over the lazy dog."
QUERY = "Hello world!"
#: the family's RMSNorm computes in float32 inside a float64 model (Llama's, Gemma's): the
#: identity then holds to float32 rounding of the logit scale (ANALYSIS.md A1)
FLOAT32_NORMS = 1e-6
FLOAT64 = 1e-12

FAMILIES = {  # name -> (config, tolerance, the parts split)
    "llama": (lambda: tiny_config("llama"), FLOAT32_NORMS, True),
    "gemma3": (lambda: gemma3_config(layers=4), FLOAT32_NORMS, True),
    "gemma2_softcap": (lambda: tiny_config("gemma2"), FLOAT32_NORMS, True),
    "gpt2_layernorm": (lambda: tiny_config("gpt2"), FLOAT64, True),
    "opt_post_ln": (lambda: tiny_config("opt_post_ln"), FLOAT64, False),
    "falcon_parallel": (lambda: tiny_config("falcon_parallel"), FLOAT64, True),
    "granite_logits_scaling": (lambda: tiny_config("granite"), FLOAT32_NORMS, True),
    "cohere_logit_scale": (lambda: tiny_config("cohere"), FLOAT32_NORMS, True),
    "mixtral_moe": (lambda: tiny_config("mixtral"), FLOAT32_NORMS, True),
    "qwen3_moe": (lambda: tiny_config("qwen3_moe"), FLOAT32_NORMS, True),
    "jamba_hybrid": (lambda: tiny_config("jamba"), FLOAT32_NORMS, True),
    "qwen3_5_hybrid": (lambda: tiny_config("qwen3_5_text"), FLOAT32_NORMS, True),
    "gemma4_after_branch": (lambda: tiny_config("gemma4_text"), FLOAT32_NORMS, False),
}
#: (absorb, scope): the strategies the lens must replay (separate or batched passes, a cached
#: query, one pass of every row from the second token)
SETTINGS = [("context", "all-positions"), ("context", "query"), ("all", "all-positions")]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    config, tolerance, splits = FAMILIES[request.param]
    return request.param, tiny_loaded(config()), tolerance, splits


def _pre_softcap(model: torch.nn.Module, ids: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        return pre_softcap(model, model(input_ids=torch.tensor([list(ids)])).logits[0, -1])


def _run_with_parts(loaded, monkeypatch, **kw):  # type: ignore[no-untyped-def]
    """The run's steps and, per step, the stream rebuilt from the lens's own vectors (read as
    logits) and each layer's parts (`lens_case.stream_spy`)."""
    seen = stream_spy(monkeypatch)
    prompt = build_prompt(loaded.tokenizer, kw.pop("context", CONTEXT), QUERY)
    steps = list(iter_token_patches(loaded, prompt, RunSpec(
        max_new_tokens=kw.pop("tokens", 3), analyze=frozenset({"lens"}), **kw)))
    return steps, seen


@pytest.mark.parametrize("absorb,scope", SETTINGS)
def test_lens_parts_add_up_to_the_full_context_logits(family, monkeypatch, absorb: str,
                                                      scope: str) -> None:  # type: ignore[no-untyped-def]
    name, loaded, tolerance, _ = family
    steps, seen = _run_with_parts(loaded, monkeypatch, absorb=absorb, scope=scope)
    assert len(steps) == len(seen) == 3
    for step, (rebuilt, _) in zip(steps, seen, strict=True):
        full = _pre_softcap(loaded.model, step.full_input_ids)
        scale = float(full.abs().max())
        assert float((rebuilt - full).abs().max()) <= tolerance * scale, (name, step.step)
        assert int(full.argmax()) == step.baseline_token


def test_lens_parts_split_the_context_effect(family, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    name, loaded, _, splits = family
    steps, seen = _run_with_parts(loaded, monkeypatch, tokens=2)
    for step, (_, parts) in zip(steps, seen, strict=True):
        for i, p in parts.items():
            assert p["total"] is not None
            if not splits:  # the block changes its output after v + branch: said, not zeros
                assert p["mixer"] is None and p["mlp"] is None, (name, i)
                assert step.lens["layers"][str(i)]["mixer"] is None
                continue
            total = p["total"]
            assert float((p["mixer"] + p["mlp"] - total).abs().max()) <= 1e-9 * max(
                1.0, float(total.abs().max())), (name, i)
        # the record's entries: the emitted token's logit is the readout of the same vector
        any_layer = step.lens["layers"][str(min(parts))]["total"]
        assert len(any_layer["promoted"]) == lens_module.LENS_TOP_K
        values = [v for _, v, _ in any_layer["promoted"]]
        assert values == sorted(values, reverse=True)
        assert max(values) >= any_layer["emitted"] >= min(v for _, v, _ in any_layer["suppressed"])


def test_lens_promoted_are_the_readouts_largest(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The top-k kept equal the top-k of the whole readout (the chunked merge loses none)."""
    loaded = tiny_loaded(tiny_config("llama"))
    monkeypatch.setattr(lens_module, "_CHUNK", 7)  # (many chunks over a 320-word vocabulary)
    steps, seen = _run_with_parts(loaded, monkeypatch, tokens=1)
    parts = seen[0][1]
    readout = lens_module.Readout.of(loaded.model, torch.float64, len(loaded.tokenizer))
    for i, p in parts.items():
        logits = readout.logits(p["total"][None], torch.tensor(1.0, dtype=torch.float64))[0]
        assert logits.numel() >= 300
        got = steps[0].lens["layers"][str(i)]["total"]
        s = steps[0].lens["s"]
        want = (logits / s)[:readout.vocab].topk(lens_module.LENS_TOP_K)
        assert [t for _, _, t in got["promoted"]] == want.indices.tolist()
        assert [v for _, v, _ in got["promoted"]] == pytest.approx(want.values.tolist(), rel=1e-12)
        low = (logits / s)[:readout.vocab].topk(lens_module.LENS_TOP_K, largest=False)
        assert [t for _, _, t in got["suppressed"]] == low.indices.tolist()
        assert got["emitted"] == pytest.approx(float(logits[steps[0].baseline_token] / s),
                                               rel=1e-12)


def test_empty_context_writes_nothing(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """With nothing to absorb the full-context and reduced layers see the same tokens: every
    part is zero (the protocol refuses such a run for users; the lens must still read 0)."""
    from ctxpatch.core import plan

    monkeypatch.setattr(plan, "check_prompt", lambda prompt, absorb: None)
    loaded = tiny_loaded(tiny_config("llama"))
    steps, seen = _run_with_parts(loaded, monkeypatch, context="", tokens=2)
    for step, (_, parts) in zip(steps, seen, strict=True):
        for i, p in parts.items():
            for part in ("total", "mixer", "mlp"):
                assert float(p[part].abs().max()) <= 1e-12, (step.step, i, part)
            assert abs(step.lens["layers"][str(i)]["total"]["emitted"]) <= 1e-9


def _planted(layer: int) -> object:
    """A tiny Llama whose layer ``layer`` copies every earlier word's embedding into the
    residual (uniform attention: zero queries; the value and output maps a multiple of the
    identity), with tied embeddings so that the copied word is its own readout's top word;
    every other layer's attention and MLP write nothing."""
    config = llama_config(layers=3)
    config.hidden_size, config.num_attention_heads, config.num_key_value_heads = 64, 1, 1
    config.head_dim = 64
    config.tie_word_embeddings = True
    loaded = tiny_loaded(config)
    with torch.no_grad():
        for i, block in enumerate(loaded.model.model.layers):
            attn = block.self_attn
            attn.q_proj.weight.zero_()
            if i == layer:
                attn.v_proj.weight.copy_(torch.eye(64, dtype=torch.float64))
                attn.o_proj.weight.copy_(4.0 * torch.eye(64, dtype=torch.float64))
            else:
                attn.o_proj.weight.zero_()
            block.mlp.down_proj.weight.zero_()
            block.input_layernorm.weight.fill_(1.0)
        loaded.model.model.norm.weight.fill_(1.0)
    return loaded


def test_lens_finds_a_planted_context_word(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    layer = 1
    loaded = _planted(layer)
    tok = loaded.tokenizer
    context = "z" * 24
    ids = build_prompt(tok, context, QUERY).segments
    context_ids = [i for s in ids if s.kind == "context" for i in s.ids]
    word = max(set(context_ids), key=context_ids.count)  # (the word the context repeats)
    assert context_ids.count(word) >= 4
    assert word not in tok(QUERY, add_special_tokens=False)["input_ids"]
    steps, _ = _run_with_parts(loaded, monkeypatch, context=context, tokens=1)
    layers = steps[0].lens["layers"]
    assert layers[str(layer)]["total"]["promoted"][0][2] == word
    assert layers[str(layer)]["mixer"]["promoted"][0][2] == word
    # the layers that write nothing show nothing (to rounding), the planted one a clear logit
    assert layers[str(layer)]["total"]["promoted"][0][1] > 0.1
    for other in (0, 2):
        assert abs(layers[str(other)]["mixer"]["promoted"][0][1]) < 1e-9


def test_without_analyze_a_run_has_no_lens() -> None:
    loaded = tiny_loaded(tiny_config("llama"))
    prompt = build_prompt(loaded.tokenizer, CONTEXT, QUERY)
    steps = list(iter_token_patches(loaded, prompt, RunSpec(max_new_tokens=1)))
    assert steps[0].lens is None


def _full_context_layers(model: torch.nn.Module, layers, ids) -> tuple[list, list, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Plain transformers: every layer's input and output at the last position, and the final
    norm's input there."""
    ins, outs, final = [], [], []
    handles = [layer.register_forward_pre_hook(
        lambda m, a, kw: ins.append((a[0] if a else kw["hidden_states"])[0, -1]),
        with_kwargs=True) for layer in layers]
    handles += [layer.register_forward_hook(
        lambda m, a, out: outs.append((out[0] if isinstance(out, tuple) else out)[0, -1]))
        for layer in layers]
    norm = lens_module.final_norm(model)
    handles.append(norm.register_forward_pre_hook(lambda m, a: final.append(a[0][0, -1])))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([list(ids)]))
    finally:
        for h in handles:
            h.remove()
    return ins, outs, final[0]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_lens_total_is_the_unpatched_layer_on_the_full_context_input(name: str) -> None:
    """With absorb all the reduced input at a layer is the current token alone: ``T_0`` is the
    layer run by itself on the full context's input vector there. Computed here from plain
    transformers and the final norm's own formula, independently of the lens's hooks."""
    loaded = tiny_loaded(tiny_config(name))
    model = loaded.model
    prompt = build_prompt(loaded.tokenizer, CONTEXT, QUERY)
    steps = list(iter_token_patches(loaded, prompt, RunSpec(
        max_new_tokens=2, absorb="all", analyze=frozenset({"lens"}))))
    decoder = model.model if name == "llama" else model.transformer
    layers = decoder.layers if name == "llama" else decoder.h
    for step in steps:
        ids = step.full_input_ids
        ins, outs, final = _full_context_layers(model, layers, ids)
        position = torch.tensor([[len(ids) - 1]])
        norm = lens_module.final_norm(model)
        if name == "llama":
            s = (final.pow(2).mean() + norm.variance_epsilon).sqrt()
        else:
            s = ((final - final.mean()).pow(2).mean() + norm.eps).sqrt()
        w_u = model.get_output_embeddings().weight
        for i, layer in enumerate(layers):
            x = ins[i][None, None]
            with torch.no_grad():
                if name == "llama":
                    out = layer(x, position_embeddings=decoder.rotary_emb(x, position),
                                attention_mask=None, position_ids=position)
                else:
                    out = layer(x)
            t0 = (out[0] if isinstance(out, tuple) else out)[0, -1]
            delta = outs[i] - t0
            if name == "gpt2":
                delta = delta - delta.mean()
            want = float((w_u[step.baseline_token] @ (norm.weight * delta / s)).detach())
            got = step.lens["layers"][str(i)]["total"]["emitted"]
            assert got == pytest.approx(want, rel=1e-6, abs=1e-9), (name, step.step, i)
            assert abs(want) > 1e-6  # (the context does change this layer's output)
