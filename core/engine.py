"""One step of Algorithm 1 (PAPER.md section 3): record targets, then a patched reduced pass.

Both halves are context managers that register forward hooks on the model's own modules and
remove them in ``finally``; the model's code is never replaced.

- `recording` hooks the full-context forward and keeps, for each patched layer, the targets at
  the query (last) position: ``v_C``, each input matrix's output ``W z_C``, the output matrix's
  output ``h_down,C``, the branch output and the block output ``T_C``.
- `patching` hooks the reduced forward and builds each layer's patch *inside* that forward, from
  the actual (already patched) reduced activations, so layer ``l`` also absorbs the rounding
  drift of layers ``< l``. Patches act as rank-1 actions ``W x + u (a . x)``. Which output
  control absorbs the attention shift in a layer was decided when the run was planned
  (``PatchSpec.outputs``, `core.controllability.output_plan`); the hooks apply that kind.

Tensors captured at the query position are 1-D: ``(d,)`` model width, ``(f,)`` MLP width.
Forward activations are ``(batch=1, seq, width)``. The mixture-of-experts hooks live in
`core.engine_moe`; running the model (logits, caches) in `core.forward`; weights offloaded by
accelerate are read through `core.offload`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .activations import (
    acts_on_one_row,
    first_input,
    first_output,
    first_row_query,
    keep_patched_rows,
    query_row,
    rank1_action,
    rank1_row,
    replace_output,
    with_last_row,
)
from .adapters.base import LayerSites
from .controllability import OutputPlan
from .engine_moe import MoEPatcher, name_expert_slices, record_moe, shared_inputs
from .errors import Cancelled
from .offload import plain_call, resident
from .patches import (
    Delta,
    Patch,
    Rank1,
    down_patch_row,
    either,
    fit_down_target,
    matrix_output_patch,
    poles,
    rank1_input_patch,
    rms_normalize,
    scale_patch,
    stable_down_target,
    stable_poles,
)

StopFn = Callable[[], bool]


@dataclass
class LayerTargets:
    """Full-context values of one layer at the query position (compute dtype)."""

    v_parts: list[Tensor] = field(default_factory=list)  # summed: v_C (d,)
    inputs: dict[str, Tensor] = field(default_factory=dict)  # role -> W z_C (f,)
    down: Tensor | None = None  # h_down,C (d,)
    branch: Tensor | None = None  # m * N(h_down,C) or h_down,C (d,)
    block: Tensor | None = None  # T_C (d,)

    @property
    def v(self) -> Tensor:
        return _summed(self.v_parts)


def _summed(parts: list[Tensor]) -> Tensor:
    """The sum of ``v``'s parts (most families have one: it is then itself)."""
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)


@dataclass
class LayerPatch:
    """What one layer's patch is and how its construction went.

    The measures and flags may be 0-d tensors on the model's device (the hot path decides
    nothing on the host); `core.compare` brings a step's values over in one transfer.
    """

    layer: int
    patches: dict[str, Patch] = field(default_factory=dict)  # parameter name -> patch
    shift_norm: Any = 0.0  # |dv| (L2)
    zero_z: Any = False  # an input matrix saw z = 0: no input patch possible
    zero_h: Any = False  # the output matrix saw h = 0: no output patch possible
    div_by_one: Any = 0  # scale-patch coordinates with N(h)_j = 0
    hard_case: Any = False  # stable update: the secular equation had no interior root
    zero_s: Any = False  # MoE: the active routing weights summed to 0, no expert can absorb dv
    block_error: Any = float("nan")  # max |T - T_C| at the query after patching
    #: MoE: placeholder key of a routed expert's patch -> (parameter name, expert index as a
    #: 0-d tensor); empty once the forward is over (`engine_moe.name_expert_slices`)
    expert_slots: dict[str, tuple[str, Tensor]] = field(default_factory=dict)


@dataclass(frozen=True)
class PatchSpec:
    """How to patch (resolved settings, no tensors).

    Attributes:
        method: "direct" or "stable".
        output_control: "scale", "matrix", "bias" or "experts" (MoE; dense layers
            of an MoE model then use their down matrix).
        last_only: patches act at the query position only (scope "query").
        disabled: patch kinds left out: "input" and/or "output" (negative controls, ablations).
        norm_offset: the post-norm scale is ``norm_offset + weight``.
        stored_dtype: when set, every patch vector is rounded to it before it acts, so the
            run applies exactly the patches that are saved (the patches file is float32) and
            later layers absorb that rounding instead of a verifier meeting it unabsorbed.
        batch: rows of the reduced forward; the patched sequence is the last, the ones before
            it (the unpatched control, `core.compare`) are read and changed by no hook. Dense
            layers only (MoE experts see every row's tokens mixed).
        outputs: each patched layer's `OutputPlan`, by layer index: what absorbs ``dv``
            there (`core.controllability.output_plan` of the layer's sites, ``output_control``,
            ``method`` and ``disabled``, decided once when the run is planned).
        same_pass: `recording`'s hooks run in the same forward (batch row 0, `core.compare`'s
            one pass): a post-norm's full-context output is known only once the post-norm has
            run, so the stable update and the fit make the down matrix's patch there (from its
            input and output kept at the down matrix) instead of at the down matrix.
    """

    method: str = "direct"
    output_control: str = "scale"
    last_only: bool = False
    disabled: frozenset[str] = frozenset()
    norm_offset: float = 0.0
    stored_dtype: torch.dtype | None = None
    batch: int = 1
    outputs: Mapping[int, OutputPlan] = field(default_factory=dict)
    same_pass: bool = False


def compute_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """Patch vectors are float64 for float64 models, float32 otherwise."""
    return torch.float64 if model_dtype == torch.float64 else torch.float32


@contextmanager
def _hook_scope() -> Iterator[Callable[[Any], None]]:
    handles: list[Any] = []
    try:
        yield handles.append
    finally:
        for h in reversed(handles):
            h.remove()


def _stop_hooks(add: Callable[[Any], None], layers: nn.ModuleList,
                should_stop: StopFn | None) -> None:
    if should_stop is None:
        return

    def check(module: nn.Module, args: tuple[Any, ...]) -> None:
        if should_stop():
            raise Cancelled

    for layer in layers:
        add(layer.register_forward_pre_hook(check))


def _source_hook(
    add: Callable[[Any], None], module: nn.Module, kind: str, sink: Callable[[Tensor], None]
) -> None:
    if kind == "input":

        def pre(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            sink(first_input(args, kwargs))

        add(module.register_forward_pre_hook(pre, with_kwargs=True))
    else:

        def post(m: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            sink(first_output(output))

        add(module.register_forward_hook(post))


@contextmanager
def recording(
    layers: nn.ModuleList,
    sites: Mapping[int, LayerSites],
    dtype: torch.dtype,
    should_stop: StopFn | None = None,
    rows: int = 1,
) -> Iterator[dict[int, LayerTargets]]:
    """Record the targets of the patched layers during one full-context forward.

    Args:
        layers: all decoder layers (each checks ``should_stop`` before it runs).
        sites: the patched layers' handles, by layer index.
        dtype: compute dtype of the stored targets.
        rows: with more than 1, the forward runs that many batch rows and batch row 0 is the
            full context's (the others are patched by `patching`, whose hooks, registered
            after these, read the targets in the same module calls; ``PatchSpec.same_pass``).

    Yields:
        A dict filled during the forward: layer index -> `LayerTargets` at the last position.
    """
    targets: dict[int, LayerTargets] = {i: LayerTargets() for i in sites}

    def query(x: Tensor) -> Tensor:
        return query_row(x, dtype) if rows == 1 else first_row_query(x, dtype, rows)

    with _hook_scope() as add:
        _stop_hooks(add, layers, should_stop)
        for i, s in sites.items():
            t = targets[i]

            def keep_v(x: Tensor, t: LayerTargets = t) -> None:
                t.v_parts.append(query(x))

            for module, kind in s.v_sources:
                _source_hook(add, module, kind, keep_v)
            for role, module in (*s.inputs, *shared_inputs(s)):

                def keep_in(m: nn.Module, a: Any, out: Any, t: LayerTargets = t,
                            role: str = role) -> None:
                    t.inputs[role] = query(first_output(out))

                add(module.register_forward_hook(keep_in))

            def keep_down(m: nn.Module, a: Any, out: Any, t: LayerTargets = t) -> None:
                t.down = query(first_output(out))
                t.branch = t.down  # (a post-norm's output replaces it: `keep_branch`)

            if s.out_matrix is not None:
                add(s.out_matrix.register_forward_hook(keep_down))
            if s.router is not None and s.experts is not None:
                record_moe(add, s, t, dtype)  # the router's (and the experts') input
            if s.out_norm is not None:

                def keep_branch(m: nn.Module, a: Any, out: Any, t: LayerTargets = t) -> None:
                    t.branch = query(first_output(out))

                add(s.out_norm.register_forward_hook(keep_branch))

            def keep_block(m: nn.Module, a: Any, out: Any, t: LayerTargets = t) -> None:
                t.block = query(first_output(out))

            add(s.layer.register_forward_hook(keep_block))
        yield targets


def _norm_eps(module: nn.Module) -> float:
    for name in ("eps", "variance_epsilon", "epsilon"):
        if hasattr(module, name):
            return float(getattr(module, name))
    raise NotImplementedError(f"cannot find the epsilon of {type(module).__name__}")


class _LayerPatcher:
    """The hooks of one patched layer during one reduced forward (state lives here); the
    mixture-of-experts hooks are a `MoEPatcher` it owns."""

    def __init__(
        self,
        index: int,
        sites: LayerSites,
        target: LayerTargets,
        spec: PatchSpec,
        names: Mapping[int, str],
        dtype: torch.dtype,
        memo: dict[Any, Any] | None = None,
    ) -> None:
        self.s, self.t, self.spec, self.names, self.dtype = sites, target, spec, names, dtype
        self.index = index
        self.memo: dict[Any, Any] = {} if memo is None else memo  # (weights-only values)
        self.kind = spec.outputs[index].acting  # what absorbs dv here (the run's plan)
        self.result = LayerPatch(layer=index)
        self.v_parts: list[Tensor] = []
        self.g: Tensor | None = None  # stable: target branch output
        self.shifted = False  # dv was measured (`shift`)
        self.down_io: tuple[Tensor, Tensor] | None = None  # same pass: the down matrix's x, y
        self.moe = None if sites.router is None or sites.experts is None else MoEPatcher(
            sites, target, spec, self.kind, self.result, self.name, self.rank1, self.shift, dtype)

    def name(self, module: nn.Module, param: str) -> str:
        """The patched parameter's qualified name, as in ``model.named_parameters()``."""
        return f"{self.names[id(module)]}.{param}"

    def _stored(self, x: Tensor) -> Tensor:
        st = self.spec.stored_dtype
        return x if st is None or st == x.dtype else x.to(st).to(x.dtype)

    def rank1(self, r: Rank1) -> Rank1:
        """A rank-1 patch rounded as it is stored (a non-finite entry is found from the patch
        norms the step queues, `core.compare`)."""
        return Rank1(self._stored(r.u), self._stored(r.a), r.void)

    def _delta(self, d: Tensor) -> Delta:
        return Delta(self._stored(d))

    def shift(self) -> Tensor:
        """``dv = v_C - v`` at the query (its norm kept in the result)."""
        dv = self.t.v - _summed(self.v_parts)
        self.result.shift_norm = dv.norm()
        self.shifted = True
        return dv

    def keep_v(self, x: Tensor) -> None:
        self.v_parts.append(query_row(x, self.dtype))

    def on_input(self, role: str) -> Callable[[nn.Module, Any, Any], Any]:
        """The rank-1 input patch of the matrix whose full-context output is
        ``t.inputs[role]`` (a shared expert's roles are keyed by `engine_moe.shared_inputs`)."""

        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if "input" in self.spec.disabled:
                return None
            x, y = args[0], first_output(output)
            x_q, y_q = query_row(x, self.dtype), query_row(y, self.dtype)
            r = rank1_input_patch(self.t.inputs[role], y_q, x_q)
            self.result.zero_z = either(self.result.zero_z, r.void)  # (then a = 0: no change)
            r = self.rank1(r)
            self.result.patches[self.name(module, "weight")] = r
            return replace_output(output, rank1_action(x, y, r, self.spec.last_only,
                                                       self.spec.batch, rows=(x_q, y_q)))

        return hook

    def on_out_matrix(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """The output matrix's patch for kinds "bias", "matrix", "fit" and "stable" (the last two
        at the post-norm in the same pass as the full context's, `PatchSpec.same_pass`)."""
        x, y = args[0], first_output(output)
        if self.kind in ("stable", "fit") and self.spec.same_pass:
            self.down_io = (x, y)
            return None
        return replace_output(output, self._out_matrix_patch(module, x, y))

    def _out_matrix_patch(self, module: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        """The output matrix's patched output ``y`` on its input ``x``."""
        spec = self.spec
        if self.kind == "bias":
            d = self._delta(self.shift() / self.s.branch_scale)
            self.result.patches[self.name(module, "bias")] = d
            out = (y.to(d.delta.dtype) + d.delta).to(y.dtype)
            return keep_patched_rows(y, out, spec.last_only, spec.batch)
        one_row = acts_on_one_row(y, spec.last_only, spec.batch)
        r, x_q, y_q, row = self._out_matrix_rank1(module, x, y, one_row)
        if row is not None:
            return with_last_row(y, row)
        return rank1_action(x, y, r, spec.last_only, spec.batch,
                            rows=None if y_q is None else (x_q, y_q))

    def _out_matrix_rank1(self, module: nn.Module, x: Tensor, y: Tensor, one_row: bool
                          ) -> tuple[Rank1, Tensor, Tensor | None, Tensor | None]:
        """The output matrix's rank-1 patch (kinds "matrix", "fit", "stable"), kept in the
        result, with the query rows of ``x`` and (but for "matrix") ``y`` it read, and where
        the patch acts on that ``one_row`` alone and `down_patch_row` could compute it, the
        patched row (in the patch dtype; else None)."""
        x_q, y_q, row = query_row(x, self.dtype), None, None
        if self.kind == "matrix":
            r = matrix_output_patch(self.shift() / self.s.branch_scale, x_q)
        else:
            # Appendix B's fit of the down output under the norm; with kind "fit" the scale
            # stays frozen and the fit's residual is left over (PAPER.md section 7)
            assert self.s.out_norm is not None and self.t.down is not None
            m = self._scale()
            self.g = self.shift() + self.t.branch
            key = (self.index, self.kind)  # (the poles of m, or of its conditioned copy)
            if key not in self.memo:
                self.memo[key] = poles(m) if self.kind == "fit" else stable_poles(m)
            y_q = query_row(y, self.dtype)
            done = None
            if one_row and self.spec.stored_dtype in (None, self.dtype):  # (no rounding)
                done = down_patch_row(self.g, self.t.down, x_q, y_q, self.memo[key],
                                      raise_floor=self.kind == "stable")
            if done is not None:
                r, row, self.result.hard_case = done
            else:
                target = fit_down_target if self.kind == "fit" else stable_down_target
                c_rms = self.t.down.pow(2).mean().sqrt()
                h_target, self.result.hard_case = target(self.g, m, c_rms, self.memo[key])
                r = matrix_output_patch(h_target - y_q, x_q)
        self.result.zero_h = either(self.result.zero_h, r.void)  # (then a = 0: no change)
        r = self.rank1(r)
        self.result.patches[self.name(module, "weight")] = r
        return r, x_q, y_q, row

    def _norm_weight(self) -> Tensor:
        """The post-norm's weight in the patch dtype (once per run)."""
        key = (self.index, "norm weight")
        if key not in self.memo:
            assert self.s.out_norm is not None
            self.memo[key] = resident(self.s.out_norm, "weight").detach().to(self.dtype)
        return self.memo[key]

    def _scale(self) -> Tensor:
        """The post-norm scale ``m = offset + weight`` in the patch dtype (once per run)."""
        key = (self.index, "scale")
        if key not in self.memo:
            self.memo[key] = self.spec.norm_offset + self._norm_weight()
        return self.memo[key]

    def on_out_norm(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """The post-norm scale's patch for kinds "scale", "beside" (``dv``) and "stable" (the
        remainder of the down matrix's fit); in the same pass, first the down matrix's patch
        of kinds "stable" and "fit" (`PatchSpec.same_pass`)."""
        h, h_q = args[0], None
        if self.down_io is not None:
            x, y = self.down_io
            if h is not y and not (h.shape == y.shape and torch.equal(h, y.to(h.device))):
                raise NotImplementedError(
                    f"{type(module).__name__} does not read the down matrix's output itself: "
                    "the stable update and the fit need separate passes (control_row "
                    "'separate')")
            assert self.s.out_matrix is not None
            one_row = acts_on_one_row(y, self.spec.last_only, self.spec.batch)
            r, x_q, y_q, row = self._out_matrix_rank1(self.s.out_matrix, x, y, one_row)
            if one_row:  # (its row alone)
                assert y_q is not None
                h = (rank1_row(x_q, y_q, r) if row is None else row).to(y.dtype)  # (as the
                h_q = h.to(self.dtype)  # model holds it)
            else:
                h = rank1_action(x, y, r, self.spec.last_only, self.spec.batch)
            if self.kind == "fit":  # (the scale stays frozen)
                return replace_output(output, self._renormed(module, {}, h, output))
        n = rms_normalize(query_row(h, self.dtype) if h_q is None else h_q, _norm_eps(module))
        if self.kind == "stable":
            assert self.g is not None, "the down matrix's hook runs before the post-norm's"
            shift = self.g - self._scale() * n
        else:
            shift = self.shift()
        dm, zeros = scale_patch(shift, n)
        patch = self._delta(dm)
        dm = patch.delta
        self.result.div_by_one = self.result.div_by_one + zeros
        self.result.patches[self.name(module, "weight")] = patch
        weight = self._norm_weight() + dm
        return replace_output(output, self._renormed(module, {"weight": weight}, h, output))

    def _renormed(self, module: nn.Module, params: dict[str, Tensor], h: Tensor, output: Any
                  ) -> Tensor:
        """The post-norm's output on ``h`` with ``params``, where the patch acts (``h`` may be
        that row alone where the patch acts on one row)."""
        y = first_output(output)
        if acts_on_one_row(y, self.spec.last_only, self.spec.batch):
            return with_last_row(y, plain_call(module, params, h.reshape(-1, h.shape[-1])[-1:]))
        patched = plain_call(module, params, h)
        return keep_patched_rows(y, patched.to(y.dtype), self.spec.last_only, self.spec.batch)

    def on_block(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self.shifted and self.v_parts:  # output frozen: still measure |dv|
            self.shift()
        if self.t.block is not None:
            t = query_row(first_output(output), self.dtype)
            self.result.block_error = (t - self.t.block).abs().max()

    def register(self, add: Callable[[Any], None]) -> None:
        """Register this layer's hooks: ``v``'s sources, the input matrices (a shared expert's
        too), the output control of its kind, the MoE's own, and the block's check."""
        s = self.s
        for module, kind in s.v_sources:
            _source_hook(add, module, kind, self.keep_v)
        for role, module in (*s.inputs, *shared_inputs(s)):
            add(module.register_forward_hook(self.on_input(role)))
        if self.kind in ("bias", "matrix", "fit", "stable"):
            assert s.out_matrix is not None
            add(s.out_matrix.register_forward_hook(self.on_out_matrix))
        if self.moe is not None:
            self.moe.register(add)  # the router, the routed and the shared experts
        if self.kind in ("scale", "stable", "beside") or (self.kind == "fit"
                                                           and self.spec.same_pass):
            assert s.out_norm is not None
            add(s.out_norm.register_forward_hook(self.on_out_norm))
        add(s.layer.register_forward_hook(self.on_block))


@contextmanager
def patching(
    layers: nn.ModuleList,
    sites: Mapping[int, LayerSites],
    targets: Mapping[int, LayerTargets],
    spec: PatchSpec,
    names: Mapping[int, str],
    dtype: torch.dtype,
    should_stop: StopFn | None = None,
    memo: dict[Any, Any] | None = None,
) -> Iterator[dict[int, LayerPatch]]:
    """Build and apply each patched layer's patch during one reduced-context forward.

    Args:
        layers: all decoder layers (each checks ``should_stop`` before it runs).
        sites: the patched layers' handles, by layer index.
        targets: what `recording` kept for those layers.
        spec: method, output control, scope, disabled patch kinds, and each layer's
            `OutputPlan` (``spec.outputs``, one for every layer of ``sites``).
        names: ``id(module) -> qualified name`` for naming patched parameters.
        dtype: compute dtype of the patch vectors.
        memo: values that depend on the weights only (the post-norm scale, the `Poles` of its
            conditioned copy), kept across the forwards of one run; the weights must not change
            meanwhile.

    Yields:
        A dict filled during the forward: layer index -> `LayerPatch`.
    """
    results: dict[int, LayerPatch] = {}
    with _hook_scope() as add:
        _stop_hooks(add, layers, should_stop)
        for i, s in sites.items():
            lp = _LayerPatcher(i, s, targets[i], spec, names, dtype, memo)
            results[i] = lp.result
            lp.register(add)
        yield results
    name_expert_slices(results)  # (after a forward that finished)
