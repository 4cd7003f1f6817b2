"""One model of a run, shared by the command line, the window, the experiments and the Python
API: the comparison loop with its controllability plan, the run record (DESIGN.md "Run JSON"),
and the verify verdict."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .analysis import analysis_section
from .compare import iter_token_patches
from .controllability import LayerPlan
from .errors import UserError, mention
from .loading import LoadedModel
from .plan import RunPlan
from .prompt import Prompt
from .record import record_of
from .results import StepResult, nan_max
from .spec import RunSpec, check_request


@dataclass
class Comparison:
    """A finished (or stopped) comparison: its steps, its plan and its record."""

    steps: list[StepResult]
    plans: list[LayerPlan]
    record: dict[str, Any]
    spec: RunSpec
    prompt: Prompt


def prepare(spec: RunSpec) -> Any:
    """Every check of a comparison request that needs no model (`RunSpec.validate`,
    `core.spec.check_request`), and its picture read (a bad file fails before the model
    loads); returns the picture (`core.images.read_image`) or None."""
    spec.validate()
    check_request(spec)
    check_length_early(spec)
    if spec.image is None:
        return None
    from .images import read_image

    return read_image(spec.image)


#: tokens a chat template or an image may encode the same text in fewer of (an early refusal
#: must never refuse a prompt that fits: the exact check follows the load)
_SLACK = 16


def check_length_early(spec: RunSpec) -> None:
    """An over-long prompt of a local model refused before its weights load: the context's and
    the query's tokens alone (from the tokenizer, as `core.prompt.build_prompt` encodes them)
    against the config's positions. Only where the text could be too long (a token is at least
    one byte); any problem reading the files is left to the load, which reports it."""
    import json

    from .footprint import DEMOS, demo_folder

    folder = Path(demo_folder(spec.model) if spec.model in DEMOS else spec.model).expanduser()
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        text = config.get("text_config") or config
        limit = int(next(v for v in (text.get(k) for k in ("max_position_embeddings",
                                                           "n_positions")) if v))
    except (OSError, ValueError, TypeError, StopIteration, AttributeError):
        return
    if len((spec.context + spec.query).encode("utf-8")) + spec.max_new_tokens <= limit:
        return
    try:
        from transformers import AutoTokenizer

        from .loading import quiet_transformers
        from .prompt import CONTEXT_SEPARATOR, _encode

        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True,
                                                      trust_remote_code=spec.trust_remote_code)
        context = spec.context + CONTEXT_SEPARATOR if spec.context else ""
        n = len(_encode(tokenizer, context)) + len(_encode(tokenizer, spec.query))
    except Exception:  # noqa: BLE001 - the load reads these files again and says what is wrong
        return
    if n - _SLACK + spec.max_new_tokens > limit:
        raise UserError(f"input too long: at least {n} prompt tokens + {spec.max_new_tokens} new "
                        f"tokens exceed the model's {limit} positions (shorten the context or "
                        "generate fewer tokens)")


def load(spec: RunSpec, progress: Callable[[str, int, int], None] | None = None,
         should_stop: Callable[[], bool] | None = None) -> LoadedModel:
    """The spec's model, loaded as it says (dtype, device or placement, trust)."""
    from .loading import load_model

    return load_model(spec.model, dtype=spec.dtype, device=spec.device, progress=progress,
                      should_stop=should_stop, trust_remote_code=spec.trust_remote_code,
                      allow_pickle=spec.allow_pickle, placement=spec.placement())


def prompt_of(loaded: LoadedModel, spec: RunSpec, picture: Any = None) -> Prompt:
    """The spec's prompt, tokenized by the model's tokenizer (and processor, for a picture)."""
    from .prompt import build_prompt

    return build_prompt(loaded.tokenizer, spec.context, spec.query, spec.chat_template,
                        image=picture, processor=loaded.processor)


def compare(loaded: LoadedModel, spec: RunSpec, picture: Any = None,
            on_step: Callable[[StepResult], None] | None = None,
            should_stop: Callable[[], bool] | None = None) -> Comparison:
    """`prompt_of`, then `run_comparison`."""
    return run_comparison(loaded, prompt_of(loaded, spec, picture), spec, on_step, should_stop)


def run_comparison(loaded: LoadedModel, prompt: Prompt, spec: RunSpec,
                   on_step: Callable[[StepResult], None] | None = None,
                   should_stop: Callable[[], bool] | None = None,
                   plan: RunPlan | None = None,
                   transfer_progress: Callable[[int, int], None] | None = None) -> Comparison:
    """Plan (`RunPlan.build`, unless the caller did), run every step (``on_step`` after each;
    ``should_stop`` between layers and tokens), then the transfer when asked
    (``transfer_progress(done, total)`` after each of its passes) and build the record."""
    plan = RunPlan.build(loaded, prompt, spec) if plan is None else plan
    steps: list[StepResult] = []
    start = time.perf_counter()
    for s in iter_token_patches(loaded, prompt, plan.spec, should_stop, plan):
        steps.append(s)
        if on_step is not None:
            on_step(s)
    wall = time.perf_counter() - start
    transfer = None
    if "transfer" in plan.spec.analyze and steps:
        from .errors import Cancelled
        from .transfer import transfer as transfer_of

        try:  # (a stop during the transfer keeps the run, without its transfer)
            transfer = transfer_of(loaded, steps, plan.spec.scope, pixels=prompt.pixels,
                                   progress=transfer_progress, should_stop=should_stop)
        except Cancelled:
            transfer = None
    record = record_of(loaded.describe(), prompt, plan.spec, steps, plan.report, wall,
                       analysis_section(steps, plan.spec.analyze, transfer))
    return Comparison(steps, plan.report, record, plan.spec, prompt)


def verify_run(loaded: LoadedModel, comparison: Comparison,
               progress: Callable[[int, int], None] | None = None) -> Verdict:
    """Write each step's kept patches into a copy of the weights, run plain transformers and
    compare (``--verify``); the verdict also goes into the record's ``verification``."""
    from .verify import patches_of_steps, verify_patches

    checks = verify_patches(loaded, patches_of_steps(comparison.steps, comparison.spec.scope),
                            progress=progress, pixels=comparison.prompt.pixels)
    result = verdict(checks, default_tolerance(comparison.spec.dtype))
    comparison.record["verification"] = result.to_dict()
    return result


def default_tolerance(dtype: str, given: float | None = None) -> float:
    """Verify's tolerance, relative to the logit scale: ``given`` (a positive number), else
    1e-3 in float64, 1e-2 in float32, token match only (infinite) in 16-bit."""
    if given is not None:
        if not isinstance(given, int | float) or not math.isfinite(given) or given <= 0:
            raise UserError(f"{mention('tolerance')} {given}: give a positive number, e.g. 1e-3 "
                            "(relative "
                            "to the logit scale)")
        return float(given)
    return {"float64": 1e-3, "float32": 1e-2}.get(dtype, math.inf)


@dataclass(frozen=True)
class Verdict:
    """Whether saved patches reproduce the run: every token matches and the worst L-inf is
    within the tolerance of the logit scale. A NaN anywhere, or no checks at all, is never
    verified."""

    ok: bool
    matches: int
    steps: int
    worst: float  # the largest L-inf relative to the logit scale (NaN when any is NaN)
    max_linf: float  # the largest L-inf (NaN when any is NaN)
    tolerance: float

    def line(self) -> str:
        return (f"{'verified' if self.ok else 'verification FAILED'}: {self.matches}/{self.steps} "
                f"tokens match, max L-inf {self.max_linf:.3g} ({self.worst:.3g} of the logit "
                f"scale; tolerance {self.tolerance:g})")

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "matches": self.matches, "steps": self.steps,
                "worst_relative_linf": None if math.isnan(self.worst) else self.worst,
                "tolerance": self.tolerance if math.isfinite(self.tolerance) else None}


def verdict(checks: Sequence[Any], tolerance: float) -> Verdict:
    """The verdict over verify's per-step checks (`core.verify.StepCheck`)."""
    worst = nan_max([c.linf / max(c.scale, 1e-30) for c in checks], default=0.0)
    max_linf = nan_max([c.linf for c in checks], default=0.0)
    matches = sum(bool(c.match) for c in checks)
    ok = bool(checks) and matches == len(checks) and not math.isnan(worst) and worst <= tolerance
    return Verdict(ok, matches, len(checks), worst, max_linf, tolerance)
