"""The mixture-of-experts hooks of one patched layer (Mixtral, Qwen3-MoE, OLMoE): a rank-1
patch of the router so the reduced input routes like the full context, and rank-1 patches of
every active expert's slices (PAPER.md, MoE extension). Mixed into the engine's layer patcher,
whose state (targets, spec, result, dtype) they share."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from core.activations import first_output, last_rows, query_row
from core.forward import written_
from core.offload import is_offloaded, plain_call, resident
from core.patches import Rank1, matrix_output_patch, rank1_input_patch


class MoEHooks:
    """``on_router`` and ``on_experts``, for `core.engine._LayerPatcher`."""

    t: Any
    spec: Any
    result: Any
    dtype: torch.dtype

    def _rank1(self, r: Rank1) -> Rank1:  # provided by the patcher
        raise NotImplementedError

    def _name(self, module: nn.Module, param: str) -> str:  # provided by the patcher
        raise NotImplementedError

    def _shift(self) -> Tensor:  # provided by the patcher
        raise NotImplementedError

    def on_router(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """Rank-1 patch of the router so the reduced input routes like the full context: the
        same experts with the same weights (the router recomputes with the patched matrix)."""
        if "input" in self.spec.disabled:
            return None
        x, logits = args[0], first_output(output)
        q = self.dtype
        r = rank1_input_patch(self.t.inputs["router"], query_row(logits, q), query_row(x, q))
        if r is None:
            self.result.zero_z = True
            return None
        r = self._rank1(r)
        self.result.patches[self._name(module, "weight")] = r
        w = resident(module, "weight").detach()
        weight = (w.to(r.u.dtype) + torch.outer(r.u, r.a)).to(w.dtype)
        patched = plain_call(module, {"weight": weight}, x)
        return last_rows(output, patched, self.spec.last_only)

    def on_experts(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """Patch every active expert at the query: its ``gate_up_proj`` slice so the reduced input
        gives the full-context inner activation, its ``down_proj`` slice to add ``dv / S``
        (``S`` = the active routing weights' sum), so ``sum_e g_e dW_e h_e = dv``. The slices
        are written in place for one recomputation of the experts and restored at once."""
        x, index, weights = args[0], args[1], args[2]
        z = query_row(x, self.dtype)
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
        return last_rows(output, patched, self.spec.last_only)

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
