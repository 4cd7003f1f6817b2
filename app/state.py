"""The run as the views see it: a Qt-free state object the panels subscribe to (STYLE.md 5).

It holds the run's plain results (frozen `StepResult`s from core), the selected token and the
patch explorer's choices, and turns them into the numpy arrays the plots draw. Events:
``"reset"`` (a new run), ``"step"`` (a token arrived), ``"selection"``, ``"view"`` (the patch
explorer's parameter or scale), ``"finished"``.
"""

from __future__ import annotations

import functools
import math
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

Listener = Callable[[str], None]


@functools.lru_cache(maxsize=65536)  # called per step, layer and parameter by the views
def param_key(name: str, layer: int) -> str:
    """A parameter's name without its layer prefix: ``model.layers.3.mlp.up_proj.weight`` ->
    ``mlp.up_proj.weight``, so one key names the same parameter in every layer."""
    match = re.search(rf"(^|\.){layer}\.", name)
    return name[match.end():] if match else name


def norm_value(norms: dict[str, float], relative: bool) -> float:
    value = norms.get("relative") if relative else norms.get("frobenius", norms.get("l2"))
    return math.nan if value is None else value  # None: NaN in a run record (JSON has none)


class RunState:
    def __init__(self) -> None:
        self.started: Any = None  # app.jobs.RunStarted
        self.steps: list[Any] = []  # core.compare.StepResult
        self.selected: int | None = None
        self.param: str | None = None
        self.relative = False
        self.running = False
        self.wall: float | None = None  # seconds from the run's start to its end
        self.transfer: dict[str, Any] | None = None  # the run's transfer, once computed
        self._t0 = 0.0
        self._listeners: list[Listener] = []
        self._held: list[str] | None = None  # events held back by `batch()`

    # -- subscription -------------------------------------------------------------------------
    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def _notify(self, event: str) -> None:
        if self._held is not None:
            if event not in self._held:
                self._held.append(event)
            return
        for listener in list(self._listeners):
            listener(event)

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Hold events back and send each distinct one once at the end, in order; a "reset"
        stands for the "step"s and "finished" after it (every view redraws from the state on
        it). Replaying a saved run of thousands of steps redraws the views once, not once per
        step (which made opening a 9,000-step session quadratic: minutes on the GUI thread)."""
        if self._held is not None:  # nested: the outer batch sends them
            yield
            return
        self._held = []
        try:
            yield
        finally:
            held, self._held = self._held, None
            if "reset" in held:
                held = [e for e in held if e not in ("step", "finished")]
            for event in held:
                self._notify(event)

    # -- changes ------------------------------------------------------------------------------
    def reset(self, started: Any) -> None:
        self.started, self.steps, self.selected, self.running = started, [], None, True
        self.wall, self._t0, self.transfer = None, time.perf_counter(), None
        self._notify("reset")

    def add_step(self, step: Any) -> None:
        self.steps.append(step)
        if self.param is None or self.param not in self.param_keys():
            keys = self.param_keys()
            self.param = keys[0] if keys else None
        self._notify("step")

    def set_transfer(self, section: dict[str, Any]) -> None:
        """The run's transfer (`core.transfer.transfer`), computed on the worker after its
        last token; the record's ``analysis.transfer``."""
        self.transfer = section

    def finish(self) -> None:
        self.running = False
        self.wall = time.perf_counter() - self._t0
        self._notify("finished")

    def select(self, index: int | None) -> None:
        if index is not None:
            if not self.steps:
                return
            index = max(0, min(index, len(self.steps) - 1))
        if index != self.selected:
            self.selected = index
            self._notify("selection")

    def set_view(self, param: str | None = None, relative: bool | None = None) -> None:
        if param is not None:
            self.param = param
        if relative is not None:
            self.relative = relative
        self._notify("view")

    # -- derived data -------------------------------------------------------------------------
    @property
    def max_tokens(self) -> int:
        return int(self.started.settings["max_new_tokens"]) if self.started else 0

    def series(self, side: str, metric: str) -> np.ndarray:
        """One metric per step: side "patched" or "control", metric "linf", "tvd" or "match"."""
        sides = [getattr(s, side) for s in self.steps]
        return np.array([math.nan if x.token < 0 else float(getattr(x, metric)) for x in sides])

    def mismatches(self) -> np.ndarray:
        return np.array([s.step for s in self.steps if not s.patched.match], dtype=int)

    def param_keys(self) -> list[str]:
        """The patched parameters by layer-free name, in the order the first step lists them."""
        keys: dict[str, None] = {}
        for s in self.steps[:1]:
            for layer, params in s.patch_norms.items():
                for name in params:
                    keys[param_key(name, layer)] = None
        return list(keys)

    def layers(self) -> list[int]:
        return list(self.started.layers) if self.started else []

    def norm_matrix(self, key: str | None = None, relative: bool | None = None) -> np.ndarray:
        """Patch norms, layers x steps (NaN where a layer has no such patch at a step)."""
        key = self.param if key is None else key
        relative = self.relative if relative is None else relative
        layers = self.layers()
        out = np.full((len(layers), len(self.steps)), np.nan)
        for j, s in enumerate(self.steps):
            for i, layer in enumerate(layers):
                for name, norms in s.patch_norms.get(layer, {}).items():
                    if param_key(name, layer) == key:
                        out[i, j] = norm_value(norms, relative)
        return out

    def summary(self) -> dict[str, Any]:
        """The status bar's figures, by `core.results.nan_max`'s one rule (NaN when any step's
        is NaN; 0 before any step)."""
        from ..core.results import nan_max

        return {
            "tokens": len(self.steps),
            "matches": sum(s.patched.match for s in self.steps),
            "control_matches": sum(s.control.match for s in self.steps),
            "max_linf": nan_max((s.patched.linf for s in self.steps), default=0.0),
            "control_max_linf": nan_max((s.control.linf for s in self.steps), default=0.0),
            "seconds": sum(sum(s.seconds.values()) for s in self.steps),
        }
