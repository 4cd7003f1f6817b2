"""The unpatched control as a second batch row of the patched pass (issue 22), per family, in
float64 on the tiny random models: with absorb all, a run with the control batched gives the
same patched and control logits and the same patches as the run with the control in a pass of
its own; the hooks leave the control row alone (it stays far from the full-context logits
while the patched row equals them); and the rule chooses batched only where it can and pays.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from ctxpatch.core import engine, patches
from ctxpatch.core.adapters import REGISTRY
from ctxpatch.core.compare import RunSpec, iter_token_patches
from ctxpatch.core.forward import attention_only
from ctxpatch.core.plan import batched_control
from ctxpatch.core.prompt import build_prompt
from tiny import TINY, gemma3_config, tiny_config, tiny_loaded
from tiny_hybrid import ALL_LAYERS_ONLY
from transformers import DynamicCache

QUERY = "The quick brown fox jumps over the lazy dog. Hello world!"
TOKENS = 3
EXACT = 1e-6  # of the logit scale, as in test_ground_truth.py
SAME = 1e-9  # of the logit scale: batching changes the order of float64 sums only


def _config(name: str):  # type: ignore[no-untyped-def]
    if name == "gemma3":
        return gemma3_config(layers=4)
    if name in ALL_LAYERS_ONLY:
        from transformers import AutoConfig

        model_type, overrides = ALL_LAYERS_ONLY[name]
        return AutoConfig.for_model(model_type, vocab_size=320, **overrides)
    return tiny_config(name)


@functools.cache
def _loaded(name: str):  # type: ignore[no-untyped-def]
    return tiny_loaded(_config(name))


def _steps(loaded, **kw):  # type: ignore[no-untyped-def]
    prompt = build_prompt(loaded.tokenizer, "", QUERY)
    settings = RunSpec(max_new_tokens=TOKENS, absorb="all", keep_patches=True, **kw)
    return list(iter_token_patches(loaded, prompt, settings))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(["gemma3", *TINY, *ALL_LAYERS_ONLY]))
@pytest.mark.parametrize("method,scope", [("direct", "all-positions"), ("stable", "query")])
def test_batched_control_row_equals_separate_passes(name: str, method: str, scope: str) -> None:
    loaded = _loaded(name)
    batched = _steps(loaded, method=method, scope=scope, control_row="batched")
    separate = _steps(loaded, method=method, scope=scope, control_row="separate")
    for b, s in zip(batched, separate, strict=True):
        scale = s.logit_scale
        assert b.baseline_token == s.baseline_token
        assert b.patched.linf <= EXACT * scale, (b.step, b.patched.linf, scale)
        # the control row was left alone: still clearly off the full-context logits
        assert b.control.linf > 1e3 * EXACT * scale
        assert abs(b.patched.linf - s.patched.linf) <= SAME * scale
        assert abs(b.control.linf - s.control.linf) <= SAME * scale
        assert b.control.top_k.ids == s.control.top_k.ids
        assert b.patches is not None and s.patches is not None
        assert b.patches.keys() == s.patches.keys()
        # each kind of vector (u, v, delta) against the largest of its kind in the step (a
        # patch that is all rounding noise differs in its noise)
        size = {k.rpartition(".")[2]: 0.0 for k in s.patches}
        for key, value in s.patches.items():
            kind = key.rpartition(".")[2]
            size[kind] = max(size[kind], float(np.abs(value).max()))
        for key, value in s.patches.items():
            np.testing.assert_allclose(b.patches[key], value, rtol=1e-7,
                                       atol=SAME * size[key.rpartition(".")[2]], err_msg=key)


def _plan(model_type: str, device: str, dtype: torch.dtype, **settings):  # type: ignore[no-untyped-def]
    loaded = SimpleNamespace(adapter=REGISTRY[model_type], device=torch.device(device),
                             dtype=dtype)
    dense = SimpleNamespace(router=None)
    sites = {0: SimpleNamespace(router=object()) if model_type == "mixtral" else dense}
    return batched_control(loaded, RunSpec(**{"absorb": "all", **settings}), sites)  # type: ignore[arg-type]


def test_the_rule_batches_where_it_can() -> None:
    assert _plan("gemma3_text", "cpu", torch.bfloat16)
    assert _plan("gemma3_text", "cpu", torch.float16)
    assert _plan("gemma3_text", "cuda", torch.float32)
    assert _plan("gemma3_text", "cpu", torch.float32)  # with the head read once for both rows
    assert _plan("gemma3_text", "cpu", torch.float32, control_row="batched")
    assert not _plan("gemma3_text", "cpu", torch.float32, control_row="separate")
    assert not _plan("gemma3_text", "cuda", torch.bfloat16, control_row="separate")
    assert not _plan("gemma3_text", "cuda", torch.bfloat16, control=False)
    assert not _plan("gemma3_text", "cuda", torch.bfloat16, absorb="context")
    assert not _plan("mixtral", "cuda", torch.bfloat16, control_row="batched")  # MoE layers
    assert not _plan("gemma3n_text", "cuda", torch.bfloat16, control_row="batched")  # AltUp


@pytest.mark.parametrize("given,absorb,expected", [("auto", "all", "batched"),
                                                   ("separate", "all", "separate"),
                                                   ("batched", "all", "batched"),
                                                   ("batched", "context", "separate")])
def test_the_record_says_which_control_row_ran(given: str, absorb: str, expected: str) -> None:
    """Records keep their options resolved (DESIGN.md "Run JSON"): "auto" becomes what ran
    (batched, a dense model with absorb all), and "batched" where it cannot be (absorb context)
    says separate."""
    from ctxpatch.core.runs import run_comparison

    loaded = _loaded("llama")
    prompt = build_prompt(loaded.tokenizer, "Some context." if absorb == "context" else "", QUERY)
    run = run_comparison(loaded, prompt, RunSpec(max_new_tokens=1, absorb=absorb,
                                                  control_row=given))
    assert run.record["settings"]["control_row"] == expected


def test_the_head_reads_its_weights_once_for_both_rows_and_is_restored() -> None:
    """`one_read_head`: the output matrix of a two-row batch as ``W @ X^T`` (float32 and float64
    on a CPU), the same logits as ``F.linear`` to rounding; only for a block, only a plain
    ``nn.Linear`` without a forward of its own (accelerate's offload sets one), and not for one
    row or 16-bit weights (there F.linear is as fast)."""
    from ctxpatch.core.forward import one_read_head

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=True).double()
    model = SimpleNamespace(get_output_embeddings=lambda: head)
    x = torch.randn(2, 1, 8, dtype=torch.float64)
    expected = torch.nn.functional.linear(x, head.weight, head.bias)
    with one_read_head(model, 2):
        assert "forward" in vars(head)
        got = head(x)
    assert "forward" not in vars(head)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-13)
    with pytest.raises(RuntimeError), one_read_head(model, 2):
        raise RuntimeError("a failing forward")
    assert "forward" not in vars(head)
    for rows, dtype in ((1, torch.float64), (2, torch.bfloat16)):
        head.to(dtype)
        with one_read_head(model, rows):
            assert "forward" not in vars(head)
    head.double()
    own = head.forward
    head.forward = own  # as accelerate's hooks do
    with one_read_head(model, 2):
        assert vars(head)["forward"] is own
    assert vars(head)["forward"] is own


def _forwards(loaded, **kw):  # type: ignore[no-untyped-def]
    """The steps of a run and how many forwards of the whole model each step made."""
    calls: list[int] = []
    handle = loaded.model.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        prompt = build_prompt(loaded.tokenizer, "", QUERY)
        steps, counts = [], []
        for step in iter_token_patches(loaded, prompt, RunSpec(max_new_tokens=TOKENS,
                                                                absorb="all", **kw)):
            steps.append(step)
            counts.append(len(calls))
            calls.clear()
    finally:
        handle.remove()
    return steps, counts


@pytest.mark.parametrize("name", sorted(["gemma3", *TINY, *ALL_LAYERS_ONLY]))
def test_one_pass_per_token_after_the_first(name: str) -> None:
    """From the second token on, the full context, the control and the patched sequence run as
    rows of one cached forward (dense families with attention layers only; MoE, recurrent and
    state-space families keep their passes), with or without the control; the patched logits
    equal the full context's (float64) and those of the separate passes."""
    loaded = _loaded(name)
    for control in (True, False):
        one, counts = _forwards(loaded, control=control)
        separate, separate_counts = _forwards(loaded, control=control, control_row="separate")
        sites = dict(enumerate(map(loaded.adapter.sites, loaded.adapter.layers(loaded.model))))
        eligible = (loaded.adapter.batch_rows and all(s.router is None for s in sites.values())
                    and attention_only(DynamicCache(config=loaded.model.config)))
        assert separate_counts == [2 + control] * TOKENS
        # the first token: the full prompt's pass, then the patched (and control) rows
        batched = batched_control(loaded, RunSpec(absorb="all", control=control), sites)
        assert counts == ([2] + [1] * (TOKENS - 1) if eligible
                          else [2 + (control and not batched)] * TOKENS)
        for a, b in zip(one, separate, strict=True):
            scale = b.logit_scale
            assert a.baseline_token == b.baseline_token
            assert a.patched.linf <= EXACT * scale
            assert abs(a.patched.linf - b.patched.linf) <= SAME * scale
            if control:
                assert abs(a.control.linf - b.control.linf) <= SAME * scale
                assert a.control.linf > 1e3 * EXACT * scale


def _post_norm_families() -> list[str]:
    """The tiny families with a down matrix under a post-norm in some layer (the stable update
    and the fit patch both)."""
    out = []
    for name in sorted(["gemma3", *TINY]):
        adapter = REGISTRY.get(_config(name).model_type)
        if adapter is not None and "scale" in adapter.output_controls \
                and "matrix" in adapter.output_controls:
            out.append(name)
    return out


@pytest.mark.parametrize("name", _post_norm_families())
@pytest.mark.parametrize("method,control", [("stable", "scale"), ("direct", "matrix")])
def test_one_pass_makes_the_down_patch_at_the_post_norm(name: str, method: str,
                                                         control: str) -> None:
    """In one pass the full context's post-norm output is known only once the post-norm has run:
    the stable update and the fit (output control "matrix" under a post-norm) make the down
    matrix's patch there. Their patched logits and patches equal the separate passes' (float64),
    and the stable update's equal the full context's (the fit leaves a residual: the scale is
    frozen, PAPER.md section 7)."""
    loaded = _loaded(name)
    sites = [loaded.adapter.sites(layer) for layer in loaded.adapter.layers(loaded.model)]
    if not any(s.out_matrix is not None and s.out_norm is not None for s in sites):
        pytest.skip("no down matrix under a post-norm")
    kw = {"method": method, "output_control": control, "control": False}
    one, counts = _forwards(loaded, **kw)
    separate, _ = _forwards(loaded, control_row="separate", **kw)
    if counts[1:] != [1] * (TOKENS - 1):
        pytest.skip("no one pass for this family")
    for a, b in zip(one, separate, strict=True):
        scale = b.logit_scale
        assert a.baseline_token == b.baseline_token
        assert method != "stable" or a.patched.linf <= EXACT * scale
        assert abs(a.patched.linf - b.patched.linf) <= SAME * scale
    a, b = _steps(loaded, **kw)[1], _steps(loaded, control_row="separate", **kw)[1]
    assert a.patches is not None and b.patches is not None and a.patches.keys() == b.patches.keys()
    for key, value in a.patches.items():
        np.testing.assert_allclose(value, b.patches[key], rtol=1e-7, atol=1e-9)


def test_a_cache_too_large_to_copy_keeps_the_passes(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Where the rows' copies of the context's cache would add more than ROWS_CACHE_SHARE of
    the weights' memory and more than ROWS_CACHE_BYTES (long contexts), every row keeps a pass
    of its own: the same results."""
    import ctxpatch.core.forward as forward

    loaded = _loaded("llama")
    one, counts = _forwards(loaded)
    assert counts == [2] + [1] * (TOKENS - 1)
    monkeypatch.setattr(forward, "ROWS_CACHE_SHARE", 0.0)
    monkeypatch.setattr(forward, "ROWS_CACHE_BYTES", 0)
    kept, kept_counts = _forwards(loaded)
    assert kept_counts == [2] * TOKENS  # (the control as a batch row of the patched pass)
    for a, b in zip(one, kept, strict=True):
        assert a.baseline_token == b.baseline_token
        assert abs(a.patched.linf - b.patched.linf) <= SAME * b.logit_scale


@pytest.mark.parametrize("name", _post_norm_families())
@pytest.mark.parametrize("method,control", [("stable", "scale"), ("direct", "matrix")])
def test_whole_runs_with_the_compiled_down_row_are_the_composed_ones(
        name: str, method: str, control: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`core.patches.down_patch_row` (the down matrix's patch of the stable update or the fit and
    its patched row in one compiled call, at the steps that patch one row) against the same
    composed from tensors and solved on torch (`patches.JIT` off), over whole float64 runs: the
    same patches and the same distance of the patched logits to the full context's; and the
    compiled call did run."""
    pytest.importorskip("numba")
    loaded = _loaded(name)
    sites = [loaded.adapter.sites(layer) for layer in loaded.adapter.layers(loaded.model)]
    if not any(s.out_matrix is not None and s.out_norm is not None for s in sites):
        pytest.skip("no down matrix under a post-norm")
    calls: list[bool] = []

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = real(*args, **kwargs)
        calls.append(out is not None)
        return out

    real = engine.down_patch_row
    monkeypatch.setattr(engine, "down_patch_row", spy)
    kw = {"method": method, "output_control": control, "control": False}
    compiled = _steps(loaded, **kw)
    assert calls and all(calls)
    monkeypatch.setattr(patches, "JIT", False)
    calls.clear()
    composed = _steps(loaded, **kw)
    assert calls and not any(calls)
    for a, b in zip(compiled, composed, strict=True):
        assert a.baseline_token == b.baseline_token
        assert abs(a.patched.linf - b.patched.linf) <= SAME * b.logit_scale
        assert a.patches is not None and b.patches is not None
        assert a.patches.keys() == b.patches.keys()
        for key, value in a.patches.items():
            np.testing.assert_allclose(value, b.patches[key], rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_compiled_down_row_in_a_model_s_own_precision(dtype: torch.dtype,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled stable update in float32 and bfloat16 models (float32 patches), the usual
    case: compiled and composed runs both reach the full context's logits to the precision's
    level, agree with each other to it, and have the same patches to float32 rounding carried
    through the layers (measured: 7e-5 of a vector's largest entry at most)."""
    pytest.importorskip("numba")
    loaded = tiny_loaded(gemma3_config(layers=4), dtype=dtype)
    runs = {}
    for jit in (True, False):
        monkeypatch.setattr(patches, "JIT", jit)
        runs[jit] = _steps(loaded, method="stable", control=False)
    exact = 1e-6 if dtype == torch.float32 else 2e-2
    for a, b in zip(runs[True], runs[False], strict=True):
        scale = b.logit_scale
        assert a.baseline_token == b.baseline_token
        assert a.patched.linf <= exact * scale and b.patched.linf <= exact * scale
        assert abs(a.patched.linf - b.patched.linf) <= exact * scale
        assert a.patches is not None and b.patches is not None
        for key, value in a.patches.items():
            size = max(float(np.abs(b.patches[key]).max()), 1e-30)
            assert float(np.abs(value - b.patches[key]).max()) <= 1e-3 * size, key
