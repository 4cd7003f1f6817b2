"""Parallel blocks: attention and MLP read the same normalized layer input.

``T = x + Attn(LN(x); C) + MLP(LN'(x))`` (PAPER.md section 4, ``lem:parallel_block``). Once the
layer input ``x`` at the query matches (every earlier layer patched), the MLP input does not
depend on the context at all, so only the output control is needed: ``v = x + Attn(...)`` and the
output matrix (or its bias) absorbs ``dv``. The input patches are still built: they are ~0 then
(rounding only), and they are what lets the first patched layer absorb upstream mismatch when the
layer selection starts later.

- GPT-J (``transformers/models/gptj/modeling_gptj.py``, `GPTJBlock`): ``ln_1`` feeds both;
  ``mlp.fc_in`` / ``mlp.fc_out`` with biases.
- GPT-NeoX (`GPTNeoXLayer`): ``use_parallel_residual`` (the default) is parallel with two
  LayerNorms; without it the block is sequential and ``v`` is the input of
  ``post_attention_layernorm``. ``mlp.dense_h_to_4h`` / ``mlp.dense_4h_to_h`` with biases.
- Cohere and Cohere 2 (`CohereDecoderLayer`): ``input_layernorm`` feeds both; gated MLP
  ``gate_proj``, ``up_proj``, ``down_proj`` without biases.
"""

from __future__ import annotations

from torch import nn

from .base import Adapter, LayerSites


def _gptj(layer: nn.Module) -> LayerSites:
    return LayerSites(
        layer=layer,
        v_sources=((layer, "input"), (layer.attn, "output")),
        inputs=(("fc_in", layer.mlp.fc_in),),
        out_matrix=layer.mlp.fc_out,
        parallel=True,
    )


def dense_sites(layer: nn.Module, attention: nn.Module, parallel: bool) -> LayerSites:
    """GPT-NeoX and Falcon: ``mlp.dense_h_to_4h`` / ``mlp.dense_4h_to_h``, in a parallel block
    (``v = x + attn``) or a sequential one (``v`` before ``post_attention_layernorm``)."""
    v_sources: tuple[tuple[nn.Module, str], ...] = (
        ((layer, "input"), (attention, "output")) if parallel
        else ((layer.post_attention_layernorm, "input"),)
    )
    return LayerSites(
        layer=layer,
        v_sources=v_sources,
        inputs=(("fc_in", layer.mlp.dense_h_to_4h),),
        out_matrix=layer.mlp.dense_4h_to_h,
        parallel=parallel,
    )


def _neox(layer: nn.Module) -> LayerSites:
    return dense_sites(layer, layer.attention, bool(layer.use_parallel_residual))


def _cohere(layer: nn.Module) -> LayerSites:
    mlp = layer.mlp
    return LayerSites(
        layer=layer,
        v_sources=((layer, "input"), (layer.self_attn, "output")),
        inputs=(("gate", mlp.gate_proj), ("up", mlp.up_proj)),
        out_matrix=mlp.down_proj,
        parallel=True,
    )


_NOTE = ("parallel block: once the layer input matches, the MLP input does not depend on the "
         "context; the input patches are then ~0 and the output control does the work")

GPTJ = Adapter(
    family="GPT-J",
    model_types=("gptj",),
    sites=_gptj,
    output_controls=("matrix", "bias"),
    notes=(_NOTE,),
)

NEOX = Adapter(
    family="GPT-NeoX",
    model_types=("gpt_neox",),
    sites=_neox,
    output_controls=("matrix", "bias"),
    notes=(_NOTE, "use_parallel_residual=False makes the block sequential (v before the MLP norm)"),
)

COHERE = Adapter(
    family="Cohere",
    model_types=("cohere", "cohere2"),
    sites=_cohere,
    output_controls=("matrix",),
    notes=(_NOTE, "no biases: the down matrix is the output control"),
)
