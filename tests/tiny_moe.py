"""Tiny configs of the mixture-of-experts families with shared experts or biased routers (issue 17).

``FAMILIES``: test name -> (model_type, config overrides), merged into `tiny.TINY`, so every
ground-truth test of tests/core/test_ground_truth.py runs on each of them. Hidden size 32, four
layers, a few experts; dense and MoE layers alternate where the family allows. Larger inits
(``initializer_range``) keep the context's effect, and so the negative controls, clear.
"""

from __future__ import annotations

from typing import Any

_IDS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
_BASE = {"hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 512, "tie_word_embeddings": False,
         "initializer_range": 0.1, **_IDS}
# DeepSeek-style: multi-head latent attention, grouped top-k of 8 routed experts, 1 dense layer
_DEEPSEEK = {**_BASE, "num_key_value_heads": 4, "intermediate_size": 64,
             "moe_intermediate_size": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
             "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8,
             "v_head_dim": 8, "first_k_dense_replace": 1}

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt_oss": ("gpt_oss", {**_BASE, "intermediate_size": 16, "head_dim": 8,
                            "num_local_experts": 4, "num_experts_per_tok": 2,
                            "sliding_window": 4, "swiglu_limit": 0.3,
                            "layer_types": ["sliding_attention", "full_attention"] * 2,
                            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    "deepseek_v3": ("deepseek_v3", {**_DEEPSEEK, "n_shared_experts": 1, "n_group": 4,
                                    "topk_group": 2, "routed_scaling_factor": 2.5,
                                    "norm_topk_prob": True}),
    "deepseek_v2": ("deepseek_v2", {**_DEEPSEEK, "n_shared_experts": 2, "q_lora_rank": None,
                                    "topk_method": "group_limited_greedy", "n_group": 4,
                                    "topk_group": 2, "routed_scaling_factor": 1.5}),
    "glm4_moe": ("glm4_moe", {**_BASE, "head_dim": 8, "intermediate_size": 64,
                              "moe_intermediate_size": 16, "n_routed_experts": 8,
                              "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 2,
                              "topk_group": 1, "routed_scaling_factor": 1.8,
                              "first_k_dense_replace": 1, "norm_topk_prob": True,
                              "use_qk_norm": True}),
    "qwen2_moe": ("qwen2_moe", {**_BASE, "intermediate_size": 64, "moe_intermediate_size": 16,
                                "shared_expert_intermediate_size": 24, "num_experts": 4,
                                "num_experts_per_tok": 2, "norm_topk_prob": False,
                                "decoder_sparse_step": 1, "mlp_only_layers": [1]}),
    "qwen3_next": ("qwen3_next", {**_BASE, "head_dim": 8, "intermediate_size": 64,
                                  "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                                  "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                  "moe_intermediate_size": 16,
                                  "shared_expert_intermediate_size": 24, "num_experts": 4,
                                  "num_experts_per_tok": 2, "norm_topk_prob": True,
                                  "layer_types": ["linear_attention", "full_attention"] * 2,
                                  "decoder_sparse_step": 1, "mlp_only_layers": [2]}),
    "ernie4_5_moe": ("ernie4_5_moe", {**_BASE, "intermediate_size": 64,
                                      "moe_intermediate_size": 16, "moe_num_experts": 4,
                                      "moe_k": 2, "moe_num_shared_experts": 1,
                                      "moe_layer_start_index": 1, "moe_layer_end_index": 3,
                                      "moe_layer_interval": 2, "use_bias": True}),
    # without a shared expert the routed experts absorb dv / S behind a float32 router
    "ernie4_5_moe_routed": ("ernie4_5_moe", {**_BASE, "intermediate_size": 64,
                                             "moe_intermediate_size": 16, "moe_num_experts": 4,
                                             "moe_k": 2, "moe_num_shared_experts": 0,
                                             "moe_layer_start_index": 0,
                                             "moe_layer_end_index": 3, "moe_layer_interval": 1}),
    "llama4_text": ("llama4_text", {**_BASE, "head_dim": 8, "intermediate_size": 16,
                                    "intermediate_size_mlp": 64, "num_local_experts": 4,
                                    "num_experts_per_tok": 2, "moe_layers": [1, 3],
                                    "attention_chunk_size": 64}),
    "granitemoe": ("granitemoe", {**_BASE, "intermediate_size": 16, "num_local_experts": 4,
                                  "num_experts_per_tok": 2, "residual_multiplier": 0.7,
                                  "embedding_multiplier": 2.0, "attention_multiplier": 0.3,
                                  "logits_scaling": 1.5}),
    # Gemma 4's MoE kind (26B A4B): a dense GeGLU MLP beside softmax top-2 of 4 experts in every
    # layer, the sum post-normed; global layers' keys are their values, soft-capped logits
    # (tests/core/test_families_moe.py also randomises the router's scale and per-expert scale)
    "gemma4_text_moe": ("gemma4_text", {
        **_BASE, "num_attention_heads": 2, "head_dim": 16, "global_head_dim": 32,
        "num_global_key_value_heads": 1, "attention_k_eq_v": True, "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "hidden_size_per_layer_input": 0, "final_logit_softcapping": 30.0,
        "intermediate_size": 64, "enable_moe_block": True, "num_experts": 4,
        "top_k_experts": 2, "moe_intermediate_size": 16}),
}
