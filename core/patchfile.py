"""The patches file's header (DESIGN.md "Patches file"; docs/USAGE.md lists every key): read
without its tensors, checked against one schema before anything uses it, and the fingerprint
of the weights the patches were made for. Torch-free but for `weights_fingerprint`.

The header's metadata is a map of strings; ``steps``, ``conditioning``, ``image``, ``weights``
and ``processor`` hold JSON, parsed in Rust (pydantic_core: nesting too deep is an error, not a
crash) and checked with strict types and bounded numbers, so a crafted file is one line naming
the field (``steps[3].full_input_ids[0]: ...``), never a TypeError or a RecursionError later.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, StringConstraints, TypeAdapter, ValidationError
from typing_extensions import NotRequired, TypedDict

from .errors import UserError, mention
from .export import PATCHES_FORMATS
from .options import Dtype, Scope
from .record import _STRICT, Int32, Real, _Image, first_problem

#: the metadata values that hold JSON (the others are plain strings)
JSON_KEYS = ("steps", "conditioning", "image", "weights", "processor")
ADVICE = "save the patches again"

Ids = Annotated[list[Int32], Field(min_length=1)]
Hex64 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
Hex16 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{16}$")]


class _Step(TypedDict):  # core.export.patch_step_meta
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    full_input_ids: Ids
    reduced_input_ids: Ids
    reduced_position_ids: NotRequired[Ids | None]  # (None: 0..n-1)


class _At(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    step: Int32
    layer: Int32


def _cases_counted(cond: dict[str, Any]) -> dict[str, Any]:
    """A count of hard-case steps comes with its count of layer-steps (the line names both)."""
    if cond.get("hard_case_steps") and "hard_case_layers" not in cond:
        raise ValueError("hard_case_steps without hard_case_layers")
    return cond


class _Conditioning(TypedDict, total=False):  # core.results.conditioning, as conditioning_line
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    max_abs_scale_patch: Real
    max_abs_scale_patch_at: _At | None
    max_entry_ratio: Real
    max_relative_norm: Real
    bound: float
    unbounded_layers: Int32
    unbounded_steps: Int32
    hard_case_layers: Int32
    hard_case_steps: Int32


class _Weights(TypedDict):  # `weights_fingerprint`
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    dtype: str
    sha256: Hex64
    tensors: Annotated[dict[str, Hex16], Field(min_length=1)]


class _Processor(TypedDict):  # `processor_record`
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    processor: str
    image_processor: str | None


def _steps_fit(steps: list[_Step]) -> list[_Step]:
    """A run's steps: step t's full sequence is the prompt and t generated tokens, and every
    reduced position lies within its full sequence (the reduced tokens are tokens of it). Bounds
    the work: a header of N steps holds about N squared / 2 ids."""
    first = len(steps[0]["full_input_ids"])
    for t, step in enumerate(steps):
        full = len(step["full_input_ids"])
        if full != first + t:
            raise ValueError(f"step {t} holds {full} full ids and step 0 {first}, but each step "
                             "adds one generated token")
        pos = step.get("reduced_position_ids")
        if pos is not None:
            if len(pos) != len(step["reduced_input_ids"]):
                raise ValueError(f"step {t} has {len(pos)} reduced_position_ids for "
                                 f"{len(step['reduced_input_ids'])} reduced_input_ids")
            if max(pos) >= full:
                raise ValueError(f"step {t}'s reduced_position_ids reach {max(pos)}, beyond its "
                                 f"{full} full ids")
    return steps


class _Header(TypedDict):  # DESIGN.md "Patches file", the keys added since in docs/USAGE.md
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    format: Literal["ctxpatch-patches/1", "ctxpatch-patches/2"]
    model: NotRequired[str]
    dtype: NotRequired[Dtype]
    method: NotRequired[str]
    absorb: NotRequired[str]
    scope: NotRequired[Scope]
    layers: NotRequired[str]
    output_control: NotRequired[str]
    steps: Annotated[list[_Step], Field(min_length=1), AfterValidator(_steps_fit)]
    conditioning: NotRequired[Annotated[_Conditioning, AfterValidator(_cases_counted)] | None]
    image: NotRequired[_Image | None]
    weights: NotRequired[_Weights]
    processor: NotRequired[_Processor]


_HEADER: TypeAdapter[Any] | None = None  # built on first use


def _adapter() -> TypeAdapter[Any]:
    global _HEADER
    if _HEADER is None:
        _HEADER = TypeAdapter(_Header)
    return _HEADER


def _invalid(source: str, problem: str) -> UserError:
    return UserError(f"{source} is not a valid ctxpatch patches file ({problem}): {ADVICE}")


def check_header(metadata: dict[str, str], source: str) -> dict[str, Any]:
    """The metadata parsed (its JSON values as JSON) and checked against the schema.

    Raises:
        UserError: another file's metadata (no ctxpatch format), no steps, or a damaged field,
            named (``steps[3].full_input_ids[0]: ...``).
    """
    import pydantic_core

    fmt = metadata.get("format")
    if fmt not in PATCHES_FORMATS:
        raise UserError(f"{source} is not a ctxpatch patches file (format {fmt!r})")
    header: dict[str, Any] = dict(metadata)
    for key in JSON_KEYS:
        if key not in metadata:
            continue
        try:  # in Rust: truncated, or nested too deeply, is a ValueError, never a crash
            header[key] = pydantic_core.from_json(metadata[key])
        except ValueError as exc:
            what = "nested too deeply" if "recursion" in str(exc) else f"not JSON: {exc}"
            raise _invalid(source, f"{key}: {what}") from None
    if "steps" not in header:
        raise UserError(f"{source} has no step list in its metadata: {ADVICE}")
    if header["steps"] == []:
        raise UserError(f"{source} lists no steps: there is nothing to verify (was the run "
                        "cancelled before its first token?)")
    try:
        _adapter().validate_python(header)
    except ValidationError as exc:
        raise _invalid(source, first_problem(exc)) from None
    return header


def read_header(path: str | Path) -> dict[str, Any]:
    """A patches file's checked header (`check_header`), read without its tensors.

    Raises:
        UserError: a missing or unreadable file, another kind of file, a damaged header.
    """
    from safetensors import SafetensorError, safe_open

    existing(path)
    try:
        with safe_open(str(path), framework="np") as f:  # (the header only: tensors stay unread)
            metadata = dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise UserError(f"cannot read patches file {path}: {_first_line(exc)}") from None
    return check_header(metadata, str(path))


def existing(path: str | Path) -> None:
    """Refuse a path that is not a file (missing, a folder, a FIFO that reading would block on).

    Raises:
        UserError: naming what it is instead.
    """
    p = Path(path)
    if not p.is_file():
        raise UserError(f"no such patches file: {path}" if not p.exists() else
                        f"{path} is not a file: give a patches file written by "
                        f"{mention('save_patches', metavar='FILE')}")


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# -- what the patches were made with ---------------------------------------------------------
#: entries of each parameter hashed: evenly spaced, the last included (a fingerprint, not a
#: checksum: it catches another checkpoint, a parameter scaled or replaced, another dtype, for
#: about the same cost on any size of model; an edit of a single entry between the samples is
#: not caught)
SAMPLE = 1 << 16


def _tensor_digest(t: Any) -> str:
    """SHA-256 of a tensor's dtype, shape and a sample of its entries' bytes (the same
    checkpoint loaded again in the same dtype gives the same bytes on any device)."""
    import torch

    h = hashlib.sha256(f"{str(t.dtype).removeprefix('torch.')}{tuple(t.shape)}".encode())
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n:
        step = -(-n // SAMPLE)
        picked = torch.cat([flat[::step], flat[-1:]]).contiguous()
        h.update(picked.view(torch.uint8).cpu().numpy().data)
    return h.hexdigest()


def weights_fingerprint(model: Any) -> dict[str, Any] | None:
    """The fingerprint of a model's parameters (each once, tied ones under their first name):
    the dtype, a SHA-256 over every parameter's, and each parameter's (16 hex digits, to name
    the ones that differ), each from its dtype, shape and `SAMPLE` of its entries. None when a
    parameter is offloaded (not in memory)."""
    import torch

    params = list(model.named_parameters())
    if not params or any(p.device.type == "meta" for _, p in params):
        return None
    with torch.no_grad():
        named = {n: _tensor_digest(p) for n, p in params}
    total = hashlib.sha256("".join(f"{n}:{d}\n" for n, d in sorted(named.items())).encode())
    dtype = getattr(model, "dtype", params[0][1].dtype)
    return {"dtype": str(dtype).removeprefix("torch."), "sha256": total.hexdigest(),
            "tensors": {n: d[:16] for n, d in named.items()}}


def processor_record(processor: Any) -> dict[str, Any] | None:
    """What turned the picture into pixels: the processor's class and its image processor's
    (a fast and a slow image processor give slightly different pixels)."""
    if processor is None:
        return None
    image = getattr(processor, "image_processor", None)
    return {"processor": type(processor).__name__,
            "image_processor": None if image is None else type(image).__name__}


def compare_weights(recorded: dict[str, Any] | None, model: Any, model_id: str) -> str:
    """What the weights check found, as a phrase for verify's summary ("fingerprint matched
    (N tensors)", or why it could not be checked).

    Raises:
        UserError: the weights differ from those the patches were made for.
    """
    if recorded is None:
        return "not checked (the patches file records no fingerprint of them: saved by an older "\
            "ctxpatch)"
    found = weights_fingerprint(model)
    if found is None:
        return "not checked (some weights are offloaded, not in memory)"
    if found["dtype"] != recorded["dtype"]:
        return (f"not checked (the patches were made for {recorded['dtype']} weights, these are "
                f"{found['dtype']})")
    if found["sha256"] == recorded["sha256"]:
        return f"fingerprint matched ({len(found['tensors'])} tensors)"
    mine, theirs = found["tensors"], recorded["tensors"]
    differ = sorted(n for n in mine.keys() | theirs.keys() if mine.get(n) != theirs.get(n))
    named = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
    raise UserError(f"the weights of {model_id} differ from those these patches were made for "
                    f"({named or 'the parameter order'}): verify with the model they were made "
                    f"with ({mention('model')})")


def compare_processor(recorded: dict[str, Any] | None, processor: Any) -> None:
    """The picture goes through the processor the patches were made with.

    Raises:
        UserError: another processor or image processor class.
    """
    found = processor_record(processor)
    if recorded is None or found is None or found == recorded:
        return
    raise UserError(f"these patches were made with the image processor "
                    f"{recorded['image_processor'] or recorded['processor']}, this model loads "
                    f"{found['image_processor'] or found['processor']}: the pixels would differ "
                    "(verify where the patches were made, with the same transformers and "
                    "torchvision)")
