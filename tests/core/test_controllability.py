"""The controllability report: the plan names the controls and what the weights show; the
outcome counts failed conditions; a frozen scale's bound is flagged (PAPER.md sections 4, 7)."""

from __future__ import annotations

import math

import torch
from ctxpatch.core.compare import RunSpec, iter_token_patches
from ctxpatch.core.controllability import outcome, plan, summary_lines
from ctxpatch.core.prompt import build_prompt
from tiny import gemma3_config, tiny_config, tiny_loaded

CONTEXT, QUERY, TOKENS = "The quick brown fox jumps over the lazy dog.", "Hello world!", 4


def _steps(loaded, settings):  # type: ignore[no-untyped-def]
    prompt = build_prompt(loaded.tokenizer, CONTEXT, QUERY)
    return list(iter_token_patches(loaded, prompt, settings))


def test_plan_names_each_family_s_controls() -> None:
    gemma = tiny_loaded(gemma3_config(layers=4))
    p = plan(gemma, RunSpec(method="stable"))
    assert [x.layer for x in p] == [0, 1, 2, 3]
    assert p[2].inputs == ("model.layers.2.mlp.gate_proj.weight",
                           "model.layers.2.mlp.up_proj.weight")
    assert p[2].outputs == ("model.layers.2.mlp.down_proj.weight",
                            "model.layers.2.post_feedforward_layernorm.weight")
    gpt2 = plan(tiny_loaded(tiny_config("gpt2")), RunSpec())
    assert gpt2[0].outputs == ("transformer.h.0.mlp.c_proj.bias",) and gpt2[0].control == "bias"
    moe = plan(tiny_loaded(tiny_config("mixtral")), RunSpec(layers="3"))
    assert moe[0].inputs[0] == "model.layers.3.mlp.gate.weight"
    assert any("S != 0" in c for c in moe[0].conditions)
    neox = plan(tiny_loaded(tiny_config("gpt_neox")), RunSpec())
    assert any("parallel block" in w for w in neox[0].warnings)


def test_a_zero_in_the_scale_is_seen_before_the_run() -> None:
    gemma = tiny_loaded(gemma3_config(layers=4))
    with torch.no_grad():  # m = 1 + weight = 0 in two coordinates of layer 1
        gemma.model.model.layers[1].post_feedforward_layernorm.weight[:2] = -1.0
    p = plan(gemma, RunSpec(method="stable"))
    assert p[1].warnings == ("the scale m has 2 exact zero(s): the stable update aims the down "
                             "patch away from them",)
    assert p[0].warnings == () and p[2].warnings == ()
    assert "layer 1" in summary_lines(p)[1]


def test_a_zero_coordinate_of_h_is_counted_and_breaks_exactness() -> None:
    """N(h)_j = 0 (a zero row of the last down matrix): that scale coordinate divides by one at
    every step, and the shift it should have carried is left over in the logits."""
    gemma = tiny_loaded(gemma3_config(layers=4))
    with torch.no_grad():
        gemma.model.model.layers[3].mlp.down_proj.weight[5] = 0.0
    settings = RunSpec(max_new_tokens=TOKENS)
    steps = _steps(gemma, settings)
    result = outcome(steps, plan(gemma, settings))
    assert result[3]["div_by_one_steps"] == TOKENS and result[3]["div_by_one_coordinates"] == TOKENS
    assert all(result[i]["div_by_one_steps"] == 0 for i in (0, 1, 2))
    assert max(s.patched.linf / s.logit_scale for s in steps) > 1e-4
    assert ("conditions: failed in 1 layer(s): layer 3: N(h)_j = 0 at 4 token(s) (divided by one)"
            == summary_lines(plan(gemma, settings), result)[-1])


def test_a_frozen_scale_flags_shifts_beyond_its_bound() -> None:
    gemma = tiny_loaded(gemma3_config(layers=4))
    d = gemma.model.config.hidden_size
    with torch.no_grad():  # m = 1e-3 everywhere in layer 2: the branch can barely move
        gemma.model.model.layers[2].post_feedforward_layernorm.weight.fill_(1e-3 - 1.0)
    settings = RunSpec(max_new_tokens=TOKENS, disabled=frozenset({"output"}))
    p = plan(gemma, settings)
    assert p[2].outputs == () and math.isclose(p[2].frozen_bound, 2 * math.sqrt(d) * 1e-3)
    result = outcome(_steps(gemma, settings), p)
    assert result[2]["beyond_bound_steps"] == list(range(TOKENS))
    assert result[2]["max_shift"] > p[2].frozen_bound
    assert "frozen-scale bound" in summary_lines(p, result)[-1]
    # without freezing, the same layer absorbs it exactly
    steps = _steps(gemma, RunSpec(max_new_tokens=TOKENS))
    assert max(s.patched.linf / s.logit_scale for s in steps) < 1e-6


def test_down_only_under_a_frozen_scale_is_the_section_7_case() -> None:
    """Gemma with output control 'matrix': the scale stays frozen and only the down matrix moves;
    the run is no longer exact, and with a tiny m the shift is flagged beyond the bound."""
    gemma = tiny_loaded(gemma3_config(layers=4))
    settings = RunSpec(max_new_tokens=TOKENS, output_control="matrix")
    steps = _steps(gemma, settings)
    assert max(s.patched.linf / s.logit_scale for s in steps) > 1e-4
    assert all(lp["block_error"] > 1e-6 for s in steps for lp in s.layer_info.values())
    assert set(steps[0].patch_norms[0]) == {  # no scale patch: only gate, up and down
        f"model.layers.0.mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
    with torch.no_grad():
        gemma.model.model.layers[1].post_feedforward_layernorm.weight.fill_(1e-3 - 1.0)
    p = plan(gemma, settings)
    assert p[1].outputs == ("model.layers.1.mlp.down_proj.weight",) and p[1].frozen_bound
    assert outcome(_steps(gemma, settings), p)[1]["beyond_bound_steps"] == list(range(TOKENS))


def test_a_numerical_fault_stops_at_its_token_or_is_passed_as_asked() -> None:
    import pytest
    from ctxpatch.core.errors import UserError

    low = tiny_loaded(tiny_config("llama"), dtype=torch.float16)
    with torch.no_grad():  # float16 tops out at 65504: this layer's output overflows
        low.model.model.layers[1].mlp.down_proj.weight.mul_(1e7)
    with pytest.raises(UserError, match=r"numerical fault at token 1: .*float16: try dtype="):
        _steps(low, RunSpec(max_new_tokens=TOKENS))
    steps = _steps(low, RunSpec(max_new_tokens=2, on_fault="continue"))  # as the user chose
    assert len(steps) == 2 and not math.isfinite(steps[0].logit_scale)


def test_a_nonfinite_patch_names_its_layer(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import ctxpatch.core.engine as engine
    import pytest
    from ctxpatch.core.errors import UserError
    from ctxpatch.core.patches import Rank1

    real = engine.matrix_output_patch

    def poisoned(shift, h):  # type: ignore[no-untyped-def]
        r = real(shift, h)
        return Rank1(r.u * math.inf, r.a) if shift.shape[0] and poisoned.calls == 2 else r

    poisoned.calls = 0  # type: ignore[attr-defined]

    def counting(shift, h):  # type: ignore[no-untyped-def]
        out = poisoned(shift, h)
        poisoned.calls += 1  # type: ignore[attr-defined]
        return out

    monkeypatch.setattr(engine, "matrix_output_patch", counting)
    llama = tiny_loaded(tiny_config("llama"))
    with pytest.raises(UserError, match=r"numerical fault at token 1, layer 2: a patch vector"):
        _steps(llama, RunSpec(max_new_tokens=2))


def _patched_params(step) -> set[str]:  # type: ignore[no-untyped-def]
    """The parameters a step's patches touch, with expert slices folded to ``[active]``."""
    import re

    names = set()
    for key in step.patches:
        param = key.rsplit(".", 1)[0]  # "{param}.u" / ".v" / ".delta"
        names.add(re.sub(r"\[\d+\]$", "[active]", param))
    return names


def test_the_plan_names_what_the_run_patches_shared_experts_included() -> None:
    """DeepSeek V3 and Qwen2-MoE: the shared experts' gate/up (and Qwen's gate) are input
    controls, their down matrices the output control; Gemma 4's MoE block: the dense MLP, the
    router and the experts at the input, the post-norm scale at the output. Every name the plan
    gives is a parameter the run patched, and every patched parameter is in the plan."""
    for family in ("deepseek_v3", "qwen2_moe", "gemma4_text_moe"):
        loaded = tiny_loaded(tiny_config(family))
        settings = RunSpec(max_new_tokens=1, absorb="all", keep_patches=True)
        layer_plans = plan(loaded, settings)
        prompt = build_prompt(loaded.tokenizer, CONTEXT, QUERY)
        step = next(iter(iter_token_patches(loaded, prompt, settings)))
        planned = {n for p in layer_plans for n in (*p.inputs, *p.outputs)}
        assert _patched_params(step) == planned, family
        if family == "gemma4_text_moe":  # the post-norm scale, not the experts, absorbs dv
            assert all(p.outputs == (f"model.layers.{p.layer}.post_feedforward_layernorm.weight",)
                       for p in layer_plans)
            continue
        shared = [p for p in layer_plans if any("shared" in n for n in p.outputs)]
        assert shared and all("shared experts absorb dv" in " ".join(p.conditions)
                              for p in shared)
        assert not any("down_proj[active]" in n for p in shared for n in p.outputs)
