"""Architecture adapters: one module per family, one registry keyed by ``config.model_type``."""

from __future__ import annotations

from typing import Any

from core.adapters import falcon, gemma3, gpt2, llama, moe, olmo2, parallel
from core.adapters import gemma3n, gemma4, hybrid
from core.adapters import classic, dense2025
from core.adapters import moe_shared
from core.adapters.base import Adapter, LayerSites, decoder_layers
from core.errors import UserError

ADAPTERS: tuple[Adapter, ...] = (
    gemma3.ADAPTER,
    llama.ADAPTER,
    llama.GEMMA1,
    llama.GRANITE,
    llama.PHI3,
    olmo2.ADAPTER,
    gpt2.ADAPTER,
    parallel.GPTJ,
    parallel.NEOX,
    parallel.COHERE,
    falcon.ADAPTER,
    moe.ADAPTER,
    moe.GRANITEMOE,
    moe.GPT_OSS,
    moe_shared.DEEPSEEK,
    moe_shared.ERNIE,
    moe_shared.QWEN2_MOE,
    moe_shared.LLAMA4,
    *dense2025.ADAPTERS,
    *classic.ADAPTERS,
    gemma4.ADAPTER,
    gemma3n.ADAPTER,
    hybrid.QWEN3_5,
    hybrid.FALCON_H1,
    hybrid.JAMBA,
    hybrid.GRANITE_HYBRID,
)

REGISTRY: dict[str, Adapter] = {t: a for a in ADAPTERS for t in a.model_types}


def supported_families() -> str:
    """One line naming every supported family and its model types."""
    return "; ".join(f"{a.family} ({', '.join(a.model_types)})" for a in ADAPTERS)


def adapter_for_config(config: Any) -> Adapter:
    """The adapter for a transformers config, or a `UserError` naming the supported families."""
    from core.images import check_image_text

    check_image_text(config)
    model_type = getattr(config, "model_type", None)
    if model_type in REGISTRY:
        return REGISTRY[model_type]
    for cls in type(config).__mro__[1:]:  # model code shipped with a checkpoint (remote code)
        inherited = getattr(cls, "model_type", None)  # that extends one of our families
        if inherited in REGISTRY:
            return REGISTRY[inherited]
    text = getattr(config, "text_config", None)
    if getattr(config, "vision_config", None) is not None and text is not None:
        return adapter_for_config(text)  # the language model of an image+text model
    arch = (getattr(config, "architectures", None) or [model_type or "unknown"])[0]
    raise UserError(
        f"unsupported architecture {arch} (model_type {model_type!r}); "
        f"supported: {supported_families()}"
    )


__all__ = [
    "ADAPTERS",
    "Adapter",
    "LayerSites",
    "REGISTRY",
    "adapter_for_config",
    "decoder_layers",
    "supported_families",
]
