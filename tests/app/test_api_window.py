"""Issue 21: the window and the Python API (and so the command line: tests/core/test_api.py)
give the same run record for the same options, timings aside."""

from __future__ import annotations

import json
import re
from typing import Any

from windows import open_window, run_to_end

import ctxpatch


def _comparable(record: dict) -> dict:  # type: ignore[type-arg]
    text = json.dumps(record, sort_keys=True)
    text = re.sub(r'"(seconds|wall|baseline|patched|control)": [0-9.e-]+', r'"\1": 0', text)
    data = json.loads(text)
    for step in data["steps"]:
        step["seconds"] = {}
    data["summary"]["seconds"] = {}
    data["settings"].pop("keep_patches", None)  # (the API keeps them by default)
    return data


def test_the_window_and_the_api_give_the_same_record(qtbot: Any, keep: Any, settings: Any,
                                                     tiny_model_dir: str) -> None:
    w = open_window(keep, settings, tiny_model_dir, "Alice lives in Paris.", "Where?", tokens=3)
    w.model_panel.method.setCurrentText("stable")
    assert run_to_end(qtbot, w) == "completed"
    window = w.current_record()
    api = ctxpatch.compare(tiny_model_dir, context="Alice lives in Paris.", query="Where?",
                           max_new_tokens=3, method="stable").to_dict()
    assert _comparable(window) == _comparable(api)
