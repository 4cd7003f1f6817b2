"""The controllability report (PAPER.md section 4's conditions, section 7's bound).

`output_plan` decides, once per layer when a run is planned, which output control absorbs the
attention shift ``dv`` (an `OutputKind`); the engine's hooks apply that decision and `plan`
reports it. Before a run, `plan` says per patched layer which parameters carry the input and output
controls and which conditions the construction needs at every token (``z != 0`` for a rank-1
input patch, ``h != 0`` for an output matrix, every ``N(h)_j != 0`` for a scale, ``S != 0`` for
the experts), plus what can be seen in the weights already (a post-norm scale with exact zeros,
where the stable update's remainder divides by ~0). After a run, `outcome` counts per layer how
often a condition failed and what was done (division by one, the hard case's fallback, a
skipped patch). When a post-norm family's scale is frozen (output patches disabled), no
upstream change can move the branch by more than ``2 sqrt(d) max|m|``: the plan gives that
bound and `outcome` flags the steps whose attention shift ``|dv|`` exceeds it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from .results import ENTRY_BOUND  # (numpy only, no torch)

if TYPE_CHECKING:  # `outcome` and `summary_lines` run in the window's thread without torch
    from .adapters.base import LayerSites
    from .engine import PatchSpec
    from .loading import LoadedModel
    from .results import StepResult
    from .spec import RunSpec

#: what absorbs the attention shift ``dv`` in one patched layer (`output_plan`)
OutputKind = Literal[
    "bias",  # the output matrix's bias adds dv / branch_scale
    "matrix",  # a rank-1 patch of the output matrix (no post-norm after it)
    "fit",  # the down matrix under a frozen post-norm scale: Appendix B's fit (PAPER.md sec. 7)
    "scale",  # the post-norm scale, direct (Table 1)
    "stable",  # Appendix B: the down matrix's stable target, the scale the remainder
    "experts",  # the active routed experts' down slices, each adding dv / S
    "shared",  # the shared experts' output matrices
    "beside",  # experts beside a dense MLP under one post-norm (Gemma 4): its scale, direct
    "none",  # the layer offers no such control: nothing absorbs dv
]


@dataclass(frozen=True)
class OutputPlan:
    """One layer's output control, decided once when a run is planned (`output_plan`).

    Attributes:
        kind: what absorbs ``dv`` in this layer.
        frozen: output patches are disabled: nothing absorbs ``dv``; ``kind`` says what would
            have (the controllability report's conditions and bound).
    """

    kind: OutputKind
    frozen: bool = False

    @property
    def acting(self) -> OutputKind:
        """The kind the run's hooks apply: ``kind``, or "none" when frozen."""
        return "none" if self.frozen else self.kind


def output_plan(sites: LayerSites, control: str, method: str,
                disabled: frozenset[str] = frozenset()) -> OutputPlan:
    """Which output control absorbs ``dv`` in a layer: the one decision the engine's hooks
    apply (`core.engine.PatchSpec.outputs`) and `plan` reports. Torch-free.

    Args:
        sites: the layer's handles.
        control: the run's resolved output control (`core.compare.resolve_control`).
        method: "direct" or "stable".
        disabled: patch kinds left out ("output" freezes the control).
    """
    frozen = "output" in disabled
    if sites.router is not None and sites.experts is not None:
        if sites.out_norm is not None:
            kind: OutputKind = "beside" if control == "scale" else "none"
        else:
            kind = "shared" if sites.shared else "experts"
    elif sites.out_matrix is None:  # a post-norm scale alone, or nothing
        kind = "scale" if sites.out_norm is not None and control == "scale" else "none"
    elif control == "bias":
        kind = "bias"
    elif sites.out_norm is None:  # (any control but the bias: "experts" in a dense layer of an
        kind = "matrix"  #          MoE model; every family offering "scale" has a post-norm)
    elif control == "scale":
        kind = "stable" if method == "stable" else "scale"
    else:  # "matrix" (or "experts") under a post-norm: its scale stays frozen
        kind = "fit"
    return OutputPlan(kind, frozen)


CONDITIONS = {
    "input": "z != 0 (the input matrices' input at the query)",
    "matrix": "h != 0 (the output matrix's input)",
    "bias": "none (a bias can add any shift)",
    "scale": "every N(h)_j != 0 (else that coordinate divides by one and stays off)",
    "frozen": "|dv| <= 2 sqrt(d) max|m| (beyond it no change before the frozen norm can "
              "absorb the shift, PAPER.md section 7)",
    "experts": "S != 0 (the active routing weights' sum) and every active expert's h != 0",
    "shared": "every shared expert's h != 0 and gate value != 0 (the shared experts absorb dv)",
}


@dataclass(frozen=True)
class LayerPlan:
    layer: int
    inputs: tuple[str, ...]  # parameters patched at the input (rank-1)
    outputs: tuple[str, ...]  # parameters of the output control
    control: str
    conditions: tuple[str, ...]
    warnings: tuple[str, ...]
    frozen_bound: float | None  # section 7 bound when the post-norm scale is frozen
    mixer: str = "attention"  # the token mixer before the MLP (attention, linear attention,
    #                           state-space)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan(loaded: LoadedModel, settings: RunSpec) -> list[LayerPlan]:
    """The controllability report of a run of ``settings`` without running it (a run has it in
    `core.plan.RunPlan.report`)."""
    from .plan import plan_patching

    _, sites, spec = plan_patching(loaded, settings)
    return report(loaded, sites, spec)


def report(loaded: LoadedModel, sites: dict[int, LayerSites], spec: PatchSpec
           ) -> list[LayerPlan]:
    """What the run will patch, per layer, and under which conditions, from the run's own
    layers, sites and output plans (`core.plan.plan_patching`)."""
    import torch

    from .engine_moe import gate_up_name
    from .offload import resident
    from .patches import reachable_shift_bound

    model = loaded.model
    names = {id(m): n for n, m in model.named_modules()}

    def weight(m: Any) -> str:
        return f"{names[id(m)]}.weight"

    def scale(norm: Any) -> Any:  # the post-norm scale m, float64
        return spec.norm_offset + resident(norm, "weight").detach().to(torch.float64)

    plans = []
    for i, s in sites.items():
        out = spec.outputs[i]
        inputs: list[str] = [weight(m) for _, m in s.inputs]
        outputs: list[str] = []
        conditions = [CONDITIONS["input"]]
        warnings: list[str] = []
        bound = None
        if s.router is not None and s.experts is not None:
            ex = names[id(s.experts)]
            inputs += [weight(s.router), f"{ex}.{gate_up_name(s.experts)}[active]"]
            for shared in s.shared:  # always-active experts: their inputs (and gate) too
                inputs += [weight(m) for _, m in shared.inputs]
                if shared.gate is not None:
                    inputs.append(weight(shared.gate))
        if out.kind in ("bias", "matrix"):
            param = "bias" if out.kind == "bias" else "weight"
            outputs = [f"{names[id(s.out_matrix)]}.{param}"]
            conditions.append(CONDITIONS[out.kind])
        elif out.kind == "fit":
            outputs = [weight(s.out_matrix)]
            conditions.append(CONDITIONS["frozen"])
            warnings.append("the post-norm scale is frozen: the down matrix alone reaches the "
                            "shift only where Appendix B's fit is exact")
            bound = reachable_shift_bound(scale(s.out_norm))
        elif out.kind in ("scale", "stable"):
            outputs = [weight(s.out_matrix)] if out.kind == "stable" else []
            outputs.append(weight(s.out_norm))
            conditions.append(CONDITIONS["scale"])
            m = scale(s.out_norm)
            zeros = int((m == 0).sum())
            if zeros:
                warnings.append(f"the scale m has {zeros} exact zero(s)"
                                + (": the stable update aims the down patch away from them"
                                   if out.kind == "stable" else
                                   ": the direct update's dm = dv / N(h) is large there "
                                   "(method 'stable' bounds it)"))
            if out.frozen:
                bound = reachable_shift_bound(m)
        elif out.kind == "beside":  # experts beside a dense MLP under one post-norm (Gemma 4)
            outputs = [weight(s.out_norm)]
            conditions.append(CONDITIONS["scale"])
        elif out.kind == "experts":
            outputs = [f"{names[id(s.experts)]}.down_proj[active]"]
            conditions.append(CONDITIONS["experts"])
        elif out.kind == "shared":
            outputs = [weight(shared.down) for shared in s.shared]
            conditions.append(CONDITIONS["shared"])
        if s.parallel:
            warnings.append("parallel block: the input patches are ~0 once the layer input "
                            "matches (they absorb upstream mismatch only)")
        if "input" in spec.disabled:
            inputs = []
        if out.frozen:
            outputs = []
            warnings.append("output control frozen: the attention shift is not absorbed here")
        plans.append(LayerPlan(i, tuple(inputs), tuple(outputs), spec.output_control,
                               tuple(conditions), tuple(warnings), bound, s.mixer))
    return plans


def outcome(steps: Sequence[StepResult], plans: Sequence[LayerPlan]) -> dict[int, dict[str, Any]]:
    """Per layer: how often each condition failed over the run, and what was done."""
    out: dict[int, dict[str, Any]] = {}
    for p in plans:
        infos = [s.layer_info.get(p.layer, {}) for s in steps]
        shifts = [float(i.get("shift_norm", 0.0)) for i in infos]
        row: dict[str, Any] = {
            "steps": len(infos),
            "zero_z": sum(bool(i.get("zero_z")) for i in infos),
            "zero_h": sum(bool(i.get("zero_h")) for i in infos),
            "zero_s": sum(bool(i.get("zero_s")) for i in infos),
            "div_by_one_steps": sum(int(i.get("div_by_one", 0)) > 0 for i in infos),
            "div_by_one_coordinates": sum(int(i.get("div_by_one", 0)) for i in infos),
            "hard_case": sum(bool(i.get("hard_case")) for i in infos),
            "max_shift": max(shifts, default=0.0),
            "max_entry_ratio": max((float(i.get("entry_ratio", 0.0)) for i in infos),
                                   default=0.0),
            "unbounded_steps": [s.step for s, i in zip(steps, infos, strict=True)
                                if i.get("unbounded")],
        }
        if p.frozen_bound is not None:
            row["bound"] = p.frozen_bound
            row["beyond_bound_steps"] = [s.step for s, d in zip(steps, shifts, strict=True)
                                         if d > p.frozen_bound]
        out[p.layer] = row
    return out


def record_section(plans: Sequence[LayerPlan], steps: Sequence[StepResult]
                   ) -> dict[str, Any]:
    """The report as it goes into a run record: the plan, and the outcome keyed by layer."""
    return {"plan": [p.to_dict() for p in plans],
            "outcome": {str(k): v for k, v in outcome(steps, plans).items()}}


def conditioning_line(cond: dict[str, Any] | None) -> str:
    """One line on a run's conditioning (`core.results.conditioning`), for the command line,
    verify and the reports: the largest scale patch, the largest patch entry relative to its
    weight's, and where the bound does not hold."""
    if not cond:
        return "conditioning: not recorded"
    parts = []
    dm = cond.get("max_abs_scale_patch")
    if dm is not None:
        at = cond.get("max_abs_scale_patch_at") or {}
        where = f" (token {at['step'] + 1}, layer {at['layer']})" if at else ""
        parts.append(f"max |dm| {dm:.3g}{where}")
    ratio = cond.get("max_entry_ratio", 0.0)
    if isinstance(ratio, int | float) and math.isfinite(ratio):
        parts.append(f"largest patch entry {ratio:.3g}x its weight's largest")
    else:  # infinite (a patched weight or bias of all zeros), NaN, or a record's null for either
        parts.append("largest patch entry without a ratio (a patched weight is all zeros, or "
                     "the patches hold a NaN)")
    if cond.get("hard_case_steps"):
        parts.append(f"stable hard case at {cond.get('hard_case_layers', 0)} layer-step(s) over "
                     f"{cond['hard_case_steps']} token(s)")
    bound = cond.get("bound")
    if not isinstance(bound, int | float) or not math.isfinite(bound):
        bound = ENTRY_BOUND  # (a record's null)
    n = cond.get("unbounded_layers", 0)
    if n:
        tail = (f"unbounded (over {bound:g}x) at {n} layer-step(s) over "
                f"{cond.get('unbounded_steps', 0)} token(s): exact as rank-1 actions, but "
                "written into weights of this precision they amplify its rounding "
                "(method 'stable' bounds post-norm scale patches)")
    else:
        tail = f"bounded (within {bound:g}x) at every layer and token"
    return "conditioning: " + ", ".join(parts) + "; " + tail


def summary_lines(plans: Sequence[LayerPlan], result: dict[int, dict[str, Any]] | None = None
                  ) -> list[str]:
    """A few plain lines for the command line (the window shows the full table)."""
    if not plans:
        return []
    p0 = plans[-1]
    mixers = sorted({p.mixer for p in plans})
    lines = [f"controls: {len(plans)} layer(s) after {' / '.join(mixers)}; input "
             f"{', '.join(p0.inputs) or 'none'}; "
             f"output {', '.join(p0.outputs) or 'none (frozen)'} (layer {p0.layer} shown)"]
    warned = [p for p in plans if any("zero" in w for w in p.warnings)]
    if warned:
        lines.append("warning: " + "; ".join(f"layer {p.layer}: {p.warnings[0]}" for p in warned))
    if result is not None:
        lines.append(conditions_line(result))
    return lines


#: each failed condition of `outcome`'s rows in words: (key, what failed, what was done)
FAILED = (("zero_z", "z = 0", "input patch skipped"),
          ("zero_h", "h = 0", "output patch skipped"),
          ("zero_s", "S = 0", "experts cannot absorb"),
          ("div_by_one_steps", "N(h)_j = 0", "divided by one"),
          ("hard_case", "stable hard case", "fallback used"))

#: what each symbol of the controllability report means (the window's tooltips and legend)
SYMBOLS = {
    "z": "z: the input the patched matrices see at the query (the rank-1 input patch divides "
         "by |z|^2, so it needs z != 0)",
    "h": "h: the input of the output matrix (the down projection); the output patch needs h != 0",
    "N(h)_j": "N(h)_j: coordinate j of the normalized output N(h) that the post-norm scale m "
              "multiplies",
    "dm": "dm = dv / N(h): method direct's post-norm-scale patch, the output shift dv divided "
          "coordinate-wise by N(h); tiny N(h)_j or m_j = 0 make it huge (unbounded)",
    "division by one": "division by one: where N(h)_j = 0 the paper divides by one instead, so "
                       "that coordinate of dv is not absorbed",
    "unbounded": "unbounded: a patch entry over the bound times its weight's largest; exact as a "
                 "rank-1 action, but written into weights it amplifies their rounding "
                 "(conditioning, not a failed condition)",
    "S": "S: the sum of the active routing weights of a mixture of experts",
}


def conditions_line(result: dict[int, dict[str, Any]]) -> str:
    """The run's one verdict on the construction's conditions (PAPER.md section 4), from
    `outcome`: the command line, the window's Controllability tab and the reports print this
    line. Unbounded patches are conditioning (`conditioning_line`), not a failed condition:
    every condition held, and the patches are exact as rank-1 actions."""
    failures = []
    for layer, r in result.items():
        parts = [f"{what} at {r[k]} token(s) ({done})" for k, what, done in FAILED if r.get(k)]
        if r.get("beyond_bound_steps"):
            parts.append(f"|dv| beyond the frozen-scale bound {r['bound']:.3g} at "
                         f"{len(r['beyond_bound_steps'])} token(s)")
        if parts:
            failures.append(f"layer {layer}: " + ", ".join(parts))
    if not failures:
        return "conditions: held at every patched layer and step"
    return (f"conditions: failed in {len(failures)} layer(s): " + "; ".join(failures))
