"""Dense families of 2025-26, each a `Layout` over its own transformers modules (issue 17).

The MLP's matrices come from each config's ``base_model_tp_plan`` (column-wise = input side,
row-wise = output side, `core.adapters.declarative`) unless a layout names them.

- Ministral 3 (``ministral3``, `Ministral3DecoderLayer`), ERNIE 4.5 (``ernie4_5``), Seed-OSS
  (``seed_oss``), HunYuan dense (``hunyuan_v1_dense``): Llama's block; ``v`` is the input of
  ``post_attention_layernorm``, gate/up/down; ERNIE 4.5 (``use_bias``) and Seed-OSS
  (``mlp_bias``) may carry MLP biases, then the ``down_proj`` bias is an output control too;
  HunYuan's tensor-parallel plan names no MLP, so its layout does; Seed-OSS drops out after
  ``down_proj`` (identity in eval).
- OLMo 3 (``olmo3``) and EXAONE 4 (``exaone4``): OLMo 2's post-norm-only block
  (`Olmo3DecoderLayer`, `Exaone4DecoderLayer`): the MLP reads the raw residual ``v`` and the
  ``post_feedforward_layernorm`` scale ``m`` (plain ``weight``) is the output control; both mix
  sliding-window and global attention layers; EXAONE 4's RMSNorm casts before the scale, OLMo 3's
  after.
- GLM-4 (``glm4``, `Glm4DecoderLayer`): four RMSNorms; ``v`` is the input of
  ``post_attention_layernorm`` (after ``post_self_attn_layernorm`` of the attention output was
  added); the fused ``gate_up_proj`` is chunked into gate and up after the matrix (one rank-1
  patch controls both); ``post_mlp_layernorm`` follows ``down_proj``: its scale is the output
  control, as for OLMo 2 and Gemma, and method "stable" moves most of the shift into
  ``down_proj``.
- Apertus (``apertus``, `ApertusDecoderLayer`): pre-norms named ``attention_layernorm`` and
  ``feedforward_layernorm``; a non-gated MLP ``down(xIELU(up(z)))``: ``up_proj`` alone is the
  input control (xIELU has trainable ``alpha_p``/``alpha_n``, untouched).
- Arcee (``arcee``, `ArceeDecoderLayer`): Llama's layout with a non-gated ReLU^2 MLP
  ``down(relu(up(z))^2)``: ``up_proj`` alone; biases with ``mlp_bias``.
"""

from __future__ import annotations

from .declarative import POST_NORM_CONTROLS, Layout, declarative

_NO_POST_NORM = ("no post-MLP norm: the down matrix absorbs the attention shift",
                 "method 'stable' equals 'direct' (it only changes post-norm scale families)")
_BIAS = "the bias control needs MLP biases (config {flag}=True)"
_POST_NORM_ONLY = Layout(v=(("mlp", "input"),), out_norm="post_feedforward_layernorm")

MINISTRAL3 = declarative("Ministral 3", ("ministral3",), notes=_NO_POST_NORM)

ERNIE45 = declarative(
    "ERNIE 4.5", ("ernie4_5",), output_controls=("matrix", "bias"),
    notes=(*_NO_POST_NORM, _BIAS.format(flag="use_bias")),
)

SEED_OSS = declarative(
    "Seed-OSS", ("seed_oss",), output_controls=("matrix", "bias"),
    notes=(*_NO_POST_NORM, _BIAS.format(flag="mlp_bias")),
)

HUNYUAN_DENSE = declarative(
    "HunYuan dense", ("hunyuan_v1_dense",),
    Layout(inputs=("mlp.gate_proj", "mlp.up_proj"), out_matrix="mlp.down_proj"),
    notes=(*_NO_POST_NORM, "its tensor-parallel plan names no MLP: the layout names the matrices"),
)

OLMO3 = declarative(
    "OLMo 3", ("olmo3",), _POST_NORM_ONLY, POST_NORM_CONTROLS,
    notes=("no pre-MLP norm: the input patches act on the raw residual stream",
           "the post-feedforward RMSNorm scale is weight itself (no 1 +)",
           "sliding-window and global attention layers alternate"),
)

EXAONE4 = declarative(
    "EXAONE 4", ("exaone4",), _POST_NORM_ONLY, POST_NORM_CONTROLS,
    notes=("no pre-MLP norm: the input patches act on the raw residual stream",
           "the post-feedforward RMSNorm scale is weight itself (no 1 +)",
           "sliding-window and global attention layers alternate"),
)

GLM4 = declarative(
    "GLM-4", ("glm4", "glm4v_text"), Layout(out_norm="post_mlp_layernorm"), POST_NORM_CONTROLS,
    notes=("the post-MLP RMSNorm scale is the output control (weight itself, no 1 +)",
           "gate and up are one fused gate_up_proj: one rank-1 patch controls both"),
)

APERTUS = declarative(
    "Apertus", ("apertus",), Layout(v=(("feedforward_layernorm", "input"),)),
    notes=(*_NO_POST_NORM, "non-gated xIELU MLP: up_proj alone is the input control"),
)

ARCEE = declarative(
    "Arcee (AFM)", ("arcee",), output_controls=("matrix", "bias"),
    notes=(*_NO_POST_NORM, "non-gated ReLU^2 MLP: up_proj alone is the input control",
           _BIAS.format(flag="mlp_bias")),
)

ADAPTERS = (MINISTRAL3, ERNIE45, SEED_OSS, HUNYUAN_DENSE, OLMO3, EXAONE4, GLM4, APERTUS, ARCEE)
