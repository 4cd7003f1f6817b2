"""Gemma 2 and Gemma 3 (text, and the language model inside Gemma 3 image+text): the paper's
own family.

Mirrors ``transformers/models/gemma3/modeling_gemma3.py`` (`Gemma3DecoderLayer`; Gemma 2's
`Gemma2DecoderLayer` has the same four norms):

- four RMSNorms per block; ``v`` is the input of ``pre_feedforward_layernorm`` (the residual after
  ``post_attention_layernorm`` of the attention output has been added);
- GeGLU MLP: input matrices ``gate_proj`` and ``up_proj``, output matrix ``down_proj``;
- the output control is the ``post_feedforward_layernorm`` scale ``m = 1 + weight`` (the norm
  computes in float32 and casts after the scale: ``(x * (1 + w)).type_as(x)``);
- the stable update of Appendix B moves most of the shift into ``down_proj``.
"""

from __future__ import annotations

from torch import nn

from .base import Adapter, LayerSites


def sites(layer: nn.Module) -> LayerSites:
    mlp = layer.mlp
    return LayerSites(
        layer=layer,
        v_sources=((layer.pre_feedforward_layernorm, "input"),),
        inputs=(("gate", mlp.gate_proj), ("up", mlp.up_proj)),
        out_matrix=mlp.down_proj,
        out_norm=layer.post_feedforward_layernorm,
    )


ADAPTER = Adapter(
    family="Gemma 2 / Gemma 3",
    model_types=("gemma3_text", "gemma3", "gemma2"),
    sites=sites,
    output_controls=("scale", "matrix"),
    norm_offset=1.0,
    notes=(
        "post-feedforward RMSNorm scale is 1 + weight; patches to it are added to weight",
        "RMSNorms compute in float32 even in float64 models (exactness ~1e-8 relative)",
        "sliding-window and global attention layers alternate (Gemma 3: every 6th is global)",
        "Gemma 2 soft-caps attention and final logits; the patches do not touch either",
    ),
)
