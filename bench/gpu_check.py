"""The device check, prepared for a session lent a GPU: one short script, bfloat16 and float32,
20 and 200 new tokens, plain generate vs the comparison: every row of a token in one pass (what
auto does with absorb all) against a pass for each, with and without the control; the stable
update; host syncs per token.

    PYTHONPATH=. python3 bench/gpu_check.py [--out DIR] [--tokens 20,200] [--repeats 3]

The device machine reaches no package index and carries at most 64 MiB, so the demo's weights
(1.1 GB) cannot travel: the model is Gemma 3 270M's own config (bench/gemma3-270m-config.json,
copied from the converted demo) with random weights, which has the demo's shapes and therefore
its timings (not its exactness on real weights: that is measured here on the CPU). The prompt is
20 random token ids (the Mars prompt's length). Needs transformers >= 5.20 there: carry its
wheel if the machine's is older (.library/device README).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


#: (name, control, control_row, method): one pass per token (auto) against every row a pass of
#: its own (separate), with and without the control; the stable update in one pass
VARIANTS = (("no control, one pass", False, "auto", "direct"),
            ("no control, separate", False, "separate", "direct"),
            ("control, one pass", True, "auto", "direct"),
            ("control, separate", True, "separate", "direct"),
            ("stable, one pass", True, "auto", "stable"))


class _Ids:
    """A stand-in tokenizer: the comparison only decodes token ids for its top-k lists."""

    bos_token_id = 2
    eos_token_id = 1

    def decode(self, ids, **kwargs):  # type: ignore[no-untyped-def]
        return " ".join(str(i) for i in ids)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--tokens", default="20,200")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    import torch
    from ctxpatch.core.adapters import adapter_for_config
    from ctxpatch.core.bench import machine, measure_time
    from ctxpatch.core.compare import RunSpec
    from ctxpatch.core.loading import DTYPES, LoadedModel, resolve_device
    from ctxpatch.core.prompt import Prompt, Segment
    from transformers import AutoConfig, AutoModelForCausalLM

    device = resolve_device(args.device)
    config = AutoConfig.from_pretrained(ROOT / "bench" / "gemma3-270m-config.json")
    g = torch.Generator().manual_seed(0)
    ids = tuple(int(i) for i in torch.randint(3, 1000, (19,), generator=g))
    prompt = Prompt((Segment("template", "<bos>", (2,)), Segment("query", "random", ids)), 2)
    rows = []
    for dtype in ("bfloat16", "float32"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype]).to(device).eval()
        loaded = LoadedModel(model, _Ids(), adapter_for_config(config), "gemma3-270m-random",
                             "config", DTYPES[dtype], device)
        for tokens in (int(t) for t in args.tokens.split(",")):
            for name, control, row_kind, method in VARIANTS:
                settings = RunSpec(max_new_tokens=tokens, absorb="all", control=control,
                                    control_row=row_kind, method=method)
                t0 = time.perf_counter()
                r = measure_time(loaded, prompt, settings, args.repeats, lambda *a: None)
                row = {"dtype": dtype, "tokens": tokens, "variant": name, "control": control,
                       "control_row": row_kind, "method": method,
                       "generate_s": r["generate_s"], "compare_s": r["compare_s"],
                       "time_ratio": r["time_ratio"], "syncs_per_token": r["syncs_per_token"],
                       "wall_s": time.perf_counter() - t0}
                if device.type == "cuda":
                    row["peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
                rows.append(row)
                print(f"{dtype:9} {tokens:4} tokens {name:22} generate {r['generate_s']:.2f} s  "
                      f"compare {r['compare_s']:.2f} s  ratio {r['time_ratio']:.2f}  syncs/token "
                      f"{r['syncs_per_token']:.1f}", flush=True)
        del model, loaded
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result = {"machine": machine(), "device": str(device), "rows": rows}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_check.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
