"""A run's results as plain data: per-token `StepResult` (both sides' predictions, their
distances to the baseline, patch norms, layer flags) and the pooled `summarize`. No tensors:
these cross into the window, the JSON and the reports."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict, get_type_hints

import numpy as np

#: a patch whose largest entry exceeds this multiple of the largest entry of the weight it
#: patches is reported as unbounded (ill-conditioned): it reproduces the run through rank-1
#: actions, but written into weights of the run's own precision it amplifies their rounding
ENTRY_BOUND = 100.0


class LayerInfo(TypedDict):
    """One patched layer at one step (`StepResult.layer_info`; the run JSON's ``layers``)."""

    entry_ratio: float  # largest patch entry over the largest entry of the weight it patches
    unbounded: bool  # entry_ratio > ENTRY_BOUND
    shift_norm: float  # |dv|, the attention's shift at the query
    block_error: float  # max |T - T_C| at the query after patching (NaN: not measured)
    div_by_one: int  # scale-patch coordinates with N(h)_j = 0, divided by one
    hard_case: bool  # the stable update's secular equation had no interior root
    zero_z: bool  # an input matrix saw z = 0: no input patch
    zero_h: bool  # the output matrix saw h = 0: no output patch
    zero_s: bool  # MoE: the active routing weights summed to 0
    nonfinite: bool  # a patch vector came out NaN or infinite


#: the `LayerInfo` fields the engine measures per layer (`core.engine.LayerPatch`), with their
#: types; the other two come from the patch norms
LAYER_MEASURES: dict[str, type] = {name: kind for name, kind in get_type_hints(LayerInfo).items()
                                   if name not in ("entry_ratio", "unbounded")}


@dataclass(frozen=True)
class TopK:
    ids: tuple[int, ...]
    texts: tuple[str, ...]
    probs: tuple[float, ...]

    def to_list(self) -> list[dict[str, Any]]:
        return [{"id": i, "text": t, "prob": p}
                for i, t, p in zip(self.ids, self.texts, self.probs, strict=True)]


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


#: the control's place in a run made without it (``RunSpec.control`` off)
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
    layer_info: dict[int, LayerInfo]  # layer -> |dv|, block error, flags
    seconds: dict[str, float]  # baseline, patched, control
    patches: dict[str, np.ndarray] | None = field(default=None, repr=False)  # "{param}.u" etc.
    #: the context lens of this step (``analyze`` "lens"; `core.lens.lens_step`), else None
    lens: dict[str, Any] | None = field(default=None, repr=False)

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
    if any(math.isnan(v) for v in values):
        return math.nan
    return statistics.median(values) if values else math.nan


def nan_max(values: Sequence[float] | Any, default: float = math.nan) -> float:
    """The largest value, NaN when any is NaN (Python's ``max`` keeps or drops a NaN depending
    on where it stands), ``default`` when there are none. One rule for every summary."""
    values = [float(v) for v in values]
    if any(math.isnan(v) for v in values):
        return math.nan
    return max(values, default=default)


def conditioning(steps: Sequence[StepResult]) -> dict[str, Any]:
    """How well-conditioned a run's patches are (what decides whether they verify when written
    into weights of the run's own precision):

    - ``max_abs_scale_patch``: the largest ``|dm|`` of a post-norm scale patch (None without one),
      with the step and layer where it occurred;
    - ``max_entry_ratio``: the largest patch entry over the largest entry of its weight;
    - ``max_relative_norm``: the largest patch norm over its weight's norm;
    - ``unbounded_layers`` / ``unbounded_steps``: layer-steps and steps whose entry ratio exceeds
      ``bound`` (`ENTRY_BOUND`);
    - ``hard_case_layers`` / ``hard_case_steps``: where the stable fit had no interior root.
    """
    dm, dm_at = None, None
    ratio = rel = 0.0
    for s in steps:
        for layer, params in s.patch_norms.items():
            for name, v in params.items():
                ratio = max(ratio, v.get("entry_ratio", 0.0))
                rel = max(rel, v.get("relative", 0.0))
                if "linf" in v and name.endswith(".weight") and (dm is None or v["linf"] > dm):
                    dm, dm_at = v["linf"], {"step": s.step, "layer": layer}
    infos = [(s.step, i) for s in steps for i in s.layer_info.values()]
    return {
        "max_abs_scale_patch": dm,
        "max_abs_scale_patch_at": dm_at,
        "max_entry_ratio": ratio,
        "max_relative_norm": rel,
        "bound": ENTRY_BOUND,
        "unbounded_layers": sum(bool(i.get("unbounded")) for _, i in infos),
        "unbounded_steps": len({t for t, i in infos if i.get("unbounded")}),
        "hard_case_layers": sum(bool(i.get("hard_case")) for _, i in infos),
        "hard_case_steps": len({t for t, i in infos if i.get("hard_case")}),
    }


def summarize(steps: Sequence[StepResult]) -> dict[str, Any]:
    """Pooled metrics over a run: match rate, max and median of each, for patched and control."""
    out: dict[str, Any] = {"tokens": len(steps)}
    for label, sides in (("patched", [s.patched for s in steps]),
                         ("control", [s.control for s in steps])):
        if label == "control" and steps and all(x.token == NO_CONTROL.token for x in sides):
            out["control"] = None  # a run made without the control
            continue
        linf, tvd = [x.linf for x in sides], [x.tvd for x in sides]
        matches = sum(x.match for x in sides)
        out[label] = {
            "matches": matches,
            "match_rate": matches / len(sides) if sides else math.nan,
            "max_linf": nan_max(linf),
            "median_linf": _median(linf),
            "max_tvd": nan_max(tvd),
            "median_tvd": _median(tvd),
            "mean_tvd": statistics.fmean(tvd) if tvd else math.nan,  # (NaN in, NaN out)
        }
    infos = [info for s in steps for info in s.layer_info.values()]
    out["faults"] = {
        "div_by_one": sum(int(i["div_by_one"]) for i in infos),
        "hard_case_layers": sum(bool(i["hard_case"]) for i in infos),
        "zero_z_layers": sum(bool(i["zero_z"]) for i in infos),
        "zero_h_layers": sum(bool(i["zero_h"]) for i in infos),
    }
    out["conditioning"] = conditioning(steps)
    seconds = {k: sum(s.seconds.get(k, 0.0) for s in steps)  # (a record read back may lack one)
               for k in ("baseline", "patched", "control")}
    out["seconds"] = {**seconds, "total": sum(seconds.values())}
    return out
