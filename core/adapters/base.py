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
  active expert's slice of ``down_proj`` a rank-1 patch adding ``dv / S``; ``experts_view``
  says how the fused experts are stored when transformers' own flags do not (`ExpertsView`);
- ``shared``: always-active experts beside the routed ones (DeepSeek, Qwen2-MoE, Llama 4): their
  input matrices (and a gate's linear) get rank-1 input patches, and their output matrices
  absorb ``dv`` instead of the routed experts (`SharedExpert`);
- an MoE layer with ``out_norm`` (Gemma 4: a dense MLP in ``inputs`` beside the experts, both
  summed under that norm) gives ``dv`` to the norm's scale: the routed experts get input patches
  only; ``experts_own_input`` says the experts read their own input (Gemma 4's
  ``pre_feedforward_layernorm_2(v)``), not the router's, so their patches use its full-context
  value.

The branch output that is added to ``v`` is ``out_norm(out_matrix(...))`` when ``out_norm``
exists, else ``out_matrix(...)``, times ``branch_scale`` (Granite's residual multiplier); so
``T = v + branch_scale * branch``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

#: "input" reads a module's first positional (or ``hidden_states``) argument; "output" its
#: first output.
SourceKind = str


@dataclass(frozen=True)
class SharedExpert:
    """An always-active expert beside the routed ones, ``g(z) * down(act(gate(z)) * up(z))``.

    Its input matrices and its gate's linear read ``z`` and get rank-1 input patches, so its inner
    activation and its gate value are those of the full context; its ``down`` matrix absorbs the
    output correction: with ``n`` shared experts each adds ``dv / (n g_C branch_scale)``, ``g_C``
    its full-context gate value (1 when ungated), as ``dW = shift h^T / |h|^2``
    (`core.engine_moe`). The modules may see ``(tokens, width)`` or ``(1, tokens, width)``.
    Shared experts are patched in a layer that also has ``router`` and ``experts`` (their hooks
    are registered with the MoE's; a layer whose router feeds no fused experts needs more).

    Attributes:
        inputs: ``(role, nn.Linear)`` input matrices (``gate_proj``, ``up_proj``).
        down: its output matrix (an ``nn.Linear``: ``down_proj``).
        gate: the linear of ``z`` whose ``gate_fn`` weights the expert's output (Qwen2-MoE's
            ``shared_expert_gate``, ``(1, d)``), or None when the output is added as it is.
        gate_fn: the fixed function of that linear's output (a sigmoid in every family so far).
    """

    inputs: tuple[tuple[str, nn.Module], ...]
    down: nn.Module
    gate: nn.Module | None = None
    gate_fn: Callable[[Tensor], Tensor] = torch.sigmoid


@dataclass(frozen=True)
class ExpertsView:
    """How a fused experts module stores and applies its experts.

    Experts decorated with transformers' ``use_experts_implementation`` carry their own flags
    (``is_transposed``, ``has_bias``, ``has_gate``, ``_apply_gate``), which `core.engine_moe` reads
    when a layer gives no view; a view is needed only for the other kinds (Llama 4).

    Attributes:
        transposed: slices are stored ``(in, out)`` (gpt-oss, Llama 4), so a patch's ``u`` in the
            patches file runs along the input side (DESIGN.md: ``u`` has the stored ``shape[0]``).
        routing: "output": ``y = sum_e w_e E_e(z)`` (the experts get ``(z, index, weights)``);
            "input": ``y = sum_e E_e(w_e z)`` (Llama 4: the scores scale each expert's input).
        rows: "tokens": the experts' input is ``(tokens, d)`` with the routing passed beside it;
            "experts": it is ``(E * tokens, d)``, expert-major, every expert on every token
            (Llama 4's ``routed_in``).
    """

    transposed: bool = False
    routing: str = "output"
    rows: str = "tokens"


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
    #                                   (z, top_k_index, top_k_weights) or as experts_view says
    experts_view: ExpertsView | None = None  # MoE: None reads transformers' own flags
    shared: tuple[SharedExpert, ...] = ()  # MoE: always-active experts; they absorb dv
    experts_own_input: bool = False  # MoE: the experts' input is not the router's (Gemma 4)
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
        batch_rows: the reduced pass may carry the unpatched control as a second batch row
            (`core.compare`); False where activations are not ``(batch, seq, width)`` rows the
            hooks can tell apart (Gemma 3n's AltUp streams).
    """

    family: str
    model_types: tuple[str, ...]
    sites: Callable[[nn.Module], LayerSites]
    output_controls: tuple[str, ...]
    norm_offset: float = 0.0
    transposed: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)
    batch_rows: bool = True

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
        for path in ("layers", "h", "model.layers", "transformer.h", "language_model.layers",
                     "blocks", "transformer.blocks"):  # (MPT)
            obj: object = owner
            for part in path.split("."):
                obj = getattr(obj, part, None)
                if obj is None:
                    break
            if isinstance(obj, nn.ModuleList):
                return obj
    raise NotImplementedError(f"cannot find the decoder layers of {type(model).__name__}")
