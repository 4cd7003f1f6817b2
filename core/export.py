"""Run JSON, per-step CSV and the patches file (DESIGN.md "Run JSON" and "Patches file").

Every write is atomic: the data goes to a temporary file beside the target, which then replaces
it, so a crash or a cancel mid-write never leaves a half-written file.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import signal
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .errors import UserError, mention
from .images import ImageInfo
from .results import StepResult, conditioning
from .spec import RunSpec

PATCHES_FORMAT = "ctxpatch-patches/2"  # /2: float64 tensors for float64 runs, conditioning
PATCHES_FORMATS = ("ctxpatch-patches/1", PATCHES_FORMAT)  # what `verify` reads


def _mode_for(target: Path) -> int:
    """The mode a rewritten file keeps (a private 0600 file stays private); a new file gets a
    normal file's mode under the umask."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _real_target(path: str | Path) -> Path:
    """What a write of ``path`` replaces: the file a symlink points to (the link stays)."""
    return Path(os.path.realpath(path)) if os.path.islink(path) else Path(path)


def install(tmp: str | Path, path: str | Path) -> None:
    """Move a finished temporary file (in the target's folder) over ``path``, keeping the
    target's mode and following a symlink."""
    target = _real_target(path)
    os.chmod(tmp, _mode_for(target))  # mkstemp makes it private
    os.replace(tmp, target)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Ctrl+C and SIGTERM wait until the block ends, so that an interrupted command leaves the
    whole output or none of it: their handlers only note them meanwhile (never an exception
    inside Qt's painting, where it cannot propagate), and the first one noted is sent again
    after the block, to the handlers as they were. Off the main thread (where handlers cannot
    be set) the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    old = {s: signal.signal(s, lambda signum, frame: noted.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if noted:
            os.kill(os.getpid(), noted[0])


def atomic_write(path: str | Path, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` then move the temporary file over ``path``. A symlink is followed
    (the file it points to is replaced and the link stays, as a shell's ``>`` does); the
    target's mode is kept."""
    target = _real_target(path)
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"cannot write {path}: folder {parent} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=parent)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    os.close(fd)
    try:
        write(tmp)
        install(tmp, target)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    except Exception as exc:  # noqa: BLE001 - safetensors reports a full disk as its own error
        if type(exc).__name__ != "SafetensorError":
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "write failed"
        raise UserError(f"cannot write {path}: {first} (is the disk full?)") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text(path: str | Path, text: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)

    atomic_write(path, write)


def _finite(x: Any) -> Any:
    """JSON has no NaN or infinity: they become null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def json_text(record: dict[str, Any]) -> str:
    """Valid JSON whatever the record holds: NaN and infinities (a run past a numerical fault,
    or a reopened session that carried them) become null."""
    return json.dumps(_finite(record), indent=1, ensure_ascii=False, allow_nan=False) + "\n"


def write_json(path: str | Path, record: dict[str, Any]) -> None:
    write_text(path, json_text(record))


CSV_COLUMNS = (
    "step", "position", "baseline_id", "baseline_text", "patched_id", "patched_text", "match",
    "linf", "tvd", "control_id", "control_text", "control_match", "control_linf", "control_tvd",
    "seconds",
)


#: a cell starting with one of these is a formula to a spreadsheet (OWASP "CSV Injection", ASVS
#: 1.2.10): "=cmd|' /C calc'!A0" runs a program; the full-width forms count in some locales
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r", "\n", "\0", "\uff1d", "\uff0b", "\uff0d",
                  "\uff20")


def csv_text(text: str) -> str:
    """A text cell (a token's text) that a spreadsheet shows as text: one that would start a
    formula gets a leading single quote. Number cells are written as numbers, never through
    this, so -1.5e-3 stays a number."""
    return "'" + text if text.startswith(FORMULA_STARTS) else text


def steps_csv(steps: Sequence[StepResult]) -> str:
    """The per-token table; token texts are neutralised against formula injection (`csv_text`)."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(CSV_COLUMNS)
    for s in steps:
        w.writerow([
            s.step, s.position, s.baseline_token, csv_text(s.baseline_text), s.patched.token,
            csv_text(s.patched.text), int(s.patched.match), repr(s.patched.linf),
            repr(s.patched.tvd), s.control.token, csv_text(s.control.text), int(s.control.match),
            repr(s.control.linf), repr(s.control.tvd),
            f"{sum(s.seconds.values()):.6f}",
        ])
    return buf.getvalue()


def patch_step_meta(s: StepResult) -> dict[str, Any]:
    """What the patches file says of one step: the sequences its patches are checked on."""
    return {
        "full_input_ids": list(s.full_input_ids),
        "reduced_input_ids": list(s.reduced_input_ids),
        "reduced_position_ids": (None if s.reduced_position_ids is None
                                 else list(s.reduced_position_ids)),
    }


def save_patches(
    path: str | Path, steps: Sequence[StepResult], model_id: str, dtype: str, settings: RunSpec,
    image: ImageInfo | None = None, made_with: dict[str, Any] | None = None,
) -> int:
    """Write every step's patches as one safetensors file; returns the tensor count.

    ``image``: the context's picture, recorded (path, sha256) so `verify` can find it again.
    ``made_with``: what the patches were made with (`patches_made_with`): the fingerprint of the
    weights and, with a picture, the processor, which `verify` compares.

    Raises:
        UserError: when the run kept no patches (``RunSpec.keep_patches`` was off).
    """
    from safetensors.numpy import save_file

    tensors: dict[str, np.ndarray] = {}
    meta_steps = []
    for s in steps:
        if s.patches is None:
            raise UserError(f"this run kept no patches: run it with {mention('keep_patches')}")
        for name, arr in s.patches.items():
            # float64 for a float64 run, float32 otherwise (as the run computed and applied them)
            kind = np.float64 if arr.dtype == np.float64 else np.float32
            tensors[f"step.{s.step}.{name}"] = np.ascontiguousarray(arr, dtype=kind)
        meta_steps.append(patch_step_meta(s))
    metadata = {
        "format": PATCHES_FORMAT,
        "model": model_id,
        "dtype": dtype,
        "method": settings.method,
        "absorb": settings.absorb,
        "scope": settings.scope,
        "layers": settings.layers,
        "output_control": settings.output_control or "",
        "steps": json.dumps(meta_steps),
        "conditioning": json.dumps(_finite(conditioning(steps))),
    }
    if image is not None:
        metadata["image"] = json.dumps(image.to_dict())
    for key in ("weights", "processor"):
        if (made_with or {}).get(key) is not None:
            metadata[key] = json.dumps(made_with[key])  # type: ignore[index]
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
    return len(tensors)


def patches_made_with(loaded: Any, image: bool = False) -> dict[str, Any]:
    """What a run's patches are made with, for `save_patches`: the fingerprint of the loaded
    model's weights (`core.patchfile.weights_fingerprint`) and, for a run with a picture
    (``image``), its processor. Taken when the run is done (the weights are as loaded again)."""
    from .patchfile import processor_record, weights_fingerprint

    return {"weights": weights_fingerprint(loaded.model),
            "processor": processor_record(loaded.processor) if image else None}
