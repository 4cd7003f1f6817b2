"""The bad-input battery in the window (issue 8): every case is one line in the banner, the
window stays usable, nothing typed is lost, and the next good run works."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from ctxpatch.app.main_window import MainWindow
from windows import open_window, run_to_end

N = 3


@pytest.fixture
def window(qtbot: Any, keep: Any, settings: Any, tiny_model_dir: str) -> MainWindow:
    return open_window(keep, settings, tiny_model_dir, "Alice lives in Paris.",
                       "Where does Alice live?", N)


_run = run_to_end


def _one_line_and_recovers(qtbot: Any, w: MainWindow, says: str, good_model: str) -> None:
    context, query = w.input_panel.context.toPlainText(), w.input_panel.query.toPlainText()
    assert _run(qtbot, w) == "failed"
    assert says in w.last_error, w.last_error
    assert "\n" not in w.last_error and "Traceback" not in w.last_error
    assert w.banner.isVisible() and w.input_panel.run.isEnabled()
    typed = (w.input_panel.context.toPlainText(), w.input_panel.query.toPlainText())
    assert typed == (context, query)
    w.model_panel.model.setCurrentText(good_model)
    w.input_panel.query.setPlainText("Where does Alice live?")
    assert _run(qtbot, w) == "completed", w.last_error


def _folder(kind: str, tiny_model_dir: str, tmp_path: Path) -> Path:
    target = tmp_path / kind
    if kind == "no config":
        target.mkdir()
        (target / "notes.txt").write_text("not a model")
    elif kind == "truncated weights":
        shutil.copytree(tiny_model_dir, target)
        weights = target / "model.safetensors"
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size // 2)
    else:  # an architecture we cannot patch
        from transformers import MambaConfig

        MambaConfig(hidden_size=32, num_hidden_layers=1, vocab_size=64).save_pretrained(target)
    return target


@pytest.mark.parametrize("kind,says", [("no config", "has no config.json"),
                                       ("truncated weights", "damaged or incomplete"),
                                       ("state-space model", "unsupported architecture")])
def test_bad_model_folders(qtbot: Any, window: MainWindow, tiny_model_dir: str, tmp_path: Path,
                           kind: str, says: str) -> None:
    window.model_panel.model.setCurrentText(str(_folder(kind, tiny_model_dir, tmp_path)))
    _one_line_and_recovers(qtbot, window, says, tiny_model_dir)


def test_a_whitespace_query(qtbot: Any, window: MainWindow, tiny_model_dir: str) -> None:
    window.input_panel.query.setPlainText("   \n\t ")
    _one_line_and_recovers(qtbot, window, "the query is empty", tiny_model_dir)


@pytest.mark.parametrize("text", ["e\u0301te\u0301 a\u0300 Pa\u0308ris", "עליס גרה בפריז",
                                  "Alice 🧑‍🔬 lives in 🇫🇷", "Alice\x00lives in Paris"])
def test_unusual_unicode_runs_exactly(qtbot: Any, window: MainWindow, text: str) -> None:
    window.input_panel.context.setPlainText(text)
    assert _run(qtbot, window) == "completed", window.last_error
    assert all(s.patched.match for s in window.state.steps)
    assert window.input_panel.context.toPlainText() == text


def test_an_unwritable_export(qtbot: Any, window: MainWindow, tmp_path: Path) -> None:
    assert _run(qtbot, window) == "completed"
    for kind in ("json", "csv", "report"):
        assert not window.export(kind, str(tmp_path / "missing-folder" / f"run.{kind}"))
        assert "cannot write" in window.last_error and "\n" not in window.last_error
    assert window.export("json", str(tmp_path / "run.json"))


def test_out_of_memory_in_a_run_is_one_line_and_the_next_run_works(
        qtbot: Any, window: MainWindow, monkeypatch: pytest.MonkeyPatch) -> None:
    """An allocation that fails mid-run (on the worker thread) is a message with what to do;
    the worker is gone, the model stays loaded, and the next run works."""
    import torch
    from ctxpatch.core import compare as core_compare

    assert _run(qtbot, window) == "completed"
    real = core_compare.iter_token_patches

    def starved(*args: Any, **kwargs: Any) -> Any:
        yield from []
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(core_compare, "iter_token_patches", starved)
    assert _run(qtbot, window) == "failed"
    assert window.last_error.startswith("out of memory") and "bfloat16" in window.last_error
    assert "\n" not in window.last_error and window.worker is None
    monkeypatch.setattr(core_compare, "iter_token_patches", real)
    assert _run(qtbot, window) == "completed" and len(window.state.steps) == N
