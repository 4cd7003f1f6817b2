"""Hybrid blocks whose token mixer is linear attention or a state-space model in some layers
(attention in the others, or beside it), each followed by an MLP: Qwen 3.5 (Gated DeltaNet),
Falcon-H1 (Mamba 2 beside attention), Jamba (Mamba or attention; mixture-of-experts every other
layer), Granite 4.0 hybrid (Mamba 2 or attention; experts beside a shared MLP).

The paper's construction needs only "a token mixer, then an MLP": ``v`` is the residual after the
mixer, whatever the mixer is. What changes is the reduced run: a recurrent mixer carries its own
state over the reduced sequence (with absorb "all": the current token alone, from a zero state),
and ``dv`` absorbs the difference like an attention output's.

Qwen 3.5 mirrors ``transformers/models/qwen3_5/modeling_qwen3_5.py`` (`Qwen3_5DecoderLayer`):

- ``layer_types`` says per layer ``linear_attention`` (`Qwen3_5GatedDeltaNet`, a gated delta
  rule with a short causal convolution; CPU runs use transformers' torch fallback) or
  ``full_attention`` (gated attention);
- otherwise a Llama block: ``v`` is the input of ``post_attention_layernorm``, input matrices
  ``gate_proj`` and ``up_proj``, output control the ``down_proj`` matrix;
- RMSNorm scales are ``1 + weight`` (never patched here);
- the caches hold conv and recurrent states updated in place (`core.forward` gives them fresh
  copies before each cached forward, so the comparison's cache rollback holds for them too).

Falcon-H1 mirrors ``transformers/models/falcon_h1/modeling_falcon_h1.py`` (`FalconH1DecoderLayer`):

- every layer runs a Mamba 2 mixer (`FalconH1Mixer`) and attention side by side on the same
  ``input_layernorm`` output and adds both (times ``ssm_out_multiplier`` and
  ``attention_out_multiplier``) to the residual: ``v`` is the input of ``pre_ff_layernorm``;
- the MLP computes ``down(up(z) * act(gate(z) * gate_multiplier)) * down_multiplier``: gate and
  up get the rank-1 input patches (the multiplier acts after the matrix), and the down matrix (or
  its bias) absorbs ``dv / down_multiplier`` (``branch_scale``);
- its RMSNorms compute in float32 even in float64 models (``weight * x.to(input_dtype)``).

Jamba mirrors ``transformers/models/jamba/modeling_jamba.py`` (`JambaMambaDecoderLayer`,
`JambaAttentionDecoderLayer`):

- each layer has a Mamba (1) mixer or attention (``attn_layer_period``/``attn_layer_offset``),
  then ``pre_ff_layernorm`` (``v`` is its input) and a feed-forward: a Llama MLP, or every
  ``expert_layer_period``-th layer a `JambaSparseMoeBlock`;
- the MoE block has Mixtral's pieces (`JambaTopKRouter` with a ``(E, d)`` weight; fused 3-D
  `JambaExperts`) and is patched like Mixtral by `core.engine_moe`: router rank-1, every active
  expert's ``gate_up_proj[e]`` and ``down_proj[e]`` (adding ``dv / S``); its top-k weights are
  not renormalised, so ``S`` is the sum of the active softmax weights (< 1);
- float64 needs ``experts_implementation="eager"``.

Granite 4.0 hybrid mirrors ``transformers/models/granitemoehybrid/modeling_granitemoehybrid.py``
(`GraniteMoeHybridDecoderLayer`):

- each layer has a Mamba 2 mixer (``layer_types`` ``linear_attention``) or attention, then
  ``post_attention_layernorm`` (``v`` is its input) and ``shared_mlp(z)``, plus
  ``block_sparse_moe(z)`` when the model has experts (``num_local_experts`` > 0);
- both branches are scaled by ``residual_multiplier`` before they are added (``branch_scale``);
- the shared MLP's fused ``input_linear`` (gate and up, split after the matrix) gets one rank-1
  input patch, its ``output_linear`` matrix absorbs ``dv / residual_multiplier``: in a dense model
  as the layer's output matrix, in an MoE model as the shared expert of `core.engine_moe`
  (`SharedExpert`), the router (top-k of the logits, softmax over the chosen, float32) and the
  active experts' ``gate_up_proj[e]`` getting input patches only.
"""

from __future__ import annotations

from torch import nn

from .base import Adapter, LayerSites, SharedExpert


def _qwen3_5_sites(layer: nn.Module) -> LayerSites:
    mlp = layer.mlp
    linear = getattr(layer, "block_type", "") == "linear_attention"
    return LayerSites(
        layer=layer,
        v_sources=((layer.post_attention_layernorm, "input"),),
        inputs=(("gate", mlp.gate_proj), ("up", mlp.up_proj)),
        out_matrix=mlp.down_proj,
        mixer="linear attention" if linear else "attention",
    )


_NOTES = (
    "no post-MLP norm: the down matrix absorbs the mixer's shift",
    "method 'stable' equals 'direct' (it only changes post-norm scale families)",
    "the reduced run's recurrent state covers the reduced sequence only (absorb 'all': the "
    "current token from a zero state); dv absorbs the difference",
)

QWEN3_5 = Adapter(
    family="Qwen 3.5 (Gated DeltaNet hybrid)",
    model_types=("qwen3_5_text",),
    sites=_qwen3_5_sites,
    output_controls=("matrix",),
    notes=(*_NOTES, "Gated DeltaNet linear attention in most layers, full attention between"),
)


def _falcon_h1_sites(layer: nn.Module) -> LayerSites:
    mlp = layer.feed_forward
    return LayerSites(
        layer=layer,
        v_sources=((layer.pre_ff_layernorm, "input"),),
        inputs=(("gate", mlp.gate_proj), ("up", mlp.up_proj)),
        out_matrix=mlp.down_proj,
        branch_scale=float(mlp.down_multiplier),
        mixer="state-space + attention",
    )


FALCON_H1 = Adapter(
    family="Falcon-H1 (Mamba 2 + attention)",
    model_types=("falcon_h1",),
    sites=_falcon_h1_sites,
    output_controls=("matrix", "bias"),
    notes=(*_NOTES, "Mamba 2 and attention run side by side in every layer",
           "the MLP output is scaled by down_multiplier: the down patch absorbs dv / it"),
)


def _jamba_sites(layer: nn.Module) -> LayerSites:
    ff = layer.feed_forward
    mixer = "state-space" if hasattr(layer, "mamba") else "attention"
    v_sources = ((layer.pre_ff_layernorm, "input"),)
    if hasattr(ff, "experts"):
        return LayerSites(layer=layer, v_sources=v_sources, inputs=(), out_matrix=None,
                          router=ff.router, experts=ff.experts, mixer=mixer)
    return LayerSites(
        layer=layer,
        v_sources=v_sources,
        inputs=(("gate", ff.gate_proj), ("up", ff.up_proj)),
        out_matrix=ff.down_proj,
        mixer=mixer,
    )


JAMBA = Adapter(
    family="Jamba (Mamba + attention, MoE)",
    model_types=("jamba",),
    sites=_jamba_sites,
    output_controls=("experts",),
    notes=(*_NOTES, "Mamba or attention per layer; every other feed-forward is a mixture of "
           "experts: router rank-1, then every active expert's gate_up and down slices",
           "S = the sum of the active routing weights (not renormalised) must be nonzero",
           "float64 loads with experts_implementation='eager'"),
)


def _granite_hybrid_sites(layer: nn.Module) -> LayerSites:
    shared = layer.shared_mlp
    mixer = "state-space" if layer.mamba is not None else "attention"
    v_sources = ((layer.post_attention_layernorm, "input"),)
    scale = float(layer.residual_multiplier)
    gate_up = (("gate_up", shared.input_linear),)
    if layer.block_sparse_moe is None:
        return LayerSites(layer=layer, v_sources=v_sources, inputs=gate_up,
                          out_matrix=shared.output_linear, branch_scale=scale, mixer=mixer)
    moe = layer.block_sparse_moe
    return LayerSites(
        layer=layer,
        v_sources=v_sources,
        inputs=(),
        out_matrix=None,
        router=moe.router,
        experts=moe.experts,
        shared=(SharedExpert(inputs=gate_up, down=shared.output_linear),),
        branch_scale=scale,
        mixer=mixer,
    )


GRANITE_HYBRID = Adapter(
    family="Granite 4.0 hybrid (Mamba 2 + attention, MoE)",
    model_types=("granitemoehybrid",),
    sites=_granite_hybrid_sites,
    output_controls=("matrix",),
    notes=(*_NOTES, "Mamba 2 or attention per layer; experts beside an always-active shared "
           "MLP whose output matrix absorbs dv / residual_multiplier",
           "router rank-1 and the active experts' gate_up slices: same routing, same experts",
           "float64 loads with experts_implementation='eager'"),
)
