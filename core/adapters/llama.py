"""Llama-style blocks: Llama, Mistral, Qwen 2, Qwen 3 (pre-RMSNorm, SwiGLU MLP, no post-norm).

Mirrors ``transformers/models/llama/modeling_llama.py`` (`LlamaDecoderLayer`):

- ``v`` is the input of ``post_attention_layernorm`` (which, despite its name, is the pre-MLP norm);
- input matrices ``gate_proj`` and ``up_proj``; output matrix ``down_proj``;
- no trainable post-norm, so the output control is the rank-1 patch of ``down_proj``
  (``dW = dv h^T / |h|^2`` with ``h`` the gated activation); method "stable" is the same as
  "direct" here;
- the RMSNorm casts before the scale: ``weight * x.to(input_dtype)``.
"""

from __future__ import annotations

from torch import nn

from core.adapters.base import Adapter, LayerSites


def _sites(layer: nn.Module) -> LayerSites:
    mlp = layer.mlp
    return LayerSites(
        layer=layer,
        v_sources=((layer.post_attention_layernorm, "input"),),
        inputs=(("gate", mlp.gate_proj), ("up", mlp.up_proj)),
        out_matrix=mlp.down_proj,
    )


ADAPTER = Adapter(
    family="Llama / Mistral / Qwen",
    model_types=("llama", "mistral", "qwen2", "qwen3"),
    sites=_sites,
    output_controls=("matrix",),
    notes=(
        "no post-MLP norm: the down matrix absorbs the attention shift",
        "method 'stable' equals 'direct' (it only changes post-norm scale families)",
    ),
)
