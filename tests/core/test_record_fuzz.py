"""Fuzzing run records (issue 36): a real record with any field replaced by any JSON value or
removed, and its bytes mutated. Whatever it holds, reading it back (`core.record.read_record`,
what sessions, reports and a resumed reproduction use) gives a run or one `UserError` line,
never another exception; what is read back gives its options, summary and report rows."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ctxpatch.core.errors import UserError
from ctxpatch.core.record import read_record
from ctxpatch.core.results import conditioning, summarize
from fuzz_json import DELETE, JSON, paths
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FIXTURE = Path(__file__).parents[1] / "app" / "fixtures" / "session_v0.json"
RECORD = json.loads(FIXTURE.read_text())["run"]


PATHS = [p for p in paths(RECORD) if p]


def _read(data: Any) -> None:
    try:
        run = read_record(data, "run.json")
    except UserError as exc:
        assert "\n" not in str(exc) and str(exc)
        return
    run.spec.to_dict()  # its options, as reproduce compares them
    summarize(run.steps)
    conditioning(run.steps)
    for s in run.steps:
        assert isinstance(s.patched.match, bool) and isinstance(s.step, int)
        assert math.isnan(s.patched.linf) or s.patched.linf >= 0 or s.patched.linf < 0


def test_the_fixture_reads() -> None:
    assert len(read_record(RECORD).steps) == len(RECORD["steps"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(PATHS), JSON | st.just(DELETE))
def test_any_field_replaced_or_removed(path: tuple[Any, ...], value: Any) -> None:
    data = json.loads(json.dumps(RECORD))
    node = data
    for key in path[:-1]:
        node = node[key]
    if value is DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    _read(data)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64), st.integers(min_value=0))
def test_mutated_bytes(junk: bytes, at: int) -> None:
    raw = json.dumps(RECORD).encode()
    at %= len(raw)
    mutated = raw[:at] + junk + raw[at + len(junk):]
    try:
        data = json.loads(mutated)
    except ValueError:
        return  # not JSON: the readers of files say so before this point
    _read(data)


def test_a_conditioning_place_needs_its_step_and_layer() -> None:
    """Found by the patches-file fuzz: ``max_abs_scale_patch_at: {"step": 1}`` passed the schema
    and crashed the conditioning line; a null bound too."""
    import pytest
    from ctxpatch.core.controllability import conditioning_line

    data = json.loads(json.dumps(RECORD))
    data["summary"]["conditioning"] = {"max_abs_scale_patch_at": {"step": 1}}
    with pytest.raises(UserError, match="max_abs_scale_patch_at"):
        read_record(data)
    assert "within 100x" in conditioning_line({"max_entry_ratio": 1.0, "bound": None})
    assert "hard case at 0 layer-step(s) over 2" in conditioning_line({"hard_case_steps": 2})
