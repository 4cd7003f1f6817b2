"""Prompt sets (`core.promptset`) and their statistics (`core.setstats`): bad rows refused with
their line, the bundled set, and the bootstrap intervals against a direct computation."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from ctxpatch.core import promptset, setstats
from ctxpatch.core.errors import UserError


def _jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_rows_read_from_jsonl_and_csv(tmp_path: Path) -> None:
    (tmp_path / "cat.png").write_bytes(b"not checked here")
    rows = promptset.read_set(_jsonl(tmp_path / "s.jsonl", [
        {"id": "one", "context": "Alice lives in Paris.", "query": "Where?"},
        {"query": "The capital of France is", "image": "cat.png"}]))
    assert [(r.id, r.context, r.query, r.line) for r in rows] == [
        ("one", "Alice lives in Paris.", "Where?", 1), ("p2", "", "The capital of France is", 2)]
    assert rows[1].image == str((tmp_path / "cat.png").resolve())  # relative to the set's folder
    (tmp_path / "s.csv").write_text('Query,context\n"Where, then?",ctx\nsecond,\n',
                                    encoding="utf-8")
    rows = promptset.read_set(tmp_path / "s.csv")
    assert [(r.id, r.context, r.query, r.line) for r in rows] == [
        ("p1", "ctx", "Where, then?", 2), ("p2", "", "second", 3)]


@pytest.mark.parametrize(("rows", "line", "words"), [
    ([{"query": "ok"}, {"context": "no query here"}], 2, "no query"),
    ([{"query": "ok"}, {"query": "  "}], 2, "no query"),
    ([{"query": "a", "image": "missing.png"}], 1, "'missing.png' is not a file"),
    ([{"id": "x", "query": "a"}, {"query": "b"}, {"id": "x", "query": "c"}], 3,
     "id 'x' is already the id of line 1"),
    ([{"query": "a", "qeury": "typo"}], 1, "unknown key 'qeury'"),
    ([{"query": 3}], 1, "query must be text"),
    ([{"id": "a/b", "query": "x"}], 1, "id 'a/b' may hold only"),
])
def test_a_bad_row_is_refused_with_its_line(tmp_path: Path, rows: list[object], line: int,
                                            words: str) -> None:
    path = _jsonl(tmp_path / "s.jsonl", rows)
    with pytest.raises(UserError) as err:
        promptset.read_set(path)
    message = str(err.value)
    assert f"s.jsonl, line {line}: " in message and words in message, message
    assert "\n" not in message


def test_a_blank_line_counts_and_a_bad_csv_is_refused(tmp_path: Path) -> None:
    (tmp_path / "s.jsonl").write_text('{"query": "a"}\n\n{"query": ""}\n', encoding="utf-8")
    with pytest.raises(UserError, match=r"s.jsonl, line 3: no query"):
        promptset.read_set(tmp_path / "s.jsonl")
    (tmp_path / "s.csv").write_text("query,context\nfine,\n,only context\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"s.csv, line 3: no query"):
        promptset.read_set(tmp_path / "s.csv")
    (tmp_path / "h.csv").write_text("prompt\nx\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"h.csv, line 1: the header"):
        promptset.read_set(tmp_path / "h.csv")
    with pytest.raises(UserError, match="no such file"):
        promptset.read_set(tmp_path / "absent.jsonl")
    (tmp_path / "e.jsonl").write_text("\n", encoding="utf-8")
    with pytest.raises(UserError, match="holds no prompts"):
        promptset.read_set(tmp_path / "e.jsonl")


def test_the_bundled_demo_set_is_varied_and_valid() -> None:
    rows = promptset.read_set(promptset.DEMO_SET)
    assert len(rows) >= 30 and len({r.id for r in rows}) == len(rows)
    kinds = {r.id.split("-")[0] for r in rows}
    assert {"fact", "instr", "fewshot", "code"} <= kinds
    assert sum(bool(r.context) for r in rows) >= 10  # contexts to absorb, too


# -- statistics --------------------------------------------------------------------------------
def _record(matches: list[bool], tvd: list[float], linf: list[float]) -> dict[str, object]:
    return {"steps": [{"match": m, "tvd": t, "linf": x} for m, t, x in
                      zip(matches, tvd, linf, strict=True)],
            "summary": {"seconds": {"total": 1.0}}}


#: a fixed small set: 4 prompts of unequal length (5, 3, 4, 2 tokens)
PROMPTS = {
    "a": _record([True] * 5, [1e-3, 2e-3, 1e-3, 5e-4, 1e-3], [0.1, 0.2, 0.1, 0.05, 0.1]),
    "b": _record([True, False, True], [0.02, 0.3, 0.05], [1.0, 4.0, 2.0]),
    "c": _record([True, True, True, False], [4e-3, 6e-3, 1e-2, 0.2], [0.3, 0.4, 0.5, 3.0]),
    "d": _record([False, False], [0.5, 0.4], [6.0, 5.0]),
}


def _direct(metric: str, resamples: int, seed: int) -> tuple[float, float, float]:
    """The pooled statistic and its percentile interval, computed the long way: each resample's
    prompts' raw steps concatenated, the metric averaged over them."""
    ids = list(PROMPTS)
    steps = {i: [(1.0 if s["match"] else 0.0) if metric == "match" else s[metric]
                 for s in PROMPTS[i]["steps"]] for i in ids}  # type: ignore[index]
    pooled = float(np.mean([x for i in ids for x in steps[i]]))
    draws = np.random.default_rng(seed).integers(0, len(ids), size=(resamples, len(ids)))
    stats = []
    for draw in draws:
        values = [x for k in draw for x in steps[ids[k]]]
        stats.append(sum(values) / len(values))
    low, high = np.percentile(stats, [2.5, 97.5])
    return pooled, float(low), float(high)


@pytest.mark.parametrize("metric", setstats.METRICS)
def test_bootstrap_intervals_equal_a_direct_computation(metric: str) -> None:
    numbers = {i: setstats.per_prompt(r) for i, r in PROMPTS.items()}
    stats = setstats.setting_stats(numbers, resamples=500, seed=7)
    got = stats[metric]
    want = _direct(metric, 500, 7)
    assert (got["pooled"], got["ci_low"], got["ci_high"]) == pytest.approx(want, rel=1e-12)
    assert got["ci_low"] <= got["pooled"] <= got["ci_high"]
    assert stats["tokens"] == 14 and stats["prompts"] == 4
    # another seed moves the interval: the seed is really used
    other = setstats.setting_stats(numbers, resamples=500, seed=8)[metric]
    assert (other["ci_low"], other["ci_high"]) != (got["ci_low"], got["ci_high"])


def test_the_bootstrap_distribution_is_the_exact_one() -> None:
    """With 4 prompts the bootstrap has 4^4 equally likely resamples: their pooled match rate's
    exact quantiles bracket the seeded Monte Carlo interval (20000 resamples)."""
    numbers = {i: setstats.per_prompt(r) for i, r in PROMPTS.items()}
    sums = [numbers[i]["match_sum"] for i in PROMPTS]
    counts = [numbers[i]["match_n"] for i in PROMPTS]
    exact = sorted(sum(sums[k] for k in draw) / sum(counts[k] for k in draw)
                   for draw in itertools.product(range(4), repeat=4))
    _, low, high = setstats.bootstrap(sums, counts, resamples=20000, seed=0)
    q = np.quantile(exact, [0.015, 0.035, 0.965, 0.985])
    assert q[0] <= low <= q[1] and q[2] <= high <= q[3], (low, high, q)


def test_worst_prompts_spread_and_degenerate_sets() -> None:
    numbers = {i: setstats.per_prompt(r) for i, r in PROMPTS.items()}
    stats = setstats.setting_stats(numbers, resamples=200)
    assert [w["id"] for w in stats["worst"]] == ["d", "b", "c", "a"]  # lowest match first
    assert stats["match"]["per_prompt"]["min"] == 0.0
    assert stats["match"]["per_prompt"]["max"] == 1.0
    assert stats["linf"]["max"] == 6.0
    one = setstats.setting_stats({"a": numbers["a"]}, resamples=200)
    assert one["match"]["pooled"] == 1.0 and math.isnan(one["match"]["ci_low"])  # nothing to draw
    same = setstats.setting_stats({"a": numbers["a"], "b": numbers["a"]}, resamples=200)
    assert same["tvd"]["ci_low"] == pytest.approx(same["tvd"]["ci_high"])  # agreeing prompts


def test_a_line_nested_too_deep_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "s.jsonl").write_text('{"query": "a"}\n' + "[" * 100_000 + "\n",
                                      encoding="utf-8")
    with pytest.raises(UserError, match=r"s.jsonl, line 2: not a JSON object"):
        promptset.read_set(tmp_path / "s.jsonl")
