"""Progress over stages that only goes forward: a slow job of several stages (the demo's first
use: join the parts, read the tokenizer, read the GGUF, convert the tensors, save, load) is one
determinate bar, each stage a share of it, and each message says which stage of how many.

A stage's own counter (tensor i of n) moves the bar inside that stage's share; a report that
would move the bar back (a later stage restarting its own count) is held at the furthest point
reached. Reports go to a ``progress(message, done, total)`` function with ``total`` = `SCALE`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

#: the ``total`` of a staged report (per mille): front ends show it as a percentage
SCALE = 1000


class Stages:
    """Stage ``i`` of ``len(weights)``, each weighted by the time it takes (any positive
    numbers: they are normalised), reported through ``report(message, done, SCALE)``."""

    def __init__(self, report: Callable[[str, int, int], None], weights: Sequence[float]) -> None:
        total = float(sum(weights))
        self._report = report
        self._starts = [sum(weights[:i]) / total for i in range(len(weights))]
        self._shares = [w / total for w in weights]
        self._done = 0

    @property
    def count(self) -> int:
        return len(self._shares)

    def stage(self, i: int, message: str, fraction: float = 0.0) -> None:
        """Report stage ``i`` (0-based) at ``fraction`` of its own share (0..1)."""
        fraction = min(max(fraction, 0.0), 1.0)
        done = round(SCALE * (self._starts[i] + self._shares[i] * fraction))
        self._done = max(self._done, min(done, SCALE))
        self._report(f"Step {i + 1} of {self.count}: {message}", self._done, SCALE)

    def finish(self, message: str) -> None:
        self._done = SCALE
        self._report(message, SCALE, SCALE)
