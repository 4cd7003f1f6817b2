"""Mixture-of-experts blocks with shared experts: DeepSeek V2 and V3, GLM-4 MoE, Qwen2-MoE,
Qwen3-Next, ERNIE 4.5 MoE and Llama 4 (text).

A shared expert is an always-active dense MLP beside the routed experts (`SharedExpert`): its
gate and up matrices get the rank-1 input patch like a dense MLP's, and its down matrix absorbs
the whole output correction ``dv`` (divided by the full-context value of its gate where it has
one), so the routed experts need only their input patches; the router's rank-1 patch keeps the
routing (selection and weights) identical (`core.engine_moe`). Layers without experts are
patched like Llama.

DeepSeek V3 mirrors ``transformers/models/deepseek_v3/modeling_deepseek_v3.py``
(`DeepseekV3DecoderLayer`, `DeepseekV3MoE`, `DeepseekV3TopkRouter`, `DeepseekV3Experts`,
`DeepseekV3MLP`); DeepSeek V2 and GLM-4 MoE have the same pieces:

- the first ``first_k_dense_replace`` layers are dense MLPs;
- the router ``mlp.gate`` computes ``W z`` in float32 (its matrix is kept float32 even in a
  float64 model), then sigmoid scores (V3, GLM) or a softmax (V2); ``e_score_correction_bias``
  steers only the selection; grouped top-k (``n_group``, ``topk_group``), optional
  renormalisation, then ``routed_scaling_factor``: all fixed functions of ``W z``, so the
  patched reduced run routes exactly like the full context, up to the float32 rounding of the
  router's matmul (~1e-7 relative), which the float64 residual stream then absorbs;
- ``mlp.shared_experts`` is added unweighted;
- DeepSeek's attention is multi-head latent attention (MLA): it changes only ``dv``.

Qwen2-MoE and Qwen3-Next mirror ``transformers/models/qwen2_moe/modeling_qwen2_moe.py``
(`Qwen2MoeSparseMoeBlock`) and ``qwen3_next/modeling_qwen3_next.py`` (`Qwen3NextDecoderLayer`):

- ``mlp.shared_expert`` runs before the router, and its output is weighted by
  ``sigmoid(mlp.shared_expert_gate(z))``: the gate's ``(1, d)`` matrix gets the rank-1 input patch
  too (the same gate value), and the shared down matrix adds ``dv / sigmoid(gate(z_C))``;
- dense layers: ``mlp_only_layers`` and ``decoder_sparse_step``;
- Qwen3-Next alternates Gated DeltaNet linear attention (``layer_types``, ``mixer`` "linear
  attention") with gated full attention; the reduced run's recurrent state covers the reduced
  sequence only, and ``dv`` absorbs the difference.

ERNIE 4.5 MoE mirrors ``transformers/models/ernie4_5_moe/modeling_ernie4_5_moe.py``
(`Ernie4_5_MoeSparseMoeBlock`, `Ernie4_5_MoeTopKRouter`):

- the router is float32 (softmax, a correction bias through ``moe_statics`` for the selection
  only, renormalised with a floor ``moe_norm_min``); MoE layers are every
  ``moe_layer_interval``-th from ``moe_layer_start_index``; MLPs may have biases (``use_bias``);
- ``mlp.shared_experts`` is optional (``moe_num_shared_experts``): without it the routed experts
  absorb ``dv / S`` as in Mixtral.

Llama 4 (text) mirrors ``transformers/models/llama4/modeling_llama4.py`` (`Llama4TextDecoderLayer`,
`Llama4TextMoe`, `Llama4Router`, `Llama4TextExperts`):

- the MLP is ``feed_forward``: an MoE in ``moe_layers``, else a dense MLP;
- the router (an ``nn.Linear``) returns ``(scores, logits)``: top-k of the logits, a sigmoid of
  the chosen ones, zero elsewhere; the scores scale each expert's *input*
  (``E_e(s_e z)``), so the routed outputs are summed unweighted;
- the experts are stored transposed, ``(E, d, 2f)`` and ``(E, f, d)``, and run on every token
  (``routed_in`` is ``(E * tokens, d)``, expert-major): the patch of an expert's ``gate_up`` slice
  acting on ``s_e z`` gives ``s_e W z_C``;
- ``feed_forward.shared_expert`` is added unweighted and absorbs ``dv``.
"""

from __future__ import annotations

from torch import nn

from .base import Adapter, ExpertsView, LayerSites, SharedExpert


def _mlp_inputs(mlp: nn.Module) -> tuple[tuple[str, nn.Module], ...]:
    return (("gate", mlp.gate_proj), ("up", mlp.up_proj))


def _dense(layer: nn.Module, mlp: nn.Module, mixer: str) -> LayerSites:
    return LayerSites(
        layer=layer,
        v_sources=((layer.post_attention_layernorm, "input"),),
        inputs=_mlp_inputs(mlp),
        out_matrix=mlp.down_proj,
        mixer=mixer,
    )


def _moe(layer: nn.Module, mlp: nn.Module, shared: tuple[SharedExpert, ...], mixer: str,
         router: nn.Module, view: ExpertsView | None = None) -> LayerSites:
    return LayerSites(
        layer=layer,
        v_sources=((layer.post_attention_layernorm, "input"),),
        inputs=(),
        out_matrix=None,
        router=router,
        experts=mlp.experts,
        experts_view=view,
        shared=shared,
        mixer=mixer,
    )


def _shared(mlp: nn.Module | None, gate: nn.Module | None = None) -> tuple[SharedExpert, ...]:
    if mlp is None:
        return ()
    return (SharedExpert(inputs=_mlp_inputs(mlp), down=mlp.down_proj, gate=gate),)


def _deepseek_sites(layer: nn.Module) -> LayerSites:
    """DeepSeek V2 / V3, GLM-4 MoE, ERNIE 4.5 MoE: ``mlp.gate``, ``mlp.experts``,
    ``mlp.shared_experts`` (ERNIE: possibly None)."""
    mlp = layer.mlp
    if not hasattr(mlp, "experts"):
        return _dense(layer, mlp, "attention")
    return _moe(layer, mlp, _shared(mlp.shared_experts), "attention", mlp.gate)


def _qwen_sites(layer: nn.Module) -> LayerSites:
    """Qwen2-MoE and Qwen3-Next: ``mlp.shared_expert`` weighted by ``mlp.shared_expert_gate``."""
    mlp = layer.mlp
    linear = getattr(layer, "block_type", "") == "linear_attention"
    mixer = "linear attention" if linear else "attention"
    if not hasattr(mlp, "experts"):
        return _dense(layer, mlp, mixer)
    return _moe(layer, mlp, _shared(mlp.shared_expert, mlp.shared_expert_gate), mixer, mlp.gate)


_LLAMA4_VIEW = ExpertsView(transposed=True, routing="input", rows="experts")


def _llama4_sites(layer: nn.Module) -> LayerSites:
    ff = layer.feed_forward
    if not hasattr(ff, "experts"):
        return _dense(layer, ff, "attention")
    return _moe(layer, ff, _shared(ff.shared_expert), "attention", ff.router, _LLAMA4_VIEW)


_NOTES = (
    "router rank-1: same experts, same routing weights; every active expert's gate_up slice "
    "rank-1",
    "the shared expert's gate and up matrices rank-1; its down matrix absorbs dv",
    "dense layers are patched like Llama",
    "float64 loads with experts_implementation='eager'",
)
_FLOAT32_ROUTER = "the router computes in float32 (its matrix is kept float32): routing " \
                  "weights match to ~1e-7 relative"

DEEPSEEK = Adapter(
    family="DeepSeek V2 / V3, GLM-4 MoE",
    model_types=("deepseek_v3", "deepseek_v2", "glm4_moe"),
    sites=_deepseek_sites,
    output_controls=("experts",),
    notes=(*_NOTES, _FLOAT32_ROUTER,
           "grouped top-k on sigmoid (V3, GLM) or softmax (V2) scores; the correction bias "
           "steers the selection only; routed_scaling_factor",
           "multi-head latent attention (DeepSeek) changes only the attention shift dv"),
)

ERNIE = Adapter(
    family="ERNIE 4.5 MoE",
    model_types=("ernie4_5_moe",),
    sites=_deepseek_sites,
    output_controls=("experts",),
    notes=(*_NOTES, _FLOAT32_ROUTER,
           "without shared experts the active routed experts share dv / S"),
)

QWEN2_MOE = Adapter(
    family="Qwen2-MoE / Qwen3-Next",
    model_types=("qwen2_moe", "qwen3_next"),
    sites=_qwen_sites,
    output_controls=("experts",),
    notes=(*_NOTES,
           "the shared expert is weighted by sigmoid(shared_expert_gate(z)): that gate's matrix "
           "rank-1 too, and the down patch adds dv / the full-context gate value",
           "Qwen3-Next: Gated DeltaNet linear attention between full-attention layers"),
)

LLAMA4 = Adapter(
    family="Llama 4 (text)",
    model_types=("llama4_text",),
    sites=_llama4_sites,
    output_controls=("experts",),
    notes=(*_NOTES[:3],
           "the router's sigmoid scores scale the experts' input; every expert runs on every "
           "token (expert-major rows), stored transposed: patches saved in that orientation"),
)
