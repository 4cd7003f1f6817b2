"""The compile jobs the worker thread runs (ANALYSIS.md A4; `app.jobs` holds the others): fit
and evaluate a compilation, with an optional sweep over ranks, and write its adapter.

The window gets plain data (`CompileReady.record`, a `core.compile_record` record) and an opaque
handle to give back to `adapter_job`; it never touches the deltas.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .jobs import ModelReady, ProgressFn, StopFn, Task


@dataclass(frozen=True)
class CompileReady:
    """A compilation fitted and evaluated: its record, and its `core.compile.Compiled` (opaque
    here: only `adapter_job` uses it)."""

    record: dict[str, Any]
    handle: Any


@dataclass(frozen=True)
class AdapterSaved:
    """The adapter of a compilation written into ``folder``."""

    folder: str


def compile_job(model: ModelReady, context: str, queries: Sequence[str],
                held_out: Sequence[str], rank: int, ridge: float, sweep: Sequence[int],
                max_new_tokens: int) -> Task:
    """Compile ``context`` at ``rank`` (and at each rank of ``sweep``), then evaluate it: one
    `CompileReady`. Progress counts the layers fitted; cancel stops before the next layer."""

    def job(should_stop: StopFn, progress: ProgressFn) -> Iterator[Any]:
        from ..core.compile import compile_context, rank_limit
        from ..core.compile_record import check_rank, compile_record

        loaded = model.handle
        check_rank(rank_limit(loaded), rank, sweep, front="window")  # before any work
        layers = max(1, int(model.info.get("num_layers") or 1))
        ranks = [rank, *sorted({k for k in sweep if k != rank})]  # in the order they are fitted
        total = layers * len(ranks)
        done = [0]

        def say(message: str) -> None:  # (core says one line per layer fitted)
            done[0] += 1
            fitting = ranks[min((done[0] - 1) // layers, len(ranks) - 1)]
            progress(f"Compile: rank {fitting}, {message}", min(done[0], total), total)

        start = time.perf_counter()
        progress("Compile: the full-context answers and recordings…", 0, 0)
        compiled = compile_context(loaded, context, list(queries), list(held_out), rank=rank,
                                   ridge=ridge, max_new_tokens=max_new_tokens, say=say,
                                   should_stop=should_stop)
        progress(f"Compile: evaluating rank {rank}…", done[0], total)
        compiled.evaluate()
        record = compile_record(compiled, sweep, should_stop, lambda k: progress(
            f"Compile: rank {k} evaluated", done[0], total))
        record["seconds"] = time.perf_counter() - start
        yield CompileReady(record, compiled)

    return job


def adapter_job(handle: Any, folder: str) -> Task:
    """Write a compilation's PEFT LoRA adapter (``handle``: `CompileReady.handle`)."""

    def job(should_stop: StopFn, progress: ProgressFn) -> Iterator[Any]:
        progress(f"Writing the adapter {folder}…", 0, 0)
        handle.save_adapter(folder)
        yield AdapterSaved(folder)

    return job
