"""Mixture-of-experts blocks with fused 3-D experts: Mixtral, Qwen3-MoE, OLMoE.

Mirrors ``transformers/models/mixtral/modeling_mixtral.py`` (`MixtralSparseMoeBlock`,
`MixtralTopKRouter`, `MixtralExperts`; Qwen3-MoE and OLMoE have the same three pieces):

- pre-RMSNorm as in Llama: ``v`` is the input of ``post_attention_layernorm``, ``z = N(v)``;
- the router ``mlp.gate`` (a matrix ``(E, d)``; softmax, top-k, renormalised for Mixtral and
  where ``norm_topk_prob``) gets the rank-1 input patch, so the reduced input picks the same
  experts with the same weights;
- the experts ``mlp.experts`` store ``gate_up_proj (E, 2f, d)`` and ``down_proj (E, d, f)``;
  every active expert's slices get rank-1 patches (DESIGN.md names them ``param[e]``): the
  input patch on ``gate_up_proj[e]``, and ``down_proj[e]`` adds ``dv / S`` with ``S`` the sum of
  the active routing weights (1 after Mixtral's renormalisation), so ``sum_e g_e dW_e h_e = dv``;
- Qwen3-MoE keeps dense MLP layers (``mlp_only_layers``, ``decoder_sparse_step``): those are
  patched like Llama;
- the expert slices are written into the weights for one recomputation and restored at once,
  so in 16-bit models they are rounded to the weights' dtype like a verification would;
- float64 needs ``experts_implementation="eager"`` (the grouped-matmul kernel refuses it).
"""

from __future__ import annotations

from torch import nn

from core.adapters import llama
from core.adapters.base import Adapter, LayerSites


def _sites(layer: nn.Module) -> LayerSites:
    mlp = layer.mlp
    if not hasattr(mlp, "experts"):  # a dense layer of a Qwen3-MoE model
        return llama._sites(layer)
    return LayerSites(
        layer=layer,
        v_sources=((layer.post_attention_layernorm, "input"),),
        inputs=(),
        out_matrix=None,
        router=mlp.gate,
        experts=mlp.experts,
    )


ADAPTER = Adapter(
    family="Mixtral / Qwen3-MoE / OLMoE",
    model_types=("mixtral", "qwen3_moe", "olmoe"),
    sites=_sites,
    output_controls=("experts",),
    notes=(
        "router rank-1: same experts, same routing weights; then every active expert's "
        "gate_up and down slices",
        "S = the sum of the active routing weights must be nonzero",
        "float64 loads with experts_implementation='eager'",
    ),
)
