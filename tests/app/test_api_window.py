"""Issue 21: the window and the Python API (and so the command line: tests/core/test_api.py)
give the same run record for the same options, timings aside."""

from __future__ import annotations

from typing import Any

from tiny import comparable_record
from windows import open_window, run_to_end

import ctxpatch


def test_the_window_and_the_api_give_the_same_record(qtbot: Any, keep: Any, settings: Any,
                                                     tiny_model_dir: str) -> None:
    w = open_window(keep, settings, tiny_model_dir, "Alice lives in Paris.", "Where?", tokens=3)
    w.model_panel.method.setCurrentText("stable")
    assert run_to_end(qtbot, w) == "completed"
    window = w.current_record()
    api = ctxpatch.compare(tiny_model_dir, context="Alice lives in Paris.", query="Where?",
                           max_new_tokens=3, method="stable", keep_patches=False).to_dict()
    assert comparable_record(window) == comparable_record(api)
    assert "wall" in window["summary"]["seconds"]


def test_on_fault_continue_from_the_window(qtbot: Any, keep: Any, settings: Any,
                                           tmp_path: Any) -> None:
    """The window's "Continue past NaN" is ``on_fault`` "continue": a float16 run that overflows
    at its first token stops there with one line unticked, and runs to the end ticked."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file
    from tiny import llama_config, save_tiny_folder

    folder = Path(save_tiny_folder(tmp_path / "fault", llama_config(layers=2)))
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"] *= 1e7  # float16 tops out at 65504
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    w = open_window(keep, settings, str(folder), "Alice lives in Paris.", "Where?", tokens=2)
    w.model_panel.dtype.setCurrentText("float16")
    assert run_to_end(qtbot, w) == "failed" and "numerical fault at token 1" in w.last_error
    w.model_panel.on_fault.setChecked(True)
    assert run_to_end(qtbot, w) == "completed", w.last_error
    record = w.current_record()
    assert record["settings"]["on_fault"] == "continue" and len(record["steps"]) == 2
