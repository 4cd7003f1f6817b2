"""The context lens's stream, rebuilt from the lens's own vectors for the ground-truth tests
(tests/core/test_lens.py, the image+text families): ``lens(r^0) + sum_l lens(T_0,l - r^{l-1})
+ sum_l lens(delta_l)`` plus the biases' logits, which must equal the full-context logits before
any softcap."""

from __future__ import annotations

from typing import Any

import torch
from ctxpatch.core import lens as lens_module
from ctxpatch.core.activations import query_row


def stream_spy(monkeypatch: Any) -> list[tuple[torch.Tensor, dict[int, dict[str, Any]]]]:
    """Wrap `Lens.read`: each step appends (the rebuilt stream's logits, each layer's parts)."""
    seen: list[tuple[torch.Tensor, dict[int, dict[str, Any]]]] = []
    read = lens_module.Lens.read

    def spy(self, targets, tokens, queue):  # type: ignore[no-untyped-def]
        s = self.readout.scale(self.final)
        layers = sorted(self.stream.inputs)
        r = [query_row(self.stream.inputs[i], self.dtype) for i in layers]
        parts = self.deltas(targets)
        x = r[0].clone()  # r^0, then each layer's own change on the stream and its context effect
        for j, i in enumerate(layers):
            x = x + (self.stream.block[i] - r[j]) + parts[i]["total"]
        seen.append((self.readout.logits(x[None], s)[0] + self.readout.constant(), parts))
        return read(self, targets, tokens, queue)

    monkeypatch.setattr(lens_module.Lens, "read", spy)
    return seen


def pre_softcap(model: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """The logits before the family's final softcap (Gemma 2 and 4), in float64."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    cap = getattr(config, "final_logit_softcapping", None)
    logits = logits.double()
    return torch.atanh(logits / cap) * cap if cap else logits
