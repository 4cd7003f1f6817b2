"""A run's results as plain data: per-token `StepResult` (both sides' predictions, their
distances to the baseline, patch norms, layer flags) and the pooled `summarize`. No tensors:
these cross into the window, the JSON and the reports."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class TopK:
    ids: tuple[int, ...]
    texts: tuple[str, ...]
    probs: tuple[float, ...]

    def to_list(self) -> list[dict[str, Any]]:
        return [{"id": i, "text": t, "prob": p} for i, t, p in zip(self.ids, self.texts, self.probs, strict=True)]


@dataclass(frozen=True)
class Side:
    """One side's prediction at a step and its distance to the baseline."""

    token: int
    text: str
    match: bool
    linf: float  # max |logits - baseline logits|
    tvd: float  # half the L1 distance of the softmaxes
    top_k: TopK

    def to_dict(self) -> dict[str, Any]:
        return {
            "token": self.token,
            "text": self.text,
            "match": self.match,
            "linf": self.linf,
            "tvd": self.tvd,
            "top_k": self.top_k.to_list(),
        }


#: the control's place in a run made without it (``Settings.control`` off)
NO_CONTROL = Side(token=-1, text="", match=False, linf=math.nan, tvd=math.nan,
                  top_k=TopK((), (), ()))


@dataclass(frozen=True)
class StepResult:
    """Everything about one generated token, as plain data."""

    step: int
    position: int  # absolute position of the current (query) token in the full sequence
    baseline_token: int
    baseline_text: str
    baseline_top_k: TopK
    logit_scale: float  # max |baseline logits|, the scale the differences are judged against
    patched: Side
    control: Side  # the unpatched model on the same reduced sequence
    full_input_ids: tuple[int, ...]
    reduced_input_ids: tuple[int, ...]
    reduced_position_ids: tuple[int, ...] | None
    patch_norms: dict[int, dict[str, dict[str, float]]]  # layer -> param -> norm name -> value
    layer_info: dict[int, dict[str, Any]]  # layer -> shift_norm, block_error, flags
    seconds: dict[str, float]  # baseline, patched, control
    patches: dict[str, np.ndarray] | None = field(default=None, repr=False)  # "{param}.u" etc.

    @property
    def match(self) -> bool:
        return self.patched.match

    @property
    def linf(self) -> float:
        return self.patched.linf

    @property
    def tvd(self) -> float:
        return self.patched.tvd


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def summarize(steps: Sequence[StepResult]) -> dict[str, Any]:
    """Pooled metrics over a run: match rate, max and median of each, for patched and control."""
    out: dict[str, Any] = {"tokens": len(steps)}
    for label, sides in (("patched", [s.patched for s in steps]), ("control", [s.control for s in steps])):
        if label == "control" and steps and all(x.token == NO_CONTROL.token for x in sides):
            out["control"] = None  # a run made without the control
            continue
        linf, tvd = [x.linf for x in sides], [x.tvd for x in sides]
        matches = sum(x.match for x in sides)
        out[label] = {
            "matches": matches,
            "match_rate": matches / len(sides) if sides else math.nan,
            "max_linf": max(linf, default=math.nan),
            "median_linf": _median(linf),
            "max_tvd": max(tvd, default=math.nan),
            "median_tvd": _median(tvd),
            "mean_tvd": statistics.fmean(tvd) if tvd else math.nan,
        }
    infos = [info for s in steps for info in s.layer_info.values()]
    out["faults"] = {
        "div_by_one": sum(int(i["div_by_one"]) for i in infos),
        "hard_case_layers": sum(bool(i["hard_case"]) for i in infos),
        "zero_z_layers": sum(bool(i["zero_z"]) for i in infos),
        "zero_h_layers": sum(bool(i["zero_h"]) for i in infos),
    }
    seconds = {k: sum(s.seconds[k] for s in steps) for k in ("baseline", "patched", "control")}
    out["seconds"] = {**seconds, "total": sum(seconds.values())}
    return out
