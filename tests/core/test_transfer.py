"""Transfer (ANALYSIS.md A3), in float64 on tiny random models: the diagonal is the run's own
patched logits (R = 1, every token matches); the batched hooks give what writing step s's
patches into plain weights and running step t's reduced ids gives (Llama, Gemma 3's post-norm
scales, GPT-2's transposed Conv1D weights and biases; absorb all and context, scope
all-positions and query); the mean-patch row is the averaged patch matrices written in; a zero
patch set is the control exactly (R = 0); MoE experts' slices take the written-weights fallback."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ctxpatch.app.cli import main
from ctxpatch.core.analysis import summary_lines
from ctxpatch.core.compare import RunSpec, iter_token_patches
from ctxpatch.core.errors import Cancelled, UserError
from ctxpatch.core.prompt import build_prompt
from ctxpatch.core.record import check_record
from ctxpatch.core.transfer import hookable, iter_transfer, transfer
from ctxpatch.core.verify import patches_of_steps
from tiny import gemma3_config, llama_config, save_tiny_folder, tiny_config, tiny_loaded

import ctxpatch

CONTEXT = "The quick brown fox jumps over the lazy dog."
QUERY = "Hello world!"
TOKENS = 3


def _config(family: str):  # type: ignore[no-untyped-def]
    return gemma3_config(layers=4) if family == "gemma3" else tiny_config(family)


def _run(family: str, absorb: str, scope: str):  # type: ignore[no-untyped-def]
    loaded = tiny_loaded(_config(family))
    prompt = build_prompt(loaded.tokenizer, CONTEXT, QUERY)
    steps = list(iter_token_patches(loaded, prompt, RunSpec(
        max_new_tokens=TOKENS, absorb=absorb, scope=scope, keep_patches=True)))
    return loaded, steps


def _written(model: torch.nn.Module, dense: dict[str, torch.Tensor], ids, positions):  # type: ignore[no-untyped-def]
    """Plain weights, written by hand, and a plain forward over all of the reduced ids (scope
    all-positions: the patches act at every position)."""
    params = dict(model.named_parameters())
    saved = {name: params[name].detach().clone() for name in dense}
    try:
        with torch.no_grad():
            for name, d in dense.items():
                params[name] += d
            kwargs = {} if positions is None else {"position_ids": torch.tensor([list(positions)])}
            return model(input_ids=torch.tensor([list(ids)]), **kwargs).logits[0, -1].double()
    finally:
        with torch.no_grad():
            for name, w in saved.items():
                params[name].copy_(w)


def _dense(step) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """A step's patches as matrices in the parameters' stored orientation (u along shape[0])."""
    out: dict[str, torch.Tensor] = {}
    for key, arr in step.patches.items():
        name, part = key.rsplit(".", 1)
        if part == "delta":
            out[name] = torch.from_numpy(arr)
        elif part == "u":
            out[name] = torch.outer(torch.from_numpy(arr),
                                    torch.from_numpy(step.patches[f"{name}.v"]))
    return out


CASES = [("llama", "all", "all-positions"), ("llama", "context", "query"),
         ("llama", "context", "all-positions"), ("gemma3", "all", "all-positions"),
         ("gemma3", "context", "query"), ("gpt2", "context", "all-positions"),
         ("gpt2", "all", "query")]


@pytest.mark.parametrize("family,absorb,scope", CASES)
def test_batched_hooks_are_the_written_weights(family: str, absorb: str, scope: str) -> None:
    loaded, steps = _run(family, absorb, scope)
    pf = patches_of_steps(steps, scope)
    assert all(hookable(loaded.model, p) for p in pf.patches.values())
    batched = list(iter_transfer(loaded, steps, scope, batched=True))
    written = list(iter_transfer(loaded, steps, scope, batched=False))
    n = len(steps)
    for (t, full, rows, was_batched), (t2, full2, rows2, was2) in zip(batched, written,
                                                                      strict=True):
        assert (t, was_batched, was2) == (t2, True, False)
        assert rows.shape == (n + 2, full.shape[0])
        scale = float(full.abs().max())
        assert torch.equal(full, full2)
        assert float((rows - rows2).abs().max()) <= 1e-10 * scale
        # the diagonal: the run's own patches give the full-context logits (Gemma's norms
        # compute in float32 inside the float64 model: ~1e-8 of the scale, ANALYSIS.md A1)
        assert float((rows[t] - full).abs().max()) <= 1e-6 * scale
        # the sources move the logits away from the control (the test can see a wrong patch)
        assert float((rows[(t + 1) % n] - rows[-1]).abs().max()) > 1e-4 * scale
    if scope != "all-positions":
        return
    # an off-diagonal entry and the mean row against weights written by hand
    last = steps[-1]
    want = _written(loaded.model, _dense(steps[0]), last.reduced_input_ids,
                    last.reduced_position_ids)
    full, rows = batched[-1][1], batched[-1][2]
    scale = float(full.abs().max())
    assert float((rows[0] - want).abs().max()) <= 1e-10 * scale
    sets = [_dense(s) for s in steps]
    mean = {name: sum(d[name] for d in sets) / n for name in sets[0]}
    want = _written(loaded.model, mean, last.reduced_input_ids, last.reduced_position_ids)
    assert float((rows[n] - want).abs().max()) <= 1e-10 * scale
    control = _written(loaded.model, {}, last.reduced_input_ids, last.reduced_position_ids)
    assert float((rows[-1] - control).abs().max()) <= 1e-12 * scale


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_section_diagonal_and_a_zero_patch(family: str) -> None:
    loaded, steps = _run(family, "all", "all-positions")
    zero = dataclasses.replace(steps[1], patches={k: np.zeros_like(v)
                                                  for k, v in steps[1].patches.items()})
    steps = [steps[0], zero, *steps[2:]]
    for batched in (True, False):
        got = transfer(loaded, steps, "all-positions", batched=batched)
        assert got["batched"] is batched
        n = len(steps)
        for t in range(n):
            if t != 1:
                assert got["retained"][t][t] == pytest.approx(1.0, abs=1e-6)
                assert got["match"][t][t]
                assert got["relative_linf"][t][t] <= 1e-6
            assert got["retained"][1][t] == 0.0  # the zero patch is the control, exactly
        assert got["previous"][0] is None and got["previous_match"][0] is None
        assert got["previous"][2] == got["retained"][1][2] == 0.0
        assert len(got["mean"]) == len(got["mean_match"]) == n
        json.dumps(got, allow_nan=False)


def test_moe_experts_take_the_written_weights() -> None:
    loaded, steps = _run("mixtral", "all", "all-positions")
    pf = patches_of_steps(steps, "all-positions")
    assert any(index is not None for p in pf.patches.values() for _, index in p)
    assert not hookable(loaded.model, pf.patches[0])
    got = list(iter_transfer(loaded, steps, "all-positions", batched=True))
    assert not any(was for *_, was in got)
    for t, full, rows, _ in got:
        scale = float(full.abs().max())
        assert float((rows[t] - full).abs().max()) <= 1e-8 * scale
    section = transfer(loaded, steps, "all-positions")
    assert section["batched"] is False
    assert all(section["retained"][t][t] == pytest.approx(1.0, abs=1e-8)
               for t in range(len(steps)))


def test_progress_cancel_and_missing_patches() -> None:
    loaded, steps = _run("llama", "all", "all-positions")
    seen: list[tuple[int, int]] = []
    transfer(loaded, steps, "all-positions", progress=lambda d, t: seen.append((d, t)))
    assert seen[-1] == (len(steps), len(steps))  # (one batched pass per target)
    seen.clear()
    transfer(loaded, steps, "all-positions", batched=False,
             progress=lambda d, t: seen.append((d, t)))
    assert seen[-1] == (len(steps) * (len(steps) + 2),) * 2
    calls = iter(range(100))
    with pytest.raises(Cancelled):
        transfer(loaded, steps, "all-positions", should_stop=lambda: next(calls) >= 1)
    bare = [dataclasses.replace(s, patches=None) for s in steps]
    with pytest.raises(UserError, match="kept none"):
        transfer(loaded, bare, "all-positions")


def test_the_record_the_command_line_and_the_api(tmp_path: Path) -> None:
    folder = Path(save_tiny_folder(tmp_path / "model", llama_config(layers=2)))
    case = {"context": "Alice lives in Paris.", "query": "Where?", "max_new_tokens": 3}
    run = ctxpatch.compare(str(folder), **case, analyze=["transfer"])
    assert run.analysis is not None and set(run.analysis) == {"transfer"}
    section = run.analysis["transfer"]
    assert len(section["retained"]) == 3 and all(len(r) == 3 for r in section["retained"])
    assert section["batched"] is True
    out = tmp_path / "cli.json"
    assert main(["compare", "--model", str(folder), "--context", case["context"], "--query",
                 case["query"], "--max-new-tokens", "3", "--analyze", "transfer", "--quiet",
                 "--json", str(out)]) == 0
    cli = json.loads(out.read_text())
    check_record(cli)
    assert np.allclose(cli["analysis"]["transfer"]["retained"], section["retained"])
    lines = summary_lines(cli["analysis"])
    assert len(lines) == 1 and lines[0].startswith("transfer: ") and "diagonal 1)" in lines[0]
    broken = json.loads(out.read_text())
    broken["analysis"]["transfer"]["retained"] = "oops"
    with pytest.raises(UserError):
        check_record(broken)


def test_the_command_line_warns_of_direct_on_a_post_norm_scale(tmp_path: Path,
                                                                capsys: Any) -> None:
    """Method direct on a Gemma (output control "scale"): one warning line suggesting method
    stable; not with stable, and not on a Llama (a matrix output control)."""
    gemma = Path(save_tiny_folder(tmp_path / "gemma", gemma3_config(layers=2)))
    llama = Path(save_tiny_folder(tmp_path / "llama", llama_config(layers=2)))
    args = ["--context", "Alice lives in Paris.", "--query", "Where?", "--max-new-tokens", "1",
            "--analyze", "transfer", "--quiet"]
    said = {}
    for name, folder, method in (("gemma direct", gemma, "direct"),
                                 ("gemma stable", gemma, "stable"),
                                 ("llama direct", llama, "direct")):
        assert main(["compare", "--model", str(folder), "--method", method, *args]) == 0
        said[name] = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(said["gemma direct"]) == 1 and "--method stable" in said["gemma direct"][0]
    assert said["gemma stable"] == [] and said["llama direct"] == []


def test_a_stop_during_the_transfer_keeps_the_run_without_it() -> None:
    """A stop that comes once every token is done (during the transfer) keeps the run and its
    other analyses, and no part of the transfer (the window's and the API's cancel)."""
    from ctxpatch.core.runs import run_comparison

    loaded = tiny_loaded(llama_config(layers=2))
    prompt = build_prompt(loaded.tokenizer, "Alice lives in Paris.", "Where?")
    done: list[Any] = []
    spec = RunSpec(max_new_tokens=TOKENS, analyze=frozenset({"transfer", "geometry"}))
    run = run_comparison(loaded, prompt, spec, done.append, lambda: len(done) == TOKENS)
    assert len(run.steps) == TOKENS
    assert set(run.record["analysis"]) == {"geometry"}
    check_record(json.loads(json.dumps(run.record)))
    # the negative control: without the stop the same run holds its transfer
    whole = run_comparison(loaded, prompt, spec)
    assert set(whole.record["analysis"]) == {"geometry", "transfer"}


def test_the_command_line_says_each_transfer_pass(tmp_path: Path, capsys: Any) -> None:
    folder = Path(save_tiny_folder(tmp_path / "llama", llama_config(layers=2)))
    args = ["compare", "--model", str(folder), "--context", "Alice lives in Paris.", "--query",
            "Where?", "--max-new-tokens", "2"]
    assert main([*args, "--analyze", "transfer"]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "transfer: pass" in line]
    assert said == ["transfer: pass (1/2)", "transfer: pass (2/2)"]  # one batched pass a target
    assert main(args) == 0  # without the transfer: no such line
    assert "transfer: pass" not in capsys.readouterr().err
