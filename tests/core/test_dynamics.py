"""Context dynamics (ANALYSIS.md A5) against its ground truths, in float64 on tiny random models.

- ``P_{l,0} = 0``; ``P_{l,n}`` is a plain comparison's step-0 patches with the whole context; a
  middle prefix's patches are those of a separate comparison whose prompt has that prefix as its
  context (built here from the segments), whose first token is plain transformers' on those ids.
- The increments from the factors equal ``|P_i - P_{i-1}|_F`` of the materialised matrices
  (NumPy outer products), and they telescope (triangle inequality).
- The lens reads extra tokens exactly (the promoted tokens' own logits), and the answer's lens
  logit increments sum to the whole context's lens logit per layer.
- The command line: one clear line for a bad input; the JSON carries the contract's keys.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from ctxpatch.core.compare import iter_token_patches
from ctxpatch.core.dynamics import (
    factors_of,
    layer_distance,
    run_dynamics,
    squared_distance,
    summary_lines,
    trend,
)
from ctxpatch.core.prompt import Prompt, Segment, build_prompt
from ctxpatch.core.spec import RunSpec
from tiny import gemma3_config, tiny_config, tiny_loaded

CONTEXT = "The fox jumps."
QUERY = "Hello world!"
FAMILIES = {"llama": lambda: tiny_config("llama"), "gemma3": lambda: gemma3_config(layers=4),
            "mixtral": lambda: tiny_config("mixtral")}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def run(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    loaded = tiny_loaded(FAMILIES[request.param]())
    prompt = build_prompt(loaded.tokenizer, CONTEXT, QUERY)
    spec = RunSpec(model=loaded.spec, dtype="float64", context=CONTEXT, query=QUERY)
    return loaded, prompt, spec, run_dynamics(loaded, prompt, spec, keep_patches=True)


def _context(prompt: Prompt) -> tuple[int, ...]:
    return next(s.ids for s in prompt.segments if s.kind == "context")


def _one_step(loaded, prompt, **kw):  # type: ignore[no-untyped-def]
    spec = RunSpec(model=loaded.spec, dtype="float64", max_new_tokens=1, keep_patches=True,
                   control=False, **kw)
    return next(iter_token_patches(loaded, prompt, spec))


def _same(a, b) -> None:  # type: ignore[no-untyped-def]
    assert a.keys() == b.keys()
    for layer in a:
        assert a[layer].keys() == b[layer].keys()
        for name in a[layer]:
            for x, y in zip(a[layer][name], b[layer][name], strict=True):
                # float64 rounding, relative to each factor's scale: two runs may sum in another
                # order (torch's threads on a CPU are chosen per run: core/threads.py)
                np.testing.assert_allclose(x, y, rtol=0, atol=1e-12 * max(1.0, np.abs(y).max()))


def _materialised(factors: dict[str, tuple[np.ndarray, ...]]) -> dict[str, np.ndarray]:
    return {name: np.outer(*f) if len(f) == 2 else f[0] for name, f in factors.items()}


def test_no_context_is_a_zero_patch(run) -> None:  # type: ignore[no-untyped-def]
    loaded, prompt, spec, d = run
    n = len(_context(prompt))
    assert d.patches[0] == {} and len(d.patches) == n + 1
    assert np.all(d.norm[:, 0] == 0) and np.all(d.lens[:, 0] == 0)
    np.testing.assert_allclose(d.increment[:, 0], d.norm[:, 1], rtol=1e-12)


def test_whole_context_equals_a_plain_comparison(run) -> None:  # type: ignore[no-untyped-def]
    loaded, prompt, spec, d = run
    plain = _one_step(loaded, prompt)
    _same(d.patches[-1], factors_of(plain))
    assert d.answer == (plain.baseline_token, plain.baseline_text)
    assert d.prefix_tokens[-1] == plain.baseline_text
    assert d.norm[:, -1].max() > 0


def test_a_middle_prefix_equals_its_own_comparison(run) -> None:  # type: ignore[no-untyped-def]
    loaded, prompt, spec, d = run
    ids = _context(prompt)
    for i in (1, len(ids) // 2):
        cut = Prompt(tuple(Segment(s.kind, s.text, s.ids[:i]) if s.kind == "context" else s
                           for s in prompt.segments), bos_id=prompt.bos_id)
        step = _one_step(loaded, cut)
        _same(d.patches[i], factors_of(step))
        full = [i_ for s in prompt.segments if s.kind != "context" for i_ in s.ids][:1]
        full = [*full, *ids[:i], *next(s.ids for s in prompt.segments if s.kind == "query")]
        assert list(step.full_input_ids) == full  # (BOS, the prefix, the query)
        with torch.no_grad():  # plain transformers on the prefix's ids
            logits = loaded.model(input_ids=torch.tensor([full])).logits[0, -1]
        assert d.prefix_tokens[i - 1] == loaded.tokenizer.decode([int(logits.argmax())])


def test_increments_from_factors_equal_the_materialised_ones(run) -> None:  # type: ignore[no-untyped-def]
    loaded, prompt, spec, d = run
    n = len(d.context_ids)
    for j, layer in enumerate(d.layers):
        for i in range(1, n + 1):
            now = _materialised(d.patches[i].get(layer, {}))
            before = _materialised(d.patches[i - 1].get(layer, {}))
            diff = math.sqrt(sum(float(np.sum((now.get(k, 0.0) - before.get(k, 0.0)) ** 2))
                                 for k in {*now, *before}))
            norm = math.sqrt(sum(float(np.sum(m ** 2)) for m in now.values()))
            assert d.increment[j, i - 1] == pytest.approx(diff, rel=1e-9, abs=1e-12)
            assert d.norm[j, i] == pytest.approx(norm, rel=1e-9, abs=1e-12)
    # they telescope: |P_n| <= sum of the increments, and each step is a triangle
    assert np.all(d.norm[:, -1] <= d.increment.sum(1) * (1 + 1e-12))
    assert np.all(d.norm[:, 1:] <= d.norm[:, :-1] + d.increment + 1e-12)


def test_the_lens_logit_increments_telescope(run) -> None:  # type: ignore[no-untyped-def]
    loaded, prompt, spec, d = run
    whole = _one_step(loaded, prompt, analyze=frozenset({"lens"}))
    emitted = [whole.lens["layers"][str(layer)]["total"]["emitted"] for layer in d.layers]
    np.testing.assert_allclose(d.lens_increment.sum(1), emitted, rtol=1e-9, atol=1e-12)
    assert d.lens_logit.sum() == pytest.approx(sum(emitted), rel=1e-9, abs=1e-12)
    assert np.isfinite(d.lens).all()


def test_shares_sum_to_one(run) -> None:  # type: ignore[no-untyped-def]
    loaded, prompt, spec, d = run
    n = len(d.context_ids)
    assert d.attribution.shape == (n,) and d.attribution.sum() == pytest.approx(1.0)
    assert np.all(d.attribution >= 0)
    np.testing.assert_allclose(d.attribution_by_layer.sum(1), 1.0)
    np.testing.assert_allclose(d.attribution, d.increment.sum(0) / d.increment.sum())
    lines = summary_lines(d)
    assert repr(d.answer[1]) in lines[0] and len(lines) == 3 + min(5, n)  # (as repr)


def test_the_record_reads_back(run) -> None:  # type: ignore[no-untyped-def]
    """The JSON record (what a session stores) rebuilds the same numbers, NaN included."""
    from ctxpatch.core.dynamics_record import read_dynamics

    d = run[3]
    record = json.loads(json.dumps(d.to_dict()))
    back = read_dynamics(record)
    for name in ("norm", "increment", "lens", "attribution", "attribution_by_layer",
                 "lens_logit"):
        np.testing.assert_array_equal(getattr(back, name), getattr(d, name))
    assert (back.context_tokens, back.answer, back.layers) == (d.context_tokens, d.answer,
                                                                d.layers)
    assert back.model["class"] == type(run[0].model).__name__
    first = str(d.layers[0])
    record["layers"][first]["lens_logit"][1] = None  # (a NaN, as JSON writes it)
    assert math.isnan(read_dynamics(record).lens[0, 1])


def test_a_damaged_record_is_one_line(run) -> None:  # type: ignore[no-untyped-def]
    from ctxpatch.core.dynamics_record import read_dynamics
    from ctxpatch.core.errors import UserError

    good = json.loads(json.dumps(run[3].to_dict()))
    first = next(iter(good["layers"]))

    def broken(change) -> str:  # type: ignore[no-untyped-def]
        record = json.loads(json.dumps(good))
        change(record)
        with pytest.raises(UserError) as caught:
            read_dynamics(record, "the file x.json")
        message = str(caught.value)
        assert "\n" not in message and message.startswith("the file x.json is ")
        return message

    assert "not a context-dynamics record" in broken(lambda r: r.update(schema="other/1"))
    assert f"layers.{first}.norm" in broken(lambda r: r["layers"][first]["norm"].pop())
    assert "increment" in broken(lambda r: r["layers"][first].update(increment="x"))
    assert "prefix_tokens" in broken(lambda r: r["prefix_tokens"].append("y"))
    assert "context_ids" in broken(lambda r: r.update(context_ids=[]))
    assert "answer" in broken(lambda r: r.pop("answer"))
    # a layer written "01": passed the check, then a KeyError where it was looked up as "1"
    assert "layers" in broken(lambda r: r.update(layers={f"0{k}": v
                                                          for k, v in r["layers"].items()}))


def test_the_lens_reads_extra_tokens_exactly() -> None:
    """The lens's readout of given tokens (what dynamics reads the answer with) equals the
    promoted tokens' own logits, and leaves the emitted token's first."""
    loaded = tiny_loaded(tiny_config("llama"))
    prompt = build_prompt(loaded.tokenizer, CONTEXT, QUERY)
    plain = _one_step(loaded, prompt, analyze=frozenset({"lens"}))
    layer = plain.lens["layers"]["1"]["total"]
    ids = [t for _, _, t in layer["promoted"]]
    spec = RunSpec(model=loaded.spec, dtype="float64", max_new_tokens=1, control=False,
                   analyze=frozenset({"lens"}))
    asked = next(iter_token_patches(loaded, prompt, spec, lens_tokens=ids))
    got = asked.lens["layers"]["1"]["total"]
    assert got["tokens"][0] == got["emitted"] == pytest.approx(layer["emitted"], rel=1e-12)
    np.testing.assert_allclose(got["tokens"][1:], [v for _, v, _ in layer["promoted"]],
                               rtol=1e-12)
    assert "tokens" not in layer  # (none asked: the record as it was)


def test_rank1_difference_does_not_cancel() -> None:
    """Two patches that differ by 1e-9 of their size: the factor route keeps the difference's
    digits (the expanded |u|²|v|² + |u'|²|v'|² - 2 (u.u')(v.v') would lose all of them)."""
    g = np.random.default_rng(0)
    u, v = g.standard_normal(50), g.standard_normal(70)
    du, dv = 1e-9 * g.standard_normal(50), 1e-9 * g.standard_normal(70)
    f, h = (u + du, v + dv), (u, v)
    exact = float(np.sum((np.outer(*f) - np.outer(*h)) ** 2))
    assert squared_distance(f, h) == pytest.approx(exact, rel=1e-6, abs=0)
    assert squared_distance((-u, -v), h) == pytest.approx(0.0, abs=1e-20 * float(u @ u))
    assert squared_distance(None, h) == pytest.approx(float(u @ u) * float(v @ v))
    assert squared_distance(None, None) == 0.0
    assert layer_distance({0: {"w": h}}, {}, 0) == pytest.approx(
        float(np.linalg.norm(np.outer(u, v))))
    assert trend([4.0, 4.0, 3.0, 2.0, 1.0, 1.0]) == (4.0, 1.0)


# -- the command line and the Python API ---------------------------------------------------
def _err(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    from ctxpatch.app.cli import main

    code = main(["dynamics", *argv, "--quiet"])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ctxpatch: error: "), captured.err
    assert "Traceback" not in captured.err and not captured.out
    return lines[0]


def test_cli_bad_inputs(capsys: pytest.CaptureFixture[str], folder: Path) -> None:
    m = ["--model", str(folder)]
    assert "context is empty" in _err(capsys, [*m, "--context", "", "--query", "Hi"])
    assert "query is empty" in _err(capsys, [*m, "--context", "A fox.", "--query", " "])
    assert "would overwrite" in _err(capsys, [*m, "--context", "A fox.", "--query", "Hi",
                                              "--json", str(folder / "config.json")])
    assert "--image" in _err(capsys, [*m, "--context", "A fox.", "--query", "Hi",
                                      "--image", "x.png"])
    assert "--max-new-tokens" in _err(capsys, [*m, "--context", "A fox.", "--query", "Hi",
                                               "--max-new-tokens", "3"])
    # --report: checked like --json against the inputs, before the model loads
    ok = [*m, "--context", "A fox.", "--query", "Hi"]
    assert "would overwrite" in _err(capsys, [*ok, "--report", str(folder / "config.json")])
    assert ".html or .pdf" in _err(capsys, [*ok, "--report", "out.txt"])
    assert "name the same file" in _err(capsys, [*ok, "--json", "r.html", "--report", "r.html"])


def test_cli_json_contract(capsys: pytest.CaptureFixture[str], folder: Path,
                           tmp_path: Path) -> None:
    from ctxpatch.app.cli import main

    out = tmp_path / "d.json"
    code = main(["dynamics", "--model", str(folder), "--context", CONTEXT, "--query", QUERY,
                 "--json", str(out), "--quiet"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    data = json.loads(out.read_text())
    n = len(data["context_tokens"])
    assert n >= 3 and all(isinstance(t, str) for t in data["context_tokens"])
    assert "".join(data["context_tokens"]) == CONTEXT + "\n\n"
    assert sorted(data["layers"], key=int) == ["0", "1"]
    for entry in data["layers"].values():
        assert len(entry["norm"]) == n + 1 and entry["norm"][0] == 0
        assert len(entry["increment"]) == n and len(entry["lens_logit_increment"]) == n
    assert len(data["attribution"]) == n and sum(data["attribution"]) == pytest.approx(1.0)
    assert len(data["lens_logit"]) == n and len(data["prefix_tokens"]) == n
    assert set(data["answer"]) == {"id", "text"} and data["settings"]["max_new_tokens"] == 1
    assert len(data["seconds"]["prefix"]) == n
    assert "context tokens that moved the patches most" in captured.out
    assert "increments (summed over layers)" in captured.out
    code = main(["dynamics", "--model", str(folder), "--context", CONTEXT, "--query", QUERY,
                 "--json", "-", "--quiet"])
    captured = capsys.readouterr()
    assert code == 0 and json.loads(captured.out)["context_tokens"] == data["context_tokens"]


def test_api(folder: Path) -> None:
    import threading

    import ctxpatch

    loaded = ctxpatch.load(str(folder), dtype="float64")
    d = ctxpatch.dynamics(CONTEXT, QUERY, model=loaded)
    record = d.to_dict()
    assert record["attribution"] == pytest.approx(d.attribution.tolist())
    assert d.norm.shape == (2, len(d.context_ids) + 1) and len(d.patches) == d.norm.shape[1]
    with pytest.raises(ctxpatch.OptionError, match="max_new_tokens"):
        ctxpatch.dynamics(CONTEXT, QUERY, model=loaded, max_new_tokens=3)
    with pytest.raises(ctxpatch.OptionError, match="context is empty"):
        ctxpatch.dynamics("", QUERY, model=loaded)
    stop = threading.Event()
    seen: list[tuple[int, int]] = []

    def progress(done: int, total: int) -> None:
        seen.append((done, total))
        stop.set()

    with pytest.raises(ctxpatch.Cancelled):
        ctxpatch.dynamics(CONTEXT, QUERY, model=loaded, progress=progress, cancel=stop)
    assert seen == [(1, len(d.context_ids))]
