"""Interleaved A/B of comparison settings on one loaded model: plain generate and each variant
in turn, ``--repeats`` rounds after a warm-up, in one process (so that a noisy machine slows
every variant alike); prints min and median seconds and each min over generate's min, and each
later variant's per-round ratio to the first with their median. ``NUMBA_DISABLE_JIT=1`` runs
the stable update as before session 10 (NumPy and torch instead of `core.secular_jit`).

    PYTHONPATH=. python3 bench/ab.py --dtype float32 --repeats 6 \\
        '{"direct": {"control": false}, "stable": {"control": false, "method": "stable"}}'

The prompt is the Mars prompt with absorb all, 20 new tokens, the demo model (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MARS = ("Write a single-sentence weather forecast for Mars, from the perspective of a slightly "
        "annoyed robot:")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("variants",
                    help='JSON: name -> compare settings, e.g. {"b": {"control_row": "batched"}}')
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=20)
    args = ap.parse_args()
    from ctxpatch.core.bench import _generate
    from ctxpatch.core.compare import RunSpec, iter_token_patches
    from ctxpatch.core.prompt import build_prompt

    import ctxpatch

    variants = json.loads(args.variants)
    loaded = ctxpatch.load(args.model, dtype=args.dtype)
    prompt = build_prompt(loaded.tokenizer, "", MARS)

    def run(kw: dict) -> None:
        settings = RunSpec(max_new_tokens=args.tokens, absorb="all", **kw)
        list(iter_token_patches(loaded, prompt, settings))

    times: dict[str, list[float]] = {name: [] for name in ["generate", *variants]}
    _generate(loaded, prompt, args.tokens)
    for kw in variants.values():
        run(kw)
    for _ in range(args.repeats):
        t = time.perf_counter()
        _generate(loaded, prompt, args.tokens)
        times["generate"].append(time.perf_counter() - t)
        for name, kw in variants.items():
            t = time.perf_counter()
            run(kw)
            times[name].append(time.perf_counter() - t)
    base = min(times["generate"])
    for name, values in times.items():
        print(f"{args.dtype} {name}: min {min(values):.2f} s, "
              f"median {statistics.median(values):.2f} s,"
              f" ratio {min(values) / base:.2f}", flush=True)
    first, *others = variants
    for name in others:  # (each round's own ratio: a drifting machine slows both alike)
        paired = [b / a for a, b in zip(times[first], times[name], strict=True)]
        print(f"{args.dtype} {name} / {first}: paired median {statistics.median(paired):.3f},"
              f" rounds {' '.join(f'{r:.3f}' for r in paired)}", flush=True)


if __name__ == "__main__":
    main()
