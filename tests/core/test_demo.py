"""The paper's protocol on the real demo model (Gemma 3 270M from PyPI; converted once)."""

from __future__ import annotations

import pytest

from core.compare import Settings, iter_token_patches, summarize
from core.loading import load_model
from core.prompt import build_prompt

MARS = ("Write a single-sentence weather forecast for Mars, from the perspective of a slightly "
        "annoyed robot:")


@pytest.fixture(scope="module")
def demo():  # type: ignore[no-untyped-def]
    return load_model("demo", dtype="float32", device="cpu")


def test_mars_float32_direct_is_exact(demo) -> None:  # type: ignore[no-untyped-def]
    prompt = build_prompt(demo.tokenizer, "", MARS)
    assert prompt.full_ids[0] == demo.tokenizer.bos_token_id
    steps = list(iter_token_patches(demo, prompt, Settings(max_new_tokens=20, absorb="all")))
    summary = summarize(steps)
    assert summary["patched"]["matches"] == 20
    assert summary["patched"]["max_linf"] < 1e-3
    # without the patches, the single current token is far from the full-context prediction
    assert min(s.control.linf for s in steps) > 5.0
    assert steps[0].baseline_text == "\n\n"
