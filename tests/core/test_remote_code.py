"""Model code shipped with a checkpoint runs only on the user's explicit opt-in
(``--trust-remote-code``); a remote-code model that extends a supported family is then exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ctxpatch.app.cli import main
from tiny import save_tiny_folder

REMOTE_CODE = '''
import os
from pathlib import Path

Path(os.environ["CTXPATCH_REMOTE_MARKER"]).touch()  # proof that this file was executed

from transformers import LlamaConfig, LlamaForCausalLM


class RemoteLlamaConfig(LlamaConfig):
    model_type = "remote_llama"


class RemoteLlamaForCausalLM(LlamaForCausalLM):
    config_class = RemoteLlamaConfig
'''


@pytest.fixture
def remote_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    folder = Path(save_tiny_folder(tmp_path / "remote"))
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="remote_llama", architectures=["RemoteLlamaForCausalLM"],
                  auto_map={"AutoConfig": "remote_code.RemoteLlamaConfig",
                            "AutoModelForCausalLM": "remote_code.RemoteLlamaForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "remote_code.py").write_text(REMOTE_CODE)
    marker = tmp_path / "executed"
    monkeypatch.setenv("CTXPATCH_REMOTE_MARKER", str(marker))
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    return folder, marker


def _compare(folder: Path, *extra: str) -> list[str]:
    return ["compare", "--model", str(folder), "--context", "Alice lives in Paris.", "--query",
            "Where?", "--max-new-tokens", "3", "--quiet", *extra]


def test_remote_code_never_runs_without_the_flag(capsys: pytest.CaptureFixture[str],
                                                 remote_folder: tuple[Path, Path]) -> None:
    folder, marker = remote_folder
    capsys.readouterr()
    assert main(_compare(folder)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--trust-remote-code" in err[0], err
    assert not marker.exists()


def test_trusted_remote_code_extending_llama_is_exact(capsys: pytest.CaptureFixture[str],
                                                      remote_folder: tuple[Path, Path]) -> None:
    folder, marker = remote_folder
    assert main(_compare(folder, "--trust-remote-code")) == 0
    assert marker.exists()
    assert "token match 3/3" in capsys.readouterr().out
