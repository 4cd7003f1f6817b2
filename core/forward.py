"""Running the model: last-position logits, extending a cache, comparing logits, and writing
deltas into parameters for one call. Used by the comparison protocol, verify and the bench."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from .images import input_rules, vision_kwargs


@contextmanager
def written_(pairs: Sequence[tuple[Tensor, Tensor]]) -> Iterator[None]:
    """Add each delta to its parameter (or parameter slice) in place, rounded to the parameter's
    dtype; restore the exact originals in ``finally``."""
    saved: list[tuple[Tensor, Tensor]] = []
    try:
        with torch.no_grad():
            for target, delta in pairs:
                saved.append((target, target.detach().clone()))
                target.copy_((target.to(delta.dtype) + delta).to(target.dtype))
        yield
    finally:
        with torch.no_grad():
            for target, original in reversed(saved):
                target.copy_(original)


def add_to_slices_(param: Tensor, index: Tensor, deltas: Tensor) -> Tensor:
    """Add ``deltas[j]`` to the slice ``param[index[j]]`` in place (the indices distinct; no
    host sync), computed in the deltas' dtype and rounded to the parameter's; returns the
    original slices (a copy), for a restore with ``index_copy_``."""
    slices = param.index_select(0, index)  # (a copy)
    patched = slices.to(deltas.dtype, copy=True)
    patched += deltas  # (in place: one buffer of k slices fewer)
    param.index_copy_(0, index, patched.to(param.dtype))
    return slices


@contextmanager
def written_slices_(items: Sequence[tuple[Tensor, Tensor, Tensor]]) -> Iterator[None]:
    """For each ``(param, index, deltas)``: `add_to_slices_`; restore the exact originals in
    ``finally``."""
    saved: list[tuple[Tensor, Tensor, Tensor]] = []
    try:
        with torch.no_grad():
            for param, index, deltas in items:
                saved.append((param, index, add_to_slices_(param, index, deltas)))
        yield
    finally:
        with torch.no_grad():
            for param, index, slices in reversed(saved):
                param.index_copy_(0, index, slices)


def fresh_states(cache: Any) -> None:
    """Give every cache layer fresh copies of the states a forward updates in place: the conv and
    recurrent states of linear-attention and state-space layers (`copy_` into tensors held in
    dicts). The forward then changes only the copies, so whoever kept the layer's attributes
    before it (the comparison's rollback of the reduced prefix cache) still holds the old state;
    attention layers replace their key and value tensors and need nothing."""
    for layer in getattr(cache, "layers", ()):
        for name, value in list(getattr(layer, "__dict__", {}).items()):
            if isinstance(value, dict):
                setattr(layer, name, {k: v.clone() if isinstance(v, Tensor) else v
                                      for k, v in value.items()})


def cache_state(cache: Any) -> list[dict[str, Any]]:
    """A DynamicCache's state as it is now (its layers' attributes), for `restored`."""
    return [dict(layer.__dict__) for layer in cache.layers]


def _set_state(cache: Any, state: list[dict[str, Any]]) -> None:
    for layer, attributes in zip(cache.layers, state, strict=True):
        layer.__dict__.clear()
        layer.__dict__.update(attributes)


@contextmanager
def rolled_back(cache: Any) -> Iterator[None]:
    """Undo whatever forwards inside the block append to a DynamicCache: its layers replace,
    not mutate, their key and value tensors, and `fresh_states` gives the states a forward
    updates in place fresh copies, so restoring each layer's attributes restores the cache."""
    saved = cache_state(cache)
    try:
        yield
    finally:
        _set_state(cache, saved)


@contextmanager
def restored(cache: Any, state: list[dict[str, Any]]) -> Iterator[None]:
    """The cache as it was in ``state`` (`cache_state`) inside the block, and as it is now
    after it (forwards in the block are undone, as with `rolled_back`)."""
    now = cache_state(cache)
    _set_state(cache, state)
    try:
        yield
    finally:
        _set_state(cache, now)


@contextmanager
def one_read_head(model: Any, rows: int) -> Iterator[None]:
    """For a batch of ``rows`` > 1 on a CPU in float32 or float64: the output matrix as
    ``W @ X^T``, which reads the weights once for all rows. ``F.linear`` (``X @ W^T``) for a few
    rows costs a full read per row there, and more (measured: the demo's 262k-word head in
    float32 takes 64 ms for one row, 156 ms as F.linear for two, 22 ms as ``W @ X^T`` for two;
    docs/PERFORMANCE.md); the same products, rounded differently (float32: ~1e-6 of a logit).
    Only a plain ``nn.Linear`` head without a forward of its own (accelerate's offload sets one)
    is swapped, for the block only; restored in ``finally``."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if (rows < 2 or type(head) is not torch.nn.Linear or "forward" in vars(head)
            or weight is None or weight.device.type != "cpu"
            or weight.dtype not in (torch.float32, torch.float64)):
        yield
        return
    linear: Any = head

    def forward(x: Tensor) -> Tensor:
        w = linear.weight
        flat = x.reshape(-1, x.shape[-1])
        y = (w @ flat.T).T
        if linear.bias is not None:
            y = y + linear.bias
        return y.reshape(*x.shape[:-1], w.shape[0])

    linear.forward = forward
    try:
        yield
    finally:
        del linear.forward


def last_logits(model: Any, ids: Sequence[int], device: torch.device, cache: Any = None,
                positions: Sequence[int] | None = None, pixels: dict[str, Any] | None = None,
                prompt_length: int | None = None, rows: int = 1) -> torch.Tensor:
    """Last-position logits as a float64 vector (`logits64`); with ``rows`` > 1 (no image; a
    ``cache`` then holds that many rows), ``ids`` run as that many identical batch rows and the
    result is ``(rows, vocabulary)``.

    ``pixels``: an image's processor inputs (`core.prompt.Prompt.pixels`), for the full run: a run
    over ids from position 0 that contain its image tokens, or (``cache`` holding those) its
    continuation, which the model runs as `generate` does; ``prompt_length``: how many of ``ids``
    are the prompt, when a full run from position 0 also holds generated tokens. Without
    ``pixels``, a run reads text only; families whose model keeps the image's position offset
    between calls (Qwen2-VL's M-RoPE) then get the language model's plain positions explicitly.
    """
    if rows > 1 and pixels is not None:
        raise ValueError("identical batch rows run without an image")
    kwargs: dict[str, Any] = {"logits_to_keep": 1}
    past = 0
    if cache is not None:
        fresh_states(cache)
        kwargs.update(cache=cache, use_cache=True)
        past = cache.get_seq_length()
    else:
        kwargs["use_cache"] = False
    input_ids = torch.tensor([list(ids)] * rows, device=device)
    if pixels is not None:
        if past == 0:
            kwargs.update(vision_kwargs(model, pixels, input_ids, prompt_length))
    elif positions is None and input_rules(model.config).plain_positions:
        positions = range(past, past + len(ids))
    if positions is not None:
        kwargs["position_ids"] = torch.tensor([list(positions)] * rows, device=device)
    with one_read_head(model, rows):
        out = model(input_ids=input_ids, **kwargs)
    return logits64(out.logits[:, -1] if rows > 1 else out.logits[0, -1])


def attention_only(cache: Any) -> bool:
    """Whether every layer of a DynamicCache holds keys and values only (full or sliding
    window): what `rows_logits` can mask row by row (recurrent and state-space states cannot
    be hidden by an attention mask)."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    return all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in cache.layers)


#: `one_pass_fits`: the most the rows' copies of the context's cache may add, as a share of
#: the weights' memory (the memory goal of the comparison is 1.2x plain generation), or in
#: bytes whatever the share (a few MB never matter)
ROWS_CACHE_SHARE = 0.15
ROWS_CACHE_BYTES = 64 << 20


def one_pass_fits(cache: Any, model: Any, rows: int, growth: float) -> bool:
    """Whether ``rows - 1`` more copies of ``cache`` (grown ``growth``-fold by the tokens still
    to come) stay within `ROWS_CACHE_SHARE` of the model's parameter memory or within
    `ROWS_CACHE_BYTES`; on long contexts with large caches the rows keep passes of their own."""
    cache_bytes = sum(t.numel() * t.element_size() for layer in cache.layers
                      for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                      if isinstance(t, Tensor))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return (rows - 1) * cache_bytes * growth <= max(ROWS_CACHE_SHARE * weights, ROWS_CACHE_BYTES)


def rows_logits(model: Any, token: int, position: int, device: torch.device, cache: Any,
                rows: int) -> torch.Tensor:
    """One token at ``position`` as ``rows`` batch rows of one cached forward: row 0 sees the
    whole cache (the full context), the others only themselves, as a run without any context
    would (an attention mask hides the cache from them; ``cache`` must hold ``rows`` rows and
    ``position`` tokens, `attention_only`). Returns the last-position logits, ``(rows,
    vocabulary)``, float64 (`logits64`)."""
    mask = torch.zeros((rows, position + 1), dtype=torch.long, device=device)
    mask[0] = 1
    mask[:, -1] = 1
    with one_read_head(model, rows):
        out = model(input_ids=torch.full((rows, 1), token, device=device), attention_mask=mask,
                    position_ids=torch.full((rows, 1), position, device=device), cache=cache,
                    use_cache=True, logits_to_keep=1)
    return logits64(out.logits[:, -1])


def logits64(x: Tensor) -> Tensor:
    """Logits in float64 where the step's metrics are computed: on their own device (a GPU's
    logits stay there and cross to the host with the step's other values in one transfer,
    `core.compare._Host`), on the CPU for devices without float64 (Apple's MPS)."""
    x = x.detach()
    return x.to(torch.float64) if x.device.type in ("cpu", "cuda") else x.to("cpu", torch.float64)


def extend_cache(model: Any, ids: Sequence[int], device: torch.device, cache: Any) -> None:
    """Run ``ids`` into ``cache`` through the decoder alone: the keys and values without the
    output matrix (on the demo model the 262k-word head is two thirds of a one-token pass)."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else model
    decoder(input_ids=torch.tensor([list(ids)], device=device), cache=cache, use_cache=True)


def logit_gaps(logits: Tensor, base: Tensor, base_probs: Tensor | None = None,
               probs: Tensor | None = None, base_token: Tensor | None = None
               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(argmax of ``logits``, argmax of ``base``, max |logits - base|, TVD = half the L1 distance
    of the softmaxes) as 0-d tensors on the logits' device, so no host sync; pass softmaxes
    (and the base's argmax) already computed so that each is computed once per step."""
    if base_probs is None:
        base_probs = torch.softmax(base, -1)
    if probs is None:
        probs = torch.softmax(logits, -1)
    if base_token is None:
        base_token = base.argmax()
    return (logits.argmax(), base_token, (logits - base).abs().max(),
            0.5 * (probs - base_probs).abs().sum())


def logit_distance(logits: Tensor, base: Tensor) -> tuple[bool, float, float]:
    """(argmax match, max |logits - base|, TVD) as Python values (`logit_gaps`)."""
    token, base_token, linf, tvd = logit_gaps(logits, base)
    return int(token) == int(base_token), float(linf), float(tvd)
