"""Tiny random models and an offline tokenizer for tests (no downloads)."""

from __future__ import annotations

import functools
from typing import Any

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Write a single-sentence weather forecast for Mars, from the perspective of a robot:",
    "Context and parameter updates are equivalent in modern transformer blocks.",
    "Hello world! 123 456 789. Ünïcödé and emoji 🙂 are bytes too.",
]


@functools.cache
def tiny_tokenizer(vocab_size: int = 320) -> Any:
    """A byte-level BPE tokenizer trained on a few sentences, with <pad>=0, <eos>=1, <bos>=2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<eos>", "<bos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(CORPUS, trainer)
    tk.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", 2)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )


#: other parameters or buffers that start at zero (or near it) and would hide bugs: MoE experts'
#: biases, the routers' selection-only correction biases, attention sinks (gpt-oss); Gemma 3n's
#: AltUp output scale (zero: it would switch the per-layer-input branch off) and Gemma 4's
#: per-layer output scalar (a buffer of ones)
_RANDOM_TOO = ("gate_up_proj_bias", "down_proj_bias", "e_score_correction_bias", "sinks",
               "correct_output_scale", "layer_scalar")


def randomize_norms(model: torch.nn.Module, seed: int = 0, scale: float = 0.5) -> None:
    """Give every norm's weight and bias, and every other bias, random values (the zero/one init
    hides cast-order bugs, and a zero bias hides a bias patch's sign); likewise the `_RANDOM_TOO`
    parameters and buffers (a zero correction bias hides a routing that ignores it)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            is_norm = "norm" in type(module).__name__.lower()
            for name, p in module.named_parameters(recurse=False):
                if not is_norm and name != "bias" and name not in _RANDOM_TOO:
                    continue
                noise = torch.randn(p.shape, generator=g, dtype=torch.float64) * scale
                p.add_(noise.to(p.dtype))
            for name, b in module.named_buffers(recurse=False):
                if name in _RANDOM_TOO and b.is_floating_point():
                    noise = torch.randn(b.shape, generator=g, dtype=torch.float64) * scale
                    b.add_(noise.to(b.dtype))


def gemma3_config(layers: int = 4, vocab: int = 320) -> Any:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * (layers // 3)
        + ["sliding_attention"] * (layers % 3),
        max_position_embeddings=512,
        query_pre_attn_scalar=16,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )


def llama_config(model_type: str = "llama", layers: int = 4, vocab: int = 320) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(
        model_type,
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=False,
    )


_IDS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
_LLAMA_LIKE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
               "tie_word_embeddings": False, **_IDS}
# GPT-style inits (std 0.02) make a tiny model's attention nearly uniform and the context's
# effect tiny; a larger init keeps the negative controls meaningful
_GPT = {"n_embd": 32, "n_layer": 4, "n_head": 4, "n_positions": 512, "initializer_range": 0.2,
        **_IDS}
_FALCON = {"hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
           "max_position_embeddings": 512, "initializer_range": 0.2, **_IDS}

#: every family the ground-truth tests cover: name -> (model_type, config overrides)
TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", _LLAMA_LIKE),
    "mistral": ("mistral", _LLAMA_LIKE),
    "ministral": ("ministral", {**_LLAMA_LIKE, "head_dim": 8, "sliding_window": 64}),
    "qwen2": ("qwen2", _LLAMA_LIKE),
    "qwen3": ("qwen3", _LLAMA_LIKE),
    "smollm3": ("smollm3", _LLAMA_LIKE),
    "granite": ("granite", {**_LLAMA_LIKE, "residual_multiplier": 0.7, "embedding_multiplier": 2.0,
                            "attention_multiplier": 0.3, "logits_scaling": 1.5}),
    "phi3": ("phi3", _LLAMA_LIKE),
    "gemma": ("gemma", {**_LLAMA_LIKE, "head_dim": 8}),
    "gemma2": ("gemma2", {**_LLAMA_LIKE, "head_dim": 8, "sliding_window": 4,
                          "query_pre_attn_scalar": 8}),
    "olmo2": ("olmo2", _LLAMA_LIKE),
    "gpt2": ("gpt2", _GPT),
    "gptj": ("gptj", {**_GPT, "rotary_dim": 4}),
    "gpt_neox": ("gpt_neox", {**_FALCON, "intermediate_size": 64, "use_parallel_residual": True}),
    "gpt_neox_sequential": ("gpt_neox", {**_FALCON, "intermediate_size": 64,
                                         "use_parallel_residual": False}),
    "cohere": ("cohere", {**_LLAMA_LIKE, "logit_scale": 0.5}),
    "falcon_new": ("falcon", {**_FALCON, "new_decoder_architecture": True, "num_kv_heads": 2}),
    "falcon_parallel": ("falcon", {**_FALCON, "parallel_attn": True, "multi_query": True,
                                   "bias": True}),
    "mixtral": ("mixtral", {**_LLAMA_LIKE, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("qwen3_moe", {**_LLAMA_LIKE, "num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 16, "norm_topk_prob": False,
                                "decoder_sparse_step": 1, "mlp_only_layers": [1]}),
    "olmoe": ("olmoe", {**_LLAMA_LIKE, "num_experts": 4, "num_experts_per_tok": 2}),
    "falcon_sequential": ("falcon", {**_FALCON, "parallel_attn": False, "alibi": True,
                                     "bias": True}),
}


# the 2025-26 families (issue 17), one file per group, merged into TINY (they import nothing
# from here: each holds only a dict of the same shape)
import tiny_dense  # noqa: E402
import tiny_hybrid  # noqa: E402
import tiny_moe  # noqa: E402

for _group in (tiny_dense, tiny_moe, tiny_hybrid):
    TINY.update(_group.FAMILIES)


def tiny_config(name: str, vocab: int = 320) -> Any:
    """A tiny config of one of the `TINY` families."""
    from transformers import AutoConfig

    model_type, overrides = TINY[name]
    return AutoConfig.for_model(model_type, vocab_size=vocab, **overrides)


def tiny_loaded(config: Any, dtype: torch.dtype = torch.float64, seed: int = 0) -> Any:
    """A `LoadedModel` of a random model built from ``config``."""
    from ctxpatch.core.adapters import adapter_for_config
    from ctxpatch.core.loading import LoadedModel
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    extra = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, **extra).eval()
    randomize_norms(model, seed)
    return LoadedModel(
        model=model,
        tokenizer=tiny_tokenizer(config.vocab_size),
        adapter=adapter_for_config(config),
        spec=f"tiny-{config.model_type}",
        source="memory",
        dtype=dtype,
        device=torch.device("cpu"),
    )


def save_tiny_folder(folder: Any, config: Any | None = None, seed: int = 0) -> Any:
    """Write a tiny random Llama (random norms) and the tiny tokenizer as a model folder, the
    way a user's local checkpoint looks; returns the folder."""
    from ctxpatch.core.loading import quiet_transformers

    loaded = tiny_loaded(config or llama_config(), dtype=torch.float32, seed=seed)
    with quiet_transformers():  # (its "Writing model shards" bar is no output of the app's)
        loaded.model.save_pretrained(folder)
        loaded.tokenizer.save_pretrained(folder)
    return folder


#: image+text families: (image tokens the tokenizer needs, as extra special tokens by role)
IMAGE_TOKENS = {
    "gemma3": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
               "image_token": "<image_soft_token>"},
    "llava": {"image_token": "<image>"},
    "llava_next": {"image_token": "<image>"},
    "idefics3": {},  # its processor adds <image> and <fake_token_around_image> itself
}
#: Idefics3's image grid tokens, special in its tokenizers (SmolVLM's too)
GRID_TOKENS = ["<global-img>"] + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
IMAGE_SIZE = 32


def image_tokenizer(kind: str) -> Any:
    """The tiny tokenizer plus the image tokens of an image+text family (ids 320 and up)."""
    from transformers import PreTrainedTokenizerFast

    roles = IMAGE_TOKENS[kind]
    backend = tiny_tokenizer(320).backend_tokenizer.__class__.from_str(
        tiny_tokenizer(320).backend_tokenizer.to_str())
    from tokenizers import AddedToken

    extra = GRID_TOKENS if kind == "idefics3" else []
    backend.add_special_tokens([AddedToken(t, special=True) for t in [*roles.values(), *extra]])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", extra_special_tokens=dict(roles))


def image_text_parts(kind: str, layers: int = 4) -> tuple[Any, Any]:
    """(config, processor) of a tiny image+text model: Gemma 3 (SigLIP, 4 soft tokens per image)
    or LLaVA on Llama (CLIP, 16 patch tokens + CLS dropped)."""
    tok = image_tokenizer(kind)
    ids = {role: tok.convert_tokens_to_ids(t) for role, t in IMAGE_TOKENS[kind].items()}
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  image_size=IMAGE_SIZE, patch_size=8)
    norm = dict(image_mean=[0.5] * 3, image_std=[0.5] * 3)
    if kind == "gemma3":
        from transformers import Gemma3Config, Gemma3ImageProcessorPil, Gemma3Processor

        config = Gemma3Config(
            text_config=gemma3_config(layers=layers, vocab=330).to_dict(),
            vision_config=vision, mm_tokens_per_image=4, boi_token_index=ids["boi_token"],
            eoi_token_index=ids["eoi_token"], image_token_index=ids["image_token"])
        images = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, **norm)
        processor = Gemma3Processor(image_processor=images, tokenizer=tok, image_seq_length=4)
    elif kind == "idefics3":
        from transformers import Idefics3Config, Idefics3ImageProcessorPil, Idefics3Processor

        images = Idefics3ImageProcessorPil(size={"longest_edge": 2 * IMAGE_SIZE},
                                           max_image_size={"longest_edge": IMAGE_SIZE},
                                           do_image_splitting=True, **norm)
        processor = Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=4)
        config = Idefics3Config(
            text_config=llama_config(layers=layers, vocab=400).to_dict(),
            vision_config={k: v for k, v in vision.items()}, scale_factor=2,
            image_token_id=processor.image_token_id)
    elif kind == "llava_next":
        from transformers import (
            LlavaNextConfig,
            LlavaNextImageProcessorPil,
            LlavaNextProcessor,
        )

        grid = [[IMAGE_SIZE, 2 * IMAGE_SIZE], [2 * IMAGE_SIZE, IMAGE_SIZE]]
        config = LlavaNextConfig(
            text_config=llama_config(layers=layers, vocab=330).to_dict(),
            vision_config={**vision, "model_type": "clip_vision_model", "projection_dim": 16},
            image_token_index=ids["image_token"], vision_feature_select_strategy="default",
            vision_feature_layer=-2, image_grid_pinpoints=grid)
        images = LlavaNextImageProcessorPil(
            size={"shortest_edge": IMAGE_SIZE},
            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
            image_grid_pinpoints=grid, **norm)
        processor = LlavaNextProcessor(image_processor=images, tokenizer=tok, patch_size=8,
                                       vision_feature_select_strategy="default",
                                       num_additional_image_tokens=1)
    else:
        from transformers import CLIPImageProcessorPil, LlavaConfig, LlavaProcessor

        config = LlavaConfig(
            text_config=llama_config(layers=layers, vocab=330).to_dict(),
            vision_config={**vision, "model_type": "clip_vision_model", "projection_dim": 16},
            image_token_index=ids["image_token"], vision_feature_select_strategy="default",
            vision_feature_layer=-2)
        images = CLIPImageProcessorPil(
            size={"shortest_edge": IMAGE_SIZE},
            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, **norm)
        processor = LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=8,
                                   vision_feature_select_strategy="default",
                                   num_additional_image_tokens=1)
    return config, processor


def tiny_image_loaded(kind: str, dtype: torch.dtype = torch.float64, seed: int = 0) -> Any:
    """A `LoadedModel` of a random image+text model with its processor (random norms, biases)."""
    from ctxpatch.core.adapters import adapter_for_config
    from ctxpatch.core.loading import LoadedModel
    from transformers import AutoModelForImageTextToText

    config, processor = image_text_parts(kind)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=dtype).eval()
    randomize_norms(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # Gemma 3's projector starts at zero: the image would be all zeros
        for p in model.parameters():
            if not p.any():
                p.add_((torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.2).to(p.dtype))
    return LoadedModel(model=model, tokenizer=processor.tokenizer,
                       adapter=adapter_for_config(config), spec=f"tiny-{kind}-image",
                       source="memory", dtype=dtype, device=torch.device("cpu"),
                       processor=processor)


def save_tiny_image_folder(folder: Any, kind: str, seed: int = 0) -> Any:
    """Write a tiny random image+text model and its processor as a model folder."""
    from ctxpatch.core.loading import quiet_transformers

    loaded = tiny_image_loaded(kind, dtype=torch.float32, seed=seed)
    with quiet_transformers():
        loaded.model.save_pretrained(folder)
        loaded.processor.save_pretrained(folder)
    return folder


def comparable_record(record: dict[str, Any]) -> dict[str, Any]:
    """A run record without what differs between two runs of the same options: the timings'
    values (their keys stay: every front end measures the same ones, the wall time included)."""
    import json
    import re

    text = json.dumps(record, sort_keys=True)
    text = re.sub(r'"(seconds|wall|baseline|patched|control|total)": [0-9.e-]+', r'"\1": 0',
                  text)
    return json.loads(text)