"""Older, still popular families: non-gated MLPs with biases, parallel blocks, ALiBi, layers under
other paths (issue 17). Each is a `Layout` over its own transformers modules.

- Phi (``phi``, ``transformers/models/phi/modeling_phi.py``, `PhiDecoderLayer`): a parallel
  block, ``input_layernorm`` feeds both ``self_attn`` and the MLP, ``T = x + attn + mlp``, so
  ``v = x + attn`` and only the output control is needed once ``x`` matches; ``mlp.fc1`` /
  ``mlp.fc2`` (GELU) with biases; partial rotary embeddings.
- StarCoder 2 (``starcoder2``, `Starcoder2DecoderLayer`): pre-LayerNorm, ``v`` is the input of
  ``post_attention_layernorm``; ``mlp.c_fc`` / ``mlp.c_proj`` are `nn.Linear` (not GPT-2's
  Conv1D), with biases when ``use_bias``; residual dropout after ``c_proj`` (identity in eval).
- StableLM (``stablelm``, `StableLmDecoderLayer`): gated ``gate_proj``/``up_proj``/``down_proj``
  without biases; ``use_parallel_residual`` makes the block parallel (``v = x + attn``, as
  GPT-NeoX), else ``v`` is the input of ``post_attention_layernorm``; optional per-head q/k
  LayerNorms inside the attention.
- CodeGen (``codegen``, `CodeGenBlock`): parallel as GPT-J: ``ln_1`` feeds ``attn`` and the MLP;
  ``mlp.fc_in`` / ``mlp.fc_out`` with biases.
- GPTBigCode / StarCoder 1 / SantaCoder (``gpt_bigcode``, `GPTBigCodeBlock`): GPT-2's block
  with multi-query attention; ``v`` is the input of ``ln_2``; ``mlp.c_fc`` / ``mlp.c_proj`` are
  `nn.Linear` (not transposed) with biases.
- Bloom (``bloom``, `BloomBlock`): ALiBi; the attention adds its own residual, so ``v`` is the
  input of ``post_attention_layernorm``; with ``apply_residual_connection_post_layernorm`` the
  MLP's residual is that norm's *output*, so ``v = z`` (the MLP's input) and ``T = z + mlp(z)``;
  ``mlp.dense_h_to_4h`` / ``mlp.dense_4h_to_h`` with biases; the MLP adds the residual after
  ``dense_4h_to_h`` (our hook sees the matrix output first). ``pretraining_tp > 1`` with
  ``slow_but_exact`` calls the output weight's slices directly: refused.
- OPT (``opt``, `OPTDecoderLayer`): the layer holds ``fc1`` / ``fc2`` itself (no MLP module) and
  runs them on flattened ``(tokens, width)`` rows; ``do_layer_norm_before`` (all but 350m):
  ``v`` is the input of ``final_layer_norm``; otherwise (350m, post-LN) ``v`` is the output of
  ``self_attn_layer_norm``, ``fc1`` reads it directly, and ``final_layer_norm`` is applied to
  ``v + mlp`` (matching ``v + mlp`` matches the block output). The engine acts on the last
  row of its flattened rows at the query.
- MPT (``mpt``, `MptBlock`): layers under ``transformer.blocks``; ALiBi; LayerNorms without
  bias; ``v`` is the input of ``norm_2``; the MLP is ``ffn.up_proj`` / ``ffn.down_proj`` (GELU,
  no biases) and adds the residual after ``down_proj``.
"""

from __future__ import annotations

from torch import nn

from ..errors import UserError
from .base import LayerSites
from .declarative import Layout, declarative, parallel_layout

_PARALLEL = ("parallel block: once the layer input matches, the MLP input does not depend on the "
             "context; the input patches are then ~0 and the output control does the work")
_BIAS = "the bias control needs a model built with biases ({flag})"

PHI = declarative(
    "Phi (1, 1.5, 2)", ("phi",), parallel_layout("self_attn"), ("matrix", "bias"),
    notes=(_PARALLEL,),
)

STARCODER2 = declarative(
    "StarCoder 2", ("starcoder2",), output_controls=("matrix", "bias"),
    notes=("c_fc and c_proj are nn.Linear, stored (out, in) unlike GPT-2's Conv1D",
           _BIAS.format(flag="use_bias=True, the default")),
)

_STABLELM_SEQUENTIAL = Layout(inputs=("mlp.gate_proj", "mlp.up_proj"), out_matrix="mlp.down_proj")
_STABLELM_PARALLEL = parallel_layout(
    "self_attn", inputs=("mlp.gate_proj", "mlp.up_proj"), out_matrix="mlp.down_proj")


def _stablelm(layer: nn.Module) -> LayerSites:
    parallel = bool(layer.use_parallel_residual)
    return (_STABLELM_PARALLEL if parallel else _STABLELM_SEQUENTIAL)(layer)


STABLELM = declarative(
    "StableLM", ("stablelm",), _stablelm,
    notes=("use_parallel_residual=True makes the block parallel (v = x + attn); " + _PARALLEL,
           "no MLP biases: the down matrix is the output control"),
)

CODEGEN = declarative(
    "CodeGen", ("codegen",), parallel_layout("attn"), ("matrix", "bias"), notes=(_PARALLEL,),
)

GPT_BIGCODE = declarative(
    "GPTBigCode (StarCoder 1, SantaCoder)", ("gpt_bigcode",),
    Layout(v=(("ln_2", "input"),), inputs=("mlp.c_fc",), out_matrix="mlp.c_proj"),
    ("bias", "matrix"),
    notes=("GPT-2's block with multi-query attention; c_fc and c_proj are nn.Linear (not "
           "transposed)",),
)

_BLOOM_MLP = {"inputs": ("mlp.dense_h_to_4h",), "out_matrix": "mlp.dense_4h_to_h"}
_BLOOM = Layout(**_BLOOM_MLP)
_BLOOM_POST_LN_RESIDUAL = Layout(v=(("post_attention_layernorm", "output"),), **_BLOOM_MLP)


def _bloom(layer: nn.Module) -> LayerSites:
    mlp = layer.mlp
    if mlp.pretraining_tp > 1 and mlp.slow_but_exact:
        raise UserError("Bloom with slow_but_exact and pretraining_tp > 1 computes its MLP "
                        "output from weight slices, out of reach of the output patch: load it "
                        "with slow_but_exact=False")
    post_ln = bool(layer.apply_residual_connection_post_layernorm)
    return (_BLOOM_POST_LN_RESIDUAL if post_ln else _BLOOM)(layer)


BLOOM = declarative(
    "Bloom", ("bloom",), _bloom, output_controls=("bias", "matrix"),
    notes=("ALiBi attention: no position ids",
           "apply_residual_connection_post_layernorm: the MLP's residual is its normed input, "
           "so v = z"),
)

_OPT_MLP = {"mlp": "", "inputs": ("fc1",), "out_matrix": "fc2"}
_OPT_PRE_LN = Layout(v=(("final_layer_norm", "input"),), **_OPT_MLP)
_OPT_POST_LN = Layout(v=(("self_attn_layer_norm", "output"),), **_OPT_MLP)


def _opt(layer: nn.Module) -> LayerSites:
    return (_OPT_PRE_LN if layer.do_layer_norm_before else _OPT_POST_LN)(layer)


OPT = declarative(
    "OPT", ("opt",), _opt, output_controls=("bias", "matrix"),
    notes=("do_layer_norm_before=False (OPT-350m): post-LayerNorm blocks, v is the MLP's own "
           "input and the final norm is applied after the patched sum",
           _BIAS.format(flag="enable_bias=True, the default")),
)

MPT = declarative(
    "MPT", ("mpt",),
    Layout(v=(("norm_2", "input"),), mlp="ffn", inputs=("ffn.up_proj",),
           out_matrix="ffn.down_proj"),
    notes=("ALiBi attention: no position ids", "no biases: the down matrix is the output control"),
)

ADAPTERS = (PHI, STARCODER2, STABLELM, CODEGEN, GPT_BIGCODE, BLOOM, MPT, OPT)
