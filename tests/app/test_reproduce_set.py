"""``ctxpatch reproduce --prompts FILE`` on a tiny model: the grid once per (prompt, setting),
the statistics and tables, a resumed set redoing nothing finished, a folder never mixing runs
made with other options, bad rows refused up front."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
from ctxpatch.app.cli import main

pytestmark = pytest.mark.slow  # (the fast tier: pytest -m "not slow")

ROWS = [{"id": "alice", "context": "Alice lives in Paris.", "query": "Where does Alice live?"},
        {"context": "France: Paris. Japan:", "query": "Tokyo. Italy:"},
        {"id": "code", "context": "def f(x):", "query": "return"}]


def _set(tmp_path: Path, rows: list[dict[str, Any]] = ROWS) -> Path:
    path = tmp_path / "set.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _argv(model: str, prompts: Path, out: Path, *more: str) -> list[str]:
    return ["reproduce", "--model", model, "--prompts", str(prompts), "--out", str(out),
            "--max-new-tokens", "2", "--dtypes", "float32", "--sweep", "none", *more]


def test_a_set_runs_its_grid_writes_its_tables_and_resumes(
        qtbot: Any, tiny_model_dir: str, tmp_path: Path, capsys: Any) -> None:
    from ctxpatch.app import reproduce_set

    out = tmp_path / "out"
    prompts = _set(tmp_path)
    # an interrupted set: stopped after its second finished run
    finished: list[str] = []

    def stop_after_two(job: Any, record: dict[str, Any]) -> None:
        finished.append(job.name)
        if len(finished) == 2:
            raise KeyboardInterrupt

    request = reproduce_set.request(str(prompts), model=tiny_model_dir, out=out,
                                    dtypes="float32", max_new_tokens=2, sweep="none",
                                    absorb="all,context")
    with pytest.raises(KeyboardInterrupt):
        reproduce_set.execute(request, say=lambda line: None, on_record=stop_after_two)
    kept = {p.stem: p.stat().st_mtime_ns for p in (out / "runs").glob("*.json")}
    assert sorted(kept) == sorted(finished) and len(kept) == 2
    # resumed: the two finished runs are reused (untouched), the rest run once each
    capsys.readouterr()
    assert main(_argv(tiny_model_dir, prompts, out, "--absorb", "all,context")) == 0
    err = capsys.readouterr().err
    names = sorted(f"float32-{m}{a}-{p}" for m in ("direct", "stable")
                   for a in ("", "-context") for p in ("alice", "p2", "code"))
    assert sorted(p.stem for p in (out / "runs").glob("*.json")) == names
    assert err.count("reusing") == 2 and all(f"{n}: reusing" in err for n in kept)
    assert {p: (out / "runs" / f"{p}.json").stat().st_mtime_ns for p in kept} == kept
    for name in names:  # every other run exactly once
        if name not in kept:
            assert err.count(f"{name}: match") == 1, name
    # (the settings' records are exact on the tiny float32 model)
    summary = json.loads((out / "summary.json").read_text())
    stats = summary["statistics"]
    assert stats["bootstrap"]["resamples"] == 2000 and stats["bootstrap"]["seed"] == 0
    assert [s["setting"] for s in stats["settings"]] == [
        "float32-direct", "float32-direct-context", "float32-stable", "float32-stable-context"]
    for s in stats["settings"]:
        assert s["prompts"] == 3 and s["tokens"] == 6 and s["match"]["pooled"] == 1.0
        assert s["tvd"]["ci_low"] <= s["tvd"]["pooled"] <= s["tvd"]["ci_high"]
        assert len(s["worst"]) == 3
    assert [r["id"] for r in summary["prompts"]["rows"]] == ["alice", "p2", "code"]
    with open(out / "summary.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [r["setting"] for r in table] == [s["setting"] for s in stats["settings"]]
    assert float(table[0]["match_ci_low"]) == stats["settings"][0]["match"]["ci_low"]
    with open(out / "prompts.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == 12
    report = (out / "report.html").read_text()
    assert "Statistics over the prompts" in report and "2000 resamples, seed 0" in report
    assert "<td>code</td>" in report  # the set's rows are listed by id
    # every record is a valid run record, and the context setting really absorbed the context
    from ctxpatch.core.record import check_record

    record = check_record(json.loads((out / "runs" / "float32-direct-context-alice.json")
                                     .read_text()))
    assert record["settings"]["absorb"] == "context"
    assert record["settings"]["context"] == "Alice lives in Paris."


def test_a_folder_never_mixes_runs_made_with_other_options(
        tiny_model_dir: str, tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "out"
    prompts = _set(tmp_path, ROWS[:1])
    assert main(_argv(tiny_model_dir, prompts, out, "--methods", "direct")) == 0
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    argv = _argv(tiny_model_dir, prompts, out, "--methods", "direct")
    argv[argv.index("--max-new-tokens") + 1] = "3"
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was made with max_new_tokens 2, not 3" in err[0], err
    # the same id with another query: refused too
    _set(tmp_path, [{**ROWS[0], "query": "Who lives in Paris?"}])
    assert main(_argv(tiny_model_dir, prompts, out, "--methods", "direct")) == 2
    assert "was made with query" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize(("rows", "words"), [
    ([{"query": "fine"}, {"context": "no query"}], "set.jsonl, line 2: no query"),
    ([{"query": "a", "image": "nope.png"}], "set.jsonl, line 1: image 'nope.png' is not a file"),
    ([{"id": "x", "query": "a"}, {"id": "x", "query": "b"}],
     "set.jsonl, line 2: id 'x' is already the id of line 1"),
    ([{"query": "a"}, {"query": "b", "context": ""}], "set.jsonl, line 2 (float32-direct-context)"
     ": the context is empty: with absorb 'context' there is nothing to absorb (give --context"),
])
def test_bad_rows_are_refused_up_front(tiny_model_dir: str, tmp_path: Path, capsys: Any,
                                       rows: list[dict[str, Any]], words: str) -> None:
    out = tmp_path / "out"
    more = ["--absorb", "context"] if "context is empty" in words else []
    if more:
        rows = [{"query": "a", "context": "c"}, rows[1]]
    assert main(_argv(tiny_model_dir, _set(tmp_path, rows), out, *more)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not out.exists()  # nothing written


def test_ray_without_ray_says_what_to_install(tiny_model_dir: str, tmp_path: Path,
                                              capsys: Any, monkeypatch: Any) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else real(name, *a))
    assert main(_argv(tiny_model_dir, _set(tmp_path), tmp_path / "out", "--ray", "auto")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ['ctxpatch: error: --ray needs Ray, which is not installed: '
                   'pip install "ctxpatch[cluster]"']
    assert not (tmp_path / "out").exists()


def test_the_python_api_runs_a_set(qtbot: Any, tiny_model_dir: str, tmp_path: Path) -> None:
    import ctxpatch

    lines: list[str] = []
    result = ctxpatch.reproduce(str(_set(tmp_path, ROWS[:2])), model=tiny_model_dir,
                                out=tmp_path / "out", dtypes=["float32"], methods="direct",
                                max_new_tokens=2, sweep="none", resamples=500, seed=3,
                                progress=lines.append)
    assert result.report.is_file() and len(lines) == 2
    stats = result.statistics
    assert stats["bootstrap"]["resamples"] == 500 and stats["bootstrap"]["seed"] == 3
    assert [s["setting"] for s in stats["settings"]] == ["float32-direct"]
    with pytest.raises(ctxpatch.OptionError, match="line 2: no query"):
        ctxpatch.reproduce(str(_set(tmp_path, [{"query": "a"}, {"context": "b"}])),
                           out=tmp_path / "bad")
    with pytest.raises(ctxpatch.OptionError, match="unknown option 'tokens'"):
        ctxpatch.reproduce(5, out=tmp_path / "bad", tokens=3)
    assert not (tmp_path / "bad").exists()
    import threading

    stop = threading.Event()
    stop.set()  # a cancel is `ctxpatch.Cancelled`, as from every other API call (it was a
    with pytest.raises(ctxpatch.Cancelled):  # KeyboardInterrupt, a BaseException)
        ctxpatch.reproduce(str(_set(tmp_path, ROWS[:2])), model=tiny_model_dir,
                           out=tmp_path / "stopped", dtypes="float32", methods="direct",
                           max_new_tokens=2, sweep="none", cancel=stop)


@pytest.mark.parametrize("where", ["the set's folder", "the model's folder", "inside the model"])
def test_an_output_folder_over_what_the_set_reads_is_refused(
        tiny_model_dir: str, tmp_path: Path, capsys: Any, where: str) -> None:
    """The set writes summary.csv, prompts.csv and the runs into --out: a folder that holds the
    prompt set (a user's prompts.csv was overwritten by the statistics) or is, or lies in, the
    model's folder is refused before any run, and nothing is written."""
    prompts = tmp_path / "prompts.csv"
    with prompts.open("w", encoding="utf-8", newline="") as f:
        csv.writer(f).writerows([["query"], ["Where does Alice live?"]])
    kept = prompts.read_bytes()
    out = {"the set's folder": tmp_path, "the model's folder": Path(tiny_model_dir),
           "inside the model": Path(tiny_model_dir) / "runs"}[where]
    before = sorted(p.name for p in out.parent.rglob("*"))
    assert main(_argv(tiny_model_dir, prompts, out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "which the set reads: give a folder of its own" in err[0], err
    assert prompts.read_bytes() == kept and sorted(p.name for p in out.parent.rglob("*")) == before


@pytest.mark.parametrize(("option", "value"), [("--resamples", "1000000000"),
                                               ("--resamples", "99"), ("--seed", "-1")])
def test_absurd_statistics_options_are_refused_before_any_run(
        tiny_model_dir: str, tmp_path: Path, capsys: Any, option: str, value: str) -> None:
    out = tmp_path / "out"
    assert main(_argv(tiny_model_dir, _set(tmp_path), out, option, value)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{option} must be a whole number from" in err[0], err
    assert not out.exists()


def test_another_set_in_the_same_folder_is_refused_before_its_grid(
        tiny_model_dir: str, tmp_path: Path, capsys: Any) -> None:
    """A second set whose ids differ from the first's but whose start-layer sweep would reuse
    the first's sweep runs: refused before any run (it ran its whole grid into the folder,
    then failed at the sweep)."""
    out = tmp_path / "out"
    first = _set(tmp_path, ROWS[:1])
    argv = ["reproduce", "--model", tiny_model_dir, "--prompts", str(first), "--out", str(out),
            "--max-new-tokens", "2", "--dtypes", "float32", "--methods", "direct",
            "--sweep", "1"]
    assert main(argv) == 0
    runs = sorted(p.name for p in (out / "runs").iterdir())
    second = tmp_path / "other.jsonl"
    second.write_text(json.dumps({"id": "other", "query": "Who lives in Paris?"}) + "\n",
                      encoding="utf-8")
    capsys.readouterr()
    for sweep in ("1", None):  # given, or the default's (found among the saved runs)
        more = argv[:4] + [str(second)] + argv[5:]
        if sweep is None:
            more = more[:-2]
        assert main(more) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "sweep-s1" in err[0], err
        assert sorted(p.name for p in (out / "runs").iterdir()) == runs
