"""GPT-2: LayerNorm, a GELU MLP of two Conv1D layers, biases everywhere.

Mirrors ``transformers/models/gpt2/modeling_gpt2.py`` (`GPT2Block`, `GPT2MLP`):

- ``v`` is the input of ``ln_2`` (the residual after the attention);
- input matrix ``mlp.c_fc``, output matrix ``mlp.c_proj``; both are `Conv1D`, whose weight is
  stored transposed, ``(in, out)``: the patches act on outputs, and the patches file stores
  ``u`` along the stored ``shape[0]`` (the input side);
- the output control is the ``c_proj`` bias (``db = dv``, always possible; the paper's first
  choice for GPT-2) or the rank-1 ``c_proj`` matrix (needs ``h != 0``).
"""

from __future__ import annotations

from torch import nn

from .base import Adapter, LayerSites


def _sites(layer: nn.Module) -> LayerSites:
    return LayerSites(
        layer=layer,
        v_sources=((layer.ln_2, "input"),),
        inputs=(("fc", layer.mlp.c_fc),),
        out_matrix=layer.mlp.c_proj,
    )


ADAPTER = Adapter(
    family="GPT-2",
    model_types=("gpt2",),
    sites=_sites,
    output_controls=("bias", "matrix"),
    transposed=True,
    notes=(
        "Conv1D weights are stored (in, out): patches are saved in that orientation",
        "absolute position embeddings: absorb 'all' keeps each token at its absolute position",
    ),
)
