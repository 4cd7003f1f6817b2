"""The paper's experiments in one command (PAPER.md section 6): the five prompts x {direct,
stable} x {float32, bfloat16}, absorb "all", greedy, 20 tokens; then a start-layer sweep (patch
only layers s..L-1) on the first prompt. Every run is saved as its own record the moment it
ends, so an interrupted reproduction resumes where it stopped.
"""

from __future__ import annotations

import json
import math
import statistics
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import UserError
from .options import METHODS
from .results import nan_max

PAPER_PROMPTS = (
    "Write a single-sentence weather forecast for Mars, from the perspective of a slightly "
    "annoyed robot:",
    "Constraint: No 'e's. Topic: The meaning of life. Length: Exactly 20 words. Write:",
    "Explain what a 'bug' is in computer programming, but explain it to a 16th-century medieval "
    "peasant. Use 20 words or less:",
    "Topic: Three siblings named Jack, Fred, and Alice. Task: Write one 5-7-5 haiku about them:",
    "We can absorb the impact of a prompt for a modern language model such as Gemma into the "
    "MLP weights. Write a two-line rhyming couplet about this fact:",
)
DTYPES = ("float32", "bfloat16")
#: the paper's image run (Figure 5): a picture in the context, described in ten words; the
#: prompt's exact text is unknown (PAPER.md section 6), this is its stated request
IMAGE_QUERY = "Describe this image in 10 words."


@dataclass(frozen=True)
class Job:
    name: str  # file stem under runs/
    dtype: str
    method: str
    prompt: int  # index into the prompts (-1: the image run)
    layers: str = "all"


def grid(prompts: int, dtypes: Sequence[str], sweep: Sequence[int]) -> list[Job]:
    jobs = [Job(f"{d}-{m}-p{p + 1}", d, m, p) for d in dtypes for m in METHODS
            for p in range(prompts)]
    jobs += [Job(f"sweep-s{s}", dtypes[0], "direct", 0, f"{s}:") for s in sweep]
    return jobs


def image_grid(dtypes: Sequence[str]) -> list[Job]:
    """Figure 5: the image run, both methods in each precision."""
    return [Job(f"image-{d}-{m}", d, m, -1) for d in dtypes for m in METHODS]


#: the settings a run resolves as it runs, which a resumed job does not know in advance
_RESOLVED = ("device", "control_row", "chat_template")


def _saved(path: Path, spec: Any) -> dict[str, Any] | None:
    """A finished run's record for ``spec``, or None when missing, unreadable, damaged or made
    with other options (another model, precision, token count, prompt...): it is then redone."""
    from .record import read_record

    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        read_record(record, str(path))
    except (OSError, ValueError, UserError):
        return None
    settings = record.get("settings")
    if not isinstance(settings, dict) or not record.get("steps"):
        return None
    with warnings.catch_warnings():  # a newer writer's keys: not options of this run
        warnings.simplefilter("ignore")
        made = type(spec).from_dict(settings)  # an option an older record lacks: its default

    def compared(s: Any) -> dict[str, Any]:
        return {k: v for k, v in s.to_dict(recorded=True).items() if k not in _RESOLVED}

    return record if compared(made) == compared(spec) else None


def run_grid(model: str, out: Path, jobs: Sequence[Job], tokens: int, device: str = "auto",
             say: Callable[[str], None] = print, should_stop: Callable[[], bool] | None = None,
             image: str | None = None) -> dict[str, dict[str, Any]]:
    """Run (or reuse) every job; returns {job name: record}. Image jobs put ``image`` in the
    context of a chat-template prompt (the model's processor makes its tokens)."""
    from .export import write_json
    from .runs import compare, load, prepare

    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    records: dict[str, dict[str, Any]] = {}
    loaded: Any = None
    for i, job in enumerate(jobs):
        path = runs_dir / f"{job.name}.json"
        if job.prompt < 0 and image is None:
            raise UserError("the image runs need a picture")
        if loaded is not None and str(loaded.dtype).removeprefix("torch.") != job.dtype:
            loaded = None  # free the other precision first
        spec = job_spec(job, model, tokens, device, image, loaded)
        saved = _saved(path, spec)
        if saved is not None:
            records[job.name] = saved
            say(f"[{i + 1}/{len(jobs)}] {job.name}: reusing {path}")
            continue
        if loaded is None:
            loaded = load(spec)
            spec = job_spec(job, model, tokens, device, image, loaded)
        run = compare(loaded, spec, prepare(spec), should_stop=should_stop)
        if len(run.steps) < tokens:
            raise KeyboardInterrupt  # stopped: keep what is saved, redo this run next time
        record = run.record
        record["max_abs_scale_patch"] = max_scale_patch(record)
        write_json(path, record)
        records[job.name] = record
        p = record["summary"]["patched"]
        say(f"[{i + 1}/{len(jobs)}] {job.name}: match {p['matches']}/{tokens}, "
            f"max L-inf {p['max_linf']:.3g}")
    return records


def job_spec(job: Job, model: str, tokens: int, device: str, image: str | None,
             loaded: Any = None) -> Any:
    """A job's `RunSpec`: absorb all, greedy, no context; the image run's picture in the
    context of a chat-template prompt when the model has one (instruct models; known once
    ``loaded``)."""
    from .spec import RunSpec

    chat = False
    if job.prompt < 0 and loaded is not None:
        from .prompt import has_chat_template

        chat = has_chat_template(loaded.tokenizer, loaded.processor)
    return RunSpec(model=model, dtype=job.dtype, device=device, max_new_tokens=tokens,
                   method=job.method, absorb="all", layers=job.layers,
                   query=IMAGE_QUERY if job.prompt < 0 else PAPER_PROMPTS[job.prompt],
                   image=image if job.prompt < 0 else None, chat_template=chat)


def max_scale_patch(record: dict[str, Any]) -> float | None:
    """The largest |dm| of any scale patch in the run (None when no scale was patched)."""
    best = None
    for s in record["steps"]:
        for params in s.get("patch_norms", {}).values():
            for name, norms in params.items():
                if "linf" in norms and "norm" in name:
                    best = max(best or 0.0, float(norms["linf"]))
    return best


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def summary(records: dict[str, dict[str, Any]], dtypes: Sequence[str], prompts: int
            ) -> list[dict[str, Any]]:
    """Figure 4's numbers: per dtype and method, pooled over the prompts."""
    rows = []
    for d in dtypes:
        for m in METHODS:
            runs = [records[f"{d}-{m}-p{p + 1}"] for p in range(prompts)
                    if f"{d}-{m}-p{p + 1}" in records]
            if not runs:
                continue
            steps = [s for r in runs for s in r["steps"]]
            tvd = [float(s["tvd"]) for s in steps]
            linf = [float(s["linf"]) for s in steps]
            scale = [r.get("max_abs_scale_patch") for r in runs]
            rows.append({
                "dtype": d, "method": m, "prompts": len(runs), "tokens": len(steps),
                "match_rate": sum(bool(s["match"]) for s in steps) / len(steps),
                "per_prompt_matches": [r["summary"]["patched"]["matches"] for r in runs],
                "median_tvd": _median(tvd), "mean_tvd": statistics.fmean(tvd),
                "max_tvd": nan_max(tvd), "max_linf": nan_max(linf),
                "control_match_rate": sum(bool(s["control"]["match"]) for s in steps) / len(steps),
                "max_abs_scale_patch": max((x for x in scale if x is not None), default=None),
                "seconds": sum(float(r["summary"]["seconds"]["total"]) for r in runs),
            })
    return rows


def sweep_rows(records: dict[str, dict[str, Any]], sweep: Sequence[int]) -> list[dict[str, Any]]:
    rows = []
    for s in sweep:
        r = records.get(f"sweep-s{s}")
        if r is None:
            continue
        p = r["summary"]["patched"]
        rows.append({"start_layer": s, "matches": p["matches"], "tokens": r["summary"]["tokens"],
                     "max_linf": p["max_linf"], "median_tvd": p["median_tvd"],
                     "max_abs_scale_patch": r.get("max_abs_scale_patch")})
    return rows


def default_sweep(num_layers: int) -> list[int]:
    if num_layers < 1:
        raise UserError("the model has no layers to sweep")
    picks = {0, num_layers // 4, num_layers // 2, (3 * num_layers) // 4, num_layers - 1}
    return sorted(picks)
