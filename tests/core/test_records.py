"""Runs read back from their JSON records: the same steps, clear errors for damaged files."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from ctxpatch.core.compare import RunSpec, iter_token_patches
from ctxpatch.core.errors import UserError
from ctxpatch.core.prompt import build_prompt
from ctxpatch.core.record import read_record, record_of
from tiny import gemma3_config, tiny_loaded


@pytest.fixture(scope="module")
def record():  # type: ignore[no-untyped-def]
    loaded = tiny_loaded(gemma3_config())
    prompt = build_prompt(loaded.tokenizer, "The quick brown fox.", "Hello world!")
    settings = RunSpec(max_new_tokens=4)
    steps = list(iter_token_patches(loaded, prompt, settings))
    rec = record_of(loaded.describe(), prompt, replace(settings, context="The quick brown fox."),
                    steps)
    return json.loads(json.dumps(rec)), steps, prompt


def test_a_record_reads_back_as_the_same_run(record) -> None:  # type: ignore[no-untyped-def]
    rec, steps, prompt = record
    run = read_record(rec)
    assert run.prompt == prompt and run.settings["context"] == "The quick brown fox."
    assert len(run.steps) == len(steps)
    for a, b in zip(run.steps, steps, strict=True):
        assert a.patched == b.patched and a.control == b.control
        assert a.baseline_top_k == b.baseline_top_k and a.full_input_ids == b.full_input_ids
        assert (a.step, a.position, a.baseline_token, a.logit_scale) == (
            b.step, b.position, b.baseline_token, b.logit_scale)
        assert a.patch_norms == b.patch_norms and a.layer_info == b.layer_info
        assert a.reduced_input_ids == b.reduced_input_ids


@pytest.mark.parametrize("damage,message", [
    (lambda r: {**r, "schema_version": 99}, "schema 99"),
    (lambda r: {k: v for k, v in r.items() if k != "schema_version"}, "not a ctxpatch run"),
    (lambda r: {**r, "steps": [{"step": 0}]}, "damaged or incomplete"),
    (lambda r: {**r, "prompt": {"segments": [{"kind": "query"}]}}, "damaged or incomplete"),
    (lambda r: [r], "not a ctxpatch run"),
])
def test_damaged_records_are_one_clear_error(record, damage, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UserError, match=message):
        read_record(damage(record[0]), "run.json")


def test_a_record_with_nan_and_infinite_measures_reads_back() -> None:
    """The writer stores NaN and infinity as null (a run past a fault, a patch of a weight whose
    largest entry is 0): its own schema takes them, and the reader gives NaN back."""
    from ctxpatch.core.export import json_text

    loaded = tiny_loaded(gemma3_config())
    prompt = build_prompt(loaded.tokenizer, "The quick brown fox.", "Hello world!")
    steps = list(iter_token_patches(loaded, prompt, RunSpec(max_new_tokens=1)))
    rec = json.loads(json_text(record_of(loaded.describe(), prompt, RunSpec(), steps)))
    info = rec["steps"][0]["layers"]["0"]
    info["entry_ratio"] = info["shift_norm"] = None
    rec["summary"]["conditioning"]["max_entry_ratio"] = None
    run = read_record(rec)
    assert math.isnan(run.steps[0].layer_info[0]["entry_ratio"])
