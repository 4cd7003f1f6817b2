"""Mixture-of-experts blocks with fused 3-D experts and no shared expert: Mixtral, Qwen3-MoE,
OLMoE, GraniteMoE and gpt-oss (the families with shared experts are in `core.adapters.moe_shared`).

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

GraniteMoE mirrors ``transformers/models/granitemoe/modeling_granitemoe.py``
(`GraniteMoeDecoderLayer`, `GraniteMoeMoE`, `GraniteMoeTopKRouter`, `GraniteMoeExperts`):

- the MoE is ``block_sparse_moe`` (router ``router``: top-k of the logits, then a softmax over
  the chosen ones, in float32), experts as Mixtral's;
- each branch is scaled by ``residual_multiplier`` before it is added, so the experts absorb
  ``dv / (S residual_multiplier)``.

gpt-oss mirrors ``transformers/models/gpt_oss/modeling_gpt_oss.py`` (`GptOssDecoderLayer`,
`GptOssMLP`, `GptOssTopKRouter`, `GptOssExperts`):

- the router ``mlp.router`` has a bias (``W z + b``, top-k, softmax over the chosen): its matrix
  gets the rank-1 patch, the bias stays;
- the experts are stored transposed, ``gate_up_proj (E, d, 2f)`` and ``down_proj (E, f, d)``,
  with biases ``gate_up_proj_bias`` and ``down_proj_bias``; gate and up are interleaved columns
  and the SwiGLU is clamped (``swiglu_limit``) with ``(up + 1) * gate * sigmoid(alpha gate)``: the
  patch reproduces the full-context pre-activation, and the gated activation comes from the
  module's own ``_apply_gate``; patches of these slices are saved in the stored ``(in, out)``
  orientation;
- the attention has learned sinks (they change only ``dv``); the MLP returns
  ``(hidden, router_scores)``.
"""

from __future__ import annotations

from torch import nn

from . import llama
from .base import Adapter, LayerSites


def _sites(layer: nn.Module) -> LayerSites:
    mlp = layer.mlp
    if not hasattr(mlp, "experts"):  # a dense layer of a Qwen3-MoE model
        return llama.sites(layer)
    return LayerSites(
        layer=layer,
        v_sources=((layer.post_attention_layernorm, "input"),),
        inputs=(),
        out_matrix=None,
        router=mlp.gate,
        experts=mlp.experts,
    )


def _granite_sites(layer: nn.Module) -> LayerSites:
    moe = layer.block_sparse_moe
    return LayerSites(
        layer=layer,
        v_sources=((layer.post_attention_layernorm, "input"),),
        inputs=(),
        out_matrix=None,
        router=moe.router,
        experts=moe.experts,
        branch_scale=float(layer.residual_multiplier),
    )


def _gpt_oss_sites(layer: nn.Module) -> LayerSites:
    mlp = layer.mlp
    return LayerSites(
        layer=layer,
        v_sources=((layer.post_attention_layernorm, "input"),),
        inputs=(),
        out_matrix=None,
        router=mlp.router,
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

GRANITEMOE = Adapter(
    family="GraniteMoE",
    model_types=("granitemoe",),
    sites=_granite_sites,
    output_controls=("experts",),
    notes=(
        "router rank-1: same experts, same routing weights; then every active expert's "
        "gate_up and down slices",
        "each branch is scaled by residual_multiplier: the experts absorb dv / it",
        "float64 loads with experts_implementation='eager'",
    ),
)

GPT_OSS = Adapter(
    family="gpt-oss",
    model_types=("gpt_oss",),
    sites=_gpt_oss_sites,
    output_controls=("experts",),
    notes=(
        "router W z + b: the matrix gets the rank-1 patch, the bias stays",
        "experts stored transposed (E, in, out) with biases, interleaved gate/up, clamped "
        "SwiGLU: patches saved in the stored orientation",
        "attention sinks change only the attention shift dv",
        "float64 loads with experts_implementation='eager'",
    ),
)
