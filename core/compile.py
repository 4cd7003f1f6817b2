"""Compile a context into one weight delta per layer, exported as a PEFT LoRA (ANALYSIS.md A4).

Algorithm 1 (PAPER.md section 3) patches every generated token with its own rank-1 patches;
here one delta per matrix is fitted over many examples at once, by ridge least squares, layer by
layer (MEMIT-style, sequential like Algorithm 1):

- Examples: every position of every training query's reduced sequence (the query's tokens, then
  the full-context model's greedy tokens, teacher-forced) at its plain position 0..n-1, with the
  same token of the full-context sequence (the context before it) as its target.
- Layer l, with the compiled deltas of layers < l applied: the reduced inputs ``Z`` of each MLP
  input matrix and its outputs ``Y``, against the full context's ``Y_C = W Z_C``; each input
  matrix gets ``dW = (Y_C - Y)^T (Z Z^T + lambda I)^-1 Z``, which is ``W (Z_C - Z) Z^T
  (Z Z^T + lambda I)^-1`` in the dual form (solved, never inverted), truncated to rank k by an
  SVD of its factors. With one example it is Theorem 1's ``W (z_C - z) z^T / |z|^2``.
- The output control then absorbs what is left of the block output's mismatch ``dT = T_C - T``
  (after the input deltas of layer l): an output matrix by the same ridge form on the MLP
  hidden states ``h`` with targets ``dT / branch_scale``; a post-norm scale (Gemma 2/3, OLMo 2)
  by PAPER.md section 5: the down matrix is fitted to the stable update's RMS-inverted targets
  (`core.patches.stable_down_target`, one per example) and the shared remainder goes into the
  scale by least squares per coordinate, lossy by nature (the training residual is reported).
- Mixture-of-experts layers and AltUp streams are refused (`UserError`).

Deltas act as hooks (``y + (x A^T) B^T``, as PEFT's LoRA computes them) and, for vectors (norm
scales), written into the weights; both are restored in ``finally``. Dimensions: ``N`` training
positions, ``i``/``o`` a matrix's input/output width, ``r`` the rank, ``d`` the model width.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .activations import first_output
from .adapters.base import LayerSites
from .errors import Cancelled, UserError
from .forward import written_
from .loading import LoadedModel
from .patches import rms_normalize, stable_down_target, stable_poles
from .prompt import ABSORBED, build_prompt

#: the ridge's default: small against ``|z|^2`` of a normed MLP input (about the model width)
DEFAULT_RIDGE = 1e-3
DEFAULT_RANK = 8
Say = Callable[[str], None]


@dataclass(frozen=True)
class LowRank:
    """``dW = b @ a`` in (out, in) orientation, as a LoRA holds it: ``b`` (o, r), ``a`` (r, i)."""

    b: Tensor
    a: Tensor


@dataclass
class LayerDelta:
    """One layer's compiled deltas and how well they fit the training positions."""

    layer: int
    matrices: dict[str, LowRank] = field(default_factory=dict)  # module name -> factors
    vectors: dict[str, Tensor] = field(default_factory=dict)  # parameter name -> delta
    residual: float = 0.0  # max |T - T_C| / max |T_C| over the training positions, after it


@dataclass(frozen=True)
class Example:
    """One query's sequences: ``reduced`` (no context, positions 0..n-1) and ``full``; ``where``
    maps each reduced position to its full-context one; ``greedy`` the full model's answer."""

    query: str
    full: tuple[int, ...]
    reduced: tuple[int, ...]
    where: tuple[int, ...]
    greedy: tuple[int, ...]


def check_family(loaded: LoadedModel) -> list[LayerSites]:
    """The layers' sites, or a `UserError` saying in one line why this family cannot compile."""
    adapter = loaded.adapter
    if not adapter.batch_rows:
        raise UserError(f"compile does not support {adapter.family}: its layers do not read "
                        "plain (batch, seq, width) activations")
    sites = [adapter.sites(layer) for layer in adapter.layers(loaded.model)]
    for s in sites:
        if s.router is not None or s.experts is not None or s.out_matrix is None:
            raise UserError(f"compile does not support mixture-of-experts models "
                            f"({adapter.family}): each token's experts differ, so no one delta "
                            "per expert matrix holds for every position")
    return sites


def rank_limit(loaded: LoadedModel) -> int:
    """The highest rank a compiled delta can have: the smallest size of the matrices compiled
    (each MLP input matrix and the output matrix of every layer), ``min(d_model, d_ff)``."""
    sizes = [min(module.weight.shape[-2:]) for s in check_family(loaded)
             for _, module in _modules(s) if getattr(module, "weight", None) is not None]
    return int(min(sizes))


# -- the examples --------------------------------------------------------------------------------

def _decoder(model: Any) -> Any:
    get = getattr(model, "get_decoder", None)
    return get() if callable(get) else model


def _logits(model: Any, ids: Sequence[int], last: int) -> Tensor:
    """The logits at the last ``last`` positions of ``ids`` (plain positions), float64."""
    device = next(p.device for p in model.parameters())
    out = model(input_ids=torch.tensor([list(ids)], device=device), use_cache=False,
                logits_to_keep=last)
    return out.logits[0, -last:].detach().double()


def greedy(model: Any, ids: Sequence[int], n: int, eos: set[int]) -> list[int]:
    """``n`` greedy tokens after ``ids`` (fewer when one is an end of text)."""
    seq, made = list(ids), []
    for _ in range(n):
        token = int(_logits(model, seq, 1)[-1].argmax())
        made.append(token)
        seq.append(token)
        if token in eos:
            break
    return made


def _eos(loaded: LoadedModel) -> set[int]:
    e = getattr(loaded.model.generation_config, "eos_token_id", None) or \
        loaded.tokenizer.eos_token_id
    return set(e if isinstance(e, list) else [] if e is None else [e])


def make_example(loaded: LoadedModel, context: str, query: str, max_new_tokens: int) -> Example:
    """A query's reduced and full sequences and the full-context greedy answer."""
    prompt = build_prompt(loaded.tokenizer, context, query)
    if not prompt.has_context:
        raise UserError("the context is empty: there is nothing to compile")
    if not query.strip():
        raise UserError("a query is empty (or only whitespace): compile needs query tokens")
    where: list[int] = []
    start = 0
    for s in prompt.segments:
        if s.kind not in ABSORBED:
            where += range(start, start + len(s.ids))
        start += len(s.ids)
    full = prompt.full_ids
    with torch.inference_mode():
        answer = greedy(loaded.model, full, max_new_tokens, _eos(loaded))
    history = tuple(answer[:-1])
    where += range(len(full), len(full) + len(history))
    return Example(query, full + history, prompt.reduced_prompt_ids + history, tuple(where),
                   tuple(answer))


# -- hooks -----------------------------------------------------------------------------------------

class _Done(Exception):
    """Raised after the layer being fitted has run: the rest of the forward is not needed."""


@dataclass
class _Rows:
    """What one layer's modules saw on the chosen positions, stacked over examples (N, ...)."""

    x: dict[str, list[Tensor]] = field(default_factory=dict)  # role -> inputs (n, i)
    y: dict[str, list[Tensor]] = field(default_factory=dict)  # role -> outputs (n, o)
    block: list[Tensor] = field(default_factory=list)  # (n, d)
    branch: list[Tensor] = field(default_factory=list)  # post-norm output (n, d)

    def get(self, kind: str, role: str | None = None) -> Tensor:
        rows = getattr(self, kind) if role is None else getattr(self, kind)[role]
        return torch.cat(rows)


def _modules(s: LayerSites) -> list[tuple[str, nn.Module]]:
    assert s.out_matrix is not None
    return [*s.inputs, ("out", s.out_matrix)]


@contextmanager
def _capture(sites: dict[int, LayerSites], dtype: torch.dtype, stop_after: int | None = None
             ) -> Iterator[tuple[dict[int, _Rows], list[Tensor]]]:
    """Record each layer's module inputs and outputs at the positions in ``pick[0]`` (a
    (n,) index tensor the caller sets before each forward); raise `_Done` after
    ``stop_after``."""
    rows = {i: _Rows() for i in sites}
    pick: list[Tensor] = []
    handles: list[Any] = []

    def sel(t: Tensor) -> Tensor:
        return t.reshape(-1, t.shape[-1])[pick[0]].to(dtype)

    try:
        for i, s in sites.items():
            r = rows[i]
            for role, module in _modules(s):
                def keep(m: nn.Module, args: Any, out: Any, r: _Rows = r, role: str = role
                         ) -> None:
                    r.x.setdefault(role, []).append(sel(args[0]))
                    r.y.setdefault(role, []).append(sel(first_output(out)))

                handles.append(module.register_forward_hook(keep))
            if s.out_norm is not None:
                handles.append(s.out_norm.register_forward_hook(
                    lambda m, a, out, r=r: r.branch.append(sel(first_output(out)))))

            def keep_block(m: nn.Module, a: Any, out: Any, r: _Rows = r, i: int = i) -> None:
                r.block.append(sel(first_output(out)))
                if i == stop_after:
                    raise _Done

            handles.append(s.layer.register_forward_hook(keep_block))
        yield rows, pick
    finally:
        for h in reversed(handles):
            h.remove()


@contextmanager
def applied_(model: nn.Module, deltas: Sequence[LayerDelta]) -> Iterator[None]:
    """The deltas acting on the model: matrices as hooks ``y + (x a^T) b^T`` (PEFT's unmerged
    LoRA), vectors added to their parameters; all restored in ``finally``."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    handles: list[Any] = []
    pairs = [(params[name], d) for ld in deltas for name, d in ld.vectors.items()]
    try:
        for ld in deltas:
            for name, lr in ld.matrices.items():
                def hook(m: nn.Module, args: Any, out: Any, lr: LowRank = lr) -> Any:
                    x = args[0]
                    return out + ((x.to(lr.a.dtype) @ lr.a.T) @ lr.b.T).to(out.dtype)

                handles.append(modules[name].register_forward_hook(hook))
        with written_(pairs):
            yield
    finally:
        for h in reversed(handles):
            h.remove()


# -- the fits ------------------------------------------------------------------------------------

def ridge_lowrank(d: Tensor, z: Tensor, ridge: float, rank: int) -> LowRank:
    """The rank-``rank`` truncation of ``dW = d^T (z z^T + ridge I)^-1 z``, which maps every row
    ``z_j`` near ``d_j`` (exactly, with ``ridge`` 0 and rows independent).

    Args:
        d: (N, o) wanted output changes; z: (N, i) inputs. Solved in float64: the dual (N x N)
            system when N <= i, else the primal (i x i) one; with ``ridge`` 0 by least squares
            (the minimum-norm solution where rows repeat, as BOS does across queries).
    """
    d64, z64 = d.double(), z.double()
    n, width = z64.shape
    if n <= width:
        gram = z64 @ z64.T + ridge * torch.eye(n, dtype=torch.float64, device=z.device)
        c = _solve(gram, d64, ridge)  # (N, o): dW = c^T z
        q1, r1 = torch.linalg.qr(c.T)  # (o, N) (N, N)
        q2, r2 = torch.linalg.qr(z64.T)  # (i, N) (N, N)
        u, s, vh = torch.linalg.svd(r1 @ r2.T)
        left, right = q1 @ u, q2 @ vh.T
    else:
        gram = z64.T @ z64 + ridge * torch.eye(width, dtype=torch.float64, device=z.device)
        dw = _solve(gram, z64.T @ d64, ridge).T  # (o, i)
        left, s, right_t = torch.linalg.svd(dw, full_matrices=False)
        right = right_t.T
    k = min(rank, s.numel())
    return LowRank(b=left[:, :k] * s[:k], a=right[:, :k].T)


def _solve(gram: Tensor, rhs: Tensor, ridge: float) -> Tensor:
    if ridge > 0:
        return torch.linalg.solve(gram, rhs)
    return torch.linalg.lstsq(gram.cpu(), rhs.cpu(), driver="gelsd").solution.to(gram.device)


def _act(lr: LowRank, x: Tensor) -> Tensor:
    """``x dW^T`` for rows ``x`` (N, i)."""
    return (x.double() @ lr.a.double().T) @ lr.b.double().T


def _norm_eps(module: nn.Module) -> float:
    for name in ("eps", "variance_epsilon", "epsilon"):
        if hasattr(module, name):
            return float(getattr(module, name))
    raise NotImplementedError(f"cannot find the epsilon of {type(module).__name__}")


class Compiler:
    """The examples and their full-context recordings, fixed for a model and a context; fits
    for any rank and ridge (`fit`), and the logits the evaluation compares against."""

    def __init__(self, loaded: LoadedModel, context: str, queries: Sequence[str],
                 held_out: Sequence[str] = (), max_new_tokens: int = 8,
                 say: Say | None = None, should_stop: Callable[[], bool] | None = None) -> None:
        if not queries:
            raise UserError("compile needs at least one training query")
        if max_new_tokens < 1:
            raise UserError(f"max new tokens must be at least 1, not {max_new_tokens}")
        self.loaded, self.context = loaded, context
        self.say = say or (lambda m: None)
        self.should_stop = should_stop
        self.sites = dict(enumerate(check_family(loaded)))
        self.names = {id(m): n for n, m in loaded.model.named_modules()}
        self.dtype = torch.float64 if loaded.dtype == torch.float64 else torch.float32
        self.max_new_tokens = max_new_tokens
        self.train = [make_example(loaded, context, q, max_new_tokens) for q in queries]
        self.held_out = [make_example(loaded, context, q, max_new_tokens) for q in held_out]
        self.full = self._record_full()
        self.fits: dict[tuple[int, float], list[LayerDelta]] = {}
        self._refs: dict[Any, tuple[Tensor, Tensor]] = {}

    def _device(self) -> torch.device:
        return next(p.device for p in self.loaded.model.parameters())

    def _run(self, ids: Sequence[int]) -> None:
        try:
            _decoder(self.loaded.model)(input_ids=torch.tensor([list(ids)], device=self._device()),
                                        use_cache=False)
        except _Done:
            pass

    def _record_full(self) -> dict[int, _Rows]:
        """Every layer's full-context values at the training positions (unpatched)."""
        with torch.inference_mode(), _capture(self.sites, self.dtype) as (rows, pick):
            for ex in self.train:
                pick[:] = [torch.tensor(ex.where, device=self._device())]
                self._run(ex.full)
        return rows

    def _reduced(self, layer: int, deltas: Sequence[LayerDelta]) -> _Rows:
        """Layer ``layer``'s values on the training reduced sequences, ``deltas`` applied."""
        with torch.inference_mode(), applied_(self.loaded.model, deltas), \
                _capture({layer: self.sites[layer]}, self.dtype, stop_after=layer) as (rows, pick):
            for ex in self.train:
                pick[:] = [torch.arange(len(ex.reduced), device=self._device())]
                self._run(ex.reduced)
        return rows[layer]

    def _cast(self, lr: LowRank) -> LowRank:
        """Factors in the compute dtype, on the model's device (as they act and are saved)."""
        return LowRank(lr.b.to(self._device(), self.dtype), lr.a.to(self._device(), self.dtype))

    def positions(self) -> int:
        return sum(len(ex.reduced) for ex in self.train)

    def fit(self, rank: int = DEFAULT_RANK, ridge: float = DEFAULT_RIDGE) -> list[LayerDelta]:
        """One `LayerDelta` per layer, fitted in order (cached per rank and ridge)."""
        if rank < 1:
            raise UserError(f"the rank must be at least 1, not {rank}")
        if not ridge >= 0 or math.isinf(ridge):
            raise UserError(f"the ridge must be a finite number >= 0, not {ridge}")
        key = (rank, float(ridge))
        if key in self.fits:
            return self.fits[key]
        deltas: list[LayerDelta] = []
        t0 = time.perf_counter()
        for layer in self.sites:
            if self.should_stop is not None and self.should_stop():
                raise Cancelled
            deltas.append(self._fit_layer(layer, deltas, rank, ridge))
            self.say(f"layer {layer + 1}/{len(self.sites)}: training residual "
                     f"{deltas[-1].residual:.3g} of the block output "
                     f"({time.perf_counter() - t0:.1f} s)")
        self.fits[key] = deltas
        return deltas

    def _fit_layer(self, layer: int, before: list[LayerDelta], rank: int, ridge: float
                   ) -> LayerDelta:
        s, full = self.sites[layer], self.full[layer]
        out = LayerDelta(layer)
        red = self._reduced(layer, before)
        for role, module in s.inputs:
            out.matrices[self.names[id(module)]] = self._cast(ridge_lowrank(
                full.get("y", role) - red.get("y", role), red.get("x", role), ridge, rank))
        red = self._reduced(layer, [*before, out])  # the input deltas acting
        h = red.get("x", "out")
        target, now = full.get("block").double(), red.get("block").double()
        shift = (target - now) / s.branch_scale  # (N, d)
        down = self.names[id(s.out_matrix)]
        if s.out_norm is None:
            lr = self._cast(ridge_lowrank(shift, h, ridge, rank))
            out.matrices[down] = lr
            after = now + s.branch_scale * _act(lr, h)
        else:
            after = self._fit_scale(s, out, red, full, shift, ridge, rank)
        scale = target.abs().max().clamp_min(1e-300)
        out.residual = float((after - target).abs().max() / scale)
        return out

    def _fit_scale(self, s: LayerSites, out: LayerDelta, red: _Rows, full: _Rows, shift: Tensor,
                   ridge: float, rank: int) -> Tensor:
        """PAPER.md section 5 over N examples: the down matrix fitted to the stable update's
        RMS-inverted targets, the remainder in the scale by least squares per coordinate;
        returns the block outputs that result (N, d)."""
        assert s.out_norm is not None
        weight = s.out_norm.weight.detach().double()
        m = self.loaded.adapter.norm_offset + weight
        branch = red.get("branch").double()
        g = branch + shift  # the wanted branch outputs (N, d)
        c_rms = full.get("y", "out").double().pow(2).mean(-1).sqrt()  # RMS(h_down,C) (N,)
        fitted = stable_poles(m)
        wanted = torch.stack([stable_down_target(g[j], m, c_rms[j], fitted)[0]
                              for j in range(g.shape[0])])
        h, y_down = red.get("x", "out"), red.get("y", "out").double()
        lr = self._cast(ridge_lowrank(wanted - y_down, h, ridge, rank))
        out.matrices[self.names[id(s.out_matrix)]] = lr
        n = rms_normalize(y_down + _act(lr, h), _norm_eps(s.out_norm))
        nn_ = (n * n).sum(0)
        dm = torch.where(nn_ > 0, (n * (g - m * n)).sum(0) / torch.where(nn_ > 0, nn_, 1.0), 0.0)
        out.vectors[f"{self.names[id(s.out_norm)]}.weight"] = dm.to(weight.device, self.dtype)
        now = red.get("block").double()
        return now + s.branch_scale * ((m + dm) * n - branch)

    # -- evaluation ------------------------------------------------------------------------------

    def reference(self, ex: Example) -> tuple[Tensor, Tensor]:
        """The full-context logits at the answer's positions and the unpatched control's on the
        reduced sequence, ``(T, vocabulary)`` each (cached)."""
        key = ("reference", ex)
        if key not in self._refs:
            t = len(ex.greedy)
            with torch.inference_mode():
                self._refs[key] = (_logits(self.loaded.model, ex.full, t),
                                   _logits(self.loaded.model, ex.reduced, t))
        return self._refs[key]

    def score(self, deltas: Sequence[LayerDelta], ex: Example) -> dict[str, Any]:
        """The protocol (teacher forcing on the full-context tokens) with the compiled model and
        no context, against the full-context run and the control; and the compiled model's own
        greedy answer."""
        p, control = self.reference(ex)
        t = len(ex.greedy)
        with torch.inference_mode(), applied_(self.loaded.model, deltas):
            q = _logits(self.loaded.model, ex.reduced, t)
            answer = greedy(self.loaded.model, ex.reduced[:len(ex.reduced) - t + 1],
                            self.max_new_tokens, _eos(self.loaded))
        tvd, ctrl = _tvd(p, q), _tvd(p, control)
        match = q.argmax(-1) == p.argmax(-1)
        linf = (q - p).abs().max(-1).values
        tokens = [{"token": self._text([y]), "match": bool(match[i]), "linf": float(linf[i]),
                   "tvd": float(tvd[i]), "control_tvd": float(ctrl[i]),
                   "retained": _retained(float(tvd[i]), float(ctrl[i]))}
                  for i, y in enumerate(ex.greedy)]
        return {"query": ex.query, "match": int(match.sum()), "tokens": t,
                "retained": _retained(float(tvd.sum()), float(ctrl.sum())),
                "linf": float(linf.max()), "linf_relative": float(linf.max() / p.abs().max()),
                "tvd": float(tvd.mean()), "control_tvd": float(ctrl.mean()),
                "answer": self._text(answer), "full_context_answer": self._text(ex.greedy),
                "per_token": tokens}

    def _text(self, ids: Sequence[int]) -> str:
        return str(self.loaded.tokenizer.decode(list(ids), skip_special_tokens=True))


def _tvd(p: Tensor, q: Tensor) -> Tensor:
    """Total variation distance of the softmaxes, row by row (T,)."""
    return 0.5 * (torch.softmax(p, -1) - torch.softmax(q, -1)).abs().sum(-1)


def _retained(tvd: float, control_tvd: float) -> float | None:
    """``R = 1 - TVD(p, q) / TVD(p, q_control)``; None where the context changes nothing."""
    return None if control_tvd <= 0 else 1.0 - tvd / control_tvd


# -- the result and its adapter ----------------------------------------------------------------

class Compiled:
    """A context compiled at one rank and ridge: `evaluate`, `generate`, `save_adapter` and
    `to_dict` (ANALYSIS.md "Contracts")."""

    def __init__(self, compiler: Compiler, rank: int, ridge: float) -> None:
        self.compiler, self.rank, self.ridge = compiler, rank, float(ridge)
        self.deltas = compiler.fit(rank, ridge)
        self.adapter: str | None = None
        self._scores: dict[tuple[int, float], dict[str, Any]] = {}

    def evaluate(self, ranks: Sequence[int] | None = None, ridges: Sequence[float] | None = None
                 ) -> dict[str, Any] | list[dict[str, Any]]:
        """This compilation's scores on the training and held-out queries; with ``ranks`` and/or
        ``ridges``, a list of them for every pair (a curve: each is compiled anew, as the later
        layers' fits depend on the earlier ones' truncation)."""
        if ranks is None and ridges is None:
            return self._evaluate(self.rank, self.ridge)
        return [self._evaluate(k, lam) for lam in (ridges or [self.ridge])
                for k in (ranks or [self.rank])]

    def _evaluate(self, rank: int, ridge: float) -> dict[str, Any]:
        key = (rank, float(ridge))
        if key not in self._scores:
            c = self.compiler
            deltas = c.fit(rank, ridge)
            train = [c.score(deltas, ex) for ex in c.train]
            held = [c.score(deltas, ex) for ex in c.held_out]
            self._scores[key] = {"rank": rank, "ridge": float(ridge), "train": train,
                                 "held_out": held, "pooled": _pooled(train, held),
                                 "layers": [{"layer": d.layer, "residual": d.residual}
                                            for d in deltas]}
        return self._scores[key]

    def generate(self, query: str, max_new_tokens: int | None = None) -> str:
        """The compiled model's greedy answer to ``query`` without the context."""
        c = self.compiler
        ids = build_prompt(c.loaded.tokenizer, "", query).full_ids
        with torch.inference_mode(), applied_(c.loaded.model, self.deltas):
            made = greedy(c.loaded.model, ids, max_new_tokens or c.max_new_tokens,
                          _eos(c.loaded))
        return c._text(made)

    def save_adapter(self, folder: Any) -> Any:
        """Write the deltas as a PEFT LoRA adapter folder; returns its path."""
        path = save_adapter(self.compiler.loaded, self.deltas, self.rank, folder)
        self.adapter = str(path)
        return path

    def to_dict(self) -> dict[str, Any]:
        """``{rank, ridge, train, held_out, adapter, ...}`` (ANALYSIS.md "Contracts")."""
        out = dict(self._evaluate(self.rank, self.ridge))
        c = self.compiler
        out.update(adapter=self.adapter, context=c.context, positions=c.positions(),
                   model=c.loaded.spec, max_new_tokens=c.max_new_tokens)
        return out


def _pooled(train: list[dict[str, Any]], held: list[dict[str, Any]]) -> dict[str, Any]:
    """Retained effect pooled over every token of each set (``1 - sum TVD / sum control TVD``)."""
    out: dict[str, Any] = {}
    for name, rows in (("train", train), ("held_out", held)):
        toks = [t for r in rows for t in r["per_token"]]
        ctrl = sum(t["control_tvd"] for t in toks)
        out[name] = {"retained": _retained(sum(t["tvd"] for t in toks), ctrl),
                     "match": sum(t["match"] for t in toks), "tokens": len(toks)}
    return out


def save_adapter(loaded: LoadedModel, deltas: Sequence[LayerDelta], rank: int, folder: Any
                 ) -> Any:
    """A PEFT LoRA folder: rank-``rank`` factors (zero-padded) for every fitted matrix with
    ``lora_alpha = rank`` (scale 1), and each module with a vector delta (a norm scale) whole
    through ``modules_to_save``. ``PeftModel.from_pretrained(base, folder)`` computes what
    `applied_` does (GPT-2's Conv1D: ``fan_in_fan_out``)."""
    from pathlib import Path

    try:
        from peft import LoraConfig
        from safetensors.torch import save_file
    except ImportError:
        raise UserError('saving an adapter needs peft: pip install "ctxpatch[adapters]"') from None
    tensors: dict[str, Tensor] = {}
    params = dict(loaded.model.named_parameters())
    targets, saved = [], set()
    dtype = loaded.dtype
    for ld in deltas:
        for name, lr in ld.matrices.items():
            a = torch.zeros(rank, lr.a.shape[1], dtype=dtype)
            b = torch.zeros(lr.b.shape[0], rank, dtype=dtype)
            a[:lr.a.shape[0]], b[:, :lr.b.shape[1]] = lr.a.cpu(), lr.b.cpu()
            tensors[f"base_model.model.{name}.lora_A.weight"] = a
            tensors[f"base_model.model.{name}.lora_B.weight"] = b
            targets.append(name)
        for pname, d in ld.vectors.items():
            module = pname.rsplit(".", 1)[0]
            saved.add(module)
            for own, p in params.items():
                if own.rsplit(".", 1)[0] == module:
                    value = p.detach().double() + (d.double() if own == pname else 0.0)
                    tensors[f"base_model.model.{own}"] = value.to(p.dtype).cpu().contiguous()
    import os
    import shutil
    import tempfile

    from .export import signals_held

    out = Path(folder)
    out.parent.mkdir(parents=True, exist_ok=True)
    # staged beside the folder and moved in whole: a crash, Ctrl+C or a full disk midway never
    # leaves a half adapter that peft would try to load
    staged = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        config = LoraConfig(r=rank, lora_alpha=rank, target_modules=targets, lora_dropout=0.0,
                            modules_to_save=sorted(saved) or None, bias="none",
                            fan_in_fan_out=loaded.adapter.transposed, task_type="CAUSAL_LM",
                            base_model_name_or_path=loaded.source)
        config.save_pretrained(str(staged))
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  str(staged / "adapter_model.safetensors"), metadata={"format": "pt"})
        with signals_held():
            if out.is_dir() and not any(out.iterdir()):
                out.rmdir()  # (an empty folder chosen for it: replaced by the whole one)
            os.rename(staged, out)  # (refused if the folder has appeared meanwhile, not empty)
    except OSError as exc:
        raise UserError(f"cannot write the adapter {out}: {exc.strerror or exc}") from None
    except Exception as exc:  # noqa: BLE001 - safetensors reports a full disk as its own error
        if type(exc).__name__ != "SafetensorError":
            raise
        raise UserError(f"cannot write the adapter {out}: {exc}") from None
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return out


def compile_context(loaded: LoadedModel, context: str, queries: Sequence[str],
                    held_out: Sequence[str] = (), rank: int = DEFAULT_RANK,
                    ridge: float = DEFAULT_RIDGE, max_new_tokens: int = 8,
                    say: Say | None = None, should_stop: Callable[[], bool] | None = None
                    ) -> Compiled:
    """Compile ``context`` from ``queries`` (ANALYSIS.md A4); see `Compiled`."""
    compiler = Compiler(loaded, context, queries, held_out, max_new_tokens, say, should_stop)
    return Compiled(compiler, rank, ridge)
