"""Issue 36 (reliability, round three): the command line's and the library's writes. Each test
fails before its fix."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from ctxpatch.app.cli import main
from ctxpatch.core.errors import UserError
from ctxpatch.core.export import write_text
from ctxpatch.core.outputs import check_report
from tiny import save_tiny_folder


def test_a_rewrite_keeps_a_private_file_private(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    out.write_text("old")
    out.chmod(0o600)
    write_text(out, "new")
    assert out.read_text() == "new" and stat.S_IMODE(out.stat().st_mode) == 0o600
    fresh = tmp_path / "fresh.json"
    write_text(fresh, "x")  # a new file: a normal file's mode under the umask
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o666 & ~umask


def test_a_write_through_a_symlink_keeps_the_link(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    real = tmp_path / "real" / "run.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_text(link, "new")
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_text() == "new"
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["run.json"]  # no temporary


# -- the report (cases 4, 6, 22) -------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_folder(tmp_path_factory.mktemp("m") / "model")


def _compare(model: Path, *more: str) -> list[str]:
    return ["compare", "--model", str(model), "--context", "a b c", "--query", "d e",
            "--max-new-tokens", "2", "--quiet", *more]


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def test_the_plots_never_replace_an_input(model: Path, tmp_path: Path) -> None:
    """`--report in/X.html` puts its plots in in/X_plots/: refused, before any work, when that
    folder holds a file the run reads (here the model itself is in it)."""
    inside = tmp_path / "X_plots"
    shutil.copytree(model, inside)
    before = _tree(tmp_path)
    assert main(_compare(inside, "--report", str(tmp_path / "X.html"))) == 2
    assert _tree(tmp_path) == before
    with pytest.raises(UserError, match="which holds"):
        check_report(str(tmp_path / "X.html"), [str(inside / "config.json")])
    assert check_report(str(tmp_path / "Y.html"), [str(inside / "config.json")]) == \
        tmp_path / "Y_plots"


@pytest.mark.parametrize("name", ["r.png", "r.txt", "r"])
def test_a_report_name_that_is_neither_html_nor_pdf_is_refused(model: Path, tmp_path: Path,
                                                               capsys: Any, name: str) -> None:
    assert main(_compare(model, "--report", str(tmp_path / name))) == 2
    assert "must end in .html or .pdf" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_report_leaves_the_previous_one(model: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl+C while the plots are written: the previous report and plots stay as they were and
    no temporary is left (before: X_plots/ half rewritten, sometimes a .tmp inside)."""
    report = tmp_path / "X.html"
    assert main(_compare(model, "--report", str(report))) == 0
    before = _tree(tmp_path)
    assert "X.html" in before and any(k.startswith("X_plots/") for k in before)
    real = Path.write_bytes
    calls = []

    def interrupted(self: Path, data: bytes) -> int:
        calls.append(self)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", interrupted)
    assert main(_compare(model, "--context", "x y z", "--report", str(report))) == 130
    monkeypatch.undo()
    assert _tree(tmp_path) == before and len(calls) == 3


def test_a_failed_move_puts_the_previous_report_back(model: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The report's last move fails (a full disk): the plots already moved are taken back, a
    file of the user's in the plots folder stays, the previous report is intact."""
    from ctxpatch.core import export

    report = tmp_path / "X.html"
    assert main(_compare(model, "--report", str(report))) == 0
    (tmp_path / "X_plots" / "notes.txt").write_text("mine")
    before = _tree(tmp_path)
    real = export.install

    def full(tmp: Any, path: Any) -> None:
        if Path(path).name == "X.html":
            raise OSError(28, "No space left on device")
        real(tmp, path)

    monkeypatch.setattr(export, "install", full)
    assert main(_compare(model, "--context", "x y z", "--report", str(report))) == 2
    assert _tree(tmp_path) == before


@pytest.mark.slow
def test_sigterm_leaves_the_whole_report_or_none(model: Path, tmp_path: Path) -> None:
    """SIGTERM at any moment of a run with a report (late ones land while the plots and the
    report are written): exit 143, and either the report with all its plots or nothing; no
    temporary, no traceback."""
    def start(out: Path) -> subprocess.Popen[str]:
        out.mkdir()
        return subprocess.Popen([sys.executable, "-m", "ctxpatch.app",
                                 *_compare(model, "--report", str(out / "X.html"))],
                                stderr=subprocess.PIPE, text=True)

    def files(out: Path) -> list[str]:
        return sorted(str(p.relative_to(out)) for p in out.rglob("*"))

    began = time.monotonic()
    whole = start(tmp_path / "whole")
    assert whole.wait(timeout=300) == 0
    wall = time.monotonic() - began
    complete = files(tmp_path / "whole")
    assert "X.html" in complete and len(complete) > 2
    for fraction in (0.5, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98):
        out = tmp_path / f"at{fraction}"
        child = start(out)
        time.sleep(wall * fraction)
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=300)
        assert "Traceback" not in err, err
        # 0: it had finished; -15: killed while Python started or shut down (before the
        # command began, or after its outputs were whole)
        assert child.returncode in (0, 143, -signal.SIGTERM), (child.returncode, err)
        assert files(out) in ([], complete), (fraction, child.returncode, files(out))


# -- loading (cases 9, 13, 23, 24, 26) -------------------------------------------------------
def _variant(model: Path, tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    shutil.copytree(model, out)
    return out


def _one_line(capsys: Any) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err  # no transformers report, no bar, no traceback
    return err


def test_pickled_weights_need_the_flag_whatever_else_is_in_the_folder(
        model: Path, tmp_path: Path, capsys: Any) -> None:
    """Case 9: a patches file saved in the folder used to let pytorch_model.bin load unasked:
    the refusal looked at the folder, not at what transformers loads."""
    import torch
    from safetensors.torch import load_file

    folder = _variant(model, tmp_path, "pickled")
    weights = load_file(folder / "model.safetensors")
    torch.save(weights, folder / "pytorch_model.bin")
    (folder / "model.safetensors").rename(folder / "patches.safetensors")
    assert main(_compare(folder)) == 2
    assert "only pickled weights (pytorch_model.bin)" in _one_line(capsys)
    assert main(_compare(folder, "--allow-pickle")) == 0


def test_a_malicious_pickle_is_named_as_such(model: Path, tmp_path: Path, capsys: Any) -> None:
    """Case 24: weights-only loading stops a pickle that runs code; it was called "damaged",
    with PyTorch's advice to set weights_only=False."""
    import torch

    class Payload:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    folder = _variant(model, tmp_path, "evil")
    (folder / "model.safetensors").unlink()
    torch.save({"x": Payload()}, folder / "pytorch_model.bin")
    assert main(_compare(folder, "--allow-pickle")) == 2
    err = _one_line(capsys)
    assert "refuses (code, not only tensors)" in err and "weights_only" not in err
    assert not (tmp_path / "ran").exists()


def test_a_tokenizer_with_its_own_code_asks_for_trust(model: Path, tmp_path: Path,
                                                      capsys: Any) -> None:
    """Case 24: a tokenizer with auto_map code was called "damaged or incomplete"."""
    import json

    folder = _variant(model, tmp_path, "own_tokenizer")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(auto_map={"AutoTokenizer": ["tok.MyTokenizer", None]},
                  tokenizer_class="MyTokenizer")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "tok.py").write_text("from transformers import PreTrainedTokenizerFast\n\n\n"
                                   "class MyTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    assert main(_compare(folder)) == 2
    assert "ships its own tokenizer code" in _one_line(capsys)


@pytest.mark.parametrize("change", [{"intermediate_size": 128}, {"hidden_size": 10**9}])
def test_a_config_that_does_not_match_the_weights(model: Path, tmp_path: Path, capsys: Any,
                                                  change: dict[str, int]) -> None:
    """Case 13: a transformers table, then "internal error: RuntimeError: You set
    `ignore_mismatched_sizes` to `False`"."""
    import json

    folder = _variant(model, tmp_path, "mismatch")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    assert main(_compare(folder)) == 2
    assert "does not match its weights" in _one_line(capsys)


def test_a_missing_tensor_is_one_line_without_the_load_report(model: Path, tmp_path: Path,
                                                              capsys: Any) -> None:
    """Case 23: the one-line refusal came after transformers' 7-line load table."""
    from safetensors.torch import load_file, save_file

    folder = _variant(model, tmp_path, "missing")
    weights = load_file(folder / "model.safetensors")
    weights.pop(next(k for k in weights if "down_proj" in k))
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    assert main(_compare(folder)) == 2
    assert "lacks model.layers.0.mlp.down_proj.weight" in _one_line(capsys)


def test_an_over_long_prompt_is_refused_before_the_weights_load(
        model: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Case 26: the tokenizer alone knows the length; the weights are never read."""
    from ctxpatch.core import loading

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(loading, "_load_model", never)
    argv = _compare(model)
    argv[argv.index("--context") + 1] = " ".join(["a"] * 3000)  # 512 positions
    assert main(argv) == 2
    assert "input too long: at least" in _one_line(capsys)


# -- float64 MoE from a saved folder (case 19) ---------------------------------------------
def _moe_families() -> list[str]:
    from tiny import TINY, tiny_config

    def experts(config: Any) -> int:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return max(int(getattr(text, k, 0) or 0) for k in
                   ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"))

    return [name for name in TINY if experts(tiny_config(name)) > 1]


@pytest.mark.parametrize("family", _moe_families())
def test_every_moe_family_loads_in_float64_from_a_folder(family: str, tmp_path: Path) -> None:
    """Case 19: float64 loads got eager experts only where the adapter lists an "experts"
    output control (Granite 4.0 hybrid lists "matrix": "Expected mat_a to be Float32..."); the
    tests built models in memory, so the loading rule never ran."""
    import torch
    from ctxpatch.core.loading import load_model
    from ctxpatch.core.runs import compare
    from ctxpatch.core.spec import RunSpec
    from tiny import tiny_config, tiny_loaded

    made = tiny_loaded(tiny_config(family), dtype=torch.float32)
    made.model.save_pretrained(tmp_path / family)
    made.tokenizer.save_pretrained(tmp_path / family)
    loaded = load_model(str(tmp_path / family), dtype="float64")
    done = compare(loaded, RunSpec(model=str(tmp_path / family), dtype="float64",
                                   context="a b c", query="d e", max_new_tokens=2,
                                   absorb="all"))
    assert all(s.patched.match and s.patched.linf <= 1e-6 * s.logit_scale for s in done.steps)


# -- pictures and saved runs (cases 17, 18) ----------------------------------------------------
@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="Linux's /proc")
def test_a_regular_file_that_cannot_be_read_is_one_line(model: Path, capsys: Any) -> None:
    assert main(_compare(model, "--image", "/proc/self/mem")) == 2
    assert "cannot read /proc/self/mem" in _one_line(capsys)


def test_a_pipe_is_never_opened_as_a_picture(tmp_path: Path) -> None:
    from ctxpatch.core.images import read_image

    os.mkfifo(tmp_path / "pipe.png")
    with pytest.raises(UserError, match="not a file"):
        read_image(tmp_path / "pipe.png")  # (a regression blocks here: the open waits)


def test_a_damaged_saved_run_is_redone(model: Path, tmp_path: Path) -> None:
    """Case 17: a reproduction's run record that is JSON but damaged (``{"steps": [1, 2]}``)
    raised KeyError on resuming; it is now redone, as a missing one is."""
    import json

    from ctxpatch.core import experiments as ex

    jobs = [j for j in ex.grid(1, ["float32"], []) if j.method == "direct"]
    said: list[str] = []
    first = ex.run_grid(str(model), tmp_path, jobs, 1, say=said.append)
    for path in (tmp_path / "runs").glob("*.json"):
        path.write_text(json.dumps({"steps": [1, 2]}))
    again = ex.run_grid(str(model), tmp_path, jobs, 1, say=said.append)
    assert not any("reusing" in line for line in said)
    assert [r["steps"][0]["patched_token"] for r in again.values()] == \
        [r["steps"][0]["patched_token"] for r in first.values()]


def test_bytes_that_are_not_utf8_are_one_line_before_the_load(
        model: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Case 14: `--context $'\\xff'` reaches Python as a lone surrogate (surrogateescape); it
    was an internal TypeError from the tokenizer."""
    from ctxpatch.core import loading

    monkeypatch.setattr(loading, "_load_model", lambda *a, **k: pytest.fail("loaded"))
    argv = _compare(model)
    argv[argv.index("--context") + 1] = b"caf\xff".decode("utf-8", "surrogateescape")
    assert main(argv) == 2
    assert "context is not valid text (it holds bytes that are not UTF-8)" in _one_line(capsys)
