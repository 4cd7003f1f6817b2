"""The knock-out on demand in the Context lens tab (ANALYSIS.md A1's complement): K at a pinned
token runs `core.knockout` on the worker with the run's kept patches; its markers are checked
against plain transformers (every patch kept: the full-context logit of the emitted token; none:
the unpatched reduced run's), and every way it cannot run says so in one line, starting nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from windows import open_window, run_to_end


def _logit(model: torch.nn.Module, ids: Any, token: int) -> float:
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([list(ids)])).logits[0, -1, token])


def test_the_knockout_of_a_pinned_token_against_plain_transformers(
        qtbot: Any, keep: Any, settings: Any, tiny_model_dir: str, tmp_path: Path) -> None:
    w = open_window(keep, settings, tiny_model_dir, "Alice lives in Paris.",
                    "Where does Alice live?", tokens=2)
    w.model_panel.analyses["lens"].setChecked(True)
    assert run_to_end(qtbot, w) == "completed", w.last_error
    w.tabs.setCurrentWidget(w.lens)
    w.lens.grid.setCurrentCell(0, 1)  # pin the second token
    assert w.lens.step == 1 and w.lens.knockout_effects() == {}
    assert "press K" in w.lens.knockout_note.text()
    w.lens.knockout_button.click()
    qtbot.waitUntil(lambda: not w.busy, timeout=60_000)
    assert w.status_label.text() == "Knock-out done", w.last_error
    result = w.lens.knockouts[1]
    step = w.state.steps[1]
    model = w.model.handle.model
    full = _logit(model, step.full_input_ids, step.baseline_token)
    none = _logit(model, step.reduced_input_ids, step.baseline_token)
    scale = 1 + abs(full)
    assert result["all"] == pytest.approx(full, abs=1e-4 * scale)  # float32 tiny model
    assert result["none"] == pytest.approx(none, abs=1e-4 * scale)
    assert result["none"] != pytest.approx(result["all"], abs=1e-3 * scale)  # the context acts
    effects = w.lens.knockout_effects()
    assert sorted(effects) == sorted(int(k) for k in result["layers"])
    for layer, effect in effects.items():
        assert effect == pytest.approx(result["all"] - result["layers"][str(layer)])
    assert "with every patch" in w.lens.knockout_note.text()
    # patches whose written weights miss the run (method direct on Gemma): said, not drawn
    w.lens.set_knockout({**result, "reproduces": False, "prob_gap": 0.4})
    assert w.lens.knockout_effects() == {}
    assert "not readable" in w.lens.knockout_note.text()
    assert "method stable" in w.lens.knockout_note.text()
    w.lens.set_knockout(result)

    # another token: its own markers, none until asked; back: the first token's again
    w.lens.grid.setCurrentCell(0, 0)
    assert w.lens.knockout_effects() == {}
    w.lens.grid.setCurrentCell(1, 1)
    assert w.lens.knockout_effects() == effects

    # a session keeps no patches: the knock-out says what to do, and starts nothing
    assert w.save_session(str(tmp_path / "s.json"))
    assert w.open_session(str(tmp_path / "s.json"))
    qtbot.waitUntil(lambda: not w.busy, timeout=30_000)
    created: list[Any] = []
    w.worker_created.connect(created.append)
    w.knockout(0)
    assert created == [] and "kept no patches" in w.last_error


def test_the_knockout_refuses_in_one_line(qtbot: Any, keep: Any, settings: Any,
                                          tiny_model_dir: str) -> None:
    w = open_window(keep, settings, tiny_model_dir, "Alice lives in Paris.",
                    "Where does Alice live?", tokens=1)
    created: list[Any] = []
    w.worker_created.connect(created.append)
    w.knockout(0)  # no run yet
    assert "no token chosen" in w.last_error and "\n" not in w.last_error
    created.clear()
    assert run_to_end(qtbot, w) == "completed", w.last_error  # without Lens: no patches kept
    created.clear()
    w.knockout(0)
    assert created == [] and "tick Lens" in w.last_error
    w.model_panel.analyses["lens"].setChecked(True)
    assert run_to_end(qtbot, w) == "completed", w.last_error
    created.clear()
    w.model = None  # as if the model had been unloaded for another
    w.knockout(0)
    assert created == [] and "load the model this run used" in w.last_error
    assert np.isfinite(w.lens.levels)
