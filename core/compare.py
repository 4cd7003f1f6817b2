"""The comparison protocol: a generator of frozen per-token results (DESIGN.md "Protocol").

At every step the full-context model on the baseline history gives the targets and the baseline
logits (one cached decoding step, recorded by hooks); the patched model on the reduced sequence
gives the patched logits; the unpatched model on the reduced sequence gives the control. Patches
are rebuilt for every token; the history grows with the baseline's argmax (teacher forcing).

Results crossing into the GUI are plain Python and numpy (no tensors).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from .adapters.base import LayerSites
from .controllability import output_plan
from .engine import (
    LayerPatch,
    PatchSpec,
    compute_dtype,
    patching,
    recording,
)
from .errors import Cancelled, UserError
from .forward import (
    attention_only,
    extend_cache,
    last_logits,
    logit_gaps,
    one_pass_fits,
    rolled_back,
    rows_logits,
)
from .loading import LoadedModel
from .offload import resident
from .patches import Delta, Rank1
from .prompt import Prompt, check_prompt, reduced_sequence
from .results import (
    ENTRY_BOUND,
    LAYER_MEASURES,
    NO_CONTROL,
    LayerInfo,
    Side,
    StepResult,
    TopK,
    summarize,
)
from .spec import MAX_TOP_K, RunSpec, parse_layers


class _Host:
    """The values a step shows, gathered on the model's device and brought to the host in one
    transfer (on a GPU each ``float()`` or ``int()`` of a tensor stalls the pipeline). 0-d
    tensors are stacked by dtype and device, not cast one by one (a step queues hundreds)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.scalars: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        self.vectors: list[torch.Tensor] = []
        self.values: dict[Any, Any] = {}

    def add(self, x: Any) -> Any:
        """Queue a tensor or pass a Python number through; returns a key for `get`: a 0-d tensor
        comes back as a number, any other as a list."""
        if not isinstance(x, torch.Tensor):
            return ("value", x)
        if x.ndim:
            self.vectors.append(x.detach().reshape(-1))
            return ("slice", len(self.vectors) - 1)
        group = self.scalars.setdefault((x.dtype, x.device), [])
        group.append(x.detach())
        return ("item", (x.dtype, x.device), len(group) - 1)

    def fetch(self) -> None:
        groups = list(self.scalars.items())
        parts = [torch.stack(ts).to(self.device, torch.float64) for _, ts in groups]
        parts += [v.to(self.device, torch.float64) for v in self.vectors]
        flat = torch.cat(parts).tolist() if parts else []
        start = 0
        for key, ts in groups:
            self.values[key] = flat[start:start + len(ts)]
            start += len(ts)
        for i, v in enumerate(self.vectors):
            self.values[i] = flat[start:start + v.numel()]
            start += v.numel()

    def get(self, key: Any) -> Any:
        """The value (a float) or values (a list) queued under ``key``."""
        if key[0] == "value":
            return key[1]
        if key[0] == "item":
            return self.values[key[1]][key[2]]
        return self.values[key[1]]


def _decode(tokenizer: Any, token: int) -> str:
    return str(tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False))


def _queue_top_k(host: _Host, probs: torch.Tensor, k: int) -> tuple[Any, Any]:
    p, i = probs.topk(k)
    return host.add(i), host.add(p)


def _top_k(tokenizer: Any, host: _Host, keys: tuple[Any, Any]) -> TopK:
    ids = [int(x) for x in host.get(keys[0])]
    probs = [float(x) for x in host.get(keys[1])]
    return TopK(tuple(ids), tuple(_decode(tokenizer, x) for x in ids), tuple(probs))


def _queue_side(host: _Host, logits: torch.Tensor, base: torch.Tensor, base_probs: torch.Tensor,
                base_token: torch.Tensor, k: int) -> dict[str, Any]:
    probs = torch.softmax(logits, -1)  # once per side per step
    token, base_token, linf, tvd = logit_gaps(logits, base, base_probs, probs, base_token)
    return {"token": host.add(token), "base": host.add(base_token), "linf": host.add(linf),
            "tvd": host.add(tvd), "top": _queue_top_k(host, probs, k)}


def _side(tokenizer: Any, host: _Host, keys: dict[str, Any]) -> Side:
    token = int(host.get(keys["token"]))
    return Side(token=token, text=_decode(tokenizer, token),
                match=token == int(host.get(keys["base"])), linf=float(host.get(keys["linf"])),
                tvd=float(host.get(keys["tvd"])), top_k=_top_k(tokenizer, host, keys["top"]))


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


def _ratio(x: float, ref: float) -> float:
    return x / ref if ref else (0.0 if x == 0 else math.inf)


def _queue_patch_norms(host: _Host, lps: dict[int, LayerPatch]
                       ) -> dict[int, dict[str, dict[str, list[Any]]]]:
    """Per layer and patched parameter, the L2 and largest-entry norms of its vectors (``u`` and
    ``a`` of a rank-1 patch, a delta's vector) queued for the host: one ``_foreach_norm`` per
    order for the whole step, not a handful of small operations per patch."""
    named = [(i, name, patch) for i, lp in lps.items() for name, patch in lp.patches.items()]
    vectors = [v for _, _, patch in named
               for v in ((patch.u, patch.a) if isinstance(patch, Rank1) else (patch.delta,))]
    two = torch._foreach_norm(vectors, 2) if vectors else []
    top = torch._foreach_norm(vectors, math.inf) if vectors else []
    out: dict[int, dict[str, dict[str, list[Any]]]] = {i: {} for i in lps}
    j = 0
    for i, name, patch in named:
        n = 2 if isinstance(patch, Rank1) else 1
        out[i][name] = {"l2": [host.add(x) for x in two[j:j + n]],
                        "linf": [host.add(x) for x in top[j:j + n]]}
        j += n
    return out


def _patch_norms(host: _Host, keys: dict[str, dict[str, list[Any]]], norms: _Norms
                 ) -> tuple[dict[str, dict[str, float]], bool]:
    """Per patched parameter: its norms (a rank-1 patch's Frobenius norm ``|u| |a|``, a delta's
    L2 and largest entry), ``relative`` (norm over the parameter's norm) and ``entry_ratio``
    (largest patch entry over the parameter's largest entry: what decides whether the patched
    weights survive rounding in their own precision); and whether any patch vector has a NaN
    or infinite entry (its largest entry is then not finite)."""
    out: dict[str, dict[str, float]] = {}
    nonfinite = False
    for name, k in keys.items():
        ref, ref_max = norms.of(name)
        l2, linf = [host.get(x) for x in k["l2"]], [host.get(x) for x in k["linf"]]
        nonfinite = nonfinite or not all(math.isfinite(x) for x in linf)
        if len(l2) == 2:  # rank-1: |outer(u, a)|_F = |u| |a|, largest entry max|u| max|a|
            fro = l2[0] * l2[1]
            out[name] = {"frobenius": fro, "relative": _ratio(fro, ref),
                         "entry_ratio": _ratio(linf[0] * linf[1], ref_max)}
        else:
            out[name] = {"l2": l2[0], "linf": linf[0], "relative": _ratio(l2[0], ref),
                         "entry_ratio": _ratio(linf[0], ref_max)}
    return out, nonfinite


def _queue_layer(host: _Host, lp: LayerPatch) -> dict[str, Any]:
    return {f: host.add(getattr(lp, f)) for f in LAYER_MEASURES if f != "nonfinite"}


def _patch_arrays(lps: dict[int, LayerPatch], transposed: bool) -> dict[str, np.ndarray]:
    """Patch vectors as arrays named for the patches file, in the parameter's stored orientation
    (``u`` along ``shape[0]``; Conv1D-style weights are stored (in, out)): float64 for a float64
    run, float32 otherwise (the precision the run computed them in)."""
    arrays: dict[str, np.ndarray] = {}

    def host(x: torch.Tensor) -> np.ndarray:
        return x.detach().to(torch.float64 if x.dtype == torch.float64 else torch.float32
                             ).cpu().numpy()

    for lp in lps.values():
        for name, patch in lp.patches.items():
            if isinstance(patch, Rank1):
                out, inp = patch.u, patch.a
                first, second = (inp, out) if transposed else (out, inp)
                arrays[f"{name}.u"] = host(first)
                arrays[f"{name}.v"] = host(second)
            elif isinstance(patch, Delta):
                arrays[f"{name}.delta"] = host(patch.delta)
    return arrays


def _eos_ids(loaded: LoadedModel) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(loaded.model, "generation_config", None), loaded.tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    return ids


def resolve_control(loaded: LoadedModel, settings: RunSpec) -> str:
    controls = loaded.adapter.output_controls
    control = settings.output_control or controls[0]
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


@dataclass
class _Plan:
    """What a run needs beyond its settings, decided once before the first token."""

    layers: Any  # all decoder layers
    sites: dict[int, LayerSites]  # the patched layers' handles
    spec: PatchSpec
    names: dict[int, str]  # id(module) -> qualified name
    dtype: torch.dtype  # the patch vectors' compute dtype
    norms: _Norms
    eos: set[int]
    batched: bool  # the control runs as a batch row beside the patched one
    one_pass: bool  # after the first token, all rows in one cached pass (`one_pass`)


def batched_control(loaded: LoadedModel, settings: RunSpec, sites: dict[int, Any]) -> bool:
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
    return settings.control and _rows_batchable(loaded, settings, sites)


def _rows_batchable(loaded: LoadedModel, settings: RunSpec, sites: dict[int, Any]) -> bool:
    """What `batched_control` and `one_pass` both need: absorb all (every reduced sequence the
    same), hooks that can tell batch rows apart (dense patched layers, not Gemma 3n's streams),
    and ``control_row`` not "separate"."""
    return (settings.absorb == "all" and settings.control_row != "separate"
            and loaded.adapter.batch_rows and all(s.router is None for s in sites.values()))


def one_pass(loaded: LoadedModel, prompt: Prompt, settings: RunSpec,
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
    return (_rows_batchable(loaded, settings, sites) and not settings.keep_bos
            and not prompt.pixels)


def resolve_control_row(loaded: LoadedModel, settings: RunSpec) -> RunSpec:
    """``settings`` with ``control_row`` saying what the run does, "batched" or "separate"
    (`batched_control`), as records keep their options resolved; unchanged without a control."""
    settings.validate()
    if not settings.control:
        return settings
    _, sites, _ = plan_patching(loaded, settings)
    row = "batched" if batched_control(loaded, settings, sites) else "separate"
    return settings if row == settings.control_row else replace(settings, control_row=row)


def plan_patching(loaded: LoadedModel, settings: RunSpec
                  ) -> tuple[Any, dict[int, LayerSites], PatchSpec]:
    """The run's layers, the patched layers' sites and the `PatchSpec` with each layer's
    `OutputPlan`: decided here once, for the run (`_plan`) and for its controllability report
    (`core.controllability.plan`).

    Raises:
        UserError: on an output control the model (or its output matrix: a bias) does not
            offer, or a layer selection it does not have.
    """
    control = resolve_control(loaded, settings)
    model, adapter = loaded.model, loaded.adapter
    layers = adapter.layers(model)
    sites = {i: adapter.sites(layers[i]) for i in parse_layers(settings.layers, len(layers))}
    if control == "bias" and any(getattr(s.out_matrix, "bias", None) is None for s in sites.values()):
        raise UserError(f"this {adapter.family} model's output matrix has no bias: "
                        "use the output control 'matrix'")
    dtype = compute_dtype(loaded.dtype)
    spec = PatchSpec(
        method=settings.method,
        control=control,
        last_only=settings.scope == "query",
        disabled=settings.disabled,
        norm_offset=adapter.norm_offset,
        # kept patches are saved in float32 unless the run is float64 (patches format /2)
        stored_dtype=torch.float32 if settings.keep_patches and dtype != torch.float64 else None,
        outputs={i: output_plan(s, control, settings.method, settings.disabled)
                 for i, s in sites.items()},
    )
    return layers, sites, spec


def _plan(loaded: LoadedModel, prompt: Prompt, settings: RunSpec) -> _Plan:
    """Every check before the first token (settings, prompt, control, layers, length), and what
    the loop needs."""
    settings.validate()
    check_prompt(prompt, settings.absorb)
    layers, sites, spec = plan_patching(loaded, settings)
    model, adapter = loaded.model, loaded.adapter
    limit = _max_positions(model)
    full = len(prompt.full_ids)
    if limit is not None and full + settings.max_new_tokens > limit:
        raise UserError(
            f"input too long: {full} prompt tokens + {settings.max_new_tokens} new tokens "
            f"exceed the model's {limit} positions (shorten the context or generate fewer tokens)"
        )
    names = {id(m): n for n, m in model.named_modules()}
    dtype = compute_dtype(loaded.dtype)
    scale_names = {f"{names[id(s.out_norm)]}.weight" for s in sites.values() if s.out_norm is not None}
    return _Plan(layers, sites, spec, names, dtype, _Norms(model, adapter.norm_offset, scale_names),
                 _eos_ids(loaded) if settings.stop_at_eos else set(),
                 batched_control(loaded, settings, sites),
                 one_pass(loaded, prompt, settings, sites))


def iter_token_patches(
    loaded: LoadedModel,
    prompt: Prompt,
    settings: RunSpec,
    should_stop: Callable[[], bool] | None = None,
) -> Iterator[StepResult]:
    """Run the protocol, yielding one `StepResult` per generated token.

    Args:
        loaded: the model (only the calling thread touches it).
        prompt: the tokenized prompt.
        settings: the run's settings.
        should_stop: checked between layers and tokens; the generator then ends quietly.
    """
    from transformers import DynamicCache

    plan = _plan(loaded, prompt, settings)
    model, device = loaded.model, loaded.device
    layers, sites, spec, names, dtype = plan.layers, plan.sites, plan.spec, plan.names, plan.dtype
    full = list(prompt.full_ids)
    cached_query = settings.absorb == "context" and settings.scope == "query"
    base_cache = DynamicCache(config=model.config)
    ctrl_cache = DynamicCache(config=model.config) if settings.absorb == "context" else None
    ctrl_len = 0
    history: list[int] = []
    feed = full
    rows = 1  # batch rows of one pass per token (`one_pass`), from the second token
    memo: dict[Any, Any] = {}  # what the hooks compute from the weights alone
    try:
        with torch.inference_mode():
            for step in range(settings.max_new_tokens):
                if should_stop is not None and should_stop():
                    return
                t0 = time.perf_counter()
                if step == 1 and plan.one_pass and attention_only(base_cache):
                    more = 3 if settings.control else 2  # full context, (control,) patched
                    growth = (len(full) + settings.max_new_tokens) / len(full)
                    if one_pass_fits(base_cache, model, more, growth):
                        rows = more
                        base_cache.batch_repeat_interleave(rows)
                if rows > 1:  # one pass: the current token as every row (absorb all)
                    red_ids, red_pos = reduced_sequence(prompt, history, "all")
                    with recording(layers, sites, dtype, should_stop, rows) as targets, \
                            patching(layers, sites, targets,
                                     replace(spec, batch=rows, same_pass=True), names, dtype,
                                     memo=memo) as lps:
                        out = rows_logits(model, red_ids[0], red_pos[0], device, base_cache, rows)
                    logits = (out[0], out[-1], out[1] if settings.control else None)
                    # (all of the one pass counts as the baseline's time)
                    seconds = {"baseline": time.perf_counter() - t0, "patched": 0.0,
                               "control": 0.0}
                else:
                    with recording(layers, sites, dtype, should_stop) as targets:
                        base = last_logits(model, feed, device, cache=base_cache, pixels=prompt.pixels)
                    t1 = time.perf_counter()
                    red_ids, red_pos = reduced_sequence(prompt, history, settings.absorb, settings.keep_bos)
                    ctrl = None
                    if cached_query:
                        assert ctrl_cache is not None
                        if len(red_ids) - 1 > ctrl_len:
                            extend_cache(model, red_ids[ctrl_len:-1], device, ctrl_cache)
                            ctrl_len = len(red_ids) - 1
                        with rolled_back(ctrl_cache), patching(
                            layers, sites, targets, spec, names, dtype, should_stop, memo
                        ) as lps:
                            patched = last_logits(model, red_ids[-1:], device, cache=ctrl_cache)
                    elif plan.batched:  # the control as row 0, the patched sequence as row 1
                        with patching(layers, sites, targets, replace(spec, batch=2), names, dtype,
                                      should_stop, memo) as lps:
                            ctrl, patched = last_logits(model, red_ids, device, positions=red_pos,
                                                        rows=2)
                    else:
                        with patching(layers, sites, targets, spec, names, dtype, should_stop,
                                      memo) as lps:
                            patched = last_logits(model, red_ids, device, positions=red_pos)
                    t2 = time.perf_counter()
                    if plan.batched or not settings.control:
                        pass  # (scope query still extends the prefix cache above, step by step)
                    elif ctrl_cache is not None:
                        ctrl = last_logits(model, red_ids[ctrl_len:], device, cache=ctrl_cache)
                        ctrl_len = len(red_ids)
                    else:
                        ctrl = last_logits(model, red_ids, device, positions=red_pos)
                    logits = (base, patched, ctrl)
                    seconds = {"baseline": t1 - t0, "patched": t2 - t1,
                               "control": time.perf_counter() - t2}
                result = _step_result(
                    loaded, settings, plan, step, logits, lps,
                    ids=(full + history, red_ids, red_pos), position=len(full) + len(history) - 1,
                    seconds=seconds)
                yield result
                history.append(result.baseline_token)
                feed = [result.baseline_token]
                if result.baseline_token in plan.eos:
                    return
    except Cancelled:
        return


def _step_result(loaded: LoadedModel, settings: RunSpec, plan: _Plan, step: int,
                 logits: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
                 lps: dict[int, LayerPatch], ids: tuple[list[int], list[int], Any],
                 position: int, seconds: dict[str, float]) -> StepResult:
    """The step's results: everything it shows is queued on the device and crosses to the host
    in one transfer (`_Host`), then checked for faults and put in a `StepResult`."""
    base, patched, ctrl = logits
    tok, k = loaded.tokenizer, settings.top_k
    host = _Host(base.device)
    base_probs = torch.softmax(base, -1)
    base_token = base.argmax()
    base_keys = (host.add(base_token), host.add(base.abs().max()),
                 _queue_top_k(host, base_probs, k))
    sides = [None if x is None else _queue_side(host, x, base, base_probs, base_token, k)
             for x in (patched, ctrl)]
    norm_keys = _queue_patch_norms(host, lps)
    layer_keys = {i: _queue_layer(host, lp) for i, lp in lps.items()}
    host.fetch()
    token = int(host.get(base_keys[0]))
    plan.norms.prefetch(name for keys in norm_keys.values() for name in keys)
    pn = {i: _patch_norms(host, keys, plan.norms) for i, keys in norm_keys.items()}
    scale = float(host.get(base_keys[1]))
    if settings.on_fault == "stop":
        _check_finite(step, scale, sorted(i for i, (_, bad) in pn.items() if bad),
                      [float(host.get(side["linf"])) for side in sides if side is not None],
                      loaded.dtype)
    full_ids, red_ids, red_pos = ids
    return StepResult(
        step=step,
        position=position,
        baseline_token=token,
        baseline_text=_decode(tok, token),
        baseline_top_k=_top_k(tok, host, base_keys[2]),
        logit_scale=scale,
        patched=_side(tok, host, sides[0]),
        control=NO_CONTROL if sides[1] is None else _side(tok, host, sides[1]),
        full_input_ids=tuple(full_ids),
        reduced_input_ids=tuple(red_ids),
        reduced_position_ids=tuple(red_pos) if red_pos is not None else None,
        patch_norms={i: norms for i, (norms, _) in pn.items()},
        layer_info={i: _layer_info(host, keys, *pn[i]) for i, keys in layer_keys.items()},
        seconds=seconds,
        patches=_patch_arrays(lps, loaded.adapter.transposed) if settings.keep_patches else None,
    )


def _check_finite(step: int, scale: float, bad_layers: list[int], linfs: list[float],
                  dtype: torch.dtype) -> None:
    """A NaN or infinity stops the run at the step and layer where it appeared, in one line.
    Read from values the step shows anyway: the full-context logits are finite when their
    largest magnitude (the logit scale) is; then a side's logits are when their largest
    distance to them is."""
    hint = (f"in {str(dtype).removeprefix('torch.')}: try float32 or bfloat16, or method "
            "'stable'; or continue past faults (on_fault 'continue')")
    where = f"numerical fault at token {step + 1}"
    if not math.isfinite(scale):
        raise UserError(f"{where}: the model's own full-context logits are NaN or infinite "
                        f"{hint}")
    if bad_layers:
        raise UserError(f"{where}, layer {bad_layers[0]}: a patch vector is NaN or infinite "
                        f"{hint}")
    names = ("the patched logits", "the unpatched control's logits")
    for name, linf in zip(names, linfs, strict=False):
        if not math.isfinite(linf):
            raise UserError(f"{where}: {name} are NaN or infinite {hint}")


def _layer_info(host: _Host, keys: dict[str, Any], norms: dict[str, dict[str, float]],
                nonfinite: bool) -> LayerInfo:
    ratio = max((v["entry_ratio"] for v in norms.values()), default=0.0)
    info: dict[str, Any] = {"entry_ratio": ratio, "unbounded": ratio > ENTRY_BOUND}
    for f, kind in LAYER_MEASURES.items():
        value = nonfinite if f == "nonfinite" else host.get(keys[f])
        info[f] = kind(value) if not (kind is float and value is None) else math.nan
    return LayerInfo(**info)


__all__ = [
    "MAX_TOP_K",
    "RunSpec",
    "Side",
    "StepResult",
    "TopK",
    "iter_token_patches",
    "parse_layers",
    "summarize",
]
