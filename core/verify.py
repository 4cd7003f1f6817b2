"""Re-apply saved patches with plain transformers: no hooks, no engine.

For each step of a patches file, the patches are written into the weights (``W += outer(u, v)``,
``b += delta``; the originals are restored in ``finally``), the model runs on the step's reduced
input ids, and its last-position logits are compared with the unpatched model on the full ids.
With scope "query" the reduced prefix runs with the original weights into a KV cache first and
only the last token runs with the patched weights, which is what that scope means.

Both caches are fed as the run fed its own (`core.compare`) and as generation does: the first
step's ids in one forward, then only the ids each later step appends (`_Fed`). A fresh forward
over all the ids is the same function, but not the same rounding wherever transformers computes
in float32 inside a float64 model: Qwen3-Next's and Qwen 3.5's gated delta rule
(``torch_chunk_gated_delta_rule`` scans a sequence in chunks, ``torch_recurrent_gated_delta_rule``
takes a cached token, both in float32) give a cached and a fresh float64 forward logits ~1e-6 of
their scale apart, which a fresh reference would charge to the patches (issue 16).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import Cancelled, UserError, mention
from .export import patch_step_meta
from .forward import last_logits, logit_distance, rolled_back, written_
from .loading import LoadedModel
from .patchfile import ADVICE, check_header, compare_processor, compare_weights, existing
from .threads import run_threads

_NAME = re.compile(r"^step\.(\d+)\.(.+?)(?:\[(\d+)\])?\.(u|v|delta)$")


@dataclass
class PatchFile:
    """A parsed patches file: metadata, its checked header (`core.patchfile.check_header`: the
    metadata with its JSON values parsed) and, per step, parameter -> patch tensors."""

    metadata: dict[str, str]
    steps: list[dict[str, Any]]
    patches: dict[int, dict[tuple[str, int | None], dict[str, torch.Tensor]]] = field(
        default_factory=dict
    )
    header: dict[str, Any] = field(default_factory=dict)

    @property
    def conditioning(self) -> dict[str, Any] | None:
        """The run's conditioning summary (format /2 on; None before)."""
        value = self.header.get("conditioning")
        return value if isinstance(value, dict) else None

    @property
    def tensor_count(self) -> int:
        """The patch tensors (u, v, delta) over all steps."""
        return sum(len(parts) for params in self.patches.values() for parts in params.values())


def read_patches(path: str | Path, header: dict[str, Any] | None = None) -> PatchFile:
    """Read and check a patches file: its header first (`core.patchfile.check_header`; or
    ``header``, that check's result from `core.patchfile.read_header` of the same file), then
    its tensors; any problem is a `UserError` naming the file."""
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    existing(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            if header is None:
                header = check_header(metadata, str(path))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise UserError(f"cannot read patches file {path}: {str(exc).splitlines()[0]}") from None
    steps = [{"reduced_position_ids": None, **step} for step in header["steps"]]
    pf = PatchFile(metadata=metadata, steps=steps, header=header)
    for key, tensor in tensors.items():
        _add_tensor(pf, key, tensor, str(path))
    _check_tensors(pf, str(path))
    return pf


def _check_tensors(pf: PatchFile, source: str) -> None:
    """Every patch belongs to a listed step, is complete (u and v, or delta), one-dimensional,
    floating point and finite; the file holds patches, and for every listed step."""
    if not pf.patches:
        raise UserError(f"{source} holds no patch tensors: there is nothing to verify (a run "
                        f"with every patch kind disabled?); {ADVICE}")
    for step, params in pf.patches.items():
        if step >= len(pf.steps):
            raise UserError(f"{source} has patches for step {step}, but its step list has "
                            f"{len(pf.steps)} step(s): the file was edited or cut")
        for (name, index), parts in params.items():
            label = f"step {step}, {name}" + ("" if index is None else f"[{index}]")
            if not ("delta" in parts or {"u", "v"} <= parts.keys()):
                raise UserError(f"{source}: the patch of {label} lacks its "
                                f"{'v' if 'u' in parts else 'u'} vector")
            for part, tensor in parts.items():
                if tensor.ndim != 1 or not tensor.is_floating_point():
                    raise UserError(f"{source}: the patch of {label} ({part}) is not a vector "
                                    f"of numbers (shape {tuple(tensor.shape)}, {tensor.dtype})")
                if not bool(torch.isfinite(tensor).all()):
                    raise UserError(f"{source}: the patch of {label} ({part}) holds NaN or "
                                    "infinite entries")
    missing = [t for t in range(len(pf.steps)) if t not in pf.patches]
    if missing:  # (every step of a run patches the same parameters)
        raise UserError(f"{source} lists {len(pf.steps)} steps, but {len(missing)} of them "
                        f"have no patch tensors (step {missing[0]} first): the file was edited "
                        f"or cut; {ADVICE}")


def check_against(model: torch.nn.Module, pf: PatchFile) -> None:
    """Before any forward pass: every patched parameter exists with the patch's shape, every
    token id is in the model's vocabulary, and every step's sequence within its positions (the
    steps of a file add one token each: this bounds their count too)."""
    from .plan import _max_positions

    params = dict(model.named_parameters())
    vocab = model.get_input_embeddings().weight.shape[0]
    limit = _max_positions(model)
    longest = max(len(meta["full_input_ids"]) for meta in pf.steps)
    if limit is not None and longest > limit:
        raise UserError(f"these patches run {longest} positions ({len(pf.steps)} steps), beyond "
                        f"this model's {limit}: they were made with another model "
                        f"({mention('model')}), or the file was edited; {ADVICE}")
    for t, meta in enumerate(pf.steps):
        top = max(max(meta["full_input_ids"]), max(meta["reduced_input_ids"]))
        if top >= vocab:
            raise UserError(f"step {t} uses token id {top}, beyond this model's vocabulary "
                            f"({vocab}): these patches were made with another model "
                            f"({mention('model')})")
    for step, patches in pf.patches.items():
        for (name, index), parts in patches.items():
            if name not in params:
                raise UserError(f"the patches name parameter {name!r}, which this model lacks "
                                f"(were they made with another model? {mention('model')})")
            shape = tuple(params[name].shape)
            if index is not None:
                if len(shape) < 2 or index >= shape[0]:
                    raise UserError(f"the patches name {name}[{index}], beyond the parameter's "
                                    f"shape {shape}")
                shape = shape[1:]
            want = ((int(parts["delta"].shape[0]),) if "delta" in parts
                    else (int(parts["u"].shape[0]), int(parts["v"].shape[0])))
            if want != shape:
                raise UserError(f"the patch of {name} at step {step} has shape {want}, the "
                                f"parameter {shape} (made with another model? {mention('model')})")


def _add_tensor(pf: PatchFile, key: str, tensor: torch.Tensor, source: str) -> None:
    m = _NAME.match(key)
    if m is None:
        raise UserError(f"{source}: unexpected tensor name {key!r}")
    step, param, index, part = int(m[1]), m[2], m[3], m[4]
    slot = pf.patches.setdefault(step, {}).setdefault(
        (param, None if index is None else int(index)), {})
    slot[part] = tensor


def patches_of_steps(steps: Sequence[Any], scope: str) -> PatchFile:
    """The patches a run kept (``RunSpec.keep_patches``), as if saved and read back, so a run
    can be verified in memory (``ctxpatch compare --verify``)."""
    pf = PatchFile(metadata={"scope": scope}, steps=[])
    for s in steps:
        if s.patches is None:
            raise UserError("this run kept no patches to verify (keep_patches was off)")
        pf.steps.append(patch_step_meta(s))
        for name, arr in s.patches.items():
            _add_tensor(pf, f"step.{s.step}.{name}", torch.from_numpy(arr), "the run")
    return pf


@contextmanager
def materialized(model: torch.nn.Module,
                 patches: dict[tuple[str, int | None], dict[str, torch.Tensor]]
                 ) -> Iterator[None]:
    """Write patches into the model's parameters; restore the originals in ``finally``."""
    params = dict(model.named_parameters())
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for (name, index), parts in patches.items():
        if name not in params:
            raise UserError(f"the patches name parameter {name!r}, which this model lacks")
        p = params[name]
        if p.device.type == "meta":
            raise UserError(f"verify writes the patches into the weights, and {name} is offloaded "
                            f"(not in memory): run verify without {mention('device_map')}")
        target = p if index is None else p[index]
        ct = torch.float64 if p.dtype == torch.float64 else torch.float32
        if "delta" in parts:
            d = parts["delta"].to(p.device, ct)
        else:
            d = torch.outer(parts["u"].to(p.device, ct), parts["v"].to(p.device, ct))
        if d.shape != target.shape:
            raise UserError(
                f"patch for {name} has shape {tuple(d.shape)}, the parameter {tuple(target.shape)}"
            )
        pairs.append((target, d))
    with written_(pairs):
        yield


class _Fed:
    """A KV cache fed as a run feeds its own: ids that extend the ones already fed (with the same
    positions) run alone through the cache, anything else starts a new cache."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model, self.device = model, device
        self.cache: Any = None
        self.fed: list[tuple[int, int | None]] = []

    def feed(self, ids: Sequence[int], positions: Sequence[int] | None = None,
             logits: bool = True, **kwargs: Any) -> torch.Tensor | None:
        """Bring the cache to ``ids``; their last logits (None when nothing new ran and
        ``logits`` is off). ``kwargs`` go to `last_logits` (the picture, for a new cache)."""
        from transformers import DynamicCache

        items = list(zip(ids, [None] * len(ids) if positions is None else positions, strict=True))
        n = len(self.fed)
        if self.cache is None or items[:n] != self.fed or (logits and len(items) == n):
            self.cache, self.fed, n = DynamicCache(config=self.model.config), [], 0
        new, self.fed = items[n:], items
        if not new:
            return None
        return last_logits(self.model, [i for i, _ in new], self.device, self.cache,
                           None if positions is None else [int(p) for _, p in new], **kwargs)


@dataclass(frozen=True)
class StepCheck:
    step: int
    match: bool
    linf: float
    tvd: float
    scale: float  # max |full-context logits|


def recorded_image(pf: PatchFile, path: str | None = None) -> tuple[Any, Any] | None:
    """The picture a patches file was made with (its recorded path, or ``path`` instead), read
    and checked against the recorded hash; None when it was made without one. Needs no model,
    so a missing picture fails before the model loads."""
    from .images import ImageInfo, read_image, reopen

    recorded = pf.header.get("image")
    if recorded is None:
        return None if path is None else read_image(path)
    return reopen(ImageInfo.from_dict(recorded), path)


def image_pixels(loaded: LoadedModel, picture: tuple[Any, Any] | None) -> dict[str, Any] | None:
    """The processor's pixel inputs for a `recorded_image` (None for None)."""
    from .images import encode_image, text_only

    if picture is None:
        return None
    if loaded.processor is None:
        raise text_only(loaded.spec)
    return encode_image(loaded.processor, picture[0])[1]


def check_made_with(loaded: LoadedModel, pf: PatchFile) -> str:
    """Before any forward pass: `check_against`, then the weights are those the patches were
    made for (the fingerprint the file records) and a picture goes through the processor they
    were made with. Returns what the weights check found (`core.patchfile.compare_weights`).

    Raises:
        UserError: another model, other weights, another image processor.
    """
    check_against(loaded.model, pf)
    compare_processor(pf.header.get("processor"), loaded.processor)
    return compare_weights(pf.header.get("weights"), loaded.model, loaded.spec)


def verify_patches(
    loaded: LoadedModel,
    pf: PatchFile,
    progress: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    pixels: dict[str, Any] | None = None,
    made_with: bool = True,
) -> list[StepCheck]:
    """Compare patched-weights reduced logits with the full-context logits at every step.

    ``pixels``: the image's inputs (`image_pixels`) when the full ids hold image tokens.
    ``made_with``: `check_made_with` first (off: the caller did, and said what it found).
    """
    model, device = loaded.model, loaded.device
    image_token = getattr(model.config, "image_token_id", None)
    if pixels is None and image_token is not None and any(
            image_token in meta["full_input_ids"] for meta in pf.steps):
        raise UserError("these patches were made with an image in the context: pass "
                        f"{mention('image', metavar='FILE')}")
    if made_with:
        check_made_with(loaded, pf)
    # scope query with absorb context: the run extended a cache of the reduced prefix and patched
    # the last token alone; with absorb all it ran the (one or two token) reduced sequence in one
    # pass, patched at its last position, which written-in weights can only do split this way too
    query_scope = pf.metadata.get("scope") == "query"  # (checked: one of the scopes, or none)
    checks: list[StepCheck] = []
    full_run, prefix = _Fed(model, device), _Fed(model, device)

    with torch.inference_mode(), run_threads(device):  # (a busy CPU: core.threads)
        for t, meta in enumerate(pf.steps):
            if should_stop is not None and should_stop():
                raise Cancelled
            full = full_run.feed(meta["full_input_ids"], pixels=pixels,
                                 prompt_length=len(pf.steps[0]["full_input_ids"]))
            assert full is not None
            red, pos = meta["reduced_input_ids"], meta["reduced_position_ids"]
            step_patches = pf.patches.get(t, {})
            if query_scope and len(red) > 1:
                prefix.feed(red[:-1], None if pos is None else pos[:-1], logits=False)
                with rolled_back(prefix.cache), materialized(model, step_patches):
                    patched = last_logits(model, red[-1:], device, prefix.cache,
                                          None if pos is None else pos[-1:])
            else:
                with materialized(model, step_patches):
                    patched = last_logits(model, red, device, positions=pos)
            match, linf, tvd = logit_distance(patched, full)
            checks.append(StepCheck(step=t, match=match, linf=linf, tvd=tvd,
                                    scale=float(full.abs().max())))
            if progress:
                progress(t + 1, len(pf.steps))
    return checks
