"""OLMo 2: post-norms only; the MLP reads the raw residual stream.

Mirrors ``transformers/models/olmo2/modeling_olmo2.py`` (`Olmo2DecoderLayer`):

- ``h = x + post_attention_layernorm(attn(x))``; ``T = h + post_feedforward_layernorm(mlp(h))``;
- so ``v`` is the MLP's own input and ``z = v`` (no pre-norm): the gate and up matrices see it
  directly and the rank-1 input patches need ``v != 0``;
- the output control is the ``post_feedforward_layernorm`` scale, plain ``weight`` (not
  ``1 + weight``); method "stable" moves most of the shift into ``down_proj`` as for Gemma;
- the RMSNorm computes in float32 and casts after the scale: ``(weight * x).to(input_dtype)``.
"""

from __future__ import annotations

from torch import nn

from .base import Adapter, LayerSites


def _sites(layer: nn.Module) -> LayerSites:
    mlp = layer.mlp
    return LayerSites(
        layer=layer,
        v_sources=((mlp, "input"),),
        inputs=(("gate", mlp.gate_proj), ("up", mlp.up_proj)),
        out_matrix=mlp.down_proj,
        out_norm=layer.post_feedforward_layernorm,
    )


ADAPTER = Adapter(
    family="OLMo 2",
    model_types=("olmo2",),
    sites=_sites,
    output_controls=("scale", "matrix"),
    norm_offset=0.0,
    notes=(
        "no pre-MLP norm: the input patches act on the raw residual stream",
        "the post-feedforward RMSNorm scale is weight itself (no 1 +)",
    ),
)
