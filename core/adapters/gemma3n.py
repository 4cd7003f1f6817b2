"""Gemma 3n text (``gemma3n_text``): Gemma 3's four-norm block inside AltUp (several residual
streams), with LAuReL, per-layer inputs and KV sharing (the image+audio+text ``gemma3n`` is
refused by `core.images` until it is tested).

Mirrors ``transformers/models/gemma3n/modeling_gemma3n.py`` (`Gemma3nTextDecoderLayer`,
`Gemma3nTextAltUp`, `Gemma3nTextLaurelBlock`, `Gemma3nTextMLP`):

- a layer's input and output are ``altup_num_inputs`` streams, ``(streams, batch, seq, width)``;
  AltUp's ``predict`` mixes the streams of each token (per token, no token mixing), and the
  active prediction runs through a Gemma block: ``input_layernorm``, attention (the only token
  mixer), ``post_attention_layernorm``, plus LAuReL (a low-rank per-token branch), so
  ``v = (a + attn + laurel(a_normed)) / sqrt(2)``: the input of ``pre_feedforward_layernorm``;
- ``T = v + post_feedforward_layernorm(down(act(gate z) * up z))``, then AltUp's ``correct``,
  ``correct_output_scale`` and the per-layer-input branch are per-token functions of the layer's
  input streams, ``T`` and the token: the layer input matches at the query by induction, so
  patching the MLP until ``T`` matches makes every output stream match;
- input matrices ``gate_proj`` and ``up_proj`` (the first layers sparsify the gate with a
  per-token Gaussian top-k, a function of ``gate_proj``'s output, which the patch matches);
  output control the ``post_feedforward_layernorm`` scale, which is ``weight`` itself (Gemma 3:
  ``1 + weight``); the norms compute in float32 even in float64 models;
- KV sharing: the last ``num_kv_shared_layers`` layers attend to an earlier layer's keys and
  values (in the reduced run: the reduced sequence's own); ``dv`` absorbs the change;
- a block's target ``T_C`` check compares every stream at the query (`core.activations`);
- so only patching every layer is exact: a first patched layer after layer 0 receives input
  streams that differ from the full context's, and no patch of its MLP (one vector ``T``) can
  fix four output streams; layer selections are an ablation here, not an identity.
"""

from __future__ import annotations

from . import gemma3
from .base import Adapter

ADAPTER = Adapter(
    family="Gemma 3n",
    model_types=("gemma3n_text",),
    sites=gemma3.sites,  # the same four norms and GeGLU MLP
    output_controls=("scale", "matrix"),
    norm_offset=0.0,
    batch_rows=False,  # AltUp's (streams, batch, seq, width) activations
    notes=(
        "post-feedforward RMSNorm scale is weight itself (Gemma 2/3: 1 + weight)",
        "RMSNorms compute in float32 even in float64 models (exactness ~1e-8 relative)",
        "AltUp streams, LAuReL and per-layer inputs are per-token functions of the layer input "
        "and T: matching T matches every output stream",
        "KV-shared layers attend to an earlier layer's keys and values; dv absorbs the change",
        "exact only with every layer patched: a later first layer cannot absorb the mismatch "
        "of the AltUp streams it receives",
    ),
)
