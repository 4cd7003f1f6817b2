"""The knock-out effect of a layer at one step (ANALYSIS.md A1's complement), in float64: with
every patch written into the weights the reduced input gives the full-context logit, with none
the unpatched control's, and without the last layer's patches exactly what the last layer run
unpatched on its (exact) input gives through the model's own final norm and head."""

from __future__ import annotations

import pytest
import torch
from ctxpatch.core.compare import RunSpec, iter_token_patches
from ctxpatch.core.errors import UserError
from ctxpatch.core.knockout import knockout
from ctxpatch.core.prompt import build_prompt
from tiny import tiny_config, tiny_loaded

CONTEXT = "The quick brown fox jumps over the lazy dog."
QUERY = "Hello world!"


def _logits(model: torch.nn.Module, ids) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return model(input_ids=torch.tensor([list(ids)])).logits[0, -1]


@pytest.mark.parametrize("absorb,scope", [("all", "all-positions"), ("context", "query"),
                                          ("context", "all-positions")])
def test_knockout_all_none_and_the_last_layer(absorb: str, scope: str) -> None:
    loaded = tiny_loaded(tiny_config("llama"))
    model = loaded.model
    prompt = build_prompt(loaded.tokenizer, CONTEXT, QUERY)
    steps = list(iter_token_patches(loaded, prompt, RunSpec(
        max_new_tokens=2, absorb=absorb, scope=scope, keep_patches=True)))
    layers = model.model.layers
    for step in steps:
        got = knockout(loaded, step, scope)
        token = step.baseline_token
        full = _logits(model, step.full_input_ids)
        scale = float(full.abs().max())
        assert got["all"] == pytest.approx(float(full[token]), abs=1e-6 * scale)
        if scope == "all-positions":
            control = _logits(model, step.reduced_input_ids)
            assert got["none"] == pytest.approx(float(control[token]), abs=1e-12 * scale)
        assert sorted(got["layers"], key=int) == [str(i) for i in range(len(layers))]
        assert any(abs(e) > 1e-3 * scale for e in got["effect"].values())  # (the context acts)
        assert got["reproduces"] and got["prob_gap"] < 1e-9
        if absorb != "all":
            continue
        # the last layer: its input is exact, so without its patches it outputs T_0, the layer
        # run alone on the full context's input vector (absorb all: one token)
        seen: list[torch.Tensor] = []
        h = layers[-1].register_forward_pre_hook(lambda m, a, kw, seen=seen: seen.append(
            (a[0] if a else kw["hidden_states"])[0, -1]), with_kwargs=True)
        try:
            _logits(model, step.full_input_ids)
        finally:
            h.remove()
        x = seen[0][None, None]
        position = torch.tensor([[len(step.full_input_ids) - 1]])
        with torch.no_grad():
            out = layers[-1](x, position_embeddings=model.model.rotary_emb(x, position),
                             attention_mask=None, position_ids=position)
            t0 = out[0] if isinstance(out, tuple) else out
            want = model.lm_head(model.model.norm(t0))[0, -1, token]
        assert got["layers"][str(len(layers) - 1)] == pytest.approx(float(want),
                                                                   abs=1e-6 * scale)


def test_knockout_needs_the_patches() -> None:
    loaded = tiny_loaded(tiny_config("llama"))
    prompt = build_prompt(loaded.tokenizer, CONTEXT, QUERY)
    step = next(iter_token_patches(loaded, prompt, RunSpec(max_new_tokens=1)))
    with pytest.raises(UserError, match="kept none"):
        knockout(loaded, step)


def test_knockout_says_when_the_written_patches_do_not_reproduce_the_run() -> None:
    """Patches that are not the run's (here every vector tripled, as method direct's unbounded
    scale patches are in effect once written in float32) give a knock-out flagged unreadable."""
    import dataclasses

    loaded = tiny_loaded(tiny_config("llama"))
    prompt = build_prompt(loaded.tokenizer, CONTEXT, QUERY)
    step = next(iter_token_patches(loaded, prompt, RunSpec(max_new_tokens=1, keep_patches=True)))
    assert step.patches is not None
    bad = dataclasses.replace(step, patches={k: 3 * v for k, v in step.patches.items()})
    got = knockout(loaded, bad)
    assert not got["reproduces"] and got["prob_gap"] > 1e-3
