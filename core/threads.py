"""CPU threads for a run on a busy machine (docs/PERFORMANCE.md, "A busy machine").

On a CPU, torch splits each matrix product over its intra-op threads (one per core) and waits
at the end of each for the slowest. When other programs keep the cores busy, one of those
threads is often descheduled, and every other one waits for it: on the 2-core developer machine
under a load of 3-6, the comparison took 3.0-3.7 times plain ``generate`` with 2 threads and 1.6
times with 1. So before a run on the CPU, ctxpatch looks at how busy the cores are (Linux:
``/proc/stat`` over `PROBE_S`, less this process's own time) and runs with at most as many
threads as there are idle cores, at least one; afterwards the thread count is put back.

``CTXPATCH_THREADS=N`` fixes the count (``auto``, the default, decides as above); with
``OMP_NUM_THREADS`` set, the user's choice stands. Elsewhere than Linux nothing changes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

ENV = "CTXPATCH_THREADS"
PROBE_S = 0.05  # how long the probe watches the cores


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all cores since boot, from /proc/stat's first line."""
    with open("/proc/stat", encoding="ascii") as f:
        values = [int(v) for v in f.readline().split()[1:9]]
    idle = values[3] + values[4]  # idle and iowait
    total = sum(values)
    return total - idle, total


def busy_cores(interval: float = PROBE_S) -> float | None:
    """How many cores other processes kept busy over ``interval`` seconds (this process's own
    CPU time left out); None where the kernel does not say (not Linux)."""
    try:
        busy0, total0 = _cpu_ticks()
        own0, t0 = time.process_time(), time.perf_counter()
        time.sleep(interval)
        busy1, total1 = _cpu_ticks()
        own1, t1 = time.process_time(), time.perf_counter()
    except (OSError, ValueError, IndexError):
        return None
    cores = os.cpu_count() or 1
    if total1 <= total0:
        return None
    share = (busy1 - busy0) / (total1 - total0)  # of all cores' time
    own = (own1 - own0) / max(t1 - t0, 1e-9)  # cores this process used meanwhile
    return max(0.0, share * cores - own)


def choose_threads(current: int, busy: float | None, cores: int) -> int:
    """The threads for a run: ``current`` on an idle machine, else at most the idle cores
    (rounded to the nearest), at least 1; ``current`` when ``busy`` is unknown."""
    if busy is None:
        return current
    return max(1, min(current, int(cores - busy + 0.5)))


def wanted_threads(current: int) -> int:
    """The thread count a CPU run uses (`ENV`, ``OMP_NUM_THREADS``, else `choose_threads`).

    Raises:
        UserError: `ENV` is not ``auto`` or a count from 1 to the cores here.
    """
    fixed = os.environ.get(ENV, "auto").strip().lower()
    if fixed not in ("auto", ""):
        from .errors import UserError

        cores = os.cpu_count() or 1
        if not fixed.isdigit() or not 1 <= int(fixed) <= cores:
            raise UserError(f"{ENV}={os.environ[ENV]!r}: give a whole number of threads from 1 "
                            f"to {cores} (the cores here), or auto")
        return int(fixed)
    if os.environ.get("OMP_NUM_THREADS"):
        return current
    return choose_threads(current, busy_cores(), os.cpu_count() or current)


@contextmanager
def run_threads(device: Any) -> Iterator[int]:
    """Run the block with `wanted_threads` on a CPU ``device`` (unchanged elsewhere), and put
    torch's thread count back afterwards. Yields the count the block runs with. (torch's count
    belongs to the calling thread's OpenMP settings: call it on the thread that runs the
    model.)"""
    import torch

    before = torch.get_num_threads()
    n = wanted_threads(before) if getattr(device, "type", str(device)) == "cpu" else before
    if n != before:
        torch.set_num_threads(n)
    try:
        yield n
    finally:
        if n != before:
            torch.set_num_threads(before)
