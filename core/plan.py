"""`RunPlan`: what a run decides once, before its first token (DESIGN.md "One model of a run").

From the `RunSpec`, the model and the prompt: every check that needs them (the output control,
the layers, the length), the patched layers' sites and output plans (`PatchSpec`), the control
row that runs, the controllability report, the parameter norms patches are measured against,
and the run's execution strategy: how each step's forwards run (`STRATEGIES`). The protocol
(`core.compare.iter_token_patches`) follows the plan; the front ends read the resolved spec and
the report from it instead of planning again.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Literal

import torch

from .adapters.base import LayerSites
from .controllability import LayerPlan, output_plan, report
from .engine import PatchSpec, compute_dtype
from .errors import UserError
from .loading import LoadedModel
from .offload import resident
from .prompt import Prompt, check_prompt
from .spec import RunSpec, parse_layers

#: how a step's forwards run: "one pass" (from the second token, the full context, the control
#: and the patched sequence as batch rows of one cached forward: `one_pass`), "batched control"
#: (the control as a batch row of the patched pass: `batched_control`), "cached query" (absorb
#: context, scope query: the patched and control passes extend a cache of the reduced prefix),
#: "separate passes" (each a forward of its own)
Strategy = Literal["one pass", "batched control", "cached query", "separate passes"]
STRATEGIES: tuple[Strategy, ...] = ("one pass", "batched control", "cached query",
                                    "separate passes")


def _blocked_norm(flat: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """The L2 norm of a flat tensor in float64, to about 1e-7 relative, without a float64 copy
    of it (a 7B model's MLP matrix would take 4x its memory): norms of blocks of ``block``
    entries in float32 (float64 for a float64 tensor; a 16-bit tensor converted 2^20 entries at
    a time), combined in float64. 40 times faster here than float64 sums of squares."""
    dtype = torch.float64 if flat.dtype == torch.float64 else torch.float32
    parts = []
    for chunk in flat.split(1 << 20):
        n = chunk.numel() // block * block
        if n:
            parts.append(torch.linalg.vector_norm(chunk[:n].view(-1, block), dim=1, dtype=dtype))
        if n < chunk.numel():
            parts.append(torch.linalg.vector_norm(chunk[n:], dtype=dtype).reshape(1))
    return torch.linalg.vector_norm(torch.cat(parts).double())


class _Norms:
    """Parameter norms and largest entries, computed once per run, for relative patch sizes."""

    def __init__(self, model: torch.nn.Module, norm_offset: float, scale_names: set[str]) -> None:
        self.modules = dict(model.named_modules())
        self.offset, self.scale_names = norm_offset, scale_names
        self.cache: dict[str, tuple[float, float]] = {}

    def _measures(self, name: str) -> torch.Tensor:
        base, _, index = name.partition("[")
        owner, _, leaf = base.rpartition(".")
        p = resident(self.modules[owner], leaf).detach()
        p = p[int(index.rstrip("]"))] if index else p
        if name in self.scale_names:  # (a vector)
            p = p.double() + self.offset  # relative to the effective scale m = offset + weight
        if not p.numel():
            return p.new_zeros(2, dtype=torch.float64)
        flat = p.reshape(-1)
        low, high = torch.aminmax(flat)
        return torch.stack([_blocked_norm(flat), torch.maximum(low.abs(), high.abs()).double()])

    def prefetch(self, names: Any) -> None:
        """Measure every parameter of ``names`` not measured yet, in one transfer."""
        todo = [n for n in dict.fromkeys(names) if n not in self.cache]
        if todo:
            measures = [self._measures(n) for n in todo]
            device = measures[0].device  # (layers may sit on several devices: one of them)
            values = torch.stack([m.to(device) for m in measures]).tolist()
            self.cache.update({n: (v[0], v[1]) for n, v in zip(todo, values, strict=True)})

    def of(self, name: str) -> tuple[float, float]:
        """(norm, largest absolute entry) of a parameter, or of slice ``e`` for a name
        ``param[e]`` (MoE experts); a post-norm scale counts as ``m = offset + weight``."""
        if name not in self.cache:
            self.prefetch([name])
        return self.cache[name]


def _eos_ids(loaded: LoadedModel) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(loaded.model, "generation_config", None), loaded.tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    return ids


def resolve_control(loaded: LoadedModel, spec: RunSpec) -> str:
    controls = loaded.adapter.output_controls
    control = spec.output_control or controls[0]
    if control not in controls:
        raise UserError(
            f"output control {control!r} is not available for {loaded.adapter.family}: "
            f"use {', '.join(controls)}"
        )
    if control in ("matrix", "bias"):  # a layer whose only output control is its norm's scale
        adapter = loaded.adapter
        for i, layer in enumerate(adapter.layers(loaded.model)):
            s = adapter.sites(layer)
            if s.out_matrix is None and s.out_norm is not None:
                raise UserError(f"output control {control!r} is not available in layer {i} of "
                                f"this {adapter.family} model (experts beside the MLP under one "
                                "post-norm: its scale is the output control): use scale")
    return control


def _max_positions(model: Any) -> int | None:
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text, "max_position_embeddings", None)
    return int(value) if value else None


def batched_control(loaded: LoadedModel, spec: RunSpec, sites: dict[int, Any]) -> bool:
    """Whether the control runs as a second batch row of the patched pass.

    Possible with absorb all, where both passes run the same reduced sequence without a cache
    (with absorb context the control extends a cache of the reduced prefix instead), in families
    whose hooks can tell the rows apart (dense layers; not Gemma 3n's AltUp streams).
    ``control_row`` "batched" or "separate" decides where it is possible; "auto" batches, as
    `bench/ab.py` measured it faster everywhere it could (docs/PERFORMANCE.md): a second row is
    nearly free where a pass is bound by reading the weights (a GPU, 16-bit weights on a CPU),
    and on a CPU in float32 once the head reads its weights once for both rows
    (`core.forward.one_read_head`).
    """
    return spec.control and _rows_batchable(loaded, spec, sites)


def _rows_batchable(loaded: LoadedModel, spec: RunSpec, sites: dict[int, Any]) -> bool:
    """What `batched_control` and `one_pass` both need: absorb all (every reduced sequence the
    same), hooks that can tell batch rows apart (dense patched layers, not Gemma 3n's streams),
    and ``control_row`` not "separate"."""
    return (spec.absorb == "all" and spec.control_row != "separate"
            and loaded.adapter.batch_rows and all(s.router is None for s in sites.values()))


def one_pass(loaded: LoadedModel, prompt: Prompt, spec: RunSpec,
             sites: dict[int, Any]) -> bool:
    """Whether, from the second token on, the full context, the control and the patched
    sequence run as batch rows of one cached forward (`core.forward.rows_logits`): with absorb
    all every row is the same one token, row 0 sees the full context's cache and the others
    are masked from it, and the recording hooks read row 0 in the same module calls in which
    the patching hooks patch the last row. One pass reads the weights once for every row (a
    GPU's decoding is bound by that; on a CPU a few rows cost about one). Not with the BOS kept
    (two reduced tokens), an image, MoE layers, Gemma 3n's streams, recurrent or state-space
    layers (their states are not masked: checked on the cache), a cache whose copies for the
    rows would add more than `core.forward.ROWS_CACHE_SHARE` of the weights' memory (checked
    at the second token), or ``control_row`` "separate", which keeps every row a pass of its
    own."""
    return (_rows_batchable(loaded, spec, sites) and not spec.keep_bos
            and not prompt.pixels)


def resolve_control_row(loaded: LoadedModel, spec: RunSpec) -> RunSpec:
    """``spec`` with ``control_row`` saying what the run does, "batched" or "separate"
    (`batched_control`), as records keep their options resolved; unchanged without a control.
    (A run resolves it in `RunPlan.build`.)"""
    spec.validate()
    if not spec.control:
        return spec
    _, sites, _ = plan_patching(loaded, spec)
    return _resolved_row(loaded, spec, sites)


def _resolved_row(loaded: LoadedModel, spec: RunSpec, sites: dict[int, Any]) -> RunSpec:
    if not spec.control:
        return spec
    row = "batched" if batched_control(loaded, spec, sites) else "separate"
    return spec if row == spec.control_row else replace(spec, control_row=row)


def plan_patching(loaded: LoadedModel, spec: RunSpec
                  ) -> tuple[Any, dict[int, LayerSites], PatchSpec]:
    """The run's layers, the patched layers' sites and the `PatchSpec` with each layer's
    `OutputPlan`: decided here once per run (`RunPlan.build`; `core.controllability.plan` for a
    report without a run).

    Raises:
        UserError: on an output control the model (or its output matrix: a bias) does not
            offer, or a layer selection it does not have.
    """
    control = resolve_control(loaded, spec)
    model, adapter = loaded.model, loaded.adapter
    layers = adapter.layers(model)
    sites = {i: adapter.sites(layers[i]) for i in parse_layers(spec.layers, len(layers))}
    if control == "bias" and any(getattr(s.out_matrix, "bias", None) is None
                                 for s in sites.values()):
        raise UserError(f"this {adapter.family} model's output matrix has no bias: "
                        "use the output control 'matrix'")
    dtype = compute_dtype(loaded.dtype)
    patch = PatchSpec(
        method=spec.method,
        output_control=control,
        last_only=spec.scope == "query",
        disabled=spec.disabled,
        norm_offset=adapter.norm_offset,
        # kept patches are saved in float32 unless the run is float64 (patches format /2)
        stored_dtype=torch.float32 if spec.keep_patches and dtype != torch.float64 else None,
        outputs={i: output_plan(s, control, spec.method, spec.disabled)
                 for i, s in sites.items()},
    )
    return layers, sites, patch


@dataclass
class RunPlan:
    """What a run needs beyond its options, decided once before the first token."""

    spec: RunSpec  # the options resolved: ``control_row`` says what runs
    layers: Any  # all decoder layers
    sites: dict[int, LayerSites]  # the patched layers' handles
    patch: PatchSpec  # what the hooks need, each layer's output plan included
    names: dict[int, str]  # id(module) -> qualified name
    dtype: torch.dtype  # the patch vectors' compute dtype
    norms: _Norms  # the patched parameters' norms, measured once
    eos: set[int]  # the tokens that end the run (``stop_at_eos``), else none
    strategy: Strategy
    loaded: LoadedModel = field(repr=False)

    @cached_property
    def report(self) -> list[LayerPlan]:
        """The controllability report (`core.controllability.report`) of the run's own sites
        and output plans, made when a front end asks for it (it reads every patched layer's
        scale: host syncs a bare protocol run does without)."""
        return report(self.loaded, self.sites, self.patch)

    @property
    def batched(self) -> bool:
        """The control runs as a batch row of the patched pass (before one pass, if any)."""
        return self.spec.control and self.spec.control_row == "batched"

    @classmethod
    def build(cls, loaded: LoadedModel, prompt: Prompt, spec: RunSpec) -> RunPlan:
        """Every check before the first token (options, prompt, output control, layers,
        length) and the plan.

        Raises:
            UserError: one line naming what does not fit the model or the prompt.
        """
        spec.validate()
        check_prompt(prompt, spec.absorb)
        layers, sites, patch = plan_patching(loaded, spec)
        model, adapter = loaded.model, loaded.adapter
        limit = _max_positions(model)
        full = len(prompt.full_ids)
        if limit is not None and full + spec.max_new_tokens > limit:
            raise UserError(
                f"input too long: {full} prompt tokens + {spec.max_new_tokens} new tokens "
                f"exceed the model's {limit} positions (shorten the context or generate fewer "
                "tokens)")
        spec = _resolved_row(loaded, spec, sites)
        names = {id(m): n for n, m in model.named_modules()}
        scale_names = {f"{names[id(s.out_norm)]}.weight" for s in sites.values()
                       if s.out_norm is not None}
        if one_pass(loaded, prompt, spec, sites):
            strategy: Strategy = "one pass"
        elif spec.absorb == "context" and spec.scope == "query":
            strategy = "cached query"
        elif batched_control(loaded, spec, sites):
            strategy = "batched control"
        else:
            strategy = "separate passes"
        return cls(spec, layers, sites, patch, names, compute_dtype(loaded.dtype),
                   _Norms(model, adapter.norm_offset, scale_names),
                   _eos_ids(loaded) if spec.stop_at_eos else set(), strategy, loaded)
