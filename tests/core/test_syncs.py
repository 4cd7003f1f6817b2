"""Issue 22: the hot path keeps its values on the device. Host syncs per generated token (calls
that copy a tensor's value to the host) stay at most 8 and do not grow with the number of
layers: each step's measures, flags and metrics cross to the host in one transfer."""

from __future__ import annotations

import pytest
import torch
from ctxpatch.core.bench import counting_host_syncs, syncs_per_token
from ctxpatch.core.compare import RunSpec, iter_token_patches
from ctxpatch.core.prompt import build_prompt
from tiny import TINY, gemma3_config, llama_config, tiny_loaded
from transformers import AutoConfig


def _per_token(config, **options) -> float:  # type: ignore[no-untyped-def]
    loaded = tiny_loaded(config, dtype=torch.float32)
    prompt = build_prompt(loaded.tokenizer, "Alice lives in Paris.", "Where does she live?")
    settings = RunSpec(max_new_tokens=4, **options)
    list(iter_token_patches(loaded, prompt, settings))  # warm-up (parameters' norms, once)
    return syncs_per_token(loaded, prompt, settings)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("options", [{"absorb": "all", "method": "direct"},
                                     {"absorb": "all", "method": "stable"},
                                     {"absorb": "context", "scope": "query"}])
def test_syncs_per_token_are_few_and_flat_in_depth(family: str, options: dict) -> None:  # type: ignore[type-arg]
    build = llama_config if family == "llama" else gemma3_config
    shallow, deep = (_per_token(build(layers=n), **options) for n in (2, 12))
    assert deep == shallow, (shallow, deep)
    assert deep <= 8, deep


def _moe_config(name: str, layers: int):  # type: ignore[no-untyped-def]
    """A tiny MoE config of `TINY` with ``layers`` layers (its per-layer lists repeated)."""
    model_type, overrides = TINY[name]
    overrides = dict(overrides, num_hidden_layers=layers)
    if "layer_types" in overrides:
        overrides["layer_types"] = overrides["layer_types"][:2] * (layers // 2)
    if "moe_layers" in overrides:
        overrides["moe_layers"] = list(range(1, layers, 2))
    return AutoConfig.for_model(model_type, vocab_size=320, **overrides)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "deepseek_v3", "llama4_text",
                                    "gemma4_text_moe"])
@pytest.mark.parametrize("options", [{"absorb": "all"}, {"absorb": "context", "scope": "query"}])
def test_moe_syncs_per_token_are_few_and_flat_in_depth(family: str, options: dict) -> None:  # type: ignore[type-arg]
    """The routed experts are patched from index tensors: the active experts' names cross to the
    host once per forward, not per layer. The only per-token difference left between depths is
    the parameters' norms of expert slices first met at a token (one transfer when it happens:
    which experts a token meets depends on the model, so less than one per token)."""
    shallow, deep = (_per_token(_moe_config(family, n), **options) for n in (4, 8))
    assert deep < shallow + 1, (shallow, deep)
    assert max(shallow, deep) <= 8, (shallow, deep)


def test_the_counter_counts_and_restores() -> None:
    x = torch.ones(3)
    with counting_host_syncs() as count:
        float(x.sum())
        x.tolist()
        bool(x.any())
    assert count[0] == 3
    with counting_host_syncs() as again:
        pass
    float(x.sum())  # restored: counted nowhere
    assert again[0] == 0
