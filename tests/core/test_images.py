"""Image context (PAPER.md section 6) on tiny random image+text models in float64.

The full-context run sees the image tokens and the pixels; the patched run has neither, yet its
logits equal the full run's at every step; the saved patches reproduce it through plain weights;
dropping the output patches breaks it.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from ctxpatch.core.errors import UserError
from ctxpatch.core.export import save_patches
from ctxpatch.core.images import read_image
from ctxpatch.core.prompt import build_prompt, check_prompt
from ctxpatch.core.verify import image_pixels, read_patches, recorded_image, verify_patches
from lens_case import stream_spy
from tiny import IMAGE_SIZE, tiny_image_loaded
from tiny_images import image_steps

QUERY = "Hello world!"
CONTEXT = "The quick brown fox"
TOKENS = 4
EXACT = 1e-6


@pytest.fixture(scope="module", params=["gemma3", "llava", "llava_next", "idefics3"])
def loaded(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    return tiny_image_loaded(request.param)


def _steps(loaded, picture, context="", chat=False, **kw):  # type: ignore[no-untyped-def]
    return image_steps(loaded, picture, QUERY, TOKENS, context, chat, **kw)


def test_image_tokens_are_an_absorbed_segment(loaded, picture) -> None:  # type: ignore[no-untyped-def]
    prompt = build_prompt(loaded.tokenizer, CONTEXT, QUERY, image=picture,
                          processor=loaded.processor)
    kinds = [s.kind for s in prompt.segments]
    assert kinds == ["template", "image", "context", "query"]
    image_ids = prompt.segments[1].ids
    image_token = loaded.model.config.image_token_id
    # Gemma 3: 4 pooled soft tokens; LLaVA: 16 patches; LLaVA-NeXT: the 16 of the base view
    # plus a 2x1 grid of tiles at 16 each, with a newline token per row (any resolution);
    # Idefics3: a 2x2 split plus the global view, 4 pixel-shuffled tokens each
    expected = {"gemma3": 4, "llava": 16, "llava_next": 44, "idefics3": 20}
    assert image_ids.count(image_token) == expected[loaded.spec.split("-")[1]]
    assert image_token not in prompt.reduced_prompt_ids
    assert prompt.reduced_prompt_ids == prompt.segments[0].ids + prompt.segments[3].ids
    assert prompt.pixels["pixel_values"].shape[-1] == IMAGE_SIZE
    assert prompt.to_dict()["image"]["sha256"] == picture[1].sha256
    check_prompt(prompt, "context")  # the image alone is a context


@pytest.mark.parametrize("method,absorb,scope", list(itertools.product(
    ["direct", "stable"], ["context", "all"], ["all-positions", "query"])))
def test_patched_text_only_equals_full_run_with_image(loaded, picture, method, absorb, scope
                                                       ) -> None:  # type: ignore[no-untyped-def]
    _, _, steps = _steps(loaded, picture, method=method, absorb=absorb, scope=scope)
    assert len(steps) == TOKENS
    image_token = loaded.model.config.image_token_id
    for s in steps:
        assert image_token in s.full_input_ids and image_token not in s.reduced_input_ids
        assert s.patched.match
        assert s.patched.linf <= EXACT * s.logit_scale, (s.step, s.patched.linf, s.logit_scale)
        assert s.control.linf > 1e3 * EXACT * s.logit_scale  # the image matters


def test_the_pixels_matter(loaded, picture) -> None:  # type: ignore[no-untyped-def]
    """Negative control on the input side: the same image tokens with other pixels give other
    full-context logits, so the runs above really read the picture."""
    from PIL import Image

    _, _, steps = _steps(loaded, picture, context=CONTEXT)
    other = (Image.new("RGB", picture[0].size, (0, 90, 200)), picture[1])  # same tiles
    _, _, other_steps = _steps(loaded, other, context=CONTEXT)
    first, second = steps[0], other_steps[0]
    assert first.full_input_ids == second.full_input_ids
    assert max(abs(a - b) for a, b in zip(first.baseline_top_k.probs, second.baseline_top_k.probs,
                                          strict=True)) > 1e-4 * first.baseline_top_k.probs[0]


def test_chat_template_with_image(loaded, picture) -> None:  # type: ignore[no-untyped-def]
    loaded.processor.chat_template = (
        "{% for m in messages %}<u>{% for c in m['content'] %}{% if c['type'] == 'image' %}"
        "{{ '" + loaded.processor.image_token + "' }}\n{% else %}{{ c['text'] }}{% endif %}"
        "{% endfor %}</u>{% endfor %}{% if add_generation_prompt %}<a>{% endif %}")
    try:
        prompt, _, steps = _steps(loaded, picture, context=CONTEXT, chat=True)
    finally:
        loaded.processor.chat_template = None
    kinds = [s.kind for s in prompt.segments]
    assert kinds == ["template", "image", "context", "query", "template"]
    assert prompt.segments[2].text.startswith("\n")  # the newline after the image is absorbed
    assert all(s.patched.match and s.patched.linf <= EXACT * s.logit_scale for s in steps)


@pytest.mark.parametrize("scope", ["all-positions", "query"])
def test_saved_patches_verify_with_the_image(loaded, picture, scope, tmp_path: Path
                                             ) -> None:  # type: ignore[no-untyped-def]
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "other.png")
    prompt, settings, steps = _steps(loaded, picture, context=CONTEXT, scope=scope,
                                     keep_patches=True)
    path = tmp_path / "p.safetensors"
    save_patches(path, steps, "tiny", "float64", settings, image=prompt.image)
    pf = read_patches(path)
    with pytest.raises(UserError, match="is not the image"):
        recorded_image(pf, str(tmp_path / "other.png"))
    pixels = image_pixels(loaded, recorded_image(pf))  # found again by recorded path and hash
    checks = verify_patches(loaded, pf, pixels=pixels)
    assert len(checks) == TOKENS
    assert all(c.match and c.linf <= EXACT * c.scale for c in checks)
    # without the output patches the weights no longer carry the image
    for step in pf.patches.values():
        for key in [k for k in step if "down_proj" in k[0] or "post_feedforward" in k[0]]:
            del step[key]
    broken = verify_patches(loaded, pf, pixels=pixels)
    assert max(c.linf / c.scale for c in broken) > 1e-3


def test_image_for_a_text_only_model(picture) -> None:  # type: ignore[no-untyped-def]
    from tiny import tiny_tokenizer

    with pytest.raises(UserError, match="reads text only"):
        build_prompt(tiny_tokenizer(), "", QUERY, image=picture, processor=None)


@pytest.mark.parametrize("content,match", [
    (None, "no such image file"),
    (b"this is not a picture", "cannot read"),
    (b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, "cannot read"),
])
def test_bad_image_files(tmp_path: Path, content, match) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "picture.png"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(UserError, match=match):
        read_image(path)


def test_formats_and_gif_first_frame(tmp_path: Path) -> None:
    from PIL import Image

    red, blue = Image.new("RGB", (8, 6), (255, 0, 0)), Image.new("RGB", (8, 6), (0, 0, 255))
    red.save(tmp_path / "a.gif", save_all=True, append_images=[blue])
    for fmt in ("png", "jpeg", "webp"):
        red.save(tmp_path / f"a.{fmt}")
    for fmt in ("gif", "png", "jpeg", "webp"):
        image, info = read_image(tmp_path / f"a.{fmt}")
        assert (info.width, info.height) == (8, 6) and image.mode == "RGB"
        assert image.getpixel((3, 3))[0] > 200  # red: the GIF's first frame
    Image.new("RGB", (4, 4)).save(tmp_path / "a.bmp")
    with pytest.raises(UserError, match="BMP image"):
        read_image(tmp_path / "a.bmp")


def test_the_baseline_is_plain_generation_with_the_image(loaded, picture) -> None:  # type: ignore[no-untyped-def]
    """The comparison's full-context side (one cached step per token, the pixels in the first)
    makes the tokens transformers' own generate makes from the same inputs."""
    from ctxpatch.core.images import vision_kwargs

    prompt, _, steps = _steps(loaded, picture, context=CONTEXT)
    ids = torch.tensor([list(prompt.full_ids)])
    with torch.inference_mode():
        out = loaded.model.generate(ids, max_new_tokens=TOKENS, min_new_tokens=TOKENS,
                                    do_sample=False,
                                    **vision_kwargs(loaded.model, prompt.pixels, ids))
    assert out[0, ids.shape[1]:].tolist() == [s.baseline_token for s in steps]


def test_the_lens_adds_up_with_the_picture(loaded, picture, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The context lens (ANALYSIS.md A1) with a picture in the context: the stream's parts read
    through the frozen final norm give the run's own full-context top-k (softcap applied)."""
    seen = stream_spy(monkeypatch)
    _, _, steps = _steps(loaded, picture, context=CONTEXT, analyze=frozenset({"lens"}))
    cap = getattr(loaded.model.config.get_text_config(), "final_logit_softcapping", None)
    for step, (rebuilt, parts) in zip(steps, seen, strict=True):
        probs = torch.softmax(torch.tanh(rebuilt / cap) * cap if cap else rebuilt, -1)
        top = step.baseline_top_k
        assert probs.topk(len(top.ids)).indices.tolist() == list(top.ids)
        assert probs[list(top.ids)].tolist() == pytest.approx(list(top.probs), abs=1e-6)
        assert all(p["total"] is not None for p in parts.values())
