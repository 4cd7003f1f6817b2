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
                           max_new_tokens=3, method="stable").to_dict()
    assert comparable_record(window) == comparable_record(api)
