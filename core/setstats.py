"""A prompt set's statistics, per setting: token match, TVD and logit L-infinity pooled over the
prompts' tokens, each with a bootstrap 95% confidence interval; the per-prompt spread; the worst
prompts by name.

The interval is a percentile bootstrap over prompts (a cluster bootstrap): the tokens of one
prompt share its history and are not independent, so whole prompts are resampled with
replacement, ``RESAMPLES`` times from ``numpy.random.default_rng(SEED)``, and the pooled
statistic of each resample (sum over its prompts' tokens / their token count) gives the 2.5th
and 97.5th percentiles (numpy's linear interpolation). A setting whose prompts all agree gets a
zero-width interval; one prompt gives none (NaN: nothing to resample).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

RESAMPLES = 2000
SEED = 0
LEVEL = 0.95
#: the pooled metrics: a step's value (match as 0/1), and the name each has in the tables
METRICS = ("match", "tvd", "linf")
WORST = 5


def per_prompt(record: dict[str, Any]) -> dict[str, Any]:
    """One run's numbers: tokens, and per metric the sum over the steps with a value and their
    count (a fault's missing value is left out), its mean and its max."""
    steps = record["steps"]
    out: dict[str, Any] = {"tokens": len(steps),
                           "seconds": float(record["summary"]["seconds"]["total"])}
    for m in METRICS:
        xs = np.array([_value(s, m) for s in steps], dtype=float)
        xs = xs[np.isfinite(xs)]
        out[f"{m}_sum"] = float(xs.sum())
        out[f"{m}_n"] = int(xs.size)
        out[f"{m}_mean"] = float(xs.mean()) if xs.size else math.nan
        out[f"{m}_max"] = float(xs.max()) if xs.size else math.nan
    return out


def _value(step: dict[str, Any], metric: str) -> float:
    if metric == "match":
        return 1.0 if step["match"] else 0.0
    value = step.get(metric)
    return math.nan if value is None else float(value)


def bootstrap(sums: Sequence[float], counts: Sequence[int], resamples: int = RESAMPLES,
              seed: int = SEED, level: float = LEVEL) -> tuple[float, float, float]:
    """The pooled statistic sum(sums)/sum(counts) and its percentile bootstrap interval over
    the prompts (whole prompts resampled with replacement).

    Args:
        sums: (P,) each prompt's sum of the metric over its tokens.
        counts: (P,) each prompt's number of tokens with a value.
    Returns:
        (estimate, low, high); low and high are NaN with fewer than two prompts.
    """
    s = np.asarray(sums, dtype=float)
    n = np.asarray(counts, dtype=float)
    estimate = float(s.sum() / n.sum()) if n.sum() else math.nan
    if s.size < 2 or not n.sum():
        return estimate, math.nan, math.nan
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, s.size, size=(resamples, s.size))  # (B, P) prompts drawn
    with np.errstate(invalid="ignore", divide="ignore"):
        stats = s[idx].sum(axis=1) / n[idx].sum(axis=1)  # (B,)
    stats = stats[np.isfinite(stats)]
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(stats, [tail, 1.0 - tail])
    return estimate, float(low), float(high)


def _spread(xs: Sequence[float]) -> dict[str, float]:
    a = np.array([x for x in xs if math.isfinite(x)], dtype=float)
    if not a.size:
        return {k: math.nan for k in ("min", "q25", "median", "q75", "max")}
    q = np.quantile(a, [0.0, 0.25, 0.5, 0.75, 1.0])
    return dict(zip(("min", "q25", "median", "q75", "max"), map(float, q), strict=True))


def setting_stats(prompts: dict[str, dict[str, Any]], resamples: int = RESAMPLES,
                  seed: int = SEED) -> dict[str, Any]:
    """One setting's statistics from its prompts' `per_prompt` numbers ({prompt id: numbers},
    in the set's order)."""
    ids = list(prompts)
    rows = [prompts[i] for i in ids]
    out: dict[str, Any] = {"prompts": len(rows), "tokens": sum(r["tokens"] for r in rows),
                           "seconds": sum(r["seconds"] for r in rows)}
    for m in METRICS:
        est, low, high = bootstrap([r[f"{m}_sum"] for r in rows], [r[f"{m}_n"] for r in rows],
                                   resamples, seed)
        out[m] = {"pooled": est, "ci_low": low, "ci_high": high,
                  "max": max((r[f"{m}_max"] for r in rows), default=math.nan,
                             key=lambda x: -math.inf if math.isnan(x) else x),
                  "per_prompt": _spread([r[f"{m}_mean"] for r in rows])}
    order = sorted(range(len(rows)), key=lambda k: (rows[k]["match_mean"],
                                                    -_or(rows[k]["tvd_mean"]), ids[k]))
    out["worst"] = [{"id": ids[k], "match": rows[k]["match_mean"],
                     "mean_tvd": rows[k]["tvd_mean"], "max_linf": rows[k]["linf_max"]}
                    for k in order[:WORST]]
    return out


def _or(x: float) -> float:
    return -math.inf if math.isnan(x) else x


def set_statistics(records: dict[str, dict[str, Any]], jobs: Sequence[Any],
                   resamples: int = RESAMPLES, seed: int = SEED) -> dict[str, Any]:
    """Every setting's statistics from the set's records (``jobs``: `core.experiments.Job`
    with ``setting`` and ``prompt_id``), settings in the jobs' order; the bootstrap's method,
    resamples, seed and level stated beside them."""
    by_setting: dict[str, dict[str, dict[str, Any]]] = {}
    kinds: dict[str, Any] = {}
    for job in jobs:
        if not job.setting or job.name not in records:
            continue
        by_setting.setdefault(job.setting, {})[job.prompt_id] = per_prompt(records[job.name])
        kinds[job.setting] = job
    settings = []
    for name, prompts in by_setting.items():
        job = kinds[name]
        settings.append({"setting": name, "dtype": job.dtype, "method": job.method,
                         "absorb": job.absorb, "layers": job.layers,
                         **setting_stats(prompts, resamples, seed),
                         "per_prompt_numbers": prompts})
    return {"bootstrap": {"method": "percentile, prompts resampled with replacement",
                          "resamples": resamples, "seed": seed, "level": LEVEL},
            "settings": settings}


TABLE = ("setting", "dtype", "method", "absorb", "layers", "prompts", "tokens",
         "match", "match_ci_low", "match_ci_high", "match_prompt_min", "match_prompt_median",
         "tvd", "tvd_ci_low", "tvd_ci_high", "tvd_prompt_median", "tvd_max",
         "linf", "linf_ci_low", "linf_ci_high", "linf_max", "worst_prompts", "seconds",
         "resamples", "seed")


def table_rows(stats: dict[str, Any]) -> list[dict[str, Any]]:
    """One flat row per setting (`TABLE`'s columns), for summary.csv and a data frame."""
    b = stats["bootstrap"]
    rows = []
    for s in stats["settings"]:
        row = {k: s[k] for k in ("setting", "dtype", "method", "absorb", "layers", "prompts",
                                 "tokens", "seconds")}
        for m in METRICS:
            row[m] = s[m]["pooled"]
            row[f"{m}_ci_low"] = s[m]["ci_low"]
            row[f"{m}_ci_high"] = s[m]["ci_high"]
        row["match_prompt_min"] = s["match"]["per_prompt"]["min"]
        row["match_prompt_median"] = s["match"]["per_prompt"]["median"]
        row["tvd_prompt_median"] = s["tvd"]["per_prompt"]["median"]
        row["tvd_max"] = s["tvd"]["max"]
        row["linf_max"] = s["linf"]["max"]
        row["worst_prompts"] = ";".join(w["id"] for w in s["worst"])
        row["resamples"], row["seed"] = b["resamples"], b["seed"]
        rows.append({k: row[k] for k in TABLE})
    return rows


PROMPT_TABLE = ("setting", "prompt", "tokens", "match", "tvd_mean", "tvd_max", "linf_mean",
                "linf_max", "seconds")


def prompt_rows(stats: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (setting, prompt), for prompts.csv."""
    return [{"setting": s["setting"], "prompt": pid, "tokens": p["tokens"],
             "match": p["match_mean"], "tvd_mean": p["tvd_mean"], "tvd_max": p["tvd_max"],
             "linf_mean": p["linf_mean"], "linf_max": p["linf_max"], "seconds": p["seconds"]}
            for s in stats["settings"] for pid, p in s["per_prompt_numbers"].items()]
