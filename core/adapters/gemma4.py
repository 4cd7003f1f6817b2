"""Gemma 4 text (``gemma4_text``): Gemma 3's four-norm block plus per-layer embeddings and KV
sharing (the image+text ``gemma4`` is refused by `core.images` until it is tested).

Mirrors ``transformers/models/gemma4/modeling_gemma4.py`` (`Gemma4TextDecoderLayer`):

- as in Gemma 3, ``v`` is the input of ``pre_feedforward_layernorm``, the input matrices are
  ``mlp.gate_proj`` and ``mlp.up_proj`` and the output control is the scale of
  ``post_feedforward_layernorm``; but Gemma 4's RMSNorm scale is ``weight`` itself, not
  ``1 + weight`` (it still computes in float32 and casts after the scale);
- after ``T = v + post_feedforward_layernorm(...)`` the layer adds a per-layer-embedding branch
  (``per_layer_input_gate``, ``per_layer_projection``, ``post_per_layer_input_norm``) whose input
  is ``T`` and the current token's per-layer input (a function of the token alone), then
  multiplies by ``layer_scalar``: the layer output is a function of ``T`` and the token, so
  matching ``T`` matches it;
- KV sharing: the last ``num_kv_shared_layers`` layers reuse the keys and values of the last
  earlier layer of their type (in the reduced run: the reduced sequence's own); their attention
  output differs like any other and ``dv`` absorbs it;
- ``use_double_wide_mlp`` doubles the MLP width of the KV-shared layers (no change here);
- ``enable_moe_block`` (`Gemma4TextRouter`, `Gemma4TextExperts`) adds a second branch beside
  the dense MLP: ``s = post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(v))) +
  post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(v), router(v)))`` and
  ``T = v + post_feedforward_layernorm(s)``. The input control makes every inner activation
  that of the full context: the dense MLP's gate and up as above; the router's matrix
  ``router.proj`` (its input is ``norm(v) * scale / sqrt(d)``) gets the rank-1 patch, so the
  full-context probabilities, hence the same top-k experts with the same weights (renormalised,
  times ``per_expert_scale``); every active expert's ``gate_up_proj[e]`` gets the rank-1 patch
  on the experts' own input ``pre_feedforward_layernorm_2(v)`` (``experts_own_input``). Then
  ``s = s_C`` and the output control is ``post_feedforward_layernorm``'s scale alone; no output
  matrix (method "stable" is "direct" there: Appendix B's down fit needs the norm's input to
  be the down output), and the experts' ``down_proj`` is never patched.
"""

from __future__ import annotations

from torch import nn

from . import gemma3
from .base import Adapter, LayerSites


def _sites(layer: nn.Module) -> LayerSites:
    if not getattr(layer, "enable_moe_block", False):
        return gemma3.sites(layer)  # the same four norms and GeGLU MLP
    mlp = layer.mlp
    return LayerSites(
        layer=layer,
        v_sources=((layer.pre_feedforward_layernorm, "input"),),
        inputs=(("gate", mlp.gate_proj), ("up", mlp.up_proj)),
        out_matrix=None,  # the scale of post_feedforward_layernorm absorbs dv
        out_norm=layer.post_feedforward_layernorm,
        router=layer.router.proj,
        experts=layer.experts,
        experts_own_input=True,
    )


ADAPTER = Adapter(
    family="Gemma 4",
    model_types=("gemma4_text",),
    sites=_sites,
    output_controls=("scale", "matrix"),
    norm_offset=0.0,
    notes=(
        "post-feedforward RMSNorm scale is weight itself (Gemma 2/3: 1 + weight)",
        "RMSNorms compute in float32 even in float64 models (exactness ~1e-8 relative)",
        "per-layer embeddings and layer_scalar act after T = v + branch: matching T matches them",
        "KV-shared layers attend to an earlier layer's keys and values; dv absorbs the change",
        "MoE variant (enable_moe_block): router.proj rank-1 (same experts, same weights), every "
        "active expert's gate_up slice on its own pre-norm, the dense MLP's gate and up; the "
        "post-feedforward scale alone absorbs dv (method 'stable' is 'direct' there)",
    ),
)
