"""Family-specific checks of the mixture-of-experts adapters (issue 17, group B), in float64 on
the tiny random models of tests/tiny_moe.py; tests/core/test_ground_truth.py covers the rest.

- Routing: with the saved patches written into the weights, the reduced run selects the same
  experts with the same weights as the full-context run at every MoE layer and step (routers
  with biases, correction biases, grouped top-k, sigmoid scores, routed scaling, Llama 4's
  input-side scores); without the router's patch it does not.
- Shared experts: dropping their input patches, or their output patch, breaks the equality.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from ctxpatch.core.adapters.base import SharedExpert
from ctxpatch.core.compare import RunSpec, iter_token_patches
from ctxpatch.core.engine_moe import experts_view
from ctxpatch.core.forward import last_logits
from ctxpatch.core.prompt import build_prompt
from ctxpatch.core.verify import materialized, patches_of_steps
from tiny import tiny_config, tiny_loaded
from tiny_moe import FAMILIES

CONTEXT = "The quick brown fox jumps over the lazy dog."
QUERY = "Hello world!"
TOKENS = 3
EXACT = 1e-6  # of the logit scale
#: routers that compute in float32 (their matrix is kept float32): weights agree to ~1e-7
ROUTING_TOL = 1e-6

SHARED = ["deepseek_v3", "deepseek_v2", "glm4_moe", "qwen2_moe", "qwen3_next", "ernie4_5_moe",
          "llama4_text"]


def _steps(loaded, **kw):  # type: ignore[no-untyped-def]
    prompt = build_prompt(loaded.tokenizer, CONTEXT, QUERY)
    return list(iter_token_patches(loaded, prompt, RunSpec(max_new_tokens=TOKENS, **kw)))


def _moe_sites(loaded):  # type: ignore[no-untyped-def]
    layers = loaded.adapter.layers(loaded.model)
    return [s for s in map(loaded.adapter.sites, layers) if s.experts is not None]


class _Routing:
    """Capture, at the last position of every forward, each MoE layer's selected experts and
    their weights, as the experts module receives them."""

    def __init__(self, loaded) -> None:  # type: ignore[no-untyped-def]
        self.sites = _moe_sites(loaded)
        self.seen: list[tuple[frozenset[int], dict[int, float]]] = []

    def _experts_hook(self, module, args):  # type: ignore[no-untyped-def]
        index, weights = args[1], args[2]
        idx = index.reshape(-1, index.shape[-1])[-1].tolist()
        w = weights.reshape(-1, weights.shape[-1])[-1].double().tolist()
        self.seen.append((frozenset(idx), dict(zip(idx, w, strict=True))))

    def _router_hook(self, module, args, output):  # type: ignore[no-untyped-def]
        scores = output[0].reshape(-1, output[0].shape[-1])[-1].double()  # Llama 4
        chosen = {int(e): float(scores[e]) for e in torch.nonzero(scores).flatten()}
        self.seen.append((frozenset(chosen), chosen))

    def __enter__(self) -> _Routing:
        self.handles = []
        for s in self.sites:
            if experts_view(s, s.experts).rows == "tokens":
                self.handles.append(s.experts.register_forward_pre_hook(self._experts_hook))
            else:
                self.handles.append(s.router.register_forward_hook(self._router_hook))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()

    def take(self) -> list[tuple[frozenset[int], dict[int, float]]]:
        out, self.seen = self.seen, []
        return out


def _routings(loaded, steps, pf):  # type: ignore[no-untyped-def]
    """(full-context, patched-weights reduced) routings per step."""
    model, device = loaded.model, loaded.device
    pairs = []
    with torch.inference_mode(), _Routing(loaded) as cap:
        for t, s in enumerate(steps):
            last_logits(model, s.full_input_ids, device)
            full = cap.take()
            with materialized(model, pf.patches.get(t, {})):
                last_logits(model, s.reduced_input_ids, device,
                            positions=s.reduced_position_ids)
            pairs.append((full, cap.take()))
    return pairs


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_routing_is_identical_with_the_patches(family: str) -> None:
    loaded = tiny_loaded(tiny_config(family))
    steps = _steps(loaded, absorb="all", keep_patches=True)
    pf = patches_of_steps(steps, "all-positions")
    n_moe = len(_moe_sites(loaded))
    assert n_moe > 0
    for full, patched in _routings(loaded, steps, pf):
        assert len(full) == len(patched) == n_moe
        for (sel_c, w_c), (sel, w) in zip(full, patched, strict=True):
            assert sel == sel_c
            for e in sel:
                assert abs(w[e] - w_c[e]) <= ROUTING_TOL * max(1.0, abs(w_c[e])), (e, w, w_c)
    # the check has teeth: without the router's (input) patches the routing weights move
    pf_off = patches_of_steps(_steps(loaded, absorb="all", keep_patches=True,
                                     disabled=frozenset({"input"})), "all-positions")
    moved = 0.0
    for full, patched in _routings(loaded, steps, pf_off):
        for (sel_c, w_c), (sel, w) in zip(full, patched, strict=True):
            moved = max(moved, 1.0 if sel != sel_c else max(abs(w[e] - w_c[e]) for e in sel))
    assert moved > 1e3 * ROUTING_TOL


def _without(loaded, strip):  # type: ignore[no-untyped-def]
    """``loaded`` whose adapter gives each MoE layer's shared experts through ``strip``."""
    base = loaded.adapter.sites

    def sites(layer):  # type: ignore[no-untyped-def]
        s = base(layer)
        return dataclasses.replace(s, shared=tuple(strip(x) for x in s.shared)) if s.shared else s

    return dataclasses.replace(loaded, adapter=dataclasses.replace(loaded.adapter, sites=sites))


def _worst(loaded) -> float:  # type: ignore[no-untyped-def]
    return max(s.patched.linf / s.logit_scale for absorb in ("context", "all")
               for s in _steps(loaded, absorb=absorb))


@pytest.mark.parametrize("family", SHARED)
def test_the_shared_experts_patches_are_needed(family: str) -> None:
    loaded = tiny_loaded(tiny_config(family))
    assert any(s.shared for s in _moe_sites(loaded))
    assert _worst(loaded) <= EXACT
    # the shared expert's inner activation (and gate value) left at the reduced input's
    no_inputs = _without(loaded, lambda x: dataclasses.replace(x, inputs=(), gate=None,
                                                               gate_fn=x.gate_fn))
    if family in ("qwen2_moe", "qwen3_next"):  # (its down patch then divides by 1, not g_C)
        assert all(x.gate is not None for s in _moe_sites(loaded) for x in s.shared)
    assert _worst(no_inputs) > 10 * EXACT
    # nothing absorbs dv: the routed experts leave it to the shared one, whose down is unhooked
    no_down = _without(loaded, lambda x: SharedExpert(inputs=x.inputs, down=torch.nn.Identity(),
                                                      gate=x.gate, gate_fn=x.gate_fn))
    assert _worst(no_down) > 1e3 * EXACT


def test_a_gated_shared_expert_divides_by_its_gate() -> None:
    """Qwen2-MoE: the shared expert's down patch adds ``dv / sigmoid(gate(z_C))``; taking the
    gate as 1 leaves the shift scaled by the gate value."""
    loaded = tiny_loaded(tiny_config("qwen2_moe"))
    ungated = _without(loaded, lambda x: dataclasses.replace(x, gate_fn=torch.ones_like))
    assert _worst(ungated) > 1e3 * EXACT


# -- Gemma 4's MoE block: a dense MLP beside the experts, the sum under a post-norm ------------

GEMMA4 = "gemma4_text_moe"


def _gemma4_moe():  # type: ignore[no-untyped-def]
    """The tiny Gemma 4 MoE with its routers' ``scale`` and ``per_expert_scale`` random too
    (their init is ones: a per-expert scale the routing weights ignored would go unseen)."""
    loaded = tiny_loaded(tiny_config(GEMMA4))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in loaded.adapter.layers(loaded.model):
            for p in (layer.router.scale, layer.router.per_expert_scale):
                p.add_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * 0.5)
    return loaded


@pytest.mark.parametrize("absorb,scope", [("context", "all-positions"), ("context", "query"),
                                          ("all", "all-positions"), ("all", "query")])
def test_gemma4_moe_is_exact_and_its_saved_patches_verify(absorb: str, scope: str,
                                                          tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Router rank-1 on ``router.proj``, every active expert's ``gate_up_proj[e]`` on the
    experts' own pre-norm, the dense MLP's gate and up; ``post_feedforward_layernorm``'s scale
    alone absorbs ``dv`` (no expert's ``down_proj`` is patched); plain transformers with the
    saved patches written in reproduce the full context, with the same routing."""
    from ctxpatch.core.export import save_patches
    from ctxpatch.core.verify import read_patches, verify_patches

    loaded = _gemma4_moe()
    settings = RunSpec(max_new_tokens=TOKENS, absorb=absorb, scope=scope, keep_patches=True)
    prompt = build_prompt(loaded.tokenizer, CONTEXT, QUERY)
    steps = list(iter_token_patches(loaded, prompt, settings))
    assert len(steps) == TOKENS
    for s in steps:
        assert s.patched.match
        assert s.patched.linf <= EXACT * s.logit_scale, (s.step, s.patched.linf / s.logit_scale)
        assert s.control.linf > 1e3 * EXACT * s.logit_scale
        params = {k.rsplit(".", 1)[0] for k in s.patches}
        for i in range(len(loaded.adapter.layers(loaded.model))):
            layer = f"model.layers.{i}"
            assert {f"{layer}.router.proj.weight", f"{layer}.mlp.gate_proj.weight",
                    f"{layer}.mlp.up_proj.weight",
                    f"{layer}.post_feedforward_layernorm.weight"} <= params
            assert sum(p.startswith(f"{layer}.experts.gate_up_proj[") for p in params) == 2
        assert not any("down_proj" in p for p in params)
    path = tmp_path / "p.safetensors"
    save_patches(path, steps, "tiny", "float64", settings)
    before = {n: p.detach().clone() for n, p in loaded.model.named_parameters()}
    checks = verify_patches(loaded, read_patches(path))
    assert len(checks) == TOKENS
    for c in checks:
        assert c.match and c.linf <= EXACT * c.scale, (c.step, c.linf / c.scale)
    for n, p in loaded.model.named_parameters():
        assert torch.equal(p, before[n]), n
    if scope == "all-positions":  # the same experts with the same weights (per-expert scale in)
        for full, patched in _routings(loaded, steps, patches_of_steps(steps, scope)):
            assert len(full) == len(patched) == 4
            for (sel_c, w_c), (sel, w) in zip(full, patched, strict=True):
                assert sel == sel_c
                assert all(abs(w[e] - w_c[e]) <= ROUTING_TOL * max(1.0, abs(w_c[e])) for e in sel)


def test_gemma4_moe_needs_the_router_and_expert_patches() -> None:
    """Negative controls: the saved patches without the routers' or without the experts'
    slices do not verify; experts patched on the router's input instead of their own pre-norm
    (``experts_own_input`` off) are not exact; nor is the run without its output control."""
    from ctxpatch.core.verify import verify_patches

    loaded = _gemma4_moe()
    prompt = build_prompt(loaded.tokenizer, CONTEXT, QUERY)
    steps = list(iter_token_patches(loaded, prompt, RunSpec(
        max_new_tokens=TOKENS, absorb="all", keep_patches=True)))
    pf = patches_of_steps(steps, "all-positions")
    assert max(c.linf / c.scale for c in verify_patches(loaded, pf)) <= EXACT
    for part in ("router.proj", "experts.gate_up_proj"):
        dropped = dataclasses.replace(pf, patches={
            t: {k: v for k, v in p.items() if part not in k[0]} for t, p in pf.patches.items()})
        assert sum(map(len, dropped.patches.values())) < sum(map(len, pf.patches.values()))
        assert max(c.linf / c.scale for c in verify_patches(loaded, dropped)) > 1e3 * EXACT, part
    base = loaded.adapter.sites
    router_input = dataclasses.replace(loaded, adapter=dataclasses.replace(
        loaded.adapter, sites=lambda layer: dataclasses.replace(base(layer),
                                                                experts_own_input=False)))
    assert _worst(router_input) > 1e3 * EXACT
    frozen = max(s.patched.linf / s.logit_scale for s in _steps(
        loaded, absorb="all", disabled=frozenset({"output"})))
    assert frozen > 1e3 * EXACT
