"""Adapters described by data: a `Layout` of module paths, the MLP's matrices read from the
config's tensor-parallel plan.

Most transformers configs carry a ``base_model_tp_plan`` such as
``{"layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
"layers.*.mlp.down_proj": "rowwise", ...}``. A column-wise split shards a matrix's outputs,
which only works for the MLP's input side; a row-wise split shards its inputs and sums the
partial outputs, the MLP's output side. So the plan already names the paper's input-controlled
matrices (colwise) and the output matrix (rowwise), and a llama-like family needs only a
`Layout` saying where ``v`` is and which norm (if any) follows the MLP:

    ADAPTER = declarative("Foo", ("foo",))  # v before post_attention_layernorm, down matrix

A `Layout` names modules by their path inside one decoder layer ("" is the layer itself).
Where the plan is missing or names no MLP (HunYuan dense, StableLM, Bloom, MPT), the layout
names the matrices itself. The maths stays in `core.patches` and `core.engine`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from .base import Adapter, LayerSites, SourceKind

#: tensor-parallel styles of a matrix whose outputs are split (the MLP's input side) ...
_COLWISE = ("colwise", "packed_colwise")
#: ... and of one whose inputs are split and partial outputs summed (the MLP's output side)
_ROWWISE = ("rowwise",)


def module_at(layer: nn.Module, path: str) -> nn.Module:
    """The submodule at a dotted ``path`` inside ``layer`` ("" is the layer itself)."""
    return layer.get_submodule(path) if path else layer


def _config_of(layer: nn.Module) -> Any:
    """The model config a layer's modules keep (transformers stores it on the attention, and
    on most MLPs), or None."""
    for module in layer.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "base_model_tp_plan"):
            return config
    return None


def tp_plan_mlp(config: Any, mlp: str = "mlp") -> tuple[tuple[str, ...], str | None]:
    """The MLP's input matrices (column-wise entries) and its output matrix (the row-wise one)
    named by ``config.base_model_tp_plan``, as paths inside one decoder layer.

    Entries look like ``"layers.*.mlp.gate_proj": "colwise"``; only direct children of
    ``mlp`` count (an MoE plan's ``mlp.experts.*`` does not)."""
    plan = getattr(config, "base_model_tp_plan", None) or {}
    inputs: list[str] = []
    output: str | None = None
    for pattern, style in plan.items():
        path = pattern.split("*.", 1)[-1]
        owner, _, leaf = path.rpartition(".")
        if owner != mlp or not leaf:
            continue
        if str(style).startswith(_COLWISE):
            inputs.append(path)
        elif str(style).startswith(_ROWWISE):
            output = path
    return tuple(inputs), output


def _role(path: str) -> str:
    """``mlp.gate_proj`` -> ``gate``; ``mlp.c_fc`` -> ``c_fc`` (the engine's key for a target)."""
    leaf = path.rpartition(".")[2]
    return leaf.removesuffix("_proj") or leaf


@dataclass(frozen=True)
class Layout:
    """Where one family's decoder layer keeps the paper's quantities (paths inside the layer).

    Attributes:
        v: the modules whose ``input``/``output`` at the query sum to ``v = A(C, x)``: the
            pre-MLP norm's input for a pre-norm block (the default), the MLP's own input
            without a pre-norm (OLMo 2 style), the layer input plus the attention output for a
            parallel block.
        mlp: the MLP's path, where the tensor-parallel plan's matrices are looked up.
        inputs: the input-controlled matrices; empty: the plan's column-wise MLP matrices.
        out_matrix: the output matrix; empty: the plan's row-wise MLP matrix.
        out_norm: the trainable post-MLP norm whose scale is the output control, if any.
        branch_scale: a layer attribute that scales the MLP branch before the residual add.
        parallel: attention and MLP read the same layer input.
    """

    v: tuple[tuple[str, SourceKind], ...] = (("post_attention_layernorm", "input"),)
    mlp: str = "mlp"
    inputs: tuple[str, ...] = ()
    out_matrix: str = ""
    out_norm: str = ""
    branch_scale: str = ""
    parallel: bool = False

    def matrices(self, layer: nn.Module) -> tuple[tuple[str, ...], str]:
        """The input matrices' and the output matrix's paths, from the layout or the plan."""
        inputs, out = self.inputs, self.out_matrix
        if not inputs or not out:
            planned_in, planned_out = tp_plan_mlp(_config_of(layer), self.mlp)
            inputs, out = inputs or planned_in, out or (planned_out or "")
        if not inputs or not out:
            raise NotImplementedError(
                f"{type(layer).__name__}: the config's base_model_tp_plan names no MLP matrices "
                f"under {self.mlp!r}; name them in the adapter's Layout")
        return inputs, out

    def __call__(self, layer: nn.Module) -> LayerSites:
        inputs, out = self.matrices(layer)
        return LayerSites(
            layer=layer,
            v_sources=tuple((module_at(layer, p), kind) for p, kind in self.v),
            inputs=tuple((_role(p), module_at(layer, p)) for p in inputs),
            out_matrix=module_at(layer, out),
            out_norm=module_at(layer, self.out_norm) if self.out_norm else None,
            branch_scale=float(getattr(layer, self.branch_scale)) if self.branch_scale else 1.0,
            parallel=self.parallel,
        )


def parallel_layout(attention: str = "self_attn", **kw: Any) -> Layout:
    """A parallel block ``T = x + Attn(LN(x)) + MLP(LN(x))``: ``v = x + Attn``."""
    return Layout(v=(("", "input"), (attention, "output")), parallel=True, **kw)


#: the post-norm families' output controls (Gemma 2/3, OLMo 2): the scale, or the frozen-scale
#: demonstration on the down matrix
POST_NORM_CONTROLS = ("scale", "matrix")


def declarative(
    family: str,
    model_types: Sequence[str],
    sites: Callable[[nn.Module], LayerSites] | None = None,
    output_controls: Sequence[str] = ("matrix",),
    notes: Sequence[str] = (),
    norm_offset: float = 0.0,
) -> Adapter:
    """An `Adapter` whose sites come from a `Layout` (default: a llama-like pre-norm block
    whose MLP matrices the config's tensor-parallel plan names), or from a function that picks
    one of several layouts by a layer's flags."""
    return Adapter(
        family=family,
        model_types=tuple(model_types),
        sites=sites or Layout(),
        output_controls=tuple(output_controls),
        norm_offset=norm_offset,
        notes=tuple(notes),
    )
