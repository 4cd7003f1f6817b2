"""The adapter contract: where the paper's quantities live in one family's transformers modules.

An adapter says *where* things are, never *how* to patch them (that is `core.patches`).
For one decoder layer it names:

- ``v_sources``: the tensors whose sum at the query position is ``v = A(C, x)``, the residual
  stream after the contextual (attention) sub-layer. Sequential blocks read it as the input of the
  pre-MLP norm; parallel blocks (GPT-J, Falcon) as the layer input plus the attention output.
- ``inputs``: the input-controlled matrices of the MLP (gate and up, ``c_fc``, ``fc_in``): each gets
  the rank-1 patch ``W (z_C - z) z^T / |z|^2`` so the MLP's inner activations match.
- ``out_matrix``: the MLP's output matrix (down, ``c_proj``, ``fc_out``).
- ``out_norm``: the trainable post-MLP norm scale ``m`` (Gemma 2/3, OLMo 2), when the block has one.
- ``router`` and ``experts``: a mixture-of-experts MLP (Mixtral, Qwen3-MoE, OLMoE) instead of
  ``inputs`` and ``out_matrix``: the router gets a rank-1 input patch (same routing, same
  weights), every active expert's slice of ``gate_up_proj`` a rank-1 input patch, and every
  active expert's slice of ``down_proj`` a rank-1 patch adding ``dv / S``.

The branch output that is added to ``v`` is ``out_norm(out_matrix(...))`` when ``out_norm``
exists, else ``out_matrix(...)``, times ``branch_scale`` (Granite's residual multiplier); so
``T = v + branch_scale * branch``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

#: "input" reads a module's first positional (or ``hidden_states``) argument; "output" its
#: first output.
SourceKind = str


@dataclass(frozen=True)
class LayerSites:
    """Handles into one decoder layer (all are the model's own modules)."""

    layer: nn.Module
    v_sources: tuple[tuple[nn.Module, SourceKind], ...]
    inputs: tuple[tuple[str, nn.Module], ...]
    out_matrix: nn.Module | None  # None in a mixture-of-experts layer
    out_norm: nn.Module | None = None
    router: nn.Module | None = None  # MoE: the top-k router, called on z, returns (logits, ...)
    experts: nn.Module | None = None  # MoE: fused 3-D gate_up_proj and down_proj, called on
    #                                   (z, top_k_index, top_k_weights)
    branch_scale: float = 1.0  # T = v + branch_scale * branch (Granite's residual_multiplier)
    parallel: bool = False  # attention and MLP read the same layer input (GPT-J, Falcon 7B)
    mixer: str = "attention"  # the token mixer before the MLP: "attention", "linear attention"
    #                           or "state-space" (named in the controllability report)


@dataclass(frozen=True)
class Adapter:
    """One architecture family, described by data.

    Attributes:
        family: human name shown to users ("Gemma 3", "Llama / Mistral / Qwen").
        model_types: the ``config.model_type`` values this adapter serves.
        sites: builds the `LayerSites` of one decoder layer.
        output_controls: the output controls this family offers; the first is the paper's choice
            and the default. "scale" = post-norm scale m, "matrix" = rank-1 on the output matrix,
            "bias" = the output matrix's bias.
        norm_offset: the post-norm computes ``(norm_offset + weight) * N(h)`` (Gemma: 1).
        transposed: matrices are stored (in, out) like GPT-2's Conv1D.
        notes: the family's quirks, shown in reports and `--help`.
    """

    family: str
    model_types: tuple[str, ...]
    sites: Callable[[nn.Module], LayerSites]
    output_controls: tuple[str, ...]
    norm_offset: float = 0.0
    transposed: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)

    def layers(self, model: nn.Module) -> nn.ModuleList:
        """The decoder layers, for a causal LM or the language model inside an image+text model."""
        return decoder_layers(model)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """Find the decoder's layer list through transformers' own `get_decoder` where it exists."""
    candidates: list[nn.Module] = []
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        try:
            candidates.append(get_decoder())
        except (AttributeError, NotImplementedError):
            pass
    candidates.append(model)
    for owner in candidates:
        for path in ("layers", "h", "model.layers", "transformer.h", "language_model.layers"):
            obj: object = owner
            for part in path.split("."):
                obj = getattr(obj, part, None)
                if obj is None:
                    break
            if isinstance(obj, nn.ModuleList):
                return obj
    raise NotImplementedError(f"cannot find the decoder layers of {type(model).__name__}")
