"""Falcon: parallel (7B-style and the new decoder architecture) and sequential blocks.

Mirrors ``transformers/models/falcon/modeling_falcon.py`` (`FalconDecoderLayer`):

- parallel (``parallel_attn`` or ``new_decoder_architecture``): ``input_layernorm`` (or
  ``ln_attn`` and ``ln_mlp``) read the layer input ``x``; ``T = x + attn + mlp``; so
  ``v = x + attn`` and, as for GPT-J, the MLP input does not depend on the context once ``x``
  matches;
- sequential (neither flag): ``v`` is the input of ``post_attention_layernorm``;
- MLP ``dense_h_to_4h`` (input control), GELU, ``dense_4h_to_h`` (output control: the rank-1
  matrix, or its bias when ``config.bias``);
- the MLP output is added to the attention output in place, after our hooks have read it.
"""

from __future__ import annotations

from torch import nn

from .base import Adapter, LayerSites
from .parallel import dense_sites


def _sites(layer: nn.Module) -> LayerSites:
    config = layer.config
    parallel = bool(config.parallel_attn or config.new_decoder_architecture)
    return dense_sites(layer, layer.self_attention, parallel)


ADAPTER = Adapter(
    family="Falcon",
    model_types=("falcon",),
    sites=_sites,
    output_controls=("matrix", "bias"),
    notes=(
        "parallel blocks (7B, 40B, new decoder architecture): only the output control is needed "
        "once the layer input matches; sequential blocks (e.g. falcon-rw): input and output",
        "the bias control needs a model built with bias=True",
    ),
)
