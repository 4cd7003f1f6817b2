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
    """One (prompt, setting) run of a reproduction or a prompt set: plain, picklable data (a
    cluster's actors receive it, `core.cluster`)."""

    name: str  # file stem under runs/
    dtype: str
    method: str
    prompt: int  # index into the prompts (-1: the image run)
    layers: str = "all"
    absorb: str = "all"
    analyze: tuple[str, ...] = ()
    context: str = ""
    query: str | None = None  # None: the paper's prompt number ``prompt``
    image: str | None = None  # a set row's picture (the paper's image run takes run_grid's)
    prompt_id: str = ""  # the set row's id (p1..p5 for the paper's prompts)
    setting: str = ""  # the setting it belongs to (`core.sets.Setting.name`)


def grid(prompts: int, dtypes: Sequence[str], sweep: Sequence[int]) -> list[Job]:
    jobs = [Job(f"{d}-{m}-p{p + 1}", d, m, p, prompt_id=f"p{p + 1}", setting=f"{d}-{m}")
            for d in dtypes for m in METHODS for p in range(prompts)]
    jobs += [Job(f"sweep-s{s}", dtypes[0], "direct", 0, f"{s}:") for s in sweep]
    return jobs


def image_grid(dtypes: Sequence[str]) -> list[Job]:
    """Figure 5: the image run, both methods in each precision."""
    return [Job(f"image-{d}-{m}", d, m, -1) for d in dtypes for m in METHODS]


#: the settings a run resolves as it runs, which a resumed job does not know in advance
_RESOLVED = ("device", "control_row", "chat_template")


def _saved(path: Path, spec: Any) -> tuple[dict[str, Any] | None, tuple[str, Any, Any] | None]:
    """(a finished run's record for ``spec``, None); (None, None) when missing, unreadable or
    damaged (it is then redone); (None, (option, its value there, this value)) when made with
    other options (another model, precision, token count, prompt...)."""
    from .record import read_record

    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        read_record(record, str(path))
    except (OSError, ValueError, UserError):
        return None, None
    settings = record.get("settings")
    if not isinstance(settings, dict) or not record.get("steps"):
        return None, None
    with warnings.catch_warnings():  # a newer writer's keys: not options of this run
        warnings.simplefilter("ignore")
        made = type(spec).from_dict(settings)  # an option an older record lacks: its default

    def compared(s: Any) -> dict[str, Any]:
        return {k: v for k, v in s.to_dict(recorded=True).items() if k not in _RESOLVED}

    was, now = compared(made), compared(spec)
    if was == now:
        return record, None
    key = next(k for k in now if was.get(k) != now[k])
    return None, (key, was.get(key), now[key])


def check_resumable(out: Path, jobs: Sequence[Job], model: str, tokens: int, device: str,
                    image: str | None = None) -> dict[str, dict[str, Any]]:
    """The saved runs under ``out/runs`` that these jobs reuse (a missing, unreadable or
    damaged one is redone).

    Raises:
        UserError: a saved run of one of the jobs was made with other options (another model,
            token count, prompt text...): the folder holds another set's runs, never mixed.
    """
    records: dict[str, dict[str, Any]] = {}
    for job in jobs:
        path = out / "runs" / f"{job.name}.json"
        if not path.is_file():
            continue
        saved, differs = _saved(path, job_spec(job, model, tokens, device, image))
        if differs:
            key, was, now = differs
            raise UserError(f"{path} was made with {key} {was!r}, not {now!r}: a set never "
                            "mixes runs made with other options; give another --out (or remove "
                            "that folder's runs/)")
        if saved is not None:
            records[job.name] = saved
    return records


def run_grid(model: str, out: Path, jobs: Sequence[Job], tokens: int, device: str = "auto",
             say: Callable[[str], None] = print, should_stop: Callable[[], bool] | None = None,
             image: str | None = None,
             on_record: Callable[[Job, dict[str, Any]], None] | None = None
             ) -> dict[str, dict[str, Any]]:
    """Run (or reuse) every job, one after the other, the model loaded once per dtype (the jobs
    come grouped by dtype); returns {job name: record}. Image jobs put ``image`` in the context
    of a chat-template prompt (the model's processor makes its tokens). A saved run made with
    other options is refused before any run (`check_resumable`); each new record is checked
    and written the moment its run ends (``on_record`` then), so a stop keeps what finished."""
    records = check_resumable(out, jobs, model, tokens, device, image)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    loaded: Any = None
    for i, job in enumerate(jobs):
        if job.name in records:
            say(f"[{i + 1}/{len(jobs)}] {job.name}: reusing {out / 'runs' / job.name}.json")
            continue
        if loaded is not None and str(loaded.dtype).removeprefix("torch.") != job.dtype:
            loaded = None  # free the other precision first
        record, loaded = run_job(job, model, tokens, device, image, loaded, should_stop)
        save_record(out, job, record)
        records[job.name] = record
        if on_record is not None:
            on_record(job, record)
        say(f"[{i + 1}/{len(jobs)}] {job.name}: {record_line(record)}")
    return records


def record_line(record: dict[str, Any]) -> str:
    p = record["summary"]["patched"]
    return f"match {p['matches']}/{record['summary']['tokens']}, max L-inf {p['max_linf']:.3g}"


def run_job(job: Job, model: str, tokens: int, device: str, image: str | None, loaded: Any,
            should_stop: Callable[[], bool] | None = None) -> tuple[dict[str, Any], Any]:
    """One job's run on ``loaded`` (the model is loaded first when None); returns its record
    and the model. A stopped run raises KeyboardInterrupt (it is redone next time)."""
    from .runs import compare, load, prepare

    if job.prompt < 0 and image is None:
        raise UserError("the image runs need a picture")
    spec = job_spec(job, model, tokens, device, image, loaded)
    picture = prepare(spec)
    if loaded is None:
        loaded = load(spec, should_stop=should_stop)
        spec = job_spec(job, model, tokens, device, image, loaded)
    run = compare(loaded, spec, picture, should_stop=should_stop)
    if should_stop is not None and should_stop():
        raise KeyboardInterrupt  # stopped: keep what is saved, redo this run next time
    if len(run.steps) < tokens and not (spec.stop_at_eos and run.steps):
        raise KeyboardInterrupt
    record = run.record
    record["max_abs_scale_patch"] = max_scale_patch(record)
    return record, loaded


def save_record(out: Path, job: Job, record: dict[str, Any]) -> Path:
    """A finished run's record, checked against the schema (`core.record.check_record`) and
    written atomically under ``out/runs``."""
    from .export import json_text, write_json
    from .record import check_record

    check_record(json.loads(json_text(record)), f"the run {job.name}")
    path = out / "runs" / f"{job.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, record)
    return path


def job_spec(job: Job, model: str, tokens: int, device: str, image: str | None,
             loaded: Any = None) -> Any:
    """A job's `RunSpec`: a set row's context, query and picture with the job's absorb mode
    and layers; or the paper's grid's (absorb all, greedy, no context), the image run's picture
    in the context of a chat-template prompt when the model has one (instruct models; known
    once ``loaded``)."""
    from .spec import RunSpec

    analyze = frozenset(job.analyze)
    if job.query is not None:  # a prompt set's row
        return RunSpec(model=model, dtype=job.dtype, device=device, max_new_tokens=tokens,
                       method=job.method, absorb=job.absorb, layers=job.layers,
                       context=job.context, query=job.query, image=job.image, analyze=analyze)
    chat = False
    if job.prompt < 0 and loaded is not None:
        from .prompt import has_chat_template

        chat = has_chat_template(loaded.tokenizer, loaded.processor)
    return RunSpec(model=model, dtype=job.dtype, device=device, max_new_tokens=tokens,
                   method=job.method, absorb="all", layers=job.layers,
                   query=IMAGE_QUERY if job.prompt < 0 else PAPER_PROMPTS[job.prompt],
                   image=image if job.prompt < 0 else None, chat_template=chat, analyze=analyze)


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


def summary(records: dict[str, dict[str, Any]], jobs: Sequence[Job]) -> list[dict[str, Any]]:
    """Figure 4's numbers: per setting (precision, method, absorb mode, layers), pooled over the
    prompts, settings in the jobs' order."""
    by_setting: dict[str, list[Job]] = {}
    for job in jobs:
        if job.setting and job.name in records:
            by_setting.setdefault(job.setting, []).append(job)
    rows = []
    for name, group in by_setting.items():
        runs = [records[j.name] for j in group]
        steps = [s for r in runs for s in r["steps"]]
        tvd = [float(s["tvd"]) for s in steps]
        linf = [float(s["linf"]) for s in steps]
        scale = [r.get("max_abs_scale_patch") for r in runs]
        first = group[0]
        rows.append({
            "setting": name, "dtype": first.dtype, "method": first.method,
            "absorb": first.absorb, "layers": first.layers, "prompts": len(runs),
            "tokens": len(steps),
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
