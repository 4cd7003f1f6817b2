"""Weights that accelerate has offloaded (``device_map`` with CPU or disk offload).

accelerate's big-model inference keeps an offloaded module's parameters on the ``meta`` device
and materializes them only inside the module's own forward (an ``AlignDevicesHook`` wrapped
around ``forward``): PyTorch's forward hooks, which is where the engine works, run after the
weights have gone back to ``meta``. So the engine never reads ``module.weight`` directly:

- `resident` gives a parameter's real values: the parameter itself, or the hook's weights map
  (the checkpoint on disk, or the CPU copy) on the module's execution device;
- `plain_call` runs a module's own forward with some parameters replaced, past accelerate's
  hook (which would put the stored weights back over ours), restoring them in ``finally``.

Without accelerate (a model on one device) both are the plain thing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn


def _hook(module: nn.Module) -> Any:
    return getattr(module, "_hf_hook", None)


def is_offloaded(module: nn.Module, name: str) -> bool:
    p = getattr(module, name)
    return isinstance(p, Tensor) and p.device.type == "meta"


def resident(module: nn.Module, name: str) -> Tensor:
    """The values of ``module.<name>`` (a parameter or buffer), wherever accelerate keeps them."""
    p = getattr(module, name)
    if p.device.type != "meta":
        return p
    hook = _hook(module)
    weights = getattr(hook, "weights_map", None)
    if weights is None:
        raise RuntimeError(f"{type(module).__name__}.{name} is on meta and no offload map holds it")
    return weights[name].to(hook.execution_device)


def plain_call(module: nn.Module, params: Mapping[str, Tensor], *args: Any) -> Any:
    """``module.forward(*args)`` with ``params`` in place of its parameters of those names and
    every other offloaded parameter materialized; no hooks run (neither ours nor accelerate's)."""
    saved = dict(module._parameters)
    try:
        for name, value in module._parameters.items():
            if name in params:
                module._parameters[name] = params[name]  # type: ignore[assignment]
            elif value is not None and value.device.type == "meta":
                module._parameters[name] = resident(module, name)  # type: ignore[assignment]
        hook = _hook(module)
        device = getattr(hook, "execution_device", None)
        if device is not None:
            args = tuple(a.to(device) if isinstance(a, Tensor) else a for a in args)
        return type(module).forward(module, *args)
    finally:
        module._parameters.clear()
        module._parameters.update(saved)


def execution_device(model: nn.Module) -> torch.device:
    """Where a model's input ids go: its embedding's execution device under a device map."""
    device_map = getattr(model, "hf_device_map", None)
    if device_map:
        for place in device_map.values():
            if isinstance(place, int):
                return torch.device("cuda", place)
            if place not in ("cpu", "disk", "meta"):
                return torch.device(place)
        return torch.device("cpu")
    return next(p.device for p in model.parameters() if p.device.type != "meta")
