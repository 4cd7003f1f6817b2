"""``ctxpatch bench``: a comparison timed side by side with plain generation (issue: speed and
memory near the limit). Prints figures and ratios; asserts nothing.

Time: in one process, after a warm-up of each, K alternations of plain greedy ``generate`` (full
context, KV cache, the same number of new tokens, model, dtype and device) and the comparison;
medians and their ratio. Memory: each side once in its own child process (peak resident memory
on CPU, peak allocated CUDA memory on a GPU), so neither inherits the other's peak.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

#: one CPU burner (`background_load`): spins until its deadline, or at once when its parent is
#: gone (it checks its parent's id ten times a second), so that no burner outlives the bench
#: even when the bench is killed outright
BURNER = """
import os, sys, time
parent, deadline = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
x = 1
while time.monotonic() < deadline and os.getppid() == parent:
    stop = time.monotonic() + 0.1
    while time.monotonic() < stop:
        x = (x * 3 + 1) % 1000003
"""
#: how long a burner lives at most (seconds), whatever happens to the bench
BURNER_LIMIT_S = 3600.0


@contextmanager
def background_load(n: int, limit_s: float = BURNER_LIMIT_S) -> Iterator[list[int]]:
    """``n`` busy processes beside the bench (a busy laptop: other programs on the cores),
    stopped when the block ends, on Ctrl+C and on errors alike; each also stops by itself after
    ``limit_s`` seconds or when this process is gone. Yields their process ids."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen(
                [sys.executable, "-c", BURNER, str(os.getpid()), str(limit_s)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                # (its own session: a Ctrl+C in the terminal reaches the bench, which stops it)
                start_new_session=True))
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _generate(loaded: Any, prompt: Any, tokens: int) -> None:
    """Plain greedy generation over the full prompt (with the image's pixels, if any)."""
    import torch

    from .images import vision_kwargs

    ids = torch.tensor([list(prompt.full_ids)], device=loaded.device)
    extra = vision_kwargs(loaded.model, prompt.pixels, ids) if prompt.pixels else {}
    with torch.inference_mode():
        loaded.model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                              **extra)


def _threaded_generate(loaded: Any, prompt: Any, tokens: int) -> None:
    """`_generate` with the threads a comparison would take now (`core.threads`), so that
    both sides of the ratio run alike on a busy machine."""
    from .threads import run_threads

    with run_threads(loaded.device):
        _generate(loaded, prompt, tokens)


def _compare(loaded: Any, prompt: Any, settings: Any) -> None:
    from .compare import iter_token_patches

    for _ in iter_token_patches(loaded, prompt, settings):
        pass


def _sync(loaded: Any) -> None:
    import torch

    if loaded.device.type == "cuda":
        torch.cuda.synchronize(loaded.device)


#: the tensor methods that copy a value to the host (on a GPU each one waits for the device)
HOST_SYNCS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy")


@contextmanager
def counting_host_syncs() -> Iterator[list[int]]:
    """Count the calls that copy a tensor's value to the host while the block runs (ours,
    transformers' and torch's alike); yields a one-item list holding the count. The tensor
    methods are wrapped for the block only and restored in ``finally``. What runs is what an
    accelerator would run: the shortcut that solves CPU tensors' secular equations compiled on
    the host (`core.patches.JIT`) is off meanwhile."""
    import torch

    from . import patches

    count = [0]
    originals = {name: getattr(torch.Tensor, name) for name in HOST_SYNCS}
    jit = patches.JIT

    def counted(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            return original(self, *args, **kwargs)

        return call

    try:
        patches.JIT = False  # (a shortcut for CPU tensors only: count the device path)
        for name, original in originals.items():
            setattr(torch.Tensor, name, counted(original))
        yield count
    finally:
        patches.JIT = jit
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def syncs_per_token(loaded: Any, prompt: Any, settings: Any) -> float:
    """Host syncs per generated token of one comparison (after a warm-up run has filled the
    run's one-time caches, such as the parameters' norms)."""
    with counting_host_syncs() as count:
        _compare(loaded, prompt, settings)
    return count[0] / settings.max_new_tokens


def measure_time(loaded: Any, prompt: Any, settings: Any, repeats: int,
                 say: Callable[[str], None]) -> dict[str, Any]:
    runs: dict[str, list[float]] = {"generate": [], "compare": []}
    jobs = {"generate": lambda: _threaded_generate(loaded, prompt, settings.max_new_tokens),
            "compare": lambda: _compare(loaded, prompt, settings)}
    for job in jobs.values():  # warm-up
        job()
    for k in range(repeats):
        for name, job in jobs.items():
            _sync(loaded)
            t = time.perf_counter()
            job()
            _sync(loaded)
            runs[name].append(time.perf_counter() - t)
        say(f"repeat {k + 1}/{repeats}: generate {runs['generate'][-1]:.2f} s, "
            f"compare {runs['compare'][-1]:.2f} s")
    g, c = statistics.median(runs["generate"]), statistics.median(runs["compare"])
    syncs = syncs_per_token(loaded, prompt, settings)
    return {"generate_s": g, "compare_s": c, "time_ratio": c / g, "syncs_per_token": syncs,
            "per_token_generate_s": g / settings.max_new_tokens,
            "per_token_compare_s": c / settings.max_new_tokens, "runs": runs}


CHILD = """
import json, sys
from ctxpatch.core.bench import child_main
print(json.dumps(child_main(json.loads(sys.argv[1]))))
"""


def child_main(job: dict[str, Any]) -> dict[str, Any]:
    """Run one side (``job["side"]``) of a spec (``job["spec"]``, `RunSpec.to_dict`) once and
    report its peak memory (in a fresh process)."""
    import resource

    import torch

    from .prompt import build_prompt
    from .runs import load, prepare
    from .spec import RunSpec

    spec = RunSpec.from_dict(job["spec"])
    picture = prepare(spec) if spec.image else None
    loaded = load(spec)
    prompt = build_prompt(loaded.tokenizer, spec.context, spec.query, spec.chat_template,
                          image=picture, processor=loaded.processor)
    cuda = loaded.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(loaded.device)
    before = torch.cuda.max_memory_allocated(loaded.device) if cuda else 0
    if job["side"] == "generate":
        _generate(loaded, prompt, spec.max_new_tokens)
    else:
        _compare(loaded, prompt, spec)
    if cuda:
        peak = torch.cuda.max_memory_allocated(loaded.device)
        return {"peak_bytes": peak, "kind": "CUDA peak allocated", "model_bytes": before}
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_bytes": peak_kb * 1024, "kind": "peak resident memory"}


def measure_memory(spec: Any) -> dict[str, Any]:
    """Peak memory of plain generate and of the comparison, each in a child process."""
    out: dict[str, Any] = {}
    for side in ("generate", "compare"):
        job = json.dumps({"spec": spec.to_dict(), "side": side})
        proc = subprocess.run([sys.executable, "-c", CHILD, job],
                              capture_output=True, text=True, env=os.environ.copy())
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"the {side} memory child failed: {tail}")
        out[side] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["memory_ratio"] = out["compare"]["peak_bytes"] / out["generate"]["peak_bytes"]
    return out


def machine() -> dict[str, Any]:
    import torch

    info = {"platform": platform.platform(), "processor": platform.processor() or
            platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info
