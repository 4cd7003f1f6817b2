"""One step of Algorithm 1 (PAPER.md section 3): record targets, then a patched reduced pass.

Both halves are context managers that register forward hooks on the model's own modules and
remove them in ``finally``; the model's code is never replaced.

- `recording` hooks the full-context forward and keeps, for each patched layer, the targets at
  the query (last) position: ``v_C``, each input matrix's output ``W z_C``, the output matrix's
  output ``h_down,C``, the branch output and the block output ``T_C``.
- `patching` hooks the reduced forward and builds each layer's patch *inside* that forward, from
  the actual (already patched) reduced activations, so layer ``l`` also absorbs the rounding
  drift of layers ``< l``. Patches act as rank-1 actions ``W x + u (a . x)``.

Tensors captured at the query position are 1-D: ``(d,)`` model width, ``(f,)`` MLP width.
Forward activations are ``(batch=1, seq, width)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from core.adapters.base import LayerSites
from core.errors import Cancelled
from core.images import vision_kwargs
from core.offload import is_offloaded, plain_call, resident
from core.patches import (
    Delta,
    Patch,
    Rank1,
    matrix_output_patch,
    rank1_input_patch,
    rms_normalize,
    scale_patch,
    stable_down_target,
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
    z: Tensor | None = None  # MoE: the experts' input z_C (d,)

    @property
    def v(self) -> Tensor:
        return torch.stack(self.v_parts).sum(0)


@dataclass
class LayerPatch:
    """What one layer's patch is and how its construction went."""

    layer: int
    patches: dict[str, Patch] = field(default_factory=dict)  # parameter name -> patch
    shift_norm: float = 0.0  # |dv| (L2)
    zero_z: bool = False  # an input matrix saw z = 0: no input patch possible
    zero_h: bool = False  # the output matrix saw h = 0: no output patch possible
    div_by_one: int = 0  # scale-patch coordinates with N(h)_j = 0
    hard_case: bool = False  # stable update: the secular equation had no interior root
    zero_s: bool = False  # MoE: the active routing weights summed to 0, no expert can absorb dv
    nonfinite: bool = False  # a patch vector came out NaN or infinite
    block_error: float = float("nan")  # max |T - T_C| at the query after patching


@dataclass(frozen=True)
class PatchSpec:
    """How to patch (resolved settings, no tensors).

    Attributes:
        method: "direct" or "stable".
        control: the output control, "scale", "matrix", "bias" or "experts" (MoE; dense layers
            of an MoE model then use their down matrix).
        last_only: patches act at the query position only (scope "query").
        disabled: patch kinds left out: "input" and/or "output" (negative controls, ablations).
        norm_offset: the post-norm scale is ``norm_offset + weight``.
        stored_dtype: when set, every patch vector is rounded to it before it acts, so the
            run applies exactly the patches that are saved (the patches file is float32) and
            later layers absorb that rounding instead of a verifier meeting it unabsorbed.
    """

    method: str = "direct"
    control: str = "scale"
    last_only: bool = False
    disabled: frozenset[str] = frozenset()
    norm_offset: float = 0.0
    stored_dtype: torch.dtype | None = None


def compute_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """Patch vectors are float64 for float64 models, float32 otherwise."""
    return torch.float64 if model_dtype == torch.float64 else torch.float32


def _first_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    if args and isinstance(args[0], Tensor):
        return args[0]
    if isinstance(kwargs.get("hidden_states"), Tensor):
        return kwargs["hidden_states"]
    return next(v for v in kwargs.values() if isinstance(v, Tensor))


def _first_output(output: Any) -> Tensor:
    return output[0] if isinstance(output, tuple | list) else output


def _replace_output(output: Any, new: Tensor) -> Any:
    if isinstance(output, tuple):
        return (new, *output[1:])
    if isinstance(output, list):
        return [new, *output[1:]]
    return new


def _q(x: Tensor, dtype: torch.dtype) -> Tensor:
    """The query (last) position of a (1, seq, width) or (seq, width) activation, as a (width,)
    copy (batch is 1: MoE modules see the same rows flattened)."""
    return x.reshape(-1, x.shape[-1])[-1].detach().to(dtype).clone()


@contextmanager
def written_(pairs: Sequence[tuple[Tensor, Tensor]]) -> Iterator[None]:
    """Add each delta to its parameter (or parameter slice) in place, rounded to the parameter's
    dtype; restore the exact originals in ``finally``."""
    saved: list[tuple[Tensor, Tensor]] = []
    try:
        with torch.no_grad():
            for target, delta in pairs:
                saved.append((target, target.detach().clone()))
                target.copy_((target.to(delta.dtype) + delta).to(target.dtype))
        yield
    finally:
        with torch.no_grad():
            for target, original in reversed(saved):
                target.copy_(original)


def last_logits(model: Any, ids: Sequence[int], device: torch.device, cache: Any = None,
                positions: Sequence[int] | None = None, pixels: dict[str, Any] | None = None
                ) -> torch.Tensor:
    """Last-position logits as a float64 CPU vector.

    ``pixels``: an image's processor inputs (`core.prompt.Prompt.pixels`), for a run over ids
    from position 0 that contain its image tokens.
    """
    kwargs: dict[str, Any] = {"logits_to_keep": 1}
    if cache is not None:
        kwargs.update(cache=cache, use_cache=True)
    else:
        kwargs["use_cache"] = False
    if positions is not None:
        kwargs["position_ids"] = torch.tensor([list(positions)], device=device)
    input_ids = torch.tensor([list(ids)], device=device)
    if pixels:
        kwargs.update(vision_kwargs(model, pixels, input_ids))
    out = model(input_ids=input_ids, **kwargs)
    return out.logits[0, -1].detach().to("cpu", torch.float64)


def extend_cache(model: Any, ids: Sequence[int], device: torch.device, cache: Any) -> None:
    """Run ``ids`` into ``cache`` through the decoder alone: the keys and values without the
    output matrix (on the demo model the 262k-word head is two thirds of a one-token pass)."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else model
    decoder(input_ids=torch.tensor([list(ids)], device=device), cache=cache, use_cache=True)


def logit_distance(logits: Tensor, base: Tensor, base_probs: Tensor | None = None,
                   probs: Tensor | None = None) -> tuple[bool, float, float]:
    """(argmax match, max |logits - base|, TVD = half the L1 distance of the softmaxes); pass
    softmaxes already computed so that each side's is computed once."""
    if base_probs is None:
        base_probs = torch.softmax(base, -1)
    if probs is None:
        probs = torch.softmax(logits, -1)
    tvd = 0.5 * (probs - base_probs).abs().sum()
    return int(logits.argmax()) == int(base.argmax()), float((logits - base).abs().max()), float(tvd)


@contextmanager
def _hook_scope() -> Iterator[Callable[[Any], None]]:
    handles: list[Any] = []
    try:
        yield handles.append
    finally:
        for h in reversed(handles):
            h.remove()


def _stop_hooks(add: Callable[[Any], None], layers: nn.ModuleList, should_stop: StopFn | None) -> None:
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
            sink(_first_input(args, kwargs))

        add(module.register_forward_pre_hook(pre, with_kwargs=True))
    else:

        def post(m: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            sink(_first_output(output))

        add(module.register_forward_hook(post))


@contextmanager
def recording(
    layers: nn.ModuleList,
    sites: Mapping[int, LayerSites],
    dtype: torch.dtype,
    should_stop: StopFn | None = None,
) -> Iterator[dict[int, LayerTargets]]:
    """Record the targets of the patched layers during one full-context forward.

    Args:
        layers: all decoder layers (each checks ``should_stop`` before it runs).
        sites: the patched layers' handles, by layer index.
        dtype: compute dtype of the stored targets.

    Yields:
        A dict filled during the forward: layer index -> `LayerTargets` at the last position.
    """
    targets: dict[int, LayerTargets] = {i: LayerTargets() for i in sites}
    with _hook_scope() as add:
        _stop_hooks(add, layers, should_stop)
        for i, s in sites.items():
            t = targets[i]

            def keep_v(x: Tensor, t: LayerTargets = t) -> None:
                t.v_parts.append(_q(x, dtype))

            for module, kind in s.v_sources:
                _source_hook(add, module, kind, keep_v)
            for role, module in s.inputs:

                def keep_in(m: nn.Module, a: Any, out: Any, t: LayerTargets = t, role: str = role) -> None:
                    t.inputs[role] = _q(_first_output(out), dtype)

                add(module.register_forward_hook(keep_in))

            def keep_down(m: nn.Module, a: Any, out: Any, t: LayerTargets = t) -> None:
                t.down = _q(_first_output(out), dtype)
                t.branch = t.down

            if s.out_matrix is not None:
                add(s.out_matrix.register_forward_hook(keep_down))
            if s.router is not None and s.experts is not None:

                def keep_router(m: nn.Module, a: Any, out: Any, t: LayerTargets = t) -> None:
                    t.inputs["router"] = _q(_first_output(out), dtype)

                def keep_z(m: nn.Module, args: tuple[Any, ...], t: LayerTargets = t) -> None:
                    t.z = _q(args[0], dtype)

                add(s.router.register_forward_hook(keep_router))
                add(s.experts.register_forward_pre_hook(keep_z))
            if s.out_norm is not None:

                def keep_branch(m: nn.Module, a: Any, out: Any, t: LayerTargets = t) -> None:
                    t.branch = _q(_first_output(out), dtype)

                add(s.out_norm.register_forward_hook(keep_branch))

            def keep_block(m: nn.Module, a: Any, out: Any, t: LayerTargets = t) -> None:
                t.block = _q(_first_output(out), dtype)

            add(s.layer.register_forward_hook(keep_block))
        yield targets


def _act(x: Tensor, y: Tensor, r: Rank1, last_only: bool) -> Tensor:
    """``y + u (a . x)`` computed in the patch dtype, cast back to ``y``'s dtype."""
    ct = r.u.dtype
    if last_only or y.shape[1] == 1:
        out = y.clone()
        xq, yq = x[:, -1:], y[:, -1:]
        out[:, -1:] = (yq.to(ct) + (xq.to(ct) @ r.a)[..., None] * r.u).to(y.dtype)
        return out
    return (y.to(ct) + (x.to(ct) @ r.a)[..., None] * r.u).to(y.dtype)


def _norm_eps(module: nn.Module) -> float:
    for name in ("eps", "variance_epsilon", "epsilon"):
        if hasattr(module, name):
            return float(getattr(module, name))
    raise NotImplementedError(f"cannot find the epsilon of {type(module).__name__}")


class _LayerPatcher:
    """The hooks of one patched layer during one reduced forward (state lives here)."""

    def __init__(
        self,
        index: int,
        sites: LayerSites,
        target: LayerTargets,
        spec: PatchSpec,
        names: Mapping[int, str],
        dtype: torch.dtype,
    ) -> None:
        self.s, self.t, self.spec, self.names, self.dtype = sites, target, spec, names, dtype
        self.result = LayerPatch(layer=index)
        self.v_parts: list[Tensor] = []
        self.g: Tensor | None = None  # stable: target branch output

    def _name(self, module: nn.Module, param: str) -> str:
        return f"{self.names[id(module)]}.{param}"

    def _stored(self, x: Tensor) -> Tensor:
        st = self.spec.stored_dtype
        return x if st is None or st == x.dtype else x.to(st).to(x.dtype)

    def _rank1(self, r: Rank1) -> Rank1:
        out = Rank1(self._stored(r.u), self._stored(r.a))
        if not (torch.isfinite(out.u).all() and torch.isfinite(out.a).all()):
            self.result.nonfinite = True
        return out

    def _delta(self, d: Tensor) -> Delta:
        d = self._stored(d)
        if not torch.isfinite(d).all():
            self.result.nonfinite = True
        return Delta(d)

    def _shift(self) -> Tensor:
        """``dv = v_C - v`` at the query."""
        v = torch.stack(self.v_parts).sum(0)
        dv = self.t.v - v
        self.result.shift_norm = float(dv.norm())
        return dv

    def keep_v(self, x: Tensor) -> None:
        self.v_parts.append(_q(x, self.dtype))

    def on_input(self, role: str) -> Callable[[nn.Module, Any, Any], Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if "input" in self.spec.disabled:
                return None
            x, y = args[0], _first_output(output)
            r = rank1_input_patch(self.t.inputs[role], _q(y, self.dtype), _q(x, self.dtype))
            if r is None:
                self.result.zero_z = True
                return None
            r = self._rank1(r)
            self.result.patches[self._name(module, "weight")] = r
            return _replace_output(output, _act(x, y, r, self.spec.last_only))

        return hook

    def on_out_matrix(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if "output" in self.spec.disabled:
            return None
        x, y = args[0], _first_output(output)
        spec = self.spec
        if spec.control == "bias":
            d = self._delta(self._shift() / self.s.branch_scale)
            self.result.patches[self._name(module, "bias")] = d
            out = y.clone()
            sl = slice(-1, None) if spec.last_only else slice(None)
            out[:, sl] = (out[:, sl].to(d.delta.dtype) + d.delta).to(y.dtype)
            return _replace_output(output, out)
        post_norm = self.s.out_norm is not None
        if spec.control in ("matrix", "experts") and not post_norm:  # (experts: a dense layer)
            shift = self._shift() / self.s.branch_scale
        elif post_norm and (spec.control == "matrix" or spec.method == "stable"):
            # Appendix B's fit of the down output under the norm; with control "matrix" the
            # scale stays frozen and the fit's residual is left over (PAPER.md section 7)
            assert self.s.out_norm is not None and self.t.down is not None
            m = self._scale()
            self.g = self._shift() + self.t.branch
            c_rms = self.t.down.pow(2).mean().sqrt()
            h_target, hard = stable_down_target(self.g, m, c_rms)
            self.result.hard_case = hard
            shift = h_target - _q(y, self.dtype)
        else:
            return None
        r = matrix_output_patch(shift, _q(x, self.dtype))
        if r is None:
            self.result.zero_h = True
            return None
        r = self._rank1(r)
        self.result.patches[self._name(module, "weight")] = r
        return _replace_output(output, _act(x, y, r, spec.last_only))

    def on_router(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """Rank-1 patch of the router so the reduced input routes like the full context: the
        same experts with the same weights (the router recomputes with the patched matrix)."""
        if "input" in self.spec.disabled:
            return None
        x, logits = args[0], _first_output(output)
        r = rank1_input_patch(self.t.inputs["router"], _q(logits, self.dtype), _q(x, self.dtype))
        if r is None:
            self.result.zero_z = True
            return None
        r = self._rank1(r)
        self.result.patches[self._name(module, "weight")] = r
        w = resident(module, "weight").detach()
        weight = (w.to(r.u.dtype) + torch.outer(r.u, r.a)).to(w.dtype)
        patched = plain_call(module, {"weight": weight}, x)
        return _last_rows(output, patched, self.spec.last_only)

    def on_experts(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """Patch every active expert at the query: its ``gate_up_proj`` slice so the reduced input
        gives the full-context inner activation, its ``down_proj`` slice to add ``dv / S``
        (``S`` = the active routing weights' sum), so ``sum_e g_e dW_e h_e = dv``. The slices
        are written in place for one recomputation of the experts and restored at once."""
        x, index, weights = args[0], args[1], args[2]
        z = _q(x, self.dtype)
        active = [int(e) for e in index.reshape(-1, index.shape[-1])[-1]]
        s_sum = weights.reshape(-1, weights.shape[-1])[-1].to(self.dtype).sum()
        use_input = "input" not in self.spec.disabled
        use_output = "output" not in self.spec.disabled
        if use_output and float(s_sum) == 0.0:
            self.result.zero_s = True
        dv = self._shift() / s_sum if use_output and not self.result.zero_s else None
        pairs: list[tuple[str, int, Tensor]] = []
        gate_up_all = resident(module, "gate_up_proj")
        for e in dict.fromkeys(active):
            gate_up = gate_up_all[e].detach().to(self.dtype)  # (2f, d)
            y, y_target = gate_up @ z, gate_up @ self.t.z if self.t.z is not None else None
            if use_input and y_target is not None:
                r_in = self._expert_patch(module, "gate_up_proj", e, pairs,
                                          rank1_input_patch(y_target, y, z), "zero_z")
                if r_in is not None:
                    y = y + r_in.u * (r_in.a @ z)
            # mirrors the experts' forward: gate, up = (W x).chunk(2); h = act(gate) * up
            gate, up = y.chunk(2, dim=-1)
            h = module.act_fn(gate) * up
            if dv is not None:
                self._expert_patch(module, "down_proj", e, pairs, matrix_output_patch(dv, h),
                                   "zero_h")
        if not pairs:
            return None
        rows = slice(-1, None) if self.spec.last_only else slice(None)
        inputs = (x[rows], index[rows], weights[rows])
        if any(is_offloaded(module, name) for name, _, _ in pairs):
            # offloaded experts: patched copies of the stacked tensors for this one call
            params = {}
            for name in dict.fromkeys(n for n, _, _ in pairs):
                full = resident(module, name).detach().clone()
                for n, e, d in pairs:
                    if n == name:
                        full[e] = (full[e].to(d.dtype) + d).to(full.dtype)
                params[name] = full
            patched = plain_call(module, params, *inputs)
        else:  # resident: the slices are written in place and restored at once
            with written_([(getattr(module, n)[e], d) for n, e, d in pairs]):
                patched = plain_call(module, {}, *inputs)
        return _last_rows(output, patched, self.spec.last_only)

    def _expert_patch(self, module: nn.Module, param: str, e: int,
                      pairs: list[tuple[str, int, Tensor]], r: Rank1 | None, zero_flag: str
                      ) -> Rank1 | None:
        """Keep expert ``e``'s rank-1 patch of ``param`` (or note the failed condition)."""
        if r is None:
            setattr(self.result, zero_flag, True)
            return None
        r = self._rank1(r)
        self.result.patches[f"{self._name(module, param)}[{e}]"] = r
        pairs.append((param, e, torch.outer(r.u, r.a)))
        return r

    def _scale(self) -> Tensor:
        norm = self.s.out_norm
        assert norm is not None
        return self.spec.norm_offset + resident(norm, "weight").detach().to(self.dtype)

    def on_out_norm(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if "output" in self.spec.disabled:
            return None
        h = args[0]
        n = rms_normalize(_q(h, self.dtype), _norm_eps(module))
        if self.spec.method == "stable" and self.g is not None:
            shift = self.g - self._scale() * n
        else:
            shift = self._shift()
        dm, zeros = scale_patch(shift, n)
        patch = self._delta(dm)
        dm = patch.delta
        self.result.div_by_one += zeros
        self.result.patches[self._name(module, "weight")] = patch
        weight = resident(module, "weight").detach().to(self.dtype) + dm
        patched = plain_call(module, {"weight": weight}, h)
        y = _first_output(output)
        patched = patched.to(y.dtype)
        if self.spec.last_only and y.shape[1] > 1:
            out = y.clone()
            out[:, -1:] = patched[:, -1:]
            patched = out
        return _replace_output(output, patched)

    def on_block(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self.result.shift_norm == 0.0 and self.v_parts:  # output frozen: still measure |dv|
            self._shift()
        if self.t.block is not None:
            t = _q(_first_output(output), self.dtype)
            self.result.block_error = float((t - self.t.block).abs().max())


def _last_rows(original: Any, patched: Any, last_only: bool) -> Any:
    """With ``last_only``, keep every row of a (seq, ...) output but the last from ``original``."""
    if not last_only:
        return patched
    if isinstance(original, tuple):
        return tuple(_last_rows(o, p, True) for o, p in zip(original, patched, strict=True))
    if original.shape[0] <= 1:
        return patched
    out = original.clone()
    out[-1:] = patched[-1:]
    return out


@contextmanager
def patching(
    layers: nn.ModuleList,
    sites: Mapping[int, LayerSites],
    targets: Mapping[int, LayerTargets],
    spec: PatchSpec,
    names: Mapping[int, str],
    dtype: torch.dtype,
    should_stop: StopFn | None = None,
) -> Iterator[dict[int, LayerPatch]]:
    """Build and apply each patched layer's patch during one reduced-context forward.

    Args:
        layers: all decoder layers (each checks ``should_stop`` before it runs).
        sites: the patched layers' handles, by layer index.
        targets: what `recording` kept for those layers.
        spec: method, output control, scope and disabled patch kinds.
        names: ``id(module) -> qualified name`` for naming patched parameters.
        dtype: compute dtype of the patch vectors.

    Yields:
        A dict filled during the forward: layer index -> `LayerPatch`.
    """
    results: dict[int, LayerPatch] = {}
    with _hook_scope() as add:
        _stop_hooks(add, layers, should_stop)
        for i, s in sites.items():
            lp = _LayerPatcher(i, s, targets[i], spec, names, dtype)
            results[i] = lp.result
            for module, kind in s.v_sources:
                _source_hook(add, module, kind, lp.keep_v)
            for role, module in s.inputs:
                add(module.register_forward_hook(lp.on_input(role)))
            if s.out_matrix is not None:
                add(s.out_matrix.register_forward_hook(lp.on_out_matrix))
            if s.router is not None and s.experts is not None:
                add(s.router.register_forward_hook(lp.on_router))
                add(s.experts.register_forward_hook(lp.on_experts))
            if s.out_norm is not None and spec.control == "scale":
                add(s.out_norm.register_forward_hook(lp.on_out_norm))
            add(s.layer.register_forward_hook(lp.on_block))
        yield results
