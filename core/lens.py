"""The context lens (../shared/ANALYSIS.md A1): what each layer's context effect writes into the
vocabulary, read through the final norm frozen at the full-context residual.

At step t and patched layer l, with ``T_C`` the layer's full-context output and ``T_0`` the
output of the **unpatched** layer on the reduced input (the patched stream's, which equals the
full context's), the context adds ``delta = T_C - T_0``. It splits in two: the mixer's shift
``delta_mix = v_C - v_0`` (what the output control absorbs) and the MLP branch's
``delta_mlp = branch_scale * (branch_C - branch_0)``. Each is read out as
``multiplier * W_U (gamma * c(x) / s_t)``: ``gamma`` the final norm's effective scale, ``c``
centring for a LayerNorm (identity for an RMSNorm), ``s_t`` the RMS (or the standard deviation)
of the full-context final residual with the norm's epsilon, and ``multiplier`` the family's
logit scale (Cohere, Granite, Falcon-H1); logits before any softcap (Gemma 2). With ``s_t``
frozen the readout is linear, so the parts of the stream add up to the full-context logits
(`Readout.logits`, the ground truth the tests check).

``T_0`` costs one more reduced forward per step (`Lens.replaying`): every patched layer is fed
the input the patched pass gave it (`Lens.capturing`) and runs unpatched; the readouts are one
product of the stacked deltas with ``W_U`` in chunks over the vocabulary, keeping the top-k.
Without ``analyze=["lens"]`` none of this runs. The hooks live in context managers that remove
them in ``finally``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .activations import first_input, first_output, first_row_query, query_row
from .adapters.base import LayerSites, decoder_layers
from .errors import UserError
from .offload import resident

#: the promoted and the suppressed tokens kept per layer, step and part
LENS_TOP_K = 10
#: the parts of a layer's context effect: the whole, the mixer's shift, the MLP branch's
PARTS = ("total", "mixer", "mlp")
#: vocabulary rows read per product (bounds the transient (rows, chunk) logits)
_CHUNK = 32768
_NORM_NAMES = ("norm", "ln_f", "final_layer_norm", "final_layernorm", "norm_f", "final_norm")


def final_norm(model: nn.Module) -> nn.Module | None:
    """The decoder's final norm: the one its layer list's owner holds; None where the owner
    has the attribute unset (OPT's post-LN models: the last layer's output is the head's input).

    Raises:
        UserError: the model has none that ctxpatch knows.
    """
    layers = decoder_layers(model)
    for module in model.modules():
        if any(child is layers for child in module.children()):
            for name in _NORM_NAMES:
                if hasattr(module, name):
                    norm = getattr(module, name)
                    if norm is None or isinstance(norm, nn.Module):
                        return norm
    raise UserError(f"the context lens reads through the final norm, and "
                    f"{type(model).__name__} has none that ctxpatch knows: run without the lens")


def _project_out(model: nn.Module) -> nn.Module | None:
    """A bias-free projection between the final residual and the head (OPT's ``project_out``)."""
    layers = decoder_layers(model)
    for module in model.modules():
        if any(child is layers for child in module.children()):
            project = getattr(module, "project_out", None)
            if isinstance(project, nn.Linear) and project.bias is None:
                return project
    return None


def _eps(norm: nn.Module) -> float:
    for name in ("eps", "variance_epsilon", "epsilon"):
        value = getattr(norm, name, None)
        if isinstance(value, int | float):
            return float(value)
    return 1e-5  # (torch's LayerNorm default; the probe checks it)


def _param(module: nn.Module, name: str) -> Tensor | None:
    p = getattr(module, name, None)
    return resident(module, name).detach() if isinstance(p, Tensor) else None


def _multiplier(model: nn.Module) -> float:
    """The factor a family applies to the head's output before any softcap."""
    scale = getattr(model, "logit_scale", None)  # Cohere
    if isinstance(scale, int | float) and not isinstance(scale, bool):
        return float(scale)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    factor = 1.0
    if getattr(config, "logits_scaling", None):  # Granite: logits / logits_scaling
        factor /= float(config.logits_scaling)
    if getattr(config, "lm_head_multiplier", None):  # Falcon-H1
        factor *= float(config.lm_head_multiplier)
    return factor


@dataclass(frozen=True)
class Readout:
    """The final norm, frozen at a residual's scale, then the head: ``x -> multiplier * W_U
    (gamma * c(x) / s)`` (and the constant ``multiplier * (W_U beta + b)`` of the norm's and
    the head's biases, applied once to the whole stream)."""

    norm: nn.Module | None  # None: no final norm (the identity, ``s`` = 1)
    centred: bool  # a LayerNorm (subtracts the mean), else an RMSNorm
    gamma: Tensor  # (d,) the effective scale (Gemma's 1 + w), compute dtype
    beta: Tensor | None  # (d,) the norm's bias
    eps: float
    head: Tensor  # (V, d) W_U as the model holds it
    head_bias: Tensor | None
    multiplier: float
    vocab: int  # the rows that are words (a padded head has more)
    head_module: nn.Module | None = None  # the head itself

    @classmethod
    def of(cls, model: nn.Module, dtype: torch.dtype, vocab: int | None = None) -> Readout:
        """The readout of ``model``: its final norm checked against the norm itself (a probe of
        its scale's offset and its centring), its head, its logit multiplier.

        Raises:
            UserError: no final norm, or one whose formula is neither an RMSNorm nor a
                LayerNorm with a (possibly offset) scale, or a head that does not read it.
        """
        norm = final_norm(model)
        head_module = model.get_output_embeddings()
        head = _param(head_module, "weight") if head_module is not None else None
        if head is None:
            raise UserError(f"the context lens needs the model's output matrix, and "
                            f"{type(model).__name__} has none: run without the lens")
        project = _project_out(model)
        if project is not None:  # (OPT-350m: the head reads a narrower projection of the norm)
            head = head.to(dtype) @ _param(project, "weight").to(dtype)
            head_module = project if norm is None else head_module
        d = head.shape[-1]
        rows = head.shape[0] if vocab is None else min(vocab, head.shape[0])
        bias, multiplier = _param(model.get_output_embeddings(), "bias"), _multiplier(model)
        if norm is None:
            return cls(None, False, torch.ones(d, dtype=dtype, device=head.device), None, 0.0,
                       head, bias, multiplier, rows, head_module)
        w, b, eps = _param(norm, "weight"), _param(norm, "bias"), _eps(norm)
        if w is not None and w.numel() != d:
            raise UserError(f"the context lens reads the final norm into the head, and "
                            f"{type(model).__name__} changes width between them: run without "
                            "the lens")
        gamma, centred = _probe(norm, w, b, eps, d, head)
        return cls(norm, centred, gamma.to(dtype), None if b is None else b.to(dtype), eps,
                   head, bias, multiplier, rows, head_module)

    @property
    def hooked(self) -> nn.Module:
        """The module whose input is the final residual (the norm, else the head)."""
        module = self.norm if self.norm is not None else self.head_module
        assert module is not None
        return module

    def scale(self, h: Tensor) -> Tensor:
        """``s``: the RMS (LayerNorm: the standard deviation) of a residual, with epsilon (1
        without a final norm)."""
        if self.norm is None:
            return torch.ones((), dtype=self.gamma.dtype, device=self.gamma.device)
        h = h.to(self.gamma.dtype)
        if self.centred:
            h = h - h.mean(-1, keepdim=True)
        return (h.pow(2).mean(-1) + self.eps).sqrt()

    def linear(self, x: Tensor, s: Tensor) -> Tensor:
        """``multiplier * gamma * c(x) / s`` for rows ``x`` (the part before ``W_U``)."""
        x = x.to(self.gamma.dtype)
        if self.centred:
            x = x - x.mean(-1, keepdim=True)
        return x * (self.gamma * (self.multiplier / s))

    def constant(self) -> Tensor:
        """The logits of the norm's and the head's biases (zeros where there are none)."""
        out = torch.zeros(self.head.shape[0], dtype=self.gamma.dtype, device=self.gamma.device)
        if self.beta is not None:
            out = out + self.head.to(self.gamma.dtype) @ self.beta
        if self.head_bias is not None:
            out = out + self.head_bias.to(out.dtype)
        return out * self.multiplier

    def logits(self, x: Tensor, s: Tensor) -> Tensor:
        """Every row's whole readout (``(rows, V)``; for tests and small vocabularies)."""
        return self.linear(x, s) @ self.head.to(self.gamma.dtype).T

    def read(self, x: Tensor, s: Tensor, k: int, tokens: Sequence[int] | Tensor
             ) -> dict[str, Tensor]:
        """Rows ``x``: their ``k`` most promoted and most suppressed words (values and ids) and
        the logits they add to ``tokens``, without holding all ``(rows, V)`` logits at once."""
        y = self.linear(x, s)
        top = bottom = None
        k = min(k, self.vocab)
        for start in range(0, self.vocab, _CHUNK):
            w = self.head[start:min(start + _CHUNK, self.vocab)].to(y.dtype)
            chunk = y @ w.T
            for best, sign in ((top, 1.0), (bottom, -1.0)):
                v, i = (sign * chunk).topk(min(k, chunk.shape[1]), dim=-1)
                i = i + start
                if best is not None:
                    v, j = torch.cat([best[0], v], -1).topk(k, dim=-1)
                    i = torch.cat([best[1], i], -1).gather(-1, j)
                if sign > 0:
                    top = (v, i)
                else:
                    bottom = (v, i)
        assert top is not None and bottom is not None
        index = torch.as_tensor(tokens, device=self.head.device).reshape(-1)
        picked = y @ self.head[index].to(y.dtype).T
        return {"promoted": top[0], "promoted_ids": top[1], "suppressed": -bottom[0],
                "suppressed_ids": bottom[1], "tokens": picked}


def _probe(norm: nn.Module, w: Tensor | None, b: Tensor | None, eps: float, d: int,
           head: Tensor) -> tuple[Tensor, bool]:
    """The norm's effective scale (``w``, ``1 + w`` or ones) and whether it centres, as the norm
    itself computes them on a probe (a formula that does not match raises)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, d, generator=g, dtype=torch.float64) + 3.0  # (a mean to centre)
    param = w if w is not None else head
    with torch.no_grad():
        out = norm(x.to(param.device, param.dtype)).to(torch.float64).cpu().reshape(-1)
    x = x.reshape(-1)
    bias = torch.zeros(d, dtype=torch.float64) if b is None else b.to(torch.float64).cpu()
    best: tuple[float, Tensor, bool] | None = None
    offsets = (0.0, 1.0) if w is not None else (0.0,)
    for centred in (False, True):
        c = x - x.mean() if centred else x
        n = c / (c.pow(2).mean() + eps).sqrt()
        for offset in offsets:
            gamma = offset + (w.to(torch.float64).cpu() if w is not None
                              else torch.ones(d, dtype=torch.float64))
            error = float((gamma * n + bias - out).abs().max() / out.abs().max().clamp_min(1e-30))
            if best is None or error < best[0]:
                best = (error, gamma, centred)
    assert best is not None
    if not best[0] < 2e-2:
        raise UserError(f"the context lens cannot read {type(norm).__name__}: it is neither an "
                        "RMSNorm nor a LayerNorm with a scale (run without the lens)")
    return best[1].to(param.device), best[2]


@dataclass
class _Stream:
    """What one reduced forward showed of the patched layers, at the query position."""

    inputs: dict[int, Any] = field(default_factory=dict)  # layer -> its whole input (args[0])
    block: dict[int, Tensor] = field(default_factory=dict)  # T_0
    v_parts: dict[int, list[Tensor]] = field(default_factory=dict)  # v_0's parts
    branch: dict[int, Tensor] = field(default_factory=dict)  # branch_0


def _adds_up(t: Any, branch_scale: float) -> bool:
    """Whether a layer's full-context output is ``v + branch_scale * branch`` (to rounding), so
    that the mixer's and the MLP's parts split its context effect; False where the block adds
    more after that sum (Gemma 4's per-layer embeddings and layer scalar)."""
    if t.block is None or t.branch is None or not t.v_parts or t.block.shape != t.branch.shape:
        return True  # (an MoE layer: the MLP part is the remainder, which adds up)
    rest = (t.block - t.v - branch_scale * t.branch).abs().max()
    return bool(rest <= 1e-3 * t.block.abs().max().clamp_min(1e-30))


def _replace_input(args: tuple[Any, ...], kwargs: dict[str, Any], new: Tensor
                   ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if args and isinstance(args[0], Tensor):
        return (new, *args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), Tensor):
        return args, {**kwargs, "hidden_states": new}
    key = next(k for k, v in kwargs.items() if isinstance(v, Tensor))
    return args, {**kwargs, key: new}


class Lens:
    """The context lens of one run: its readout and, per step, the hooks that measure it.

    A step records the full-context final residual (`recording`), keeps the inputs the patched
    pass gives the patched layers (`capturing`), reruns the reduced forward with those inputs
    and no patch (`replaying`) and reads every layer's parts (`read`).
    """

    def __init__(self, model: nn.Module, sites: Mapping[int, LayerSites], dtype: torch.dtype,
                 vocab: int | None = None, k: int = LENS_TOP_K) -> None:
        self.sites, self.dtype, self.k = dict(sites), dtype, k
        self.readout = Readout.of(model, dtype, vocab)
        self.final: Tensor | None = None  # the full-context final residual at the query
        self.stream = _Stream()
        self.splits: dict[int, bool] = {}  # layer -> its output is v + branch (`_adds_up`)
        #: tokens read after the emitted one (`lens_step`'s ``tokens``; `core.dynamics` asks
        #: for the answer token at every context prefix)
        self.extra_tokens: tuple[int, ...] = ()

    @contextmanager
    def recording(self, rows: int = 1) -> Iterator[None]:
        """Keep the full-context final residual (the final norm's input at the query; batch row
        0 when a pass runs ``rows`` rows)."""

        def keep(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            x = first_input(args, kwargs)
            self.final = query_row(x, self.dtype) if rows == 1 else first_row_query(
                x, self.dtype, rows)

        handle = self.readout.hooked.register_forward_pre_hook(keep, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()

    @contextmanager
    def capturing(self) -> Iterator[None]:
        """Keep every patched layer's input during the patched pass (its hooks change the
        layers' outputs, never their inputs)."""
        self.stream = _Stream()

        def keep(i: int) -> Any:
            def pre(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                self.stream.inputs[i] = first_input(args, kwargs).detach().clone()
            return pre

        handles = [s.layer.register_forward_pre_hook(keep(i), with_kwargs=True)
                   for i, s in self.sites.items()]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @contextmanager
    def replaying(self) -> Iterator[None]:
        """Feed every patched layer the input it had in the patched pass and keep, at the query,
        its unpatched output ``T_0``, its ``v_0`` and its branch output: run the same forward as
        the patched pass inside this block (on the same cache state)."""
        inputs, dtype = self.stream.inputs, self.dtype
        stream = self.stream
        handles: list[Any] = []

        def feed(i: int) -> Any:
            def pre(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                return _replace_input(args, kwargs, inputs[i])
            return pre

        def out_hook(store: dict[int, Tensor], i: int) -> Any:
            def post(m: nn.Module, args: tuple[Any, ...], output: Any) -> None:
                store[i] = query_row(first_output(output), dtype)
            return post

        try:
            for i, s in self.sites.items():
                if i not in inputs:
                    continue
                # (the layer's input is replaced before a source of ``v`` reads it)
                handles.append(s.layer.register_forward_pre_hook(feed(i), with_kwargs=True))
                parts = stream.v_parts.setdefault(i, [])
                for module, kind in s.v_sources:
                    if kind == "input":
                        def keep_in(m: nn.Module, a: tuple[Any, ...], kw: dict[str, Any],
                                    parts: list[Tensor] = parts) -> None:
                            parts.append(query_row(first_input(a, kw), dtype))
                        handles.append(module.register_forward_pre_hook(keep_in,
                                                                        with_kwargs=True))
                    else:
                        def keep_out(m: nn.Module, a: tuple[Any, ...], out: Any,
                                     parts: list[Tensor] = parts) -> None:
                            parts.append(query_row(first_output(out), dtype))
                        handles.append(module.register_forward_hook(keep_out))
                branch = s.out_norm if s.out_norm is not None else s.out_matrix
                if branch is not None:
                    handles.append(branch.register_forward_hook(out_hook(stream.branch, i)))
                handles.append(s.layer.register_forward_hook(out_hook(stream.block, i)))
            yield
        finally:
            for h in reversed(handles):
                h.remove()

    def deltas(self, targets: Mapping[int, Any]) -> dict[int, dict[str, Tensor | None]]:
        """Each patched layer's parts of the context effect (``(d,)`` vectors, or None where a
        part is not defined there), from the full-context targets and the replay."""
        out: dict[int, dict[str, Tensor | None]] = {}
        d = self.readout.head.shape[-1]
        for i, s in self.sites.items():
            t, stream = targets[i], self.stream
            if i not in stream.block or t.block is None:
                continue
            total = t.block - stream.block[i]
            v0 = stream.v_parts.get(i) or []
            mixer = t.v - torch.stack(v0).sum(0) if v0 and t.v_parts else None
            if i in stream.branch and t.branch is not None:
                mlp = s.branch_scale * (t.branch - stream.branch[i])
            else:
                mlp = None if mixer is None else total - mixer
            if i not in self.splits:  # (a property of the layer: decided at the first step)
                self.splits[i] = _adds_up(t, s.branch_scale)
            if mixer is not None and mlp is not None and not self.splits[i]:
                mixer = mlp = None  # (the block changes T = v + branch after it: Gemma 4)
            parts = {"total": total, "mixer": mixer, "mlp": mlp}
            out[i] = {p: (x if x is not None and x.numel() == d else None)
                      for p, x in parts.items()}
        return out

    def read(self, targets: Mapping[int, Any], tokens: Sequence[int] | Tensor, queue: Any
             ) -> tuple[Any, list[tuple[int, str, Any]]]:
        """Queue every layer's readout on ``queue`` (`core.compare._Host.add`): returns the key
        of ``s_t`` and ``(layer, part, keys)`` for each defined part (keys of the promoted and
        suppressed values and ids and of the logits of ``tokens``, then of `extra_tokens`)."""
        if self.final is None:
            raise RuntimeError("the lens read before its full-context pass")
        s = self.readout.scale(self.final)
        parts = self.deltas(targets)
        rows = [(i, p, x) for i, ps in parts.items() for p, x in ps.items() if x is not None]
        undefined = [(i, p, None) for i, ps in parts.items() for p, x in ps.items() if x is None]
        if not rows:
            return queue(s), undefined
        if self.extra_tokens:
            first = torch.as_tensor(tokens).reshape(-1)
            tokens = torch.cat([first, first.new_tensor(self.extra_tokens)])
        got = self.readout.read(torch.stack([x for _, _, x in rows]), s, self.k, tokens)
        keyed = [(i, p, {name: queue(v[j]) for name, v in got.items()})
                 for j, (i, p, _) in enumerate(rows)]
        return queue(s), keyed + undefined


def lens_step(tokenizer: Any, s: float, parts: Sequence[tuple[int, str, Any]],
              value: Any) -> dict[str, Any]:
    """One step's lens as JSON-ready data (``value``: a queued key's value, `_Host.get`):
    ``{"s": s, "layers": {"l": {part: {"promoted": [[text, logit, id]], "suppressed": [...],
    "emitted": logit} or None}}}`` (the emitted token is the first of the tokens read)."""
    from .compare import _decode

    layers: dict[str, dict[str, Any]] = {}
    for i, part, keys in sorted(parts, key=lambda x: (x[0], PARTS.index(x[1]))):
        entry = layers.setdefault(str(i), {})
        if keys is None:
            entry[part] = None
            continue
        got = {name: value(k) for name, k in keys.items()}
        entry[part] = {
            "promoted": [[_decode(tokenizer, int(t)), _finite(v), int(t)]
                         for v, t in zip(got["promoted"], got["promoted_ids"], strict=True)],
            "suppressed": [[_decode(tokenizer, int(t)), _finite(v), int(t)]
                           for v, t in zip(got["suppressed"], got["suppressed_ids"],
                                           strict=True)],
            "emitted": _finite(got["tokens"][0]),
        }
        if len(got["tokens"]) > 1:
            entry[part]["tokens"] = [_finite(v) for v in got["tokens"]]
    return {"s": _finite(s), "layers": layers}


def _finite(x: Any) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


__all__ = ["LENS_TOP_K", "PARTS", "Lens", "Readout", "final_norm", "lens_step"]
