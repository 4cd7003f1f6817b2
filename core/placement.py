"""Where a model's weights live: one device, or accelerate's big-model placement
(``device_map`` auto, balanced or sequential, a ``max_memory`` per device, and a folder for what
goes to disk). transformers drives accelerate; ctxpatch only checks the user's choice and says
clearly when even offload cannot fit. No torch here (the window reads it before loading)."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import UserError, mention

DEVICE_MAPS = ("auto", "balanced", "sequential")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """"8GiB", "500MB", "123456" (bytes) -> bytes."""
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(text)
    return int(float(m[1]) * _UNITS[(m[2] or "B").upper()])


def _device(text: str) -> int | str:
    t = text.strip().lower()
    if t.isdigit():
        return int(t)
    if t.startswith("cuda:") and t[5:].isdigit():
        return int(t[5:])
    if t in ("cpu", "mps", "disk"):
        return t
    raise ValueError(text)


def parse_max_memory(items: list[str] | None) -> dict[int | str, int] | None:
    """``["cpu=8GiB", "0=20GiB"]`` -> ``{"cpu": 8 GiB, 0: 20 GiB}`` (bytes)."""
    if not items:
        return None
    out: dict[int | str, int] = {}
    for item in items:
        device, sep, size = item.partition("=")
        try:
            if not sep:
                raise ValueError(item)
            out[_device(device)] = parse_size(size)
        except ValueError:
            raise UserError(f"malformed {mention('max_memory')} {item!r}: use DEVICE=SIZE, e.g. "
                            "cpu=8GiB or "
                            "0=20GiB (devices: cpu, 0, 1, ... or cuda:N, mps)") from None
    return out


@dataclass(frozen=True)
class Placement:
    """How to place a model: ``device_map`` None means all of it on one device."""

    device_map: str | None = None
    max_memory: dict[int | str, int] = field(default_factory=dict)
    offload_folder: str | None = None

    def validate(self) -> None:
        if self.device_map is not None and self.device_map not in DEVICE_MAPS:
            raise UserError(f"unknown device map {self.device_map!r}: use one of "
                            f"{', '.join(DEVICE_MAPS)}")
        if self.device_map is None and (self.max_memory or self.offload_folder):
            raise UserError(f"{mention('max_memory')} and {mention('offload_folder')} need "
                            f"{mention('device_map')} "
                            f"({', '.join(DEVICE_MAPS)})")
        if self.offload_folder:
            folder = Path(self.offload_folder).expanduser()
            if folder.exists() and not folder.is_dir():
                raise UserError(f"the offload folder {self.offload_folder} is a file: "
                                "give a folder")

    def kwargs(self) -> dict[str, Any]:
        """from_pretrained's arguments for this placement."""
        if self.device_map is None:
            return {}
        out: dict[str, Any] = {"device_map": self.device_map}
        if self.max_memory:
            out["max_memory"] = dict(self.max_memory)
        if self.offload_folder:
            folder = Path(self.offload_folder).expanduser()
            folder.mkdir(parents=True, exist_ok=True)
            out["offload_folder"] = str(folder)
        return out

    def check_disk(self, weight_bytes: int | None) -> None:
        """Refuse before loading when the offload folder's disk cannot hold the weights."""
        if not self.offload_folder or weight_bytes is None:
            return
        folder = Path(self.offload_folder).expanduser()
        probe = folder if folder.exists() else folder.parent
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        free = shutil.disk_usage(probe).free
        if free < weight_bytes:
            raise UserError(f"even offload cannot fit: the weights need about "
                            f"{weight_bytes / 1e9:.1f} GB and {probe} has {free / 1e9:.1f} GB "
                            "free (free some disk, use a 16-bit dtype or a smaller model)")

    @classmethod
    def from_text(cls, device_map: str, max_memory: str, offload_folder: str) -> Placement:
        """From the window's fields: "one device" or a map name, "0=20GiB cpu=32GiB", a path."""
        chosen = cls(None if device_map in ("", "one device") else device_map,
                     parse_max_memory(max_memory.split()) or {},
                     offload_folder.strip() or None)
        chosen.validate()
        return chosen


def no_fit(exc: Exception) -> UserError | None:
    """accelerate's "needs an offload folder" failure as one line, or None for other errors."""
    text = str(exc)
    if "offload" in text.lower() and ("folder" in text.lower() or "disk" in text.lower()):
        return UserError(f"the model does not fit in the memory given ({mention('max_memory')})"
                         f": give {mention('offload_folder', metavar='DIR')} to put the rest on "
                         "disk, or allow more memory")
    return None
