"""The mixture-of-experts hooks of one patched layer (PAPER.md section 4, MoE): a rank-1 patch of
the router so the reduced input routes like the full context, rank-1 patches of every active
expert's slices, and of the shared experts' matrices. A `MoEPatcher` is owned by the engine's
layer patcher, which gives it the layer's sites, targets, spec and output kind, the
`LayerPatch` it fills, and the patcher's naming, rounding and ``dv`` helpers.

- The router is a linear map of ``z`` followed by a fixed function (softmax or sigmoid, biases,
  correction biases that only steer the selection, grouped top-k, renormalisation, scaling): the
  rank-1 patch ``W (z_C - z) z^T / |z|^2`` of its matrix gives it the full-context logits, so
  every variant selects the same experts with the same weights. The logits are computed here from
  the matrix and the router's recorded input ``z_C`` (routers return them in different places).
- A routed expert reads ``c z`` with ``c`` the same in both runs (1, or Llama 4's score), so the
  same patch of its ``gate_up`` slice, acting on ``c z``, gives ``c W z_C``: its full-context
  pre-activation.
- Experts that read their own input ``x`` rather than the router's (Gemma 4:
  ``pre_feedforward_layernorm_2(v)`` while the router reads ``v``; ``experts_own_input``) get
  the same patch built from ``x`` and its recorded full-context value ``x_C``.
- The output correction (the layer's `core.controllability.OutputKind`) goes to the shared
  experts when the layer has any ("shared", `SharedExpert`: each adds ``dv / (n g_C)``), else
  to a post-norm scale after the experts when the layer has one ("beside", Gemma 4: the
  engine's scale patch, once the inputs all match), else ("experts") to the active routed
  experts' ``down`` slices, each adding ``dv / S`` with ``S`` the sum of their
  output weights (routing weights; 1 each when the routing scales the input), so
  ``sum_e w_e dW_e h_e = dv``.
- Fused experts are described by transformers' own flags (``use_experts_implementation``:
  ``is_transposed``, ``has_bias``, ``has_gate``), or by the layer's `ExpertsView`. An expert's
  gated activation comes from the module's own ``_apply_gate`` (gpt-oss's clamped, interleaved
  SwiGLU included); it is needed only when routed experts absorb ``dv``.
- Patches of transposed slices are kept in the stored orientation (``u`` along the stored
  ``shape[0]``), as the patches file and `core.verify` want them; the adapter-wide
  ``transposed`` flag (GPT-2's Conv1D) stays False for these families.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from .activations import (
    first_input,
    first_output,
    last_rows,
    query_row,
    rank1_action,
    replace_output,
)
from .adapters.base import ExpertsView, LayerSites, SharedExpert
from .forward import add_to_slices_, written_slices_
from .offload import is_offloaded, plain_call, resident
from .patches import Rank1, either, matrix_output_patch, rank1_input_patch

if TYPE_CHECKING:  # (the engine imports this module)
    from .controllability import OutputKind
    from .engine import LayerPatch, LayerTargets, PatchSpec

#: key in ``LayerTargets.inputs`` of the router's full-context input ``z_C`` (not a matrix output)
ROUTER_Z = "moe.z"
#: the same for the experts' own full-context input ``x_C`` (``LayerSites.experts_own_input``)
EXPERTS_Z = "moe.x"


def _shared_key(k: int, role: str) -> str:
    return f"moe.shared{k}.{role}"


def experts_view(sites: LayerSites, module: nn.Module) -> ExpertsView:
    """The layer's `ExpertsView`, or one read from transformers' flags on the experts module."""
    if sites.experts_view is not None:
        return sites.experts_view
    return ExpertsView(transposed=bool(getattr(module, "is_transposed", False)))


def _n_experts(module: nn.Module) -> int:
    n = getattr(module, "num_experts", None)
    return int(n) if n is not None else int(resident(module, "down_proj").shape[0])


def _rows_times(w: Tensor, x: Tensor) -> Tensor:
    """``w[j] @ x`` (or ``w[j] @ x[j]``) for a batch of matrices ``(k, out, in)``: ``(k, out)``."""
    return torch.matmul(w, x.unsqueeze(-1)).squeeze(-1)


def name_expert_slices(results: Mapping[int, LayerPatch]) -> None:
    """Name the routed experts' patches of one forward ``param[e]`` (`MoEPatcher` kept them
    under placeholders): every layer's expert indices cross to the host in one transfer."""
    slots = [(base, e) for lp in results.values() for base, e in lp.expert_slots.values()]
    if not slots:
        return
    device = slots[0][1].device
    values = iter(torch.stack([e.to(device) for _, e in slots]).tolist())
    for lp in results.values():
        if lp.expert_slots:
            names = {key: f"{base}[{next(values)}]" for key, (base, _) in lp.expert_slots.items()}
            lp.patches = {names.get(key, key): p for key, p in lp.patches.items()}
            lp.expert_slots.clear()


def gate_up_name(module: nn.Module) -> str:
    """The fused experts' stacked input parameter: ``gate_up_proj``, or ``up_proj`` ungated."""
    return "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"


def _activation(module: nn.Module, pre: Tensor) -> Tensor:
    """The expert's inner activation from its pre-activation, by the module's own code."""
    if not getattr(module, "has_gate", True):
        return module.act_fn(pre)
    apply_gate = getattr(module, "_apply_gate", None)
    if apply_gate is None:
        raise NotImplementedError(f"{type(module).__name__} has no _apply_gate: its routed "
                                  "experts cannot absorb dv (give the layer a shared expert)")
    return apply_gate(pre)


def record_moe(add: Callable[[Any], None], s: LayerSites, t: LayerTargets,
               dtype: torch.dtype) -> None:
    """Register the full-context hooks of an MoE layer beyond `core.engine.recording`'s own: the
    router's input ``z_C`` (and the experts' own ``x_C`` when they read another)."""
    assert s.router is not None and s.experts is not None
    owners = ((ROUTER_Z, s.router), (EXPERTS_Z, s.experts)) if s.experts_own_input else \
        ((ROUTER_Z, s.router),)
    for key, owner in owners:

        def keep_z(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                   key: str = key) -> None:
            t.inputs[key] = query_row(first_input(args, kwargs), dtype)

        add(owner.register_forward_pre_hook(keep_z, with_kwargs=True))


def shared_inputs(s: LayerSites) -> tuple[tuple[str, nn.Module], ...]:
    """The shared experts' input matrices and gates, as ``(role, module)`` with roles keyed
    per expert: the engine records and patches them like the layer's own input matrices."""
    out: list[tuple[str, nn.Module]] = []
    for k, shared in enumerate(s.shared):
        gate = (("gate_value", shared.gate),) if shared.gate is not None else ()
        out += [(_shared_key(k, role), m) for role, m in (*shared.inputs, *gate)]
    return tuple(out)


class MoEPatcher:
    """The router's, the routed experts' and the shared experts' hooks of one patched MoE layer
    during one reduced forward, for `core.engine._LayerPatcher`.

    Args:
        sites: the layer's handles (``router`` and ``experts`` set).
        target: its full-context values (`core.engine.recording`).
        spec: the run's patch settings.
        kind: the layer's acting output kind: "experts" and "shared" are absorbed here.
        result: the layer's `LayerPatch`, filled here too.
        name: ``(module, param) -> qualified parameter name``.
        rank1: rounds a rank-1 patch as stored.
        shift: measures ``dv`` at the query (once the layer's ``v`` is known).
        dtype: compute dtype of the patch vectors.
    """

    def __init__(self, sites: LayerSites, target: LayerTargets, spec: PatchSpec,
                 kind: OutputKind, result: LayerPatch,
                 name: Callable[[nn.Module, str], str], rank1: Callable[[Rank1], Rank1],
                 shift: Callable[[], Tensor], dtype: torch.dtype) -> None:
        assert sites.router is not None and sites.experts is not None
        self.s, self.t, self.spec, self.kind, self.result = sites, target, spec, kind, result
        self.name, self.rank1, self.shift, self.dtype = name, rank1, shift, dtype
        self.z: Tensor | None = None  # the router's reduced input at the query (this forward)

    def register(self, add: Callable[[Any], None]) -> None:
        """Register the router's and the routed experts' hooks, and the shared experts' output
        hooks when they absorb ``dv`` (the engine registers their input matrices')."""
        assert self.s.router is not None and self.s.experts is not None
        add(self.s.router.register_forward_hook(self.on_router))
        add(self.s.experts.register_forward_hook(self.on_experts))
        if self.kind == "shared":
            for k, shared in enumerate(self.s.shared):
                add(shared.down.register_forward_hook(self._on_shared_down(k, shared)))

    # -- router -----------------------------------------------------------------------------

    def on_router(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """Rank-1 patch of the router's matrix so the reduced input routes like the full context:
        the same experts with the same weights (the router recomputes with the patched matrix,
        its bias and its fixed function untouched)."""
        x = args[0]
        q = self.dtype
        z = self.z = query_row(x, q)
        if "input" in self.spec.disabled:
            return None
        w = resident(module, "weight").detach()
        wq = w.to(q)
        r = rank1_input_patch(wq @ self.t.inputs[ROUTER_Z], wq @ z, z)
        self.result.zero_z = either(self.result.zero_z, r.void)  # (then a = 0: no change)
        r = self.rank1(r)
        self.result.patches[self.name(module, "weight")] = r
        weight = (w.to(r.u.dtype) + torch.outer(r.u, r.a)).to(w.dtype)
        patched = plain_call(module, {"weight": weight}, x)
        return last_rows(output, patched, self.spec.last_only)

    # -- routed experts ---------------------------------------------------------------------

    def on_experts(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """Patch every active expert at the query: its ``gate_up`` slice so the reduced input gives
        the full-context pre-activation, and (kind "experts": no shared expert or post-norm
        scale absorbs ``dv``) its ``down`` slice to add ``dv / S``. The slices are written in
        place for one recomputation of the experts by their own forward and restored at once.

        Nothing here reads the router's choice on the host: the active experts are an index
        tensor, their slices are gathered and patched as a batch, and the patches are kept
        under placeholder names that `name_expert_slices` turns into ``param[e]`` with one
        transfer for the whole forward."""
        view = experts_view(self.s, module)
        x = args[0]
        q = self.dtype
        if view.rows == "tokens":  # (x, top_k_index, top_k_weights), one row per token
            index = args[1].reshape(-1, args[1].shape[-1])[-1].long()
            out_w = args[2].reshape(-1, args[2].shape[-1])[-1].to(q) \
                if view.routing == "output" else None
            x_e = query_row(x, q)  # (in,): the same row for every expert
            live = None
        else:  # expert-major rows: every expert on every token, unselected ones read zeros
            n = _n_experts(module)
            rows = x.reshape(n, -1, x.shape[-1])[:, -1].to(q)
            selected = (rows != 0).any(-1)
            k = min(int(getattr(self.s.router, "top_k", n) or n), n)
            index = torch.topk(selected.to(torch.uint8), k, sorted=False).indices
            live = selected.index_select(0, index)  # (False only where an input row is 0)
            x_e = rows.index_select(0, index)  # (k, in)
            out_w = None
        index = index.to(x.device)
        k = index.shape[0]
        use_input = "input" not in self.spec.disabled
        if self.s.experts_own_input:  # (one row per token: the experts' x is the patch's z)
            assert view.rows == "tokens", "experts_own_input needs one input row per token"
            z, z_c = query_row(x, q), self.t.inputs.get(EXPERTS_Z)
        else:
            z, z_c = self.z, self.t.inputs.get(ROUTER_Z)
        if z is None:  # no router hook ran before (it always does in these families)
            z = query_row(x, q)
        dv = None
        if self.kind == "experts":
            if out_w is not None:  # routing weights after the experts
                s_sum = out_w.sum()
            elif live is not None:  # expert-major: each active expert's input carries its score
                s_sum = live.sum().to(q)
            else:
                s_sum = torch.full((), float(k), dtype=q, device=x.device)
            zero_s = s_sum == 0  # then no expert can absorb dv: no down patch acts
            self.result.zero_s = either(self.result.zero_s, zero_s)
            dv = self.shift() * (~zero_s) / (torch.where(zero_s, torch.ones_like(s_sum), s_sum)
                                             * self.s.branch_scale)
        gu_name = gate_up_name(module)
        w = resident(module, gu_name).detach().index_select(0, index).to(q)
        w = w.transpose(-1, -2) if view.transposed else w  # (k, out, in)
        pre = _rows_times(w, x_e)
        if getattr(module, "has_bias", False):
            pre = pre + resident(module, f"{gu_name}_bias").detach().index_select(0, index).to(q)
        pairs: list[tuple[str, Tensor]] = []
        if use_input and z_c is not None:
            r_in = rank1_input_patch(_rows_times(w, z_c), _rows_times(w, z), z)
            if live is not None:
                r_in = Rank1(r_in.u * live[:, None], r_in.a, r_in.void)
            r_in = self._expert_patches(module, gu_name, index, pairs, view, r_in, "zero_z")
            pre = pre + r_in.u * (x_e @ r_in.a).reshape(-1, 1)
        if dv is not None:
            h = _activation(module, pre)
            r_out = matrix_output_patch(dv, h)  # (a batch: one row of h per expert)
            if live is not None:  # (a row of zeros: no expert there, no failed condition)
                r_out = Rank1(r_out.u, r_out.a * live[:, None],
                              None if r_out.void is None else r_out.void & live)
            self._expert_patches(module, "down_proj", index, pairs, view, r_out, "zero_h")
        del w  # (k slices in the patch dtype: not kept through the recomputation)
        if not pairs:
            return None
        return self._recompute(module, view, args, output, index, pairs)

    def _recompute(self, module: nn.Module, view: ExpertsView, args: tuple[Any, ...],
                   output: Any, index: Tensor, pairs: list[tuple[str, Tensor]]) -> Any:
        """The experts' own forward with the patched slices (at the query only for scope
        "query"); the other rows keep the original output."""
        last_only = self.spec.last_only
        x = args[0]
        if view.rows == "tokens":
            rows = slice(-1, None) if last_only else slice(None)
            inputs: tuple[Any, ...] = tuple(a[rows] for a in args[:3])
        elif last_only:
            inputs = (x.reshape(_n_experts(module), -1, x.shape[-1])[:, -1],)
        else:
            inputs = (x,)
        if any(is_offloaded(module, name) for name, _ in pairs):
            # offloaded experts: patched copies of the stacked tensors for this one call
            params = {}
            for name, deltas in pairs:
                params[name] = resident(module, name).detach().clone()
                add_to_slices_(params[name], index, deltas)
            patched = plain_call(module, params, *inputs)
        else:  # resident: the slices are written in place and restored at once
            with written_slices_([(getattr(module, n), index, d) for n, d in pairs]):
                patched = plain_call(module, {}, *inputs)
        if view.rows == "tokens" or not last_only:
            return last_rows(output, patched, last_only)
        out = first_output(output).clone()
        n = _n_experts(module)
        out.reshape(n, -1, out.shape[-1])[:, -1] = patched.reshape(n, -1)
        return replace_output(output, out)

    def _expert_patches(self, module: nn.Module, param: str, index: Tensor,
                        pairs: list[tuple[str, Tensor]], view: ExpertsView, r: Rank1,
                        zero_flag: str) -> Rank1:
        """Keep the active experts' rank-1 patches of ``param``, a batch (row ``j`` of ``u``
        or ``a`` belongs to expert ``index[j]``; the other vector may be shared), noting a
        failed condition (then that ``a`` is 0); return them rounded as kept, in (out, in)
        orientation. Each is named ``param[e]`` once the forward is over."""
        if r.void is not None:
            setattr(self.result, zero_flag,
                    either(getattr(self.result, zero_flag), r.void.any()))
        r = self.rank1(r)
        k = index.shape[0]
        u, a = r.u.expand(k, -1), r.a.expand(k, -1)
        base = self.name(module, param)
        for j in range(k):
            stored = Rank1(a[j], u[j]) if view.transposed else Rank1(u[j], a[j])
            key = f"{base}[?{len(self.result.expert_slots)}]"  # (`name_expert_slices`)
            self.result.expert_slots[key] = (base, index[j])
            self.result.patches[key] = stored
        outer = u[:, :, None] * a[:, None, :]  # (k, out, in)
        pairs.append((param, outer.transpose(-1, -2) if view.transposed else outer))
        return r

    # -- shared experts ---------------------------------------------------------------------

    def _on_shared_down(self, k: int, shared: SharedExpert) -> Callable[[nn.Module, Any, Any], Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            x, y = args[0], first_output(output)
            g = torch.ones((), dtype=self.dtype)
            if shared.gate is not None:  # the gate's full-context value (its patch gives it)
                g = shared.gate_fn(self.t.inputs[_shared_key(k, "gate_value")]).reshape(())
            shift = self.shift() / (len(self.s.shared) * g * self.s.branch_scale)
            r = matrix_output_patch(shift, query_row(x, self.dtype))
            self.result.zero_h = either(self.result.zero_h, r.void)  # (then a = 0: no change)
            r = self.rank1(r)
            self.result.patches[self.name(module, "weight")] = r
            return replace_output(output, rank1_action(x, y, r, self.spec.last_only))

        return hook
