"""Tiny configs of the dense 2025-26 families and older popular ones (issue 17).

``FAMILIES``: test name -> (model_type, config overrides), merged into `tiny.TINY`, so every
ground-truth test of tests/core/test_ground_truth.py runs on each of them.
"""

from __future__ import annotations

from typing import Any

_IDS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
_LLAMA_LIKE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
               "tie_word_embeddings": False, **_IDS}
# GPT-style inits (std 0.02) make a tiny model's attention nearly uniform and the context's
# effect tiny; a larger init keeps the negative controls meaningful (as in tests/tiny.py)
_BIG_INIT = {"initializer_range": 0.2}
_GPT = {"n_embd": 32, "n_layer": 4, "n_head": 4, "n_positions": 512, **_BIG_INIT, **_IDS}

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # dense 2025-26
    "ministral3": ("ministral3", {**_LLAMA_LIKE, "head_dim": 8, "sliding_window": None}),
    "olmo3": ("olmo3", {**_LLAMA_LIKE, "sliding_window": 4,
                        "layer_types": ["sliding_attention", "sliding_attention",
                                        "sliding_attention", "full_attention"]}),
    "exaone4": ("exaone4", {**_LLAMA_LIKE, "sliding_window": 4, "sliding_window_pattern": 4}),
    # (random MLP biases dominate a 0.02-init MLP's inputs: a larger init keeps them reacting)
    "ernie4_5": ("ernie4_5", {**_LLAMA_LIKE, **_BIG_INIT, "head_dim": 8, "use_bias": True}),
    "seed_oss": ("seed_oss", {**_LLAMA_LIKE, **_BIG_INIT, "head_dim": 8, "mlp_bias": True,
                              "attention_bias": True}),
    "hunyuan_v1_dense": ("hunyuan_v1_dense", {**_LLAMA_LIKE, "head_dim": 8}),
    "glm4": ("glm4", {**_LLAMA_LIKE, "head_dim": 8}),
    "apertus": ("apertus", {**_LLAMA_LIKE}),
    "arcee": ("arcee", {**_LLAMA_LIKE, **_BIG_INIT, "mlp_bias": True}),
    # older, still popular
    "phi": ("phi", {**_LLAMA_LIKE, **_BIG_INIT, "partial_rotary_factor": 0.5}),
    "starcoder2": ("starcoder2", {**_LLAMA_LIKE, **_BIG_INIT, "sliding_window": None}),
    "stablelm": ("stablelm", {**_LLAMA_LIKE, **_BIG_INIT, "use_parallel_residual": False}),
    "stablelm_parallel": ("stablelm", {**_LLAMA_LIKE, **_BIG_INIT, "use_parallel_residual": True,
                                       "qk_layernorm": True}),
    "codegen": ("codegen", {**_GPT, "n_ctx": 512, "rotary_dim": 4}),
    "gpt_bigcode": ("gpt_bigcode", {**_GPT, "multi_query": True}),
    "bloom": ("bloom", {"hidden_size": 32, "n_layer": 4, "n_head": 4, **_BIG_INIT, **_IDS}),
    "bloom_post_ln_residual": ("bloom", {"hidden_size": 32, "n_layer": 4, "n_head": 4,
                                         "apply_residual_connection_post_layernorm": True,
                                         **_BIG_INIT, **_IDS}),
    "mpt": ("mpt", {"d_model": 32, "n_heads": 4, "n_layers": 4, "max_seq_len": 512,
                    "expansion_ratio": 2, **_BIG_INIT, **_IDS}),
    "opt": ("opt", {"hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 4,
                    "num_attention_heads": 4, "max_position_embeddings": 512,
                    "word_embed_proj_dim": 32, "init_std": 0.2, **_IDS}),
    "opt_post_ln": ("opt", {"hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 4,
                            "num_attention_heads": 4, "max_position_embeddings": 512,
                            "word_embed_proj_dim": 16, "do_layer_norm_before": False,
                            "init_std": 0.2, **_IDS}),
}
