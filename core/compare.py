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
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from .engine import (
    LayerPatch,
    patching,
    recording,
)
from .errors import Cancelled, UserError, mention
from .forward import (
    attention_only,
    cache_state,
    extend_cache,
    last_logits,
    logit_gaps,
    one_pass_fits,
    restored,
    rolled_back,
    rows_logits,
)
from .lens import lens_step
from .loading import LoadedModel
from .patches import Delta, Rank1
from .plan import RunPlan, _Norms
from .prompt import Prompt, reduced_sequence
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
from .threads import run_threads


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
    return str(tokenizer.decode([token], skip_special_tokens=False,
                                clean_up_tokenization_spaces=False))


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


def iter_token_patches(
    loaded: LoadedModel,
    prompt: Prompt,
    spec: RunSpec,
    should_stop: Callable[[], bool] | None = None,
    plan: RunPlan | None = None,
    lens_tokens: Sequence[int] = (),
) -> Iterator[StepResult]:
    """Run the protocol (Algorithm 1, token by token), yielding one `StepResult` per generated
    token: each step's forwards run as the plan's strategy says (`_Passes`); the history grows
    with the baseline's token (teacher forcing).

    Args:
        loaded: the model (only the calling thread touches it).
        prompt: the tokenized prompt.
        spec: the run's options.
        should_stop: checked between layers and tokens; the generator then ends quietly.
        plan: the run's plan when the caller made it (`RunPlan.build`), else made here.
        lens_tokens: with the lens, tokens whose logits it also reads at every step (after the
            emitted one: ``lens["layers"][l][part]["tokens"][1:]``).
    """
    plan = RunPlan.build(loaded, prompt, spec) if plan is None else plan
    passes = _Passes(loaded, prompt, plan, should_stop)
    if passes.lens is not None:
        passes.lens.extra_tokens = tuple(int(t) for t in lens_tokens)
    history: list[int] = []
    try:
        with torch.inference_mode(), run_threads(loaded.device):
            for step in range(plan.spec.max_new_tokens):
                if should_stop is not None and should_stop():
                    return
                logits, lps, (red_ids, red_pos), seconds = passes.step(step, history)
                result = _step_result(
                    loaded, plan, step, logits, lps,
                    ids=(passes.full + history, red_ids, red_pos),
                    position=len(passes.full) + len(history) - 1, seconds=seconds,
                    lens=None if passes.lens is None else (passes.lens, passes.targets))
                yield result
                history.append(result.baseline_token)
                passes.feed = [result.baseline_token]
                if result.baseline_token in plan.eos:
                    return
    except Cancelled:
        return


class _Passes:
    """The run's execution strategy (`core.plan.STRATEGIES`): how one step's forwards run.

    Every step records the full-context model's targets and baseline logits on its cache, then
    runs the patched model (and the unpatched control) on the reduced sequence: as passes of
    their own ("separate passes"), the control as a batch row of the patched pass ("batched
    control"), both extending a cache of the reduced prefix ("cached query"), or, from the
    second token, every row in one cached forward ("one pass", where the cache's copies fit).
    """

    def __init__(self, loaded: LoadedModel, prompt: Prompt, plan: RunPlan,
                 should_stop: Callable[[], bool] | None) -> None:
        from transformers import DynamicCache

        self.loaded, self.prompt, self.plan, self.should_stop = loaded, prompt, plan, should_stop
        config = loaded.model.config
        self.full = list(prompt.full_ids)
        self.feed = self.full  # what the full-context pass reads next (its cache holds the rest)
        self.base_cache = DynamicCache(config=config)
        self.ctrl_cache = DynamicCache(config=config) if plan.spec.absorb == "context" else None
        self.ctrl_len = 0  # reduced tokens in ctrl_cache
        self.rows = 1  # batch rows of one pass, from the second token ("one pass")
        self.memo: dict[Any, Any] = {}  # what the hooks compute from the weights alone
        self.lens = None  # the context lens (``analyze`` "lens"): `core.lens.Lens`
        self.targets: Any = None  # the step's full-context targets (the lens reads them)
        if "lens" in plan.spec.analyze:
            from .lens import Lens

            self.lens = Lens(loaded.model, plan.sites, plan.dtype, len(loaded.tokenizer))

    def _lens_recording(self, rows: int) -> Any:
        return nullcontext() if self.lens is None else self.lens.recording(rows)

    def _lens_capturing(self) -> Any:
        return nullcontext() if self.lens is None else self.lens.capturing()

    def _replayed(self, forward: Callable[[], Any], cache: Any = None,
                  before: Any = None) -> None:
        """With the lens: ``forward`` (the patched pass's own call) once more, each patched
        layer fed its input from that pass and unpatched (`core.lens.Lens.replaying`); on
        ``cache`` as it was ``before`` the patched pass (`core.forward.cache_state`), then as
        the patched pass left it."""
        if self.lens is None:
            return
        with nullcontext() if cache is None else restored(cache, before), \
                self.lens.replaying():
            forward()

    def step(self, step: int, history: list[int]) -> tuple[Any, Any, Any, dict[str, float]]:
        """The step's (baseline, patched, control) logits, layer patches, reduced ids and
        positions, and seconds per side."""
        plan = self.plan
        if step == 1 and plan.strategy == "one pass":
            self._try_one_pass()
        if self.rows > 1:
            return self._one_pass(history)
        t0 = time.perf_counter()
        with recording(plan.layers, plan.sites, plan.dtype, self.should_stop) as targets, \
                self._lens_recording(1):
            base = last_logits(self.loaded.model, self.feed, self.loaded.device,
                               cache=self.base_cache, pixels=self.prompt.pixels)
        self.targets = targets
        t1 = time.perf_counter()
        red_ids, red_pos = reduced_sequence(self.prompt, history, plan.spec.absorb,
                                            plan.spec.keep_bos)
        patched, ctrl, lps = self._patched(targets, red_ids, red_pos)
        t2 = time.perf_counter()
        if ctrl is None and plan.spec.control:
            ctrl = self._control(red_ids, red_pos)
        seconds = {"baseline": t1 - t0, "patched": t2 - t1, "control": time.perf_counter() - t2}
        return (base, patched, ctrl), lps, (red_ids, red_pos), seconds

    def _try_one_pass(self) -> None:

        if not attention_only(self.base_cache):
            return
        spec = self.plan.spec
        more = 3 if spec.control else 2  # full context, (control,) patched
        growth = (len(self.full) + spec.max_new_tokens) / len(self.full)
        if one_pass_fits(self.base_cache, self.loaded.model, more, growth):
            self.rows = more
            self.base_cache.batch_repeat_interleave(more)

    def _one_pass(self, history: list[int]) -> tuple[Any, Any, Any, dict[str, float]]:
        """The current token as every row (absorb all): row 0 sees the full context's cache."""
        plan, rows, t0 = self.plan, self.rows, time.perf_counter()
        red_ids, red_pos = reduced_sequence(self.prompt, history, "all")

        def forward() -> Any:
            return rows_logits(self.loaded.model, red_ids[0], red_pos[0], self.loaded.device,
                               self.base_cache, rows)

        before = None if self.lens is None else cache_state(self.base_cache)
        with recording(plan.layers, plan.sites, plan.dtype, self.should_stop, rows) as targets, \
                patching(plan.layers, plan.sites, targets,
                         replace(plan.patch, batch=rows, same_pass=True), plan.names, plan.dtype,
                         memo=self.memo) as lps, self._lens_recording(rows), \
                self._lens_capturing():
            out = forward()
        self.targets = targets
        self._replayed(forward, self.base_cache, before)
        logits = (out[0], out[-1], out[1] if plan.spec.control else None)
        # (all of the one pass counts as the baseline's time)
        seconds = {"baseline": time.perf_counter() - t0, "patched": 0.0, "control": 0.0}
        return logits, lps, (red_ids, red_pos), seconds

    def _patched(self, targets: Any, red_ids: list[int], red_pos: Any) -> tuple[Any, Any, Any]:
        """The patched logits, the control's when they come from the same pass, and the layer
        patches."""
        plan, model, device = self.plan, self.loaded.model, self.loaded.device
        hooks = (plan.layers, plan.sites, targets)
        if plan.strategy == "cached query":
            assert self.ctrl_cache is not None
            cache = self.ctrl_cache
            if len(red_ids) - 1 > self.ctrl_len:
                extend_cache(model, red_ids[self.ctrl_len:-1], device, cache)
                self.ctrl_len = len(red_ids) - 1

            def forward() -> Any:
                with rolled_back(cache):
                    return last_logits(model, red_ids[-1:], device, cache=cache)

            with patching(*hooks, plan.patch, plan.names, plan.dtype, self.should_stop,
                          self.memo) as lps, self._lens_capturing():
                patched = forward()
            self._replayed(forward)
            return patched, None, lps
        if plan.batched:  # the control as row 0, the patched sequence as row 1
            def forward() -> Any:
                return last_logits(model, red_ids, device, positions=red_pos, rows=2)

            with patching(*hooks, replace(plan.patch, batch=2), plan.names, plan.dtype,
                          self.should_stop, self.memo) as lps, self._lens_capturing():
                ctrl, patched = forward()
            self._replayed(forward)
            return patched, ctrl, lps

        def forward() -> Any:
            return last_logits(model, red_ids, device, positions=red_pos)

        with patching(*hooks, plan.patch, plan.names, plan.dtype, self.should_stop,
                      self.memo) as lps, self._lens_capturing():
            patched = forward()
        self._replayed(forward)
        return patched, None, lps

    def _control(self, red_ids: list[int], red_pos: Any) -> Any:
        """The control's logits in a pass of its own: on the reduced prefix's cache with absorb
        context (extended token by token), else on the whole reduced sequence."""
        model, device = self.loaded.model, self.loaded.device
        if self.ctrl_cache is not None:
            ctrl = last_logits(model, red_ids[self.ctrl_len:], device, cache=self.ctrl_cache)
            self.ctrl_len = len(red_ids)
            return ctrl
        return last_logits(model, red_ids, device, positions=red_pos)


def _step_result(loaded: LoadedModel, plan: RunPlan, step: int,
                 logits: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
                 lps: dict[int, LayerPatch], ids: tuple[list[int], list[int], Any],
                 position: int, seconds: dict[str, float], lens: Any = None) -> StepResult:
    """The step's results: everything it shows is queued on the device and crosses to the host
    in one transfer (`_Host`), then checked for faults and put in a `StepResult`; ``lens``:
    the run's `core.lens.Lens` and the step's targets, read here (``analyze`` "lens")."""
    base, patched, ctrl = logits
    tok, k = loaded.tokenizer, plan.spec.top_k
    host = _Host(base.device)
    base_probs = torch.softmax(base, -1)
    base_token = base.argmax()
    base_keys = (host.add(base_token), host.add(base.abs().max()),
                 _queue_top_k(host, base_probs, k))
    sides = [None if x is None else _queue_side(host, x, base, base_probs, base_token, k)
             for x in (patched, ctrl)]
    norm_keys = _queue_patch_norms(host, lps)
    layer_keys = {i: _queue_layer(host, lp) for i, lp in lps.items()}
    lens_keys = None if lens is None else lens[0].read(lens[1], base_token.reshape(1), host.add)
    host.fetch()
    token = int(host.get(base_keys[0]))
    plan.norms.prefetch(name for keys in norm_keys.values() for name in keys)
    pn = {i: _patch_norms(host, keys, plan.norms) for i, keys in norm_keys.items()}
    scale = float(host.get(base_keys[1]))
    if plan.spec.on_fault == "stop":
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
        patches=_patch_arrays(lps, loaded.adapter.transposed) if _keeps_patches(plan.spec)
        else None,
        lens=None if lens_keys is None else lens_step(tok, host.get(lens_keys[0]), lens_keys[1],
                                                      host.get),
    )


def _keeps_patches(spec: RunSpec) -> bool:
    """A step keeps its patch vectors for the patches file and verify, for the geometry and the
    transfer, and with the lens for its knock-out on demand (`core.knockout`, the window's
    Context lens tab)."""
    return spec.keep_patches or bool({"geometry", "transfer", "lens"} & spec.analyze)


def _check_finite(step: int, scale: float, bad_layers: list[int], linfs: list[float],
                  dtype: torch.dtype) -> None:
    """A NaN or infinity stops the run at the step and layer where it appeared, in one line.
    Read from values the step shows anyway: the full-context logits are finite when their
    largest magnitude (the logit scale) is; then a side's logits are when their largest
    distance to them is."""
    hint = (f"in {str(dtype).removeprefix('torch.')}: try {mention('dtype', 'float32')} (or "
            f"bfloat16), or {mention('method', 'stable')}; or continue past faults "
            f"({mention('on_fault', 'continue')})")
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
