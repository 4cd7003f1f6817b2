"""Tiny random image+text models of the families of issue 18, with offline processors built
without torchvision (PIL image processors, no video processor), saved as model folders."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tiny import GRID_TOKENS, IMAGE_SIZE, llama_config, randomize_norms, tiny_tokenizer

_NORM = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3}
#: larger than transformers' 0.02: a tiny model's attention stays far from uniform, so the
#: picture (and which picture) matters to the logits
INIT = 0.2


def _tokenizer(special: list[str], roles: dict[str, str]) -> Any:
    """The tiny tokenizer plus a family's image tokens (special, ids 320 and up)."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    base = tiny_tokenizer(320).backend_tokenizer
    backend = base.__class__.from_str(base.to_str())
    backend.add_special_tokens([AddedToken(t, special=True) for t in special])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", extra_special_tokens=roles)


def _text(layers: int, vocab: int = 330, **extra: Any) -> dict[str, Any]:
    text = llama_config(layers=layers, vocab=vocab).to_dict()
    text.pop("model_type")  # the family's own text model
    text.update(initializer_range=INIT, **extra)
    return text


def _qwen_vision_processor(processor_cls: Any) -> tuple[Any, dict[str, int]]:
    """The Qwen-VL processor for pictures only, and the config's special-token ids: the 4:3
    sample picture at 64 x 48 pixels, 8 x 6 patches of 8, a 4 x 3 grid of tokens after the
    2 x 2 merge (Qwen2-VL, Qwen2.5-VL and Qwen3-VL alike)."""
    from ctxpatch.core.images import pictures_only
    from transformers import Qwen2VLImageProcessorPil

    tok = _tokenizer(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"],
                     {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"})
    images = Qwen2VLImageProcessorPil(min_pixels=IMAGE_SIZE * IMAGE_SIZE,
                                      max_pixels=4 * IMAGE_SIZE * IMAGE_SIZE, patch_size=8,
                                      merge_size=2, temporal_patch_size=2, **_NORM)
    processor = pictures_only(processor_cls)(image_processor=images, tokenizer=tok)
    ids = {f"{k.replace('_pad', '')}_token_id": tok.convert_tokens_to_ids(f"<|{k}|>")
           for k in ("image_pad", "video_pad", "vision_start", "vision_end")}
    return processor, ids


def _qwen2_vl(layers: int, v25: bool = False) -> tuple[Any, Any]:
    if v25:
        from transformers import Qwen2_5_VLConfig as Config
        from transformers import Qwen2_5_VLProcessor as Processor
    else:
        from transformers import Qwen2VLConfig as Config
        from transformers import Qwen2VLProcessor as Processor

    # M-RoPE spans the 4 x 3 grid of picture tokens with 4 positions (the text after it moves
    # back by 8)
    processor, ids = _qwen_vision_processor(Processor)
    # M-RoPE: the head's 8 rotary dimensions split over time, height and width
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    vision: dict[str, Any] = dict(depth=2, hidden_size=16, num_heads=2, patch_size=8,
                                  spatial_merge_size=2, temporal_patch_size=2,
                                  initializer_range=INIT)
    if v25:  # windowed attention in the first block, full in the second
        vision.update(intermediate_size=32, out_hidden_size=32, window_size=16,
                      fullatt_block_indexes=[1])
    else:
        vision.update(embed_dim=16, hidden_size=32, mlp_ratio=2)
    config = Config(text_config=_text(layers, rope_parameters=rope), vision_config=vision, **ids)
    return config, processor


def _qwen3_vl(layers: int) -> tuple[Any, Any]:
    from transformers import Qwen3VLConfig, Qwen3VLProcessor

    processor, ids = _qwen_vision_processor(Qwen3VLProcessor)
    # interleaved M-RoPE over the head's 8 rotary dimensions; a Qwen3 language model (q and k
    # norms) that also takes DeepStack features of the first vision block in its first layer
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
            "mrope_interleaved": True}
    vision = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=8,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32,
                  num_position_embeddings=16, deepstack_visual_indexes=[0],
                  initializer_range=INIT)
    config = Qwen3VLConfig(text_config=_text(layers, head_dim=8, rope_parameters=rope),
                           vision_config=vision, **ids)
    return config, processor


def _glm4v(layers: int) -> tuple[Any, Any]:
    from ctxpatch.core.images import pictures_only
    from transformers import Glm4vConfig, Glm4vImageProcessorPil, Glm4vProcessor

    marks = ["<|image|>", "<|video|>", "<|begin_of_image|>", "<|end_of_image|>",
             "<|begin_of_video|>", "<|end_of_video|>"]
    tok = _tokenizer(marks, {"image_token": "<|image|>", "video_token": "<|video|>"})
    # the 4:3 sample picture at 64 x 48 pixels: 8 x 6 patches of 8, a 4 x 3 grid of tokens after
    # the 2 x 2 merge
    images = Glm4vImageProcessorPil(size={"shortest_edge": IMAGE_SIZE * IMAGE_SIZE,
                                          "longest_edge": 4 * IMAGE_SIZE * IMAGE_SIZE},
                                    patch_size=8, merge_size=2, temporal_patch_size=2, **_NORM)
    processor = pictures_only(Glm4vProcessor)(image_processor=images, tokenizer=tok)
    ids = {f"{k}_token_id": tok.convert_tokens_to_ids(f"<|{k}|>") for k in ("image", "video")}
    ids.update({f"{k}_{e}_token_id": tok.convert_tokens_to_ids(f"<|{w}_of_{k}|>")
                for k in ("image", "video") for e, w in (("start", "begin"), ("end", "end"))})
    # GLM-4's half-rotary heads (2 heads of 16, 8 rotary dimensions), M-RoPE over time, height
    # and width: sum(mrope_section) = head_dim * partial_rotary_factor / 2
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1]}
    text = _text(layers, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                 rope_parameters=rope)
    vision = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=8,
                  image_size=IMAGE_SIZE, spatial_merge_size=2, temporal_patch_size=2,
                  out_hidden_size=32, initializer_range=INIT)
    config = Glm4vConfig(text_config=text, vision_config=vision, **ids)
    return config, processor


def _mistral3(layers: int) -> tuple[Any, Any]:
    from ctxpatch.core.images import processor_class
    from transformers import Mistral3Config, PixtralImageProcessorPil

    marks = {"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]",
             "image_end_token": "[IMG_END]"}
    tok = _tokenizer(list(marks.values()), {})
    # the 4:3 sample picture at 64 x 48 pixels: 8 x 6 patches of 8, a 4 x 3 grid of tokens after
    # the 2 x 2 merge, each row ended by an image break, the last by the image end
    images = PixtralImageProcessorPil(size={"longest_edge": 2 * IMAGE_SIZE},
                                      patch_size={"height": 8, "width": 8}, **_NORM)
    config = Mistral3Config(
        text_config={**llama_config(layers=layers, vocab=330).to_dict(), "model_type": "mistral",
                     "initializer_range": INIT},
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=2, head_dim=8,
                           image_size=2 * IMAGE_SIZE, patch_size=8, initializer_range=INIT),
        image_token_index=tok.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2,
        vision_feature_layer=-1, tie_word_embeddings=False)
    cls = processor_class(config)  # (transformers' own needs torchvision to import)
    processor = cls(image_processor=images, tokenizer=tok, patch_size=8, spatial_merge_size=2,
                    **marks)
    return config, processor


def _paligemma(layers: int) -> tuple[Any, Any]:
    from transformers import PaliGemmaConfig, PaliGemmaProcessor, SiglipImageProcessorPil
    from transformers.models.paligemma.processing_paligemma import EXTRA_TOKENS

    # (its processor adds 1152 location and segmentation tokens to the vocabulary)
    tok = _tokenizer(["<image>", *EXTRA_TOKENS], {"image_token": "<image>"})
    vocab = len(tok)
    # PaliGemma 2: a Gemma 2 language model; 16 image tokens (4 x 4 patches of 8 pixels)
    images = SiglipImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, **_NORM)
    images.image_seq_length = (IMAGE_SIZE // 8) ** 2
    text = {**llama_config(layers=layers, vocab=vocab).to_dict(), "model_type": "gemma2",
            "head_dim": 8, "sliding_window": 4, "query_pre_attn_scalar": 8,
            "initializer_range": INIT}
    config = PaliGemmaConfig(
        text_config=text, vision_config=dict(
            model_type="siglip_vision_model", hidden_size=16, intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=8),
        image_token_index=tok.convert_tokens_to_ids("<image>"), projection_dim=32, hidden_size=32,
        vocab_size=vocab, tie_word_embeddings=False)
    return config, PaliGemmaProcessor(image_processor=images, tokenizer=tok)


def _aya_vision(layers: int) -> tuple[Any, Any]:
    from transformers import AyaVisionConfig, AyaVisionProcessor, GotOcr2ImageProcessorPil

    marks = {"start_of_img_token": "<|START_OF_IMG|>", "end_of_img_token": "<|END_OF_IMG|>",
             "img_patch_token": "<|IMG_PATCH|>", "img_line_break_token": "<|IMG_LINE_BREAK|>",
             "tile_token": "TILE", "tile_global_token": "TILE_GLOBAL"}
    tok = _tokenizer([*marks.values(), "<image>"], {})
    # one 32 x 32 tile of 4 x 4 patches of 8 pixels, pixel-shuffled by 2 into 4 image tokens
    images = GotOcr2ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                      crop_to_patches=False, **_NORM)
    processor = AyaVisionProcessor(image_processor=images, tokenizer=tok, patch_size=8,
                                   img_size=IMAGE_SIZE, downsample_factor=2, **marks)
    text = {**llama_config(layers=layers, vocab=330).to_dict(), "model_type": "cohere2",
            "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"] * layers,
            "logit_scale": 0.5, "initializer_range": INIT}
    text["layer_types"] = text["layer_types"][:layers]
    config = AyaVisionConfig(
        text_config=text, vision_config=dict(
            model_type="siglip_vision_model", hidden_size=16, intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=8),
        downsample_factor=2, image_token_index=processor.image_token_id,
        tie_word_embeddings=False)
    return config, processor


def _idefics2(layers: int) -> tuple[Any, Any]:
    from transformers import Idefics2Config, Idefics2ImageProcessorPil, Idefics2Processor

    tok = _tokenizer(["<fake_token_around_image>", "<image>", "<end_of_utterance>"], {})
    # 4 x 4 patches of 8 pixels, resampled by the perceiver into 4 latents (4 image tokens)
    images = Idefics2ImageProcessorPil(size={"shortest_edge": IMAGE_SIZE,
                                             "longest_edge": IMAGE_SIZE},
                                       do_image_splitting=False, **_NORM)
    processor = Idefics2Processor(image_processor=images, tokenizer=tok, image_seq_len=4)
    config = Idefics2Config(
        text_config={**llama_config(layers=layers, vocab=330).to_dict(), "model_type": "mistral",
                     "initializer_range": INIT},
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=8,
                           initializer_range=INIT),
        perceiver_config=dict(hidden_size=32, resampler_n_latents=4, resampler_depth=2,
                              resampler_n_heads=2, resampler_head_dim=8, num_key_value_heads=1,
                              initializer_range=INIT),
        image_token_id=processor.image_token_id, tie_word_embeddings=False)
    return config, processor


def _smolvlm(layers: int) -> tuple[Any, Any]:
    from ctxpatch.core.images import pictures_only
    from transformers import SmolVLMConfig, SmolVLMImageProcessorPil, SmolVLMProcessor

    tok = _tokenizer(["<fake_token_around_image>", "<image>", "<end_of_utterance>", *GRID_TOKENS],
                     {})
    # a 2 x 2 split plus the global view, 32 x 32 each: 4 x 4 patches of 8 pixels, pixel-shuffled
    # by 2 into 4 image tokens
    images = SmolVLMImageProcessorPil(size={"longest_edge": 2 * IMAGE_SIZE},
                                      max_image_size={"longest_edge": IMAGE_SIZE},
                                      do_image_splitting=True, **_NORM)
    processor = pictures_only(SmolVLMProcessor)(image_processor=images, tokenizer=tok,
                                                image_seq_len=4)
    config = SmolVLMConfig(
        text_config={**llama_config(layers=layers, vocab=400).to_dict(),
                     "initializer_range": INIT},
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=8,
                           initializer_range=INIT),
        scale_factor=2, image_token_id=processor.image_token_id, tie_word_embeddings=False)
    return config, processor


def _llava_onevision(layers: int) -> tuple[Any, Any]:
    from ctxpatch.core.images import pictures_only
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionImageProcessorPil,
        LlavaOnevisionProcessor,
    )

    tok = _tokenizer(["<image>", "<video>"], {"image_token": "<image>", "video_token": "<video>"})
    # any-resolution tiles of 32 x 32 (4 x 4 patches of 8 pixels, SigLIP: no CLS): the 4:3
    # sample picture takes the 64 x 32 grid, two tiles unpadded plus the base view and newlines
    grid = [[IMAGE_SIZE, IMAGE_SIZE], [IMAGE_SIZE, 2 * IMAGE_SIZE], [2 * IMAGE_SIZE, IMAGE_SIZE]]
    images = LlavaOnevisionImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                             image_grid_pinpoints=grid, **_NORM)
    processor = pictures_only(LlavaOnevisionProcessor)(
        image_processor=images, tokenizer=tok, num_image_tokens=(IMAGE_SIZE // 8) ** 2,
        vision_feature_select_strategy="full")
    config = LlavaOnevisionConfig(
        text_config={**llama_config("qwen2", layers=layers, vocab=330).to_dict(),
                     "initializer_range": INIT},
        vision_config=dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=2, image_size=IMAGE_SIZE,
                           patch_size=8),
        image_token_index=processor.image_token_id,
        video_token_index=processor.video_token_id, vision_feature_select_strategy="full",
        vision_feature_layer=-1, image_grid_pinpoints=grid, tie_word_embeddings=False)
    return config, processor


def _internvl(layers: int) -> tuple[Any, Any]:
    from ctxpatch.core.images import pictures_only
    from transformers import GotOcr2ImageProcessorPil, InternVLConfig, InternVLProcessor

    roles = {"start_image_token": "<img>", "end_image_token": "</img>",
             "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
    tok = _tokenizer(list(roles.values()), roles)
    # tiles of 32 x 32 (the processor crops to tiles; at most 4 and a thumbnail), each 4 x 4
    # patches of 8 pixels pixel-shuffled by 2 into 4 image tokens, all between <img> and </img>
    images = GotOcr2ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                      max_patches=4, **_NORM)
    processor = pictures_only(InternVLProcessor)(image_processor=images, tokenizer=tok,
                                                 image_seq_length=4)
    config = InternVLConfig(
        text_config={**llama_config("qwen2", layers=layers, vocab=330).to_dict(),
                     "initializer_range": INIT},
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=8,
                           initializer_range=INIT),
        image_token_id=processor.image_token_id, image_seq_length=4, downsample_ratio=0.5,
        tie_word_embeddings=False)
    return config, processor


def _gemma4(layers: int) -> tuple[Any, Any]:
    from ctxpatch.core.images import pictures_only
    from tiny_hybrid import FAMILIES as TEXT
    from transformers import (
        Gemma4AudioFeatureExtractor,
        Gemma4Config,
        Gemma4ImageProcessorPil,
        Gemma4Processor,
    )

    roles = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
             "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}
    tok = _tokenizer([*roles.values(), "<|video|>"], roles)
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in roles.items()}
    # patches of 8 pixels, pooled 2 x 2 into at most 70 soft tokens (the 4:3 sample picture: 63)
    images = Gemma4ImageProcessorPil(patch_size=8, pooling_kernel_size=2, max_soft_tokens=70)
    processor = pictures_only(Gemma4Processor)(
        feature_extractor=Gemma4AudioFeatureExtractor(), image_processor=images, tokenizer=tok,
        image_seq_length=70)
    # the small kind of Gemma 4 text (per-layer embeddings, KV sharing), with bidirectional
    # attention over the image in its sliding-window layers
    text = {**TEXT["gemma4_text"][1], "num_hidden_layers": layers, "vocab_size": 330,
            "vocab_size_per_layer_input": 330, "use_bidirectional_attention": "vision",
            "initializer_range": INIT, "tie_word_embeddings": False}
    # (3 layers: global, sliding, global; the last reuses the first's keys and values)
    text["layer_types"] = (["full_attention", "sliding_attention"] * layers)[:layers - 1] + [
        "full_attention"]
    text["num_kv_shared_layers"] = 1
    config = Gemma4Config(
        text_config=text, vision_config=dict(
            hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, head_dim=8, patch_size=8, pooling_kernel_size=2,
            position_embedding_size=64, initializer_range=INIT),
        boi_token_id=ids["boi_token"], eoi_token_id=ids["eoi_token"],
        image_token_id=ids["image_token"], video_token_id=tok.convert_tokens_to_ids("<|video|>"),
        boa_token_id=ids["boa_token"], eoa_token_index=ids["eoa_token"],
        audio_token_id=ids["audio_token"], tie_word_embeddings=False)
    return config, processor


#: family -> builder of (config, processor) with so many text layers
FAMILIES: dict[str, Callable[[int], tuple[Any, Any]]] = {
    "qwen2_vl": lambda layers: _qwen2_vl(layers),
    "qwen2_5_vl": lambda layers: _qwen2_vl(layers, v25=True),
    "qwen3_vl": _qwen3_vl,
    "glm4v": _glm4v,
    "mistral3": _mistral3,
    "paligemma": _paligemma,
    "aya_vision": _aya_vision,
    "idefics2": _idefics2,
    "smolvlm": _smolvlm,
    "llava_onevision": _llava_onevision,
    "internvl": _internvl,
    "gemma4": _gemma4,
}


def save_family_folder(folder: Path, kind: str, layers: int = 3, seed: int = 0) -> Path:
    """Write a tiny random float64 model of ``kind`` (random norms and biases; nothing left at
    zero) and its processor as a model folder."""
    from transformers import AutoModelForImageTextToText

    config, processor = FAMILIES[kind](layers)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float64).eval()
    randomize_norms(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():  # (zero-initialised projectors would hide the image)
                p.add_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.2)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


#: every image+text family with a tiny model: the first ones (`tiny.save_tiny_image_folder`)
#: and issue 18's (`FAMILIES`)
ALL_FAMILIES: tuple[str, ...] = ("gemma3", "llava", "llava_next", "idefics3", *FAMILIES)


def save_any_image_folder(folder: Path, kind: str, seed: int = 0) -> Path:
    """A tiny model folder of any family in `ALL_FAMILIES` (the first four saved in float32, the
    others in float64; load them in the dtype a test needs)."""
    if kind in FAMILIES:
        return save_family_folder(folder, kind, seed=seed)
    from tiny import save_tiny_image_folder

    return Path(save_tiny_image_folder(folder, kind, seed=seed))


def image_steps(loaded: Any, picture: Any, query: str, tokens: int, context: str = "",
                chat: bool = False, **options: Any) -> tuple[Any, Any, list[Any]]:
    """(prompt, settings, steps) of a run with the picture in the context."""
    from ctxpatch.core.compare import RunSpec, iter_token_patches
    from ctxpatch.core.prompt import build_prompt

    prompt = build_prompt(loaded.tokenizer, context, query, chat_template=chat, image=picture,
                          processor=loaded.processor)
    settings = RunSpec(max_new_tokens=tokens, **options)
    return prompt, settings, list(iter_token_patches(loaded, prompt, settings))
