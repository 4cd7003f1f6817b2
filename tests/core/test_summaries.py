"""Issue 21: one rule for summaries. A NaN anywhere in a run (a step past a numerical fault)
makes the maximum NaN wherever it stands, in the run JSON's summary, the window's status figures
and verify's verdict alike (Python's ``max`` kept or dropped it by position); no steps give the
documented defaults."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from ctxpatch.app.state import RunState
from ctxpatch.core.results import Side, StepResult, TopK, nan_max, summarize
from ctxpatch.core.runs import verdict

TOP = TopK((5,), ("x",), (1.0,))


def _step(i: int, linf: float) -> StepResult:
    return StepResult(step=i, position=i, baseline_token=5, baseline_text="x", baseline_top_k=TOP,
                      logit_scale=10.0, patched=Side(5, "x", True, linf, 1e-9, TOP),
                      control=Side(6, "y", False, 3.0, 0.5, TOP), full_input_ids=(1,),
                      reduced_input_ids=(1,), reduced_position_ids=None, patch_norms={},
                      layer_info={}, seconds={"baseline": 0.0, "patched": 0.0, "control": 0.0})


@pytest.mark.parametrize("where", [0, 1, 2])
def test_a_nan_anywhere_is_the_maximum_everywhere(where: int) -> None:
    linfs = [1e-6, 2e-6, 3e-6]
    linfs[where] = math.nan
    steps = [_step(i, x) for i, x in enumerate(linfs)]
    assert math.isnan(summarize(steps)["patched"]["max_linf"])
    assert math.isnan(summarize(steps)["patched"]["median_linf"])
    state = RunState()
    state.steps = steps
    assert math.isnan(state.summary()["max_linf"])
    checks = [SimpleNamespace(linf=x, scale=10.0, match=True) for x in linfs]
    result = verdict(checks, 1e-3)
    assert not result.ok and math.isnan(result.worst) and math.isnan(result.max_linf)


def test_no_steps_give_the_defaults() -> None:
    assert math.isnan(summarize([])["patched"]["max_linf"])
    assert RunState().summary()["max_linf"] == 0.0
    assert not verdict([], 1e-3).ok
    assert nan_max([], default=0.0) == 0.0 and nan_max([1.0, 3.0, 2.0]) == 3.0
