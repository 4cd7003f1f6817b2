"""Context dynamics (../shared/ANALYSIS.md A5): how the patch grows as the context is read.

Fix the query; let ``c_1..c_n`` be the context segment's ids as `core.prompt.build_prompt`
tokenized them (the separator included) and ``C_i`` the first i of them. For i = 1..n one
comparison step (one generated token, absorb "context", the patches kept, the context lens on)
with the context cut to ``C_i`` at the id level (`prefix_prompt`: never re-tokenized) gives the
patches ``P_{l,i}`` of every patched layer l; ``P_{l,0} = 0`` by definition (the protocol refuses
an empty context, so i = 0 is not run). Then, per layer:

- ``|P_{l,i}|_F``: the square root of the sum, over the layer's patched parameters, of their
  squared Frobenius norms (a rank-1 patch ``u vᵀ`` from its factors, ``|u| |v|``);
- the increment ``|P_{l,i} - P_{l,i-1}|_F``, from the factors too (a difference of two rank-1
  patches has rank <= 2): ``|u vᵀ - u' v'ᵀ|² = |du|² |v|² + |u'|² |dv|² + 2 (du . u') (v . dv)``
  with ``du = u - u'``, ``dv = v - v'`` (the expansion ``|u|²|v|² + |u'|²|v'|² - 2 (u . u')
  (v . v')`` is the same number, but cancels catastrophically when the patches barely move);
- the context attribution: token i's share is its increment summed over layers (normalised to
  sum 1 over i), and per layer; and the increment's context-lens logit for the answer ``y`` (the
  whole context's first generated token): ``y``'s lens logit at prefix i minus at i - 1 (the lens
  reads ``y`` at every prefix, `core.lens.Lens.extra_tokens`), summed over layers and per layer.
  The lens logit increments telescope to the whole context's lens logit of ``y``.

Dherin et al., arXiv 2507.16003, find such increments vanishing as examples accumulate. Cost:
one load, n one-step comparisons (no control run), the parameter norms measured once. Pure NumPy
after each step; torch is imported only to run the steps (the command line reads `OPTIONS`
before torch loads). Dimensions: L patched layers, n context tokens, M x N a patched matrix.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .errors import Cancelled, UserError, mention
from .prompt import Prompt, Segment
from .spec import RunSpec

#: the `RunSpec` options a dynamics run takes (the command line's flags, the API's keywords)
OPTIONS = ("model", "dtype", "device", "trust_remote_code", "allow_pickle", "device_map",
           "max_memory", "offload_folder", "context", "query", "chat_template", "method",
           "layers", "output_control")
#: the record's format
SCHEMA = "ctxpatch-dynamics/1"
#: the summary calls the increments shrinking when the last third's mean is below this share of
#: the first third's (growing above its inverse; about flat between)
SHRINKING = 0.8

if TYPE_CHECKING:  # (NumPy is imported where it computes: the command line starts without it)
    import numpy as np

    #: one step's patches: layer -> parameter name -> ``(u, v)`` (a rank-1 patch
    #: ``outer(u, v)``, (M,) and (N,)) or ``(delta,)`` (a vector delta, flattened), float64
    Factors = dict[int, dict[str, tuple[np.ndarray, ...]]]


def context_ids(prompt: Prompt) -> tuple[int, tuple[int, ...]]:
    """The context segment's index in ``prompt`` and its ids.

    Raises:
        UserError: the prompt has no text context, or has an image.
    """
    if any(s.kind == "image" for s in prompt.segments):
        raise UserError("context dynamics reads a text context token by token: run it without "
                        f"{mention('image')}")
    found = [j for j, s in enumerate(prompt.segments) if s.kind == "context" and s.ids]
    if not found:
        raise UserError(f"the context is empty: context dynamics needs {mention('context')}")
    return found[0], prompt.segments[found[0]].ids


def prefix_prompt(prompt: Prompt, i: int, text: str = "") -> Prompt:
    """``prompt`` with its context segment cut to its first ``i`` ids (1 <= i <= n), everything
    else (template, query) unchanged: an exact id-level prefix, never re-tokenized. ``text``:
    the segment's text to record (informational)."""
    j, ids = context_ids(prompt)
    if not 1 <= i <= len(ids):
        raise ValueError(f"a context prefix has 1..{len(ids)} tokens, not {i}")
    segments = list(prompt.segments)
    segments[j] = Segment("context", text, tuple(ids[:i]))
    return replace(prompt, segments=tuple(segments))


def factors_of(step: Any) -> Factors:
    """A step's kept patches (`StepResult.patches`) by layer and parameter, in float64.

    Args:
        step: a `core.results.StepResult` of a run that kept its patches; its ``patch_norms``
            say which parameters each layer patched.
    """
    import numpy as np

    arrays: Mapping[str, np.ndarray] = step.patches or {}
    out: Factors = {}
    for layer, params in step.patch_norms.items():
        out[layer] = {}
        for name in params:
            if f"{name}.u" in arrays:
                out[layer][name] = (np.asarray(arrays[f"{name}.u"], np.float64).ravel(),
                                    np.asarray(arrays[f"{name}.v"], np.float64).ravel())
            elif f"{name}.delta" in arrays:
                out[layer][name] = (np.asarray(arrays[f"{name}.delta"], np.float64).ravel(),)
    return out


def _squared(f: tuple[np.ndarray, ...]) -> float:
    if len(f) == 2:
        return float(f[0] @ f[0]) * float(f[1] @ f[1])
    return float(f[0] @ f[0])


def squared_distance(f: tuple[np.ndarray, ...] | None, g: tuple[np.ndarray, ...] | None
                     ) -> float:
    """``|F - G|_F²`` of two patches of one parameter from their factors (None: a zero patch,
    e.g. an expert not active at one of them); never materialised."""
    if f is None or g is None:
        return 0.0 if f is None and g is None else _squared(f if g is None else g)
    if len(f) != len(g):
        raise ValueError("a parameter's patch is rank-1 at one prefix and a delta at another")
    if len(f) == 1:
        d = f[0] - g[0]
        return float(d @ d)
    (u, v), (u2, v2) = f, g
    du, dv = u - u2, v - v2  # u vᵀ - u2 v2ᵀ = du vᵀ + u2 dvᵀ
    value = (float(du @ du) * float(v @ v) + float(u2 @ u2) * float(dv @ dv)
             + 2.0 * float(du @ u2) * float(v @ dv))
    return max(value, 0.0)


def layer_distance(p: Factors, q: Factors, layer: int) -> float:
    """``|P_l - Q_l|_F`` over the layer's parameters (a patch set without the layer: zero)."""
    a, b = p.get(layer, {}), q.get(layer, {})
    return math.sqrt(sum(squared_distance(a.get(n), b.get(n)) for n in {*a, *b}))


def layer_norm(p: Factors, layer: int) -> float:
    """``|P_l|_F``: the root of the sum of the layer's parameters' squared Frobenius norms."""
    return math.sqrt(sum(_squared(f) for f in p.get(layer, {}).values()))


@dataclass(frozen=True)
class Dynamics:
    """A dynamics run's results: per layer (rows in `layers` order) and context prefix."""

    context_ids: tuple[int, ...]  # (n,)
    context_tokens: tuple[str, ...]  # (n,) each id decoded
    layers: tuple[int, ...]  # (L,) the patched layers
    norm: np.ndarray  # (L, n + 1) |P_{l,i}|_F, column 0 zeros
    increment: np.ndarray  # (L, n) |P_{l,i} - P_{l,i-1}|_F for i = 1..n
    lens: np.ndarray  # (L, n + 1) the answer's lens logit at prefix i (NaN: undefined there)
    answer: tuple[int, str]  # y: the whole context's first generated token
    prefix_tokens: tuple[str, ...]  # (n,) each prefix's own first generated token
    settings: dict[str, Any]  # the resolved options of the comparison steps
    seconds: dict[str, Any]  # total, and per prefix i = 1..n
    #: the model (`core.loading.LoadedModel.describe`); empty when unknown
    model: dict[str, Any] = field(default_factory=dict, compare=False)
    #: P_{l,i} for i = 0..n when kept (`run_dynamics(keep_patches=True)`), else empty
    patches: tuple[Factors, ...] = field(default=(), repr=False, compare=False)

    @property
    def attribution(self) -> np.ndarray:
        """(n,) each token's share of the increments summed over layers (sums to 1)."""
        return _shares(self.increment.sum(0))

    @property
    def attribution_by_layer(self) -> np.ndarray:
        """(L, n) each token's share of the layer's increments (each row sums to 1)."""
        import numpy as np

        return np.stack([_shares(row) for row in self.increment]) if len(self.layers) \
            else np.zeros((0, len(self.context_ids)))

    @property
    def lens_increment(self) -> np.ndarray:
        """(L, n) each token's increment of the answer's lens logit, per layer."""
        import numpy as np

        return np.diff(self.lens, axis=1)

    @property
    def lens_logit(self) -> np.ndarray:
        """(n,) each token's increment of the answer's lens logit, summed over layers."""
        return self.lens_increment.sum(0)

    def to_dict(self) -> dict[str, Any]:
        """The JSON record (ANALYSIS.md "Contracts": ``context_tokens``, ``layers`` {l: {norm,
        increment}}, ``attribution``; NaN written as null)."""
        by_layer = self.attribution_by_layer
        return {
            "schema": SCHEMA,
            "context_tokens": list(self.context_tokens),
            "context_ids": list(self.context_ids),
            "answer": {"id": self.answer[0], "text": self.answer[1]},
            "prefix_tokens": list(self.prefix_tokens),
            "layers": {str(layer): {
                "norm": _json(self.norm[j]), "increment": _json(self.increment[j]),
                "attribution": _json(by_layer[j]), "lens_logit": _json(self.lens[j]),
                "lens_logit_increment": _json(self.lens_increment[j]),
            } for j, layer in enumerate(self.layers)},
            "attribution": _json(self.attribution),
            "attribution_by_layer": {str(layer): _json(by_layer[j])
                                     for j, layer in enumerate(self.layers)},
            "lens_logit": _json(self.lens_logit),
            "settings": dict(self.settings),
            "seconds": dict(self.seconds),
            **({"model": dict(self.model)} if self.model else {}),
        }


def _shares(x: np.ndarray) -> np.ndarray:
    total = float(x.sum())
    return x / total if total > 0 else x * 0.0


def _json(a: np.ndarray) -> list[float | None]:
    return [float(v) if math.isfinite(v) else None for v in a.tolist()]


def _decode(tokenizer: Any, token: int) -> str:
    return str(tokenizer.decode([token], skip_special_tokens=False,
                                clean_up_tokenization_spaces=False))


def _lens_of(step: Any, layers: Sequence[int], read: int) -> list[float]:
    """The answer's total lens logit per layer at a step (``read``: 0 the emitted token's, 1
    the first extra token's); NaN where the layer's context effect is undefined."""
    out = []
    for layer in layers:
        entry = ((step.lens or {}).get("layers", {}).get(str(layer)) or {}).get("total")
        value = None if entry is None else (entry["emitted"] if read == 0
                                            else entry.get("tokens", [None, None])[read])
        out.append(math.nan if value is None else float(value))
    return out


def run_dynamics(loaded: Any, prompt: Prompt, spec: RunSpec,
                 progress: Callable[[int, int], None] | None = None,
                 should_stop: Callable[[], bool] | None = None,
                 keep_patches: bool = False) -> Dynamics:
    """The context dynamics of ``prompt`` (its context read token by token, its query fixed).

    Args:
        loaded: the model (`core.loading.LoadedModel`).
        prompt: the tokenized prompt (`core.prompt.build_prompt`): a text context and a query.
        spec: the run's options (model, method, layers, ...); the steps run with one token,
            absorb "context", no control run, the patches kept and the lens on.
        progress: called with (prefixes done, n) after each prefix.
        should_stop: checked between prefixes and, inside a step, between layers.
        keep_patches: keep every prefix's patches on the result (`Dynamics.patches`).

    Raises:
        Cancelled: ``should_stop()`` answered True.
        UserError: a prompt or an option the comparison refuses, in one line.
    """
    import numpy as np

    from .compare import iter_token_patches
    from .plan import RunPlan

    _, ids = context_ids(prompt)
    n = len(ids)
    run = replace(spec, max_new_tokens=1, absorb="context", keep_patches=True, control=False,
                  analyze=frozenset({"lens"}), stop_at_eos=False, image=None)
    texts = tuple(_decode(loaded.tokenizer, t) for t in ids)
    norms: Any = None
    seconds: dict[int, float] = {}

    def step(i: int, extra: tuple[int, ...]) -> tuple[Any, Any]:
        nonlocal norms
        if should_stop is not None and should_stop():
            raise Cancelled
        start = time.perf_counter()
        p = prompt if i == n else prefix_prompt(prompt, i, "".join(texts[:i]))
        plan = RunPlan.build(loaded, p, run)
        if norms is None:
            norms = plan.norms
        plan.norms = norms  # (the parameters' norms, measured once for every prefix)
        got = next(iter_token_patches(loaded, p, run, should_stop, plan, lens_tokens=extra),
                   None)
        if got is None:
            raise Cancelled
        seconds[i] = time.perf_counter() - start
        if progress is not None:
            progress(len(seconds), n)
        return got, plan

    t0 = time.perf_counter()
    last, plan = step(n, ())  # the whole context first: its token is the answer y
    layers = tuple(sorted(plan.sites))
    y = last.baseline_token
    norm = np.zeros((len(layers), n + 1))
    increment = np.zeros((len(layers), n))
    lens = np.zeros((len(layers), n + 1))
    answers: list[str] = [""] * n
    kept: list[Factors] = [{}]
    previous: Factors = {}
    for i in range(1, n + 1):
        got = last if i == n else step(i, (y,))[0]
        patches = factors_of(got)
        for j, layer in enumerate(layers):
            norm[j, i] = layer_norm(patches, layer)
            increment[j, i - 1] = layer_distance(patches, previous, layer)
        lens[:, i] = _lens_of(got, layers, 0 if i == n else 1)
        answers[i - 1] = got.baseline_text
        previous = patches
        if keep_patches:
            kept.append(patches)
    total = time.perf_counter() - t0
    return Dynamics(
        context_ids=tuple(ids), context_tokens=texts, layers=layers, norm=norm,
        increment=increment, lens=lens, answer=(int(y), last.baseline_text),
        prefix_tokens=tuple(answers), settings=plan.spec.to_dict(recorded=True),
        seconds={"total": total, "prefix": [seconds[i] for i in range(1, n + 1)],
                 "mean_prefix": total / n},
        model=loaded.describe(), patches=tuple(kept))


def dynamics(loaded: Any, spec: RunSpec, progress: Callable[[int, int], None] | None = None,
             should_stop: Callable[[], bool] | None = None,
             keep_patches: bool = False) -> Dynamics:
    """`core.runs.prompt_of` (the spec's context and query), then `run_dynamics`."""
    from .runs import prompt_of

    return run_dynamics(loaded, prompt_of(loaded, spec), spec, progress, should_stop,
                        keep_patches)


def trend(increments: Sequence[float] | np.ndarray) -> tuple[float, float]:
    """The mean increment over the first and over the last third of the context (at least one
    token each)."""
    import numpy as np

    x = np.asarray(increments, np.float64)
    k = max(1, len(x) // 3)
    return float(x[:k].mean()), float(x[-k:].mean())


def summary_lines(d: Dynamics, top: int = 5) -> list[str]:
    """A few lines for the command line: the answer, the ``top`` context tokens by share with
    their lens logit, and whether the increments shrink along the context."""
    n = len(d.context_ids)
    share, logit = d.attribution, d.lens_logit
    lines = [f"answer {d.answer[1]!r}: {n} context tokens, {len(d.layers)} patched layers, "
             f"{d.seconds['total']:.1f} s ({d.seconds['mean_prefix']:.2f} s per prefix)",
             f"the {min(top, n)} context tokens that moved the patches most (share of the "
             f"increments; their increment's lens logit for {d.answer[1]!r}):"]
    for i in sorted(range(n), key=lambda k: -share[k])[:top]:
        shown = "n/a" if not math.isfinite(logit[i]) else f"{logit[i]:+.3g}"
        lines.append(f"  token {i + 1:>3} {d.context_tokens[i]!r:<16} share {share[i]:6.1%}  "
                     f"lens logit {shown}")
    first, last = trend(d.increment.sum(0))
    ratio = last / first if first > 0 else math.nan
    verdict = ("shrinking" if ratio < SHRINKING else "growing" if ratio > 1 / SHRINKING
               else "about flat")
    lines.append(f"increments (summed over layers): first third mean {first:.3g}, last third "
                 f"mean {last:.3g} ({ratio:.2g}x): {verdict}")
    return lines


__all__ = ["OPTIONS", "SCHEMA", "Dynamics", "context_ids", "dynamics", "factors_of",
           "layer_distance", "layer_norm", "prefix_prompt", "run_dynamics", "squared_distance",
           "summary_lines", "trend"]
