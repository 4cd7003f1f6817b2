"""Bad input to ``ctxpatch compile`` and ``ctxpatch.compile`` (issue 33): one line, exit 2,
nothing written, refused before any fit (before the model loads, except the rank against the
model's matrices, checked right after it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ctxpatch.app.cli import main

CONTEXT = "Zorblat is a small village."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tiny import save_tiny_folder

    return str(save_tiny_folder(tmp_path_factory.mktemp("tiny-llama")))


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _refused(capsys: Any, out: Path, argv: list[str], words: str, model_dir: str) -> None:
    before = _files(out)
    rc = main(["compile", "--model", model_dir, "--context", CONTEXT, *argv,
               "--json", str(out / "c.json"), "--report", str(out / "c.html"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("ctxpatch: error: "), err
    assert words in err, err
    assert _files(out) == before  # nothing written: no JSON, no report, no adapter folder


GOOD = ["--query", "Zorblat is famous for", "--held-out", "The quick brown fox"]


@pytest.mark.parametrize("argv, words", [
    (["--rank", "0", *GOOD], "--rank must be at least 1, not 0"),
    (["--rank", "-3", *GOOD], "--rank must be at least 1"),
    (["--ridge", "-1", *GOOD], "--ridge must be a finite number >= 0"),
    (["--ridge", "nan", *GOOD], "--ridge must be a finite number >= 0"),
    (["--ridge", "inf", *GOOD], "--ridge must be a finite number >= 0"),
    (["--query", "Zorblat is famous for"], "--held-out: give at least one held-out query"),
    (["--query", "Zorblat is famous for", "--held-out", "  "], "--held-out: give at least one"),
    (["--query", " ", "--held-out", "x"], "--query: give at least one training query"),
    (["--sweep", "1,x,4", *GOOD], "--sweep: 'x' is not a rank"),
    (["--sweep", "0,2", *GOOD], "--sweep must be at least 1, not 0"),
    (["--max-new-tokens", "0", *GOOD], "max new tokens must be between 1"),
])
def test_bad_input_is_one_line_and_writes_nothing(argv: list[str], words: str, capsys: Any,
                                                  tmp_path: Path, model_dir: str) -> None:
    _refused(capsys, tmp_path, argv, words, model_dir)


def test_an_adapter_folder_that_exists_or_is_an_input_is_refused(
        capsys: Any, tmp_path: Path, model_dir: str) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    for folder, words in ((tmp_path / "empty", "already exists"),
                          (tmp_path / "full", "already exists"),
                          (tmp_path / "file", "is a file"),
                          (tmp_path / "nowhere" / "lora", "does not exist"),
                          (Path(model_dir), "which this run reads"),
                          (Path(model_dir) / "lora", "which this run reads"),
                          (Path(model_dir).parent, "which this run reads")):
        model_files = _files(Path(model_dir))
        _refused(capsys, tmp_path, [*GOOD, "--adapter", str(folder)], words, model_dir)
        assert _files(Path(model_dir)) == model_files
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"


def test_a_rank_above_the_matrices_is_refused_before_the_fit(
        capsys: Any, tmp_path: Path, model_dir: str) -> None:
    # the tiny Llama: d_model 32, d_ff 64, so no delta has a rank above 32
    _refused(capsys, tmp_path, [*GOOD, "--rank", "33", "--adapter", str(tmp_path / "lora")],
             "--rank 33 is above the size of this model's matrices (a delta's rank is at most "
             "32): choose 1 to 32", model_dir)
    _refused(capsys, tmp_path, [*GOOD, "--sweep", "8,64"], "--sweep 64 is above", model_dir)


def test_a_bad_report_name_is_refused_before_the_model_loads(
        capsys: Any, tmp_path: Path) -> None:
    rc = main(["compile", "--model", str(tmp_path / "no-such-model"), "--context", CONTEXT,
               *GOOD, "--report", str(tmp_path / "c.txt")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "must end in .html or .pdf" in err
    assert _files(tmp_path) == set()


def test_the_python_api_refuses_in_one_line(model_dir: str) -> None:
    from tiny import llama_config, tiny_loaded

    import ctxpatch

    loaded = tiny_loaded(llama_config())
    for kwargs, words in (({}, "held_out: give at least one held-out query"),
                          ({"held_out": "x", "rank": 0}, "rank must be at least 1"),
                          ({"held_out": "x", "ridge": -0.5}, "ridge must be a finite number"),
                          ({"held_out": "x", "rank": 40}, "rank 40 is above the size")):
        with pytest.raises(ctxpatch.OptionError) as info:
            ctxpatch.compile(CONTEXT, "Zorblat is famous for", model=loaded, **kwargs)
        assert words in str(info.value) and "\n" not in str(info.value)
    # the core's own entry point stays permissive (a rank above the matrices is full rank)
    from ctxpatch.core.compile import compile_context

    full = compile_context(loaded, CONTEXT, ["Zorblat is famous for"], rank=64, ridge=0.0,
                           max_new_tokens=1)
    assert full.rank == 64


def test_a_mixture_of_experts_model_is_refused_in_one_line(capsys: Any, tmp_path: Path) -> None:
    from tiny import save_tiny_folder, tiny_config

    folder = save_tiny_folder(tmp_path / "moe", tiny_config("mixtral"))
    out = tmp_path / "out"
    out.mkdir()
    _refused(capsys, out, [*GOOD, "--adapter", str(out / "lora")], "mixture-of-experts",
             str(folder))
