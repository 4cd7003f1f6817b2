"""Bad input on the command line: exit status 2 and one clear line, no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ctxpatch.app.cli import main
from tiny import gemma3_config, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny Gemma 3 model folder with its tokenizer."""
    from tiny import save_tiny_folder

    return Path(save_tiny_folder(tmp_path_factory.mktemp("tiny-gemma3"), gemma3_config()))


def _err(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    code = main([*argv, "--quiet"] if argv[0] == "compare" else argv)
    captured = capsys.readouterr()
    assert code == 2, captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("ctxpatch: error: ")
    assert "Traceback" not in captured.err and not captured.out
    return lines[0]


def test_unknown_model_id(capsys: pytest.CaptureFixture[str]) -> None:
    line = _err(capsys, ["compare", "--model", "nobody/no-such-model-xyz", "--context", "c",
                         "--query", "hi"])
    assert "not found" in line


def test_missing_folder(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    line = _err(capsys, ["compare", "--model", str(tmp_path / "missing"), "--context", "c",
                         "--query", "hi"])
    assert "no such folder" in line


def test_folder_without_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    line = _err(capsys, ["compare", "--model", str(tmp_path), "--context", "c", "--query", "hi"])
    assert "config.json" in line


@pytest.mark.parametrize("kind", ["encoder-only", "state-space"])
def test_unsupported_architecture_names_supported(capsys: pytest.CaptureFixture[str],
                                                  tmp_path: Path, kind: str) -> None:
    from transformers import BertConfig, MambaConfig

    if kind == "encoder-only":
        config = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=8)
    else:
        config = MambaConfig(hidden_size=32, num_hidden_layers=1, vocab_size=64)
    config.save_pretrained(tmp_path)
    line = _err(capsys, ["compare", "--model", str(tmp_path), "--context", "c", "--query", "hi"])
    assert "unsupported architecture" in line
    for family in ("Gemma 2 / Gemma 3", "Llama", "GPT-2", "Falcon", "OLMo 2"):
        assert family in line


def test_empty_query_with_absorb_context(capsys: pytest.CaptureFixture[str],
                                         tiny_folder: Path) -> None:
    line = _err(capsys, ["compare", "--model", str(tiny_folder), "--context", "The fox.",
                         "--query", ""])
    assert "query is empty" in line


@pytest.mark.parametrize("spec", ["x", "1:2:3", "99", "3,,", "-99:", ","])
def test_malformed_layers(capsys: pytest.CaptureFixture[str], tiny_folder: Path, spec: str) -> None:
    line = _err(capsys, ["compare", "--model", str(tiny_folder), "--absorb", "all",
                         "--query", "The fox.", f"--layers={spec}"])
    assert "layer" in line


def test_bad_option_value(capsys: pytest.CaptureFixture[str]) -> None:
    line = _err(capsys, ["compare", "--method", "magic"])
    assert "magic" in line


def test_unreadable_patches_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "p.safetensors"
    bad.write_bytes(b"\x00not a safetensors file")
    line = _err(capsys, ["verify", str(bad)])
    assert "cannot read patches file" in line
    line = _err(capsys, ["verify", str(tmp_path / "missing.safetensors")])
    assert "no such patches file" in line


def test_unwritable_output(capsys: pytest.CaptureFixture[str], tiny_folder: Path,
                           tmp_path: Path) -> None:
    line = _err(capsys, ["compare", "--model", str(tiny_folder), "--absorb", "all",
                         "--query", "The fox.", "--max-new-tokens", "1",
                         "--json", str(tmp_path / "nope" / "run.json")])
    assert "cannot write" in line


def test_compare_and_verify_end_to_end(capsys: pytest.CaptureFixture[str], tiny_folder: Path,
                                       tmp_path: Path) -> None:
    out, patches = tmp_path / "run.json", tmp_path / "p.safetensors"
    code = main(["compare", "--model", str(tiny_folder), "--dtype", "float64",
                 "--context", "The quick brown fox.", "--query", "Hello world!",
                 "--max-new-tokens", "3", "--json", str(out),
                 "--save-patches", str(patches), "--csv", str(tmp_path / "s.csv"), "--quiet"])
    assert code == 0
    run = json.loads(out.read_text())
    assert run["schema_version"] == 1
    assert run["settings"]["absorb"] == "context" and run["settings"]["dtype"] == "float64"
    assert len(run["steps"]) == 3 and all(s["match"] for s in run["steps"])
    assert set(run["steps"][0]) >= {"baseline_token", "patched_token", "match", "linf", "tvd",
                                    "control", "top_k", "patch_norms"}
    norms = run["steps"][0]["patch_norms"]["0"]
    assert "model.layers.0.mlp.gate_proj.weight" in norms
    assert "model.layers.0.post_feedforward_layernorm.weight" in norms
    assert run["prompt"]["reduced_input_ids"] == [i for s in run["prompt"]["segments"]
                                                  if s["kind"] != "context" for i in s["ids"]]
    capsys.readouterr()
    assert main(["verify", str(patches), "--model", str(tiny_folder)]) == 0
    assert capsys.readouterr().out.startswith("verified: 3/3 tokens match")


def test_core_never_imports_qt() -> None:
    code = ("import sys, ctxpatch.core.compare, ctxpatch.core.engine, ctxpatch.core.export, "
            "ctxpatch.core.verify, ctxpatch.core.loading;"
            "bad=[m for m in sys.modules if m.startswith(('PySide6','pyqtgraph','PyQt'))];"
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_cli_start_does_not_import_torch() -> None:
    code = "import sys, ctxpatch.app.cli; sys.exit(1 if 'torch' in sys.modules else 0)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_compare_reports_controllability_and_a_frozen_output(capsys: pytest.CaptureFixture[str],
                                                              tiny_folder: Path,
                                                              tmp_path: Path) -> None:
    import json

    out = tmp_path / "run.json"
    code = main(["compare", "--model", str(tiny_folder), "--context", "The fox.",
                 "--query", "Hello", "--max-new-tokens", "3", "--disable", "output",
                 "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "output none (frozen)" in captured.err and "conditions:" in captured.err
    record = json.loads(out.read_text())
    plans = record["controllability"]["plan"]
    assert [p["layer"] for p in plans] == list(range(len(plans))) and plans[0]["outputs"] == []
    assert plans[0]["frozen_bound"] > 0
    assert set(record["controllability"]["outcome"]) == {str(p["layer"]) for p in plans}
    assert record["settings"]["disabled"] == ["output"]


@pytest.mark.slow
def test_bench_prints_ratios_last(capsys: pytest.CaptureFixture[str], tiny_folder: Path) -> None:
    """The bench's figures (not timed assertions): the last stdout line is JSON with both ratios."""
    code = main(["bench", "--model", str(tiny_folder), "--context", "The fox.", "--query", "Hi",
                 "--max-new-tokens", "3", "--repeats", "1", "--quiet"])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    result = json.loads(out[-1])
    assert result["time_ratio"] > 0 and result["memory_ratio"] > 0
    assert result["generate_s"] > 0 and result["memory"]["compare"]["peak_bytes"] > 0
    assert result["settings"]["control_row"] == "separate"  # what ran (absorb context), not auto
    assert main(["bench", "--model", str(tiny_folder), "--query", "q", "--absorb", "all",
                 "--repeats", "0"]) == 2


def test_pickled_weights_are_refused_unless_allowed(capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Path) -> None:
    from tiny import tiny_loaded

    loaded = tiny_loaded(gemma3_config(), dtype=__import__("torch").float32)
    torch = __import__("torch")
    loaded.model.config.save_pretrained(tmp_path)  # weights as a pickle, as older checkpoints
    torch.save(loaded.model.state_dict(), tmp_path / "pytorch_model.bin")
    tiny_tokenizer().save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors")) and list(tmp_path.glob("*.bin"))
    line = _err(capsys, ["compare", "--model", str(tmp_path), "--context", "c", "--query", "hi"])
    assert "only pickled weights" in line and "--allow-pickle" in line
    code = main(["compare", "--model", str(tmp_path), "--context", "The fox.", "--query", "Hi",
                 "--max-new-tokens", "2", "--quiet", "--allow-pickle"])
    assert code == 0, capsys.readouterr().err


def test_out_of_memory_is_one_line_with_what_to_do(capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from ctxpatch.core import loading as core_loading

    def no_memory(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(core_loading, "load_model", no_memory)
    line = _err(capsys, ["compare", "--context", "c", "--query", "hi"])
    assert "out of memory" in line and "bfloat16" in line


def test_a_closed_pipe_is_not_an_error(tiny_folder: Path) -> None:
    """`ctxpatch compare ... | head -1`: the reader leaves early; no 'internal error'."""
    cmd = (f"{sys.executable} -m ctxpatch compare --model {tiny_folder} --context 'The fox.' "
           "--query Hello --max-new-tokens 2 --quiet | head -1")
    out = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.stdout.startswith("baseline (with context):")
    assert "internal error" not in out.stderr and "Broken pipe" not in out.stderr
    assert out.returncode == 0, out.stderr


def test_truncated_weights_are_named_damaged(capsys: pytest.CaptureFixture[str],
                                             tiny_folder: Path, tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_folder, broken)
    weights = broken / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    line = _err(capsys, ["compare", "--model", str(broken), "--context", "c", "--query", "q"])
    assert "weights of" in line and "damaged or incomplete" in line


def test_a_context_longer_than_the_model_is_one_line(capsys: pytest.CaptureFixture[str],
                                                     tiny_folder: Path) -> None:
    line = _err(capsys, ["compare", "--model", str(tiny_folder), "--context", "word " * 600,
                         "--query", "q"])
    assert "input too long" in line and "positions" in line
