"""Image context for the image+text families of issue 18 (Qwen2-VL, Qwen2.5-VL, ...) on tiny
random float64 models saved as folders and loaded the way a user's are: the processor comes from
the folder's files without torchvision. With the picture as the context, the patched text-only
run equals the run with the picture, the saved patches reproduce it through plain weights
(`ctxpatch verify --image`), and dropping the output patches breaks it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ctxpatch.core.errors import UserError
from ctxpatch.core.export import save_patches
from ctxpatch.core.images import vision_kwargs
from ctxpatch.core.loading import load_model
from ctxpatch.core.verify import (
    image_pixels,
    materialized,
    read_patches,
    recorded_image,
    verify_patches,
)
from ctxpatch.resources import sample_image_path
from lens_case import stream_spy
from tiny_images import FAMILIES, image_steps, save_family_folder

QUERY = "Hello world!"
CONTEXT = "The quick brown fox"
TOKENS = 3
EXACT = 1e-6


def _missing(kind: str) -> str | None:
    """Why a family cannot run here, if it cannot."""
    import importlib.util

    from ctxpatch.core.adapters import REGISTRY

    if kind.startswith("qwen2") and f"{kind}_text" not in REGISTRY:
        return f"the Llama / Qwen adapter does not list {kind}_text (core/adapters/llama.py)"
    if kind == "smolvlm" and importlib.util.find_spec("num2words") is None:
        return "SmolVLM's processor needs the num2words package"
    return None


@pytest.fixture(scope="module", params=[
    pytest.param(k, marks=pytest.mark.skipif(_missing(k) is not None, reason=_missing(k) or ""))
    for k in FAMILIES])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_family_folder(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param)


@pytest.fixture(scope="module")
def loaded(folder: Path):  # type: ignore[no-untyped-def]
    return load_model(str(folder), dtype="float64", device="cpu")


def _steps(loaded, picture, context="", chat=False, **kw):  # type: ignore[no-untyped-def]
    return image_steps(loaded, picture, QUERY, TOKENS, context, chat, **kw)


def test_the_processor_needs_no_torchvision(loaded) -> None:  # type: ignore[no-untyped-def]
    assert not getattr(loaded.processor, "video_processor", None)
    assert "video_processor" not in type(loaded.processor).get_attributes()
    assert type(loaded.processor.image_processor).__name__.endswith("Pil")


@pytest.mark.parametrize("method,absorb,scope", [
    ("direct", "context", "all-positions"), ("stable", "context", "query"),
    ("direct", "all", "query"), ("stable", "all", "all-positions")])
def test_patched_text_only_equals_full_run_with_image(loaded, picture, method, absorb, scope
                                                       ) -> None:  # type: ignore[no-untyped-def]
    prompt, _, steps = _steps(loaded, picture, method=method, absorb=absorb, scope=scope)
    kinds = [s.kind for s in prompt.segments]  # (PaliGemma: the image before BOS)
    assert kinds in (["template", "image", "query"], ["image", "template", "query", "template"])
    assert len(steps) == TOKENS
    image_token = loaded.model.config.image_token_id
    for s in steps:
        assert image_token in s.full_input_ids and image_token not in s.reduced_input_ids
        assert s.patched.match
        assert s.patched.linf <= EXACT * s.logit_scale, (s.step, s.patched.linf, s.logit_scale)
        assert s.control.linf > 1e3 * EXACT * s.logit_scale  # the image matters
    if loaded.model.config.model_type.startswith("qwen2"):  # M-RoPE: the grid moved the text
        assert int(loaded.model.model.rope_deltas.abs().max()) > 0


def test_the_baseline_is_plain_generation_with_the_image(loaded, picture) -> None:  # type: ignore[no-untyped-def]
    """The full-context side (one cached step per token, the pixels in the first) makes the
    tokens transformers' own generate makes from the processor's inputs."""
    prompt, _, steps = _steps(loaded, picture, context=CONTEXT)
    ids = torch.tensor([list(prompt.full_ids)])
    with torch.inference_mode():
        out = loaded.model.generate(ids, max_new_tokens=TOKENS, min_new_tokens=TOKENS,
                                    do_sample=False,
                                    **vision_kwargs(loaded.model, prompt.pixels, ids))
    assert out[0, ids.shape[1]:].tolist() == [s.baseline_token for s in steps]


def test_the_pixels_matter(loaded, picture) -> None:  # type: ignore[no-untyped-def]
    from PIL import Image

    _, _, steps = _steps(loaded, picture, context=CONTEXT)
    other = (Image.new("RGB", picture[0].size, (0, 90, 200)), picture[1])
    _, _, other_steps = _steps(loaded, other, context=CONTEXT)
    first, second = steps[0], other_steps[0]
    assert first.full_input_ids == second.full_input_ids
    assert max(abs(a - b) for a, b in zip(first.baseline_top_k.probs, second.baseline_top_k.probs,
                                          strict=True)) > 1e-4 * first.baseline_top_k.probs[0]


def test_chat_template_with_image(loaded, picture) -> None:  # type: ignore[no-untyped-def]
    from ctxpatch.core.images import image_marker

    marker = image_marker(loaded.processor)
    loaded.processor.chat_template = (
        "{% for m in messages %}<u>{% for c in m['content'] %}{% if c['type'] == 'image' %}"
        "{{ '" + marker + "' }}\n{% else %}{{ c['text'] }}{% endif %}"
        "{% endfor %}</u>{% endfor %}{% if add_generation_prompt %}<a>{% endif %}")
    try:
        prompt, _, steps = _steps(loaded, picture, context=CONTEXT, chat=True)
    finally:
        loaded.processor.chat_template = None
    assert [s.kind for s in prompt.segments] == ["template", "image", "context", "query",
                                                 "template"]
    assert all(s.patched.match and s.patched.linf <= EXACT * s.logit_scale for s in steps)


@pytest.mark.parametrize("scope", ["all-positions", "query"])
def test_saved_patches_verify_with_the_image(loaded, folder, picture, scope, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]
                                             ) -> None:  # type: ignore[no-untyped-def]
    from ctxpatch.app.cli import main

    prompt, settings, steps = _steps(loaded, picture, context=CONTEXT, scope=scope,
                                     keep_patches=True)
    path = tmp_path / "p.safetensors"
    save_patches(path, steps, str(folder), "float64", settings, image=prompt.image)
    pf = read_patches(path)
    pixels = image_pixels(loaded, recorded_image(pf))
    checks = verify_patches(loaded, pf, pixels=pixels)
    assert len(checks) == TOKENS
    assert all(c.match and c.linf <= EXACT * c.scale for c in checks)
    if scope == "all-positions":  # plain transformers: the patched weights on the reduced ids
        model, prompt_length = loaded.model, len(prompt.full_ids)
        for t, meta in enumerate(pf.steps):
            full = torch.tensor([meta["full_input_ids"]])
            extra = vision_kwargs(model, pixels, full, prompt_length)
            with torch.inference_mode():
                base = model(input_ids=full, **extra).logits[0, -1]
                reduced = meta["reduced_input_ids"]  # (positions null: 0 .. n-1)
                with materialized(model, pf.patches[t]):
                    logits = model(input_ids=torch.tensor([reduced]),
                                   position_ids=torch.arange(len(reduced))[None]).logits
            assert (logits[0, -1] - base).abs().max() <= EXACT * checks[t].scale
    # the command line, on a fresh load of the folder
    assert main(["verify", str(path), "--model", str(folder), "--dtype", "float64",
                 "--image", str(sample_image_path())]) == 0
    assert f"{TOKENS}/{TOKENS} tokens match" in capsys.readouterr().out
    # without the output patches the weights no longer carry the image
    for step in pf.patches.values():
        for key in [k for k in step
                    if any(o in k[0] for o in ("down_proj", "post_feedforward", "post_mlp"))]:
            del step[key]
    broken = verify_patches(loaded, pf, pixels=pixels)
    assert max(c.linf / c.scale for c in broken) > 1e-3
    with pytest.raises(UserError, match="pass image="):
        verify_patches(loaded, pf)


def test_unsupported_image_text_family_names_the_supported_ones(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ctxpatch.app.cli import main
    from transformers import AutoConfig

    AutoConfig.for_model("llama4").save_pretrained(tmp_path)
    assert main(["compare", "--model", str(tmp_path), "--image", str(sample_image_path()),
                 "--query", QUERY, "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'llama4' is not supported yet" in err[0]
    assert all(name in err[0] for name in ("Qwen2-VL", "Mistral 3", "PaliGemma", "Idefics2"))




def test_the_control_as_a_batch_row_equals_its_own_pass(loaded, picture) -> None:  # type: ignore[no-untyped-def]
    """Issue 22: the unpatched control batched beside the patched row (what `--control-row auto`
    does on GPUs) gives what a pass of its own gives, for the text-only rows of each image+text
    family (M-RoPE positions included), and the patched row stays exact."""
    _, _, batched = _steps(loaded, picture, absorb="all", control_row="batched")
    _, _, separate = _steps(loaded, picture, absorb="all", control_row="separate")
    for b, s in zip(batched, separate, strict=True):
        assert b.baseline_token == s.baseline_token
        assert b.patched.linf <= EXACT * s.logit_scale
        assert abs(b.control.linf - s.control.linf) <= 1e-9 * s.logit_scale
        assert b.control.top_k.ids == s.control.top_k.ids


def test_the_lens_adds_up_with_the_picture(loaded, picture, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The context lens (ANALYSIS.md A1) of an image+text run: its stream's parts read through
    the frozen final norm add up to the full-context logits (picture included): softcapped as
    the family does, their softmax is the run's own full-context top-k, at every layer of the
    language model."""
    seen = stream_spy(monkeypatch)
    _, _, steps = image_steps(loaded, picture, QUERY, 2, "", analyze=frozenset({"lens"}))
    config = loaded.model.config.get_text_config()
    cap = getattr(config, "final_logit_softcapping", None)
    for step, (rebuilt, parts) in zip(steps, seen, strict=True):
        logits = torch.tanh(rebuilt / cap) * cap if cap else rebuilt
        probs = torch.softmax(logits, -1)
        top = step.baseline_top_k
        assert probs.topk(len(top.ids)).indices.tolist() == list(top.ids)
        assert probs[list(top.ids)].tolist() == pytest.approx(list(top.probs), abs=1e-6)
        assert all(p["total"] is not None for p in parts.values())
        assert set(step.lens["layers"]) == {str(i) for i in parts}
