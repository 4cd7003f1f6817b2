"""Runs read back from their JSON records (DESIGN.md "Run JSON"), for sessions and reports.

`run_from_record` inverts `core.export.run_record`: it rebuilds the prompt and the frozen
`StepResult`s (without patch vectors), so a saved run reopens without recomputing. Records of an
unknown or newer schema, or with missing fields, are a `UserError` naming the problem.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .errors import UserError
from .images import ImageInfo
from .prompt import Prompt, Segment

SUPPORTED_SCHEMAS = (1,)


@dataclass(frozen=True)
class Run:
    """A run as the views need it: settings, model description, prompt and steps."""

    settings: dict[str, Any]
    model: dict[str, Any]
    prompt: Prompt
    steps: tuple[Any, ...]  # core.compare.StepResult
    record: dict[str, Any]  # the record itself (summary, controllability, ...)


def _float(x: Any) -> float:
    return math.nan if x is None else float(x)


def _topk(items: list[dict[str, Any]]) -> Any:
    from .compare import TopK

    return TopK(tuple(int(i["id"]) for i in items), tuple(str(i["text"]) for i in items),
                tuple(_float(i["prob"]) for i in items))


def _side(token: dict[str, Any], match: bool, linf: Any, tvd: Any, top: list[Any]) -> Any:
    from .compare import Side

    return Side(int(token["id"]), str(token["text"]), bool(match), _float(linf), _float(tvd),
                _topk(top))


def step_from_dict(d: dict[str, Any], full_ids: tuple[int, ...]) -> Any:
    """One step of a record; ``full_ids`` is the full-context sequence up to this step."""
    from .compare import StepResult

    c, top = d["control"], d["top_k"]
    return StepResult(
        step=int(d["step"]),
        position=int(d["position"]),
        baseline_token=int(d["baseline_token"]["id"]),
        baseline_text=str(d["baseline_token"]["text"]),
        baseline_top_k=_topk(top["baseline"]),
        logit_scale=_float(d["logit_scale"]),
        patched=_side(d["patched_token"], d["match"], d["linf"], d["tvd"], top["patched"]),
        control=_side(c["token"], c["match"], c["linf"], c["tvd"], top["control"]),
        full_input_ids=full_ids,
        reduced_input_ids=tuple(int(i) for i in d["reduced_input_ids"]),
        reduced_position_ids=(None if d.get("reduced_position_ids") is None
                              else tuple(int(i) for i in d["reduced_position_ids"])),
        patch_norms={int(k): v for k, v in d.get("patch_norms", {}).items()},
        layer_info={int(k): v for k, v in d.get("layers", {}).items()},
        seconds={k: float(v) for k, v in d.get("seconds", {}).items()},
    )


def run_from_record(record: Any, source: str = "the record") -> Run:
    """Rebuild a run from its JSON record.

    Raises:
        UserError: a record of another schema, or one with missing or malformed fields.
    """
    if not isinstance(record, dict) or "schema_version" not in record:
        raise UserError(f"{source} is not a ctxpatch run (no schema_version)")
    version = record["schema_version"]
    if version not in SUPPORTED_SCHEMAS:
        raise UserError(f"{source} has run schema {version!r}; this ctxpatch reads "
                        f"{', '.join(map(str, SUPPORTED_SCHEMAS))}: update ctxpatch to open it")
    try:
        segments = tuple(Segment(str(s["kind"]), str(s["text"]), tuple(int(i) for i in s["ids"]))
                         for s in record["prompt"]["segments"])
        bos = record["prompt"].get("bos_id")
        image = record["prompt"].get("image")
        prompt = Prompt(segments, bos_id=None if bos is None else int(bos),
                        image=None if image is None else ImageInfo.from_dict(image))
        full = list(prompt.full_ids)
        steps = []
        for d in record["steps"]:
            steps.append(step_from_dict(d, tuple(full)))
            full.append(int(d["baseline_token"]["id"]))
        return Run(dict(record["settings"]), dict(record["model"]), prompt, tuple(steps), record)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UserError(f"{source} is damaged or incomplete ({type(exc).__name__}: {exc}): "
                        "re-export it from the run, or open another file") from None
