"""One model of a run, shared by the command line, the window, the experiments and the Python
API: the comparison loop with its controllability plan, the run record (DESIGN.md "Run JSON"),
and the verify verdict."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .compare import Settings, StepResult, iter_token_patches, resolve_control_row
from .controllability import LayerPlan, plan, record_section
from .errors import UserError
from .export import run_record
from .loading import LoadedModel
from .prompt import Prompt
from .results import nan_max


def record_of(model: dict[str, Any], prompt: Prompt, settings: Settings,
              steps: Sequence[StepResult], extra: dict[str, Any] | None = None,
              plans: Sequence[LayerPlan] | None = None, wall: float | None = None
              ) -> dict[str, Any]:
    """The run record: `core.export.run_record`, the controllability section when the plan is
    known, and the wall time when measured."""
    record = run_record(model, prompt, settings, steps, extra)
    if plans is not None:
        record["controllability"] = record_section(plans, steps)
    if wall is not None:
        record["summary"]["seconds"]["wall"] = wall
    return record


@dataclass
class Comparison:
    """A finished (or stopped) comparison: its steps, its plan and its record."""

    steps: list[StepResult]
    plans: list[LayerPlan]
    record: dict[str, Any]
    settings: Settings
    prompt: Prompt
    extra: dict[str, Any] = field(default_factory=dict)


def run_comparison(loaded: LoadedModel, prompt: Prompt, settings: Settings,
                   extra: dict[str, Any] | None = None,
                   on_step: Callable[[StepResult], None] | None = None,
                   should_stop: Callable[[], bool] | None = None,
                   plans: list[LayerPlan] | None = None) -> Comparison:
    """Plan (unless ``plans`` is given), run every step (``on_step`` after each; ``should_stop``
    between layers and tokens) and build the record."""
    settings = resolve_control_row(loaded, settings)
    plans = plan(loaded, settings) if plans is None else plans
    steps: list[StepResult] = []
    start = time.perf_counter()
    for s in iter_token_patches(loaded, prompt, settings, should_stop):
        steps.append(s)
        if on_step is not None:
            on_step(s)
    wall = time.perf_counter() - start
    record = record_of(loaded.describe(), prompt, settings, steps, extra, plans, wall)
    return Comparison(steps, plans, record, settings, prompt, dict(extra or {}))


def default_tolerance(dtype: str, given: float | None = None) -> float:
    """Verify's tolerance, relative to the logit scale: ``given`` (a positive number), else
    1e-3 in float64, 1e-2 in float32, token match only (infinite) in 16-bit."""
    if given is not None:
        if not isinstance(given, int | float) or not math.isfinite(given) or given <= 0:
            raise UserError(f"--tolerance {given}: give a positive number, e.g. 1e-3 (relative "
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
