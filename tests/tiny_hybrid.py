"""Tiny configs of the hybrid state-space / linear-attention families, Gemma 4 and Gemma 3n
(issue 17).

``FAMILIES``: test name -> (model_type, config overrides), merged into `tiny.TINY`, so every
ground-truth test of tests/core/test_ground_truth.py runs on each of them.

``ALL_LAYERS_ONLY``: the same for families that are exact only when every layer is patched
(Gemma 3n: a layer's output streams depend on its input streams beyond ``T``, so a first patched
layer cannot absorb an upstream mismatch); tests/core/test_families_hybrid.py runs the other
ground-truth checks on them, and shows that a later start layer is not exact.
"""

from __future__ import annotations

from typing import Any

_IDS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
_SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
          "max_position_embeddings": 512, **_IDS}

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # the small kind: per-layer embeddings; layers 2-3 reuse the keys and values of layers 0-1
    # and have MLPs twice as wide
    "gemma4_text": ("gemma4_text", {
        **_SMALL, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "global_head_dim": 16, "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 320,
        "num_kv_shared_layers": 2, "use_double_wide_mlp": True}),
    # the large dense kind: no per-layer embeddings, no KV sharing (transformers 5.24 fails
    # with KV sharing but no per-layer embeddings), global layers' keys are their values
    # (attention_k_eq_v) with their own head size; final logits soft-capped
    "gemma4_text_k_eq_v": ("gemma4_text", {
        **_SMALL, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
        "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
        "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
        "hidden_size_per_layer_input": 0, "final_logit_softcapping": 30.0}),
    # Gated DeltaNet and full attention alternate
    "qwen3_5_text": ("qwen3_5_text", {
        **_SMALL, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "tie_word_embeddings": False,
        "layer_types": ["linear_attention", "full_attention"] * 2}),
    # Mamba 2 beside attention in every layer, with muP multipliers everywhere
    "falcon_h1": ("falcon_h1", {
        **_SMALL, "num_attention_heads": 4, "num_key_value_heads": 2, "mamba_d_ssm": 32,
        "mamba_n_heads": 4, "mamba_d_state": 8, "mamba_chunk_size": 4, "mlp_bias": True,
        "mlp_multipliers": [0.8, 1.7], "ssm_multipliers": [1.1, 0.9, 1.2, 0.8, 1.3],
        "ssm_in_multiplier": 1.2, "ssm_out_multiplier": 0.7, "attention_in_multiplier": 0.9,
        "attention_out_multiplier": 1.3, "key_multiplier": 0.8, "embedding_multiplier": 1.5,
        "lm_head_multiplier": 0.6, "initializer_range": 0.2}),
    # Mamba, attention, Mamba, Mamba; experts in layers 1 (attention) and 3 (Mamba)
    "jamba": ("jamba", {
        **_SMALL, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
        "num_experts_per_tok": 2, "expert_layer_period": 2, "expert_layer_offset": 1,
        "attn_layer_period": 4, "attn_layer_offset": 1, "mamba_d_state": 8,
        "initializer_range": 0.2}),
    # Mamba 2, attention, Mamba 2, attention; experts beside the shared MLP; muP multipliers
    "granitemoehybrid": ("granitemoehybrid", {
        **_SMALL, "intermediate_size": 16, "shared_intermediate_size": 32,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
        "num_experts_per_tok": 2, "position_embedding_type": "rope",
        "layer_types": ["linear_attention", "full_attention"] * 2, "mamba_n_heads": 4,
        "mamba_d_state": 8, "mamba_chunk_size": 4, "residual_multiplier": 0.7,
        "embedding_multiplier": 2.0, "attention_multiplier": 0.3, "logits_scaling": 1.5,
        "initializer_range": 0.2}),
    # the same without experts (Granite 4.0 H Micro): the shared MLP is the layer's MLP
    "granitemoehybrid_dense": ("granitemoehybrid", {
        **_SMALL, "shared_intermediate_size": 32, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_local_experts": 0, "position_embedding_type": "rope",
        "layer_types": ["full_attention", "linear_attention"] * 2, "mamba_n_heads": 4,
        "mamba_d_state": 8, "mamba_chunk_size": 4, "residual_multiplier": 0.7,
        "initializer_range": 0.2}),
}

ALL_LAYERS_ONLY: dict[str, tuple[str, dict[str, Any]]] = {
    # four AltUp streams, LAuReL, per-layer inputs, Gaussian top-k gate sparsity in layer 0;
    # layers 2-3 reuse the keys and values of layers 0-1
    "gemma3n_text": ("gemma3n_text", {
        **_SMALL, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
        "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 320,
        "num_kv_shared_layers": 2, "laurel_rank": 4, "altup_num_inputs": 4,
        "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0], "final_logit_softcapping": 30.0}),
}
