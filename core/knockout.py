"""The context lens's complement (../shared/ANALYSIS.md A1): the knock-out effect of each layer
at one step, the emitted token's logit when that layer's patches alone are dropped.

The lens reads a layer's *direct* effect; what ``delta_l`` does through the layers after it is
not in it. Here the step's kept patches are written into the weights (as verify does:
`core.verify.materialized`, originals restored in ``finally``) and the reduced input runs with
plain transformers, once with every patch, once with none, and once per patched layer without
that layer's patches. The patches are fixed, so later layers do not re-absorb a dropped layer's
effect (the engine, which builds each patch from the actual activations, would). One reduced
forward per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .errors import Cancelled, UserError
from .forward import last_logits, rolled_back
from .geometry import layer_of
from .loading import LoadedModel
from .results import StepResult
from .verify import _Fed, materialized, patches_of_steps

#: the largest gap, in probability over the full context's top-k, between the run with every
#: patch written into the weights and the full-context run for the knock-out to be read: beyond
#: it the written patches do not reproduce the run (method direct's unbounded post-norm-scale
#: patches in float32, as verify finds), and neither do its knock-outs
REPRODUCES = 1e-3


def knockout(loaded: LoadedModel, step: StepResult, scope: str = "all-positions",
             progress: Callable[[int, int], None] | None = None,
             should_stop: Callable[[], bool] | None = None) -> dict[str, Any]:
    """The emitted token's logit at ``step`` with all its patches, with none, and with each
    patched layer's patches dropped.

    Args:
        loaded: the model the run used.
        step: a step that kept its patch vectors (``keep_patches``, or ``analyze`` geometry).
        scope: the run's scope ("query": the reduced prefix runs unpatched into a cache and
            only the last token with the patches, as verify does).

    Returns:
        JSON-ready ``{"step", "token": {"id", "text"}, "all", "none", "layers": {l: logit},
        "effect": {l: all - logit}, "prob_gap", "reproduces"}``: ``prob_gap`` the largest
        probability difference over the full context's top-k between the run with every patch
        written and the full-context run, ``reproduces`` whether it is within `REPRODUCES`.

    Raises:
        UserError: the step kept no patches.
        Cancelled: ``should_stop`` said so between passes.
    """
    if step.patches is None:
        raise UserError("the knock-out writes the step's patches into the weights, and this run "
                        "kept none: run it again keeping the patches (--save-patches, or "
                        "analyze geometry)")
    pf = patches_of_steps([step], scope)
    patches = pf.patches.get(step.step, {})
    layers = sorted({i for name, _ in patches for i in [layer_of(name)] if i is not None})
    model, device, token = loaded.model, loaded.device, step.baseline_token
    red, pos = list(step.reduced_input_ids), step.reduced_position_ids
    prefix = _Fed(model, device)

    gap: list[float] = []  # with every patch: the written run's distance to the full context

    def logit(chosen: dict[Any, Any], check: bool = False) -> float:
        if should_stop is not None and should_stop():
            raise Cancelled
        if scope == "query" and len(red) > 1:
            prefix.feed(red[:-1], None if pos is None else pos[:-1], logits=False)
            with rolled_back(prefix.cache), materialized(model, chosen):
                out = last_logits(model, red[-1:], device, prefix.cache,
                                  None if pos is None else pos[-1:])
        else:
            with materialized(model, chosen):
                out = last_logits(model, red, device, positions=None if pos is None else
                                  list(pos))
        if check:
            probs = torch.softmax(out.double(), -1)
            top = step.baseline_top_k
            gap.append(max(abs(float(probs[i]) - p) for i, p in zip(top.ids, top.probs,
                                                                     strict=True)))
        return float(out[token])

    total = len(layers) + 2
    with torch.inference_mode():
        every, none = logit(patches, check=True), logit({})
        if progress is not None:
            progress(2, total)
        dropped: dict[str, float] = {}
        for j, i in enumerate(layers):
            dropped[str(i)] = logit({k: v for k, v in patches.items() if layer_of(k[0]) != i})
            if progress is not None:
                progress(j + 3, total)
    return {"step": step.step, "token": {"id": token, "text": step.baseline_text},
            "all": every, "none": none, "layers": dropped,
            "effect": {i: every - v for i, v in dropped.items()},
            "prob_gap": gap[0], "reproduces": gap[0] <= REPRODUCES}


__all__ = ["REPRODUCES", "knockout"]
