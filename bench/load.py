"""The comparison under a background load: ``--load N`` bounded CPU burners
(`core.bench.background_load`) beside plain generate and each variant, in one process, rounds
alternating the variants; each variant may set the thread count (``"threads"``: a number, or
"auto", `core.threads`' choice from the idle cores), and its generate runs at that count too.
Prints per variant the median generate and comparison seconds and the median of the rounds'
compare/generate ratios (docs/PERFORMANCE.md, "A busy machine").

    PYTHONPATH=. python3 bench/load.py --load 2 --repeats 5 \\
        '{"2 threads": {"threads": 2}, "1 thread": {"threads": 1}, "auto": {}}'

The prompt is the Mars prompt with absorb all, 20 new tokens, the demo model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MARS = ("Write a single-sentence weather forecast for Mars, from the perspective of a slightly "
        "annoyed robot:")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", help='JSON: name -> compare settings and optional "threads"')
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--load", type=int, default=0, help="CPU burners beside the runs")
    args = ap.parse_args()
    import torch
    from ctxpatch.core.bench import _generate, background_load
    from ctxpatch.core.compare import RunSpec, iter_token_patches
    from ctxpatch.core.prompt import build_prompt
    from ctxpatch.core.threads import ENV, run_threads

    import ctxpatch

    variants = json.loads(args.variants)
    loaded = ctxpatch.load(args.model, dtype=args.dtype)
    prompt = build_prompt(loaded.tokenizer, "", MARS)
    default = torch.get_num_threads()

    def timed(kw: dict) -> tuple[float, float]:
        kw = dict(kw)
        # a count, or "auto" (`core.threads`: the idle cores); generate runs with the same
        os.environ[ENV] = str(kw.pop("threads", "auto"))
        spec = RunSpec(max_new_tokens=args.tokens, absorb="all", **kw)
        t = time.perf_counter()
        with run_threads(loaded.device):
            _generate(loaded, prompt, args.tokens)
        g = time.perf_counter() - t
        t = time.perf_counter()
        list(iter_token_patches(loaded, prompt, spec))
        return g, time.perf_counter() - t

    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    with background_load(args.load):
        for name, kw in variants.items():  # warm-up
            g, c = timed(kw)
            print(f"warm-up {name}: generate {g:.2f} s, compare {c:.2f} s", flush=True)
        for k in range(args.repeats):
            for name, kw in variants.items():
                times[name].append(timed(kw))
                g, c = times[name][-1]
                print(f"round {k + 1} {name}: generate {g:.2f} s, compare {c:.2f} s, "
                      f"ratio {c / g:.2f}, load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"load {args.load} burners, {args.dtype}, default threads {default}:")
    for name, pairs in times.items():
        g = statistics.median(p[0] for p in pairs)
        c = statistics.median(p[1] for p in pairs)
        r = statistics.median(p[1] / p[0] for p in pairs)
        print(f"  {name}: generate {g:.2f} s, compare {c:.2f} s, ratio (median of rounds) "
              f"{r:.2f}, ratios {' '.join(f'{p[1] / p[0]:.2f}' for p in pairs)}", flush=True)


if __name__ == "__main__":
    main()
