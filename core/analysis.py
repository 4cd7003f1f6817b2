"""A run's analyses of its patches (../shared/ANALYSIS.md "Contracts"): the record's
``analysis`` section from its steps, and the lines that summarise it.

- ``analysis.lens``: ``{"s": [s_t per step], "steps": [{"step", "token", "layers": {l: {part:
  {"promoted": [[text, logit, id], ...], "suppressed": [...], "emitted": logit} or None}}}]}``
  (`core.lens`; a part is None where it is not defined in that layer);
- ``analysis.geometry``: `core.geometry.patch_geometry` of the steps' patch vectors;
- ``analysis.transfer``: `core.transfer.transfer` (it needs the model: `core.runs` computes it
  after the steps and passes it in).

Plain data only (no torch here): the command line, the report and the window read it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from .results import StepResult


def analysis_section(steps: Sequence[StepResult], analyze: Sequence[str] | frozenset[str],
                     transfer: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The record's ``analysis`` for the analyses asked (None when none was); ``transfer``: the
    transfer section, computed with the model (`core.transfer.transfer`), when asked."""
    out: dict[str, Any] = {}
    if "lens" in analyze:
        out["lens"] = {
            "s": [None if s.lens is None else s.lens["s"] for s in steps],
            "steps": [{"step": s.step, "token": s.baseline_text,
                       "layers": {} if s.lens is None else s.lens["layers"]} for s in steps],
        }
    if "geometry" in analyze:
        from .geometry import patch_geometry

        out["geometry"] = patch_geometry([s.patches or {} for s in steps])
    if "transfer" in analyze and transfer is not None:
        out["transfer"] = transfer
    return out or None


def strongest_layers(step: dict[str, Any], n: int = 3) -> list[tuple[int, float, Any, Any]]:
    """The ``n`` layers that add the most to the emitted token's logit at one lens step:
    ``(layer, total, mixer, mlp)`` (a part None where it is not defined)."""
    rows = []
    for key, parts in step["layers"].items():
        total = (parts.get("total") or {}).get("emitted")
        if total is None:
            continue
        rows.append((int(key), float(total), (parts.get("mixer") or {}).get("emitted"),
                     (parts.get("mlp") or {}).get("emitted")))
    return sorted(rows, key=lambda r: -r[1])[:n]


def _signed(x: Any) -> str:
    return "n/a" if x is None else f"{x:+.3g}"


def summary_lines(analysis: dict[str, Any] | None, steps: int = 3) -> list[str]:
    """A few lines for the command line: per lens step (the first ``steps``), the layers that
    write the emitted token most; the geometry's effective ranks by parameter kind."""
    if not analysis:
        return []
    lines = []
    for step in (analysis.get("lens") or {}).get("steps", [])[:steps]:
        best = strongest_layers(step)
        if not best:
            lines.append(f"lens, token {step['step'] + 1} {step['token']!r}: no layer readable")
            continue
        where = ", ".join(f"layer {i} {_signed(t)} (mixer {_signed(a)}, MLP {_signed(b)})"
                          for i, t, a, b in best)
        lines.append(f"lens, token {step['step'] + 1} {step['token']!r}: written most by {where}")
    geometry = analysis.get("geometry")
    if geometry and geometry.get("params"):
        kinds: dict[str, list[float]] = {}
        for name, g in geometry["params"].items():
            if g.get("effective_rank") is not None:
                kinds.setdefault(_kind(name), []).append(float(g["effective_rank"]))
        steps_n = len(next(iter(geometry["params"].values())).get("gram") or [])
        ranks = ", ".join(f"{k} {statistics.median(v):.2g}" for k, v in sorted(kinds.items()))
        lines.append(f"geometry: effective rank of {steps_n} steps' patches, median over "
                     f"layers: {ranks}")
    transfer = analysis.get("transfer")
    if transfer and transfer.get("retained"):
        m = transfer_means(transfer)
        lines.append(f"transfer: retained effect of one step's patches at another, mean off the "
                     f"diagonal {_share(m['off_diagonal'])} (diagonal {_share(m['diagonal'])}); "
                     f"the mean patch {_share(m['mean'])}, the previous step's "
                     f"{_share(m['previous'])}")
    return lines


def _share(x: Any) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def transfer_means(section: dict[str, Any]) -> dict[str, float | None]:
    """Means of a transfer section's retained effect: its diagonal, off the diagonal, the mean
    patch's curve and the previous step's curve (None where nothing is defined)."""
    r = section.get("retained") or []
    n = len(r)

    def avg(xs: list[Any]) -> float | None:
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None

    return {"diagonal": avg([r[t][t] for t in range(n)]),
            "off_diagonal": avg([r[s][t] for s in range(n) for t in range(n) if s != t]),
            "mean": avg(list(section.get("mean") or [])),
            "previous": avg(list(section.get("previous") or []))}


#: a diagonal entry reproduces the run when its token matches and R is at least this
REPRODUCES = 0.9


def transfer_diagonal(section: dict[str, Any]) -> dict[str, Any]:
    """A transfer section's diagonal (each step's own patches, applied as the transfer applies
    them): ``retained`` (its R per step, None where undefined), ``matches`` (how many steps'
    tokens match), ``steps``, and ``reproduces``: every step's token matches and its R is at
    least `REPRODUCES` (an undefined R, where the control already equals the full context,
    counts as reproduced)."""
    r, match = section.get("retained") or [], section.get("match") or []
    n = len(r)
    diagonal = [r[t][t] for t in range(n)]
    matches = sum(bool(match[t][t]) for t in range(min(n, len(match))))
    return {"retained": diagonal, "matches": matches, "steps": n,
            "reproduces": matches == n and all(x is None or x >= REPRODUCES for x in diagonal)}


def transfer_caveat(record: dict[str, Any]) -> str | None:
    """One line on why a run's transfer matrix does not measure transfer, or None when it does:
    method direct on a post-norm-scale model (the run's output control "scale") writes
    unbounded scale patches, which reproduce the run only inside the engine's own pass (the
    command line warns of it before running); any other run whose diagonal does not reproduce
    it is said so too."""
    section = ((record.get("analysis") or {}).get("transfer")) or {}
    if not section.get("retained"):
        return None
    d = transfer_diagonal(section)
    values = [x for x in d["retained"] if x is not None]
    seen = (f"diagonal R {min(values):.3g}..{max(values):.3g}, " if values else "diagonal ") + (
        f"{d['matches']}/{d['steps']} tokens match")
    plans = (record.get("controllability") or {}).get("plan") or []
    direct_scale = ((record.get("settings") or {}).get("method") == "direct"
                    and any(p.get("control") == "scale" for p in plans))
    if direct_scale and not d["reproduces"]:
        return ("Not a transfer measurement: method direct's post-norm-scale patches are "
                "unbounded on this model, so even each step's own patches, applied outside the "
                f"run, do not reproduce it ({seen}): run again with method stable.")
    if direct_scale:
        return (f"Method direct on a post-norm-scale model: its scale patches can be unbounded; "
                f"here the diagonal reproduces the run ({seen}), so the matrix reads as it "
                "should (method stable is the safe choice on this family).")
    if not d["reproduces"]:
        return (f"The diagonal (each step's own patches) does not reproduce the run ({seen}): "
                "read the other entries with care.")
    return None


def _kind(name: str) -> str:
    """A parameter's role without its layer: ``mlp.gate_proj`` for
    ``model.layers.3.mlp.gate_proj.weight``."""
    parts = name.split(".")
    for j, part in enumerate(parts):
        if part.isdigit():
            rest = parts[j + 1:]
            if rest and rest[-1] == "weight":
                rest = rest[:-1]
            return ".".join(rest) or name
    return name


__all__ = ["REPRODUCES", "analysis_section", "strongest_layers", "summary_lines",
           "transfer_caveat", "transfer_diagonal", "transfer_means"]
