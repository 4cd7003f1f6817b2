"""Time per token of a comparison with all weights resident vs half the layers offloaded to disk
(accelerate), on the demo model; prints a table and a JSON line.

    python bench/offload.py [--tokens 20] [--model demo]

On a machine without a GPU, accelerate's "cpu" placement is simply resident memory; layers
placed on "disk" are read from the checkpoint (memory-mapped) at every forward. On a GPU, a
third row puts half the layers in CPU memory (moved to the GPU at every forward).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ctxpatch.core.compare import RunSpec, iter_token_patches  # noqa: E402
from ctxpatch.core.loading import load_model  # noqa: E402
from ctxpatch.core.placement import Placement  # noqa: E402
from ctxpatch.core.prompt import build_prompt  # noqa: E402

MARS = ("Write a single-sentence weather forecast for Mars, from the perspective of a slightly "
        "annoyed robot:")


def _half_budget(whole: Any) -> int:
    """Memory for everything but the second half of the layers (of the model loaded whole)."""
    from accelerate.utils import compute_module_sizes

    sizes = compute_module_sizes(whole)
    n = len([k for k in sizes if k.count(".") == 2 and k.startswith("model.layers.")])
    layer = sizes["model.layers.0"]
    return int(sizes[""] - sizes["model.layers"] + (n // 2 + 0.5) * layer)


def _run(loaded, tokens: int) -> dict:  # type: ignore[no-untyped-def]
    prompt = build_prompt(loaded.tokenizer, "", MARS)
    settings = RunSpec(max_new_tokens=tokens, absorb="all")
    list(iter_token_patches(loaded, prompt, RunSpec(max_new_tokens=2, absorb="all")))  # warm-up
    start = time.perf_counter()
    steps = list(iter_token_patches(loaded, prompt, settings))
    seconds = time.perf_counter() - start
    return {"tokens": len(steps), "matches": sum(s.patched.match for s in steps),
            "max_linf": max(s.patched.linf for s in steps), "s_per_token": seconds / len(steps),
            "placement": loaded.describe().get("placement", "resident")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=20)
    args = ap.parse_args()
    import torch

    resident = load_model(args.model, dtype=args.dtype)
    budget = _half_budget(resident.model)
    rows = {"resident": _run(resident, args.tokens)}
    del resident  # its memory back before the placed loads
    with tempfile.TemporaryDirectory() as folder:
        memory = {"cpu": budget} if not torch.cuda.is_available() else {0: budget, "cpu": 0}
        rows["half on disk"] = _run(load_model(args.model, dtype=args.dtype, placement=Placement(
            "auto", memory, folder)), args.tokens)
        if torch.cuda.is_available():
            rows["half in CPU memory"] = _run(load_model(args.model, dtype=args.dtype, placement=(
                Placement("auto", {0: budget, "cpu": 10**12}, folder))), args.tokens)
    base = rows["resident"]["s_per_token"]
    print(f"{'placement':<20} {'matches':>8} {'max L-inf':>10} {'s/token':>8} {'x resident':>10}")
    for name, r in rows.items():
        print(f"{name:<20} {r['matches']:>5}/{r['tokens']:<2} {r['max_linf']:>10.3g} "
              f"{r['s_per_token']:>8.3f} {r['s_per_token'] / base:>10.2f}   ({r['placement']})")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
