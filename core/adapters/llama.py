"""Llama-style blocks (pre-RMSNorm, gated MLP, no post-norm): Llama, Mistral, Ministral, Qwen 2,
Qwen 3, SmolLM3, Granite, Gemma 1, and Phi-3 with its fused ``gate_up_proj``.

Mirrors ``transformers/models/llama/modeling_llama.py`` (`LlamaDecoderLayer`):

- ``v`` is the input of ``post_attention_layernorm`` (which, despite its name, is the pre-MLP norm);
- input matrices ``gate_proj`` and ``up_proj`` (Phi-3: the one fused ``gate_up_proj``, whose
  output is split into gate and up after the matrix, so one rank-1 patch controls both);
  output matrix ``down_proj``;
- no trainable post-norm, so the output control is the rank-1 patch of ``down_proj``
  (``dW = dv h^T / |h|^2`` with ``h`` the gated activation); method "stable" is the same as
  "direct" here;
- Granite scales each branch by ``residual_multiplier`` before adding it, so the down matrix
  absorbs ``dv / residual_multiplier``;
- Gemma 1's RMSNorm scale is ``1 + weight`` (it is never patched here: the control is the matrix);
- the RMSNorm casts before the scale: ``weight * x.to(input_dtype)`` (Gemma: after).
"""

from __future__ import annotations

from torch import nn

from .base import Adapter, LayerSites


def sites(layer: nn.Module) -> LayerSites:
    mlp = layer.mlp
    if hasattr(mlp, "gate_up_proj"):  # Phi-3
        inputs: tuple[tuple[str, nn.Module], ...] = (("gate_up", mlp.gate_up_proj),)
    else:
        inputs = (("gate", mlp.gate_proj), ("up", mlp.up_proj))
    return LayerSites(
        layer=layer,
        v_sources=((layer.post_attention_layernorm, "input"),),
        inputs=inputs,
        out_matrix=mlp.down_proj,
        branch_scale=float(getattr(layer, "residual_multiplier", 1.0)),
    )


_NOTES = (
    "no post-MLP norm: the down matrix absorbs the attention shift",
    "method 'stable' equals 'direct' (it only changes post-norm scale families)",
)

ADAPTER = Adapter(
    family="Llama / Mistral / Qwen",
    model_types=("llama", "mistral", "ministral", "qwen2", "qwen3", "smollm3",
                 "qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text"),  # (those of Qwen2(.5)/3-VL)
    sites=sites,
    output_controls=("matrix",),
    notes=_NOTES,
)

GRANITE = Adapter(
    family="Granite",
    model_types=("granite",),
    sites=sites,
    output_controls=("matrix",),
    notes=(*_NOTES, "each branch is scaled by residual_multiplier: the down patch absorbs dv / it"),
)

PHI3 = Adapter(
    family="Phi-3",
    model_types=("phi3",),
    sites=sites,
    output_controls=("matrix",),
    notes=(*_NOTES, "gate and up are one fused gate_up_proj: one rank-1 patch controls both"),
)

GEMMA1 = Adapter(
    family="Gemma 1",
    model_types=("gemma",),
    sites=sites,
    output_controls=("matrix",),
    norm_offset=1.0,
    notes=(*_NOTES, "RMSNorm scales are 1 + weight; Gemma 1 has no post-MLP norm to patch"),
)
