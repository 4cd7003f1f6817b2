"""The supported families in one line, for ``ctxpatch compare --help`` without importing torch
(the adapter registry, `core.adapters.supported_families`, imports it: seconds and hundreds of
MB for a help text). tests/core/test_family_names.py checks that this equals the registry's
line; after adding an adapter, rewrite this file with ``python -m ctxpatch.core.family_names``."""

from __future__ import annotations

#: `core.adapters.supported_families()` as of the last rewrite, one family a line
FAMILIES = "; ".join((
    'Gemma 2 / Gemma 3 (gemma3_text, gemma3, gemma2)',
    'Llama / Mistral / Qwen (llama, mistral, ministral, qwen2, qwen3, smollm3, '
    'qwen2_vl_text, qwen2_5_vl_text, qwen3_vl_text)',
    'Gemma 1 (gemma)',
    'Granite (granite)',
    'Phi-3 (phi3)',
    'OLMo 2 (olmo2)',
    'GPT-2 (gpt2)',
    'GPT-J (gptj)',
    'GPT-NeoX (gpt_neox)',
    'Cohere (cohere, cohere2)',
    'Falcon (falcon)',
    'Mixtral / Qwen3-MoE / OLMoE (mixtral, qwen3_moe, olmoe)',
    'GraniteMoE (granitemoe)',
    'gpt-oss (gpt_oss)',
    'DeepSeek V2 / V3, GLM-4 MoE (deepseek_v3, deepseek_v2, glm4_moe)',
    'ERNIE 4.5 MoE (ernie4_5_moe)',
    'Qwen2-MoE / Qwen3-Next (qwen2_moe, qwen3_next)',
    'Llama 4 (text) (llama4_text)',
    'Ministral 3 (ministral3)',
    'ERNIE 4.5 (ernie4_5)',
    'Seed-OSS (seed_oss)',
    'HunYuan dense (hunyuan_v1_dense)',
    'OLMo 3 (olmo3)',
    'EXAONE 4 (exaone4)',
    'GLM-4 (glm4, glm4v_text)',
    'Apertus (apertus)',
    'Arcee (AFM) (arcee)',
    'Phi (1, 1.5, 2) (phi)',
    'StarCoder 2 (starcoder2)',
    'StableLM (stablelm)',
    'CodeGen (codegen)',
    'GPTBigCode (StarCoder 1, SantaCoder) (gpt_bigcode)',
    'Bloom (bloom)',
    'MPT (mpt)',
    'OPT (opt)',
    'Gemma 4 (gemma4_text)',
    'Gemma 3n (gemma3n_text)',
    'Qwen 3.5 (Gated DeltaNet hybrid) (qwen3_5_text)',
    'Falcon-H1 (Mamba 2 + attention) (falcon_h1)',
    'Jamba (Mamba + attention, MoE) (jamba)',
    'Granite 4.0 hybrid (Mamba 2 + attention, MoE) (granitemoehybrid)',
))


def _lines(entry: str, width: int = 86) -> str:
    """One family as source lines (a long one in pieces, split after a comma)."""
    pieces, cur = [], ""
    for word in entry.split(", "):
        if cur and len(cur) + len(word) + 2 > width:
            pieces.append(cur + ", ")
            cur = word
        else:
            cur = f"{cur}, {word}" if cur else word
    pieces.append(cur)
    return "\n".join(f"    {p!r}" for p in pieces) + ",\n"


def _rewrite() -> None:
    """This file, from the adapter registry."""
    from pathlib import Path

    from .adapters import supported_families

    path = Path(__file__)
    text = path.read_text(encoding="utf-8")
    start = text.index('FAMILIES = "; ".join((\n') + len('FAMILIES = "; ".join((\n')
    end = text.index("\n))\n", start)
    body = "".join(_lines(entry) for entry in supported_families().split("; "))
    path.write_text(text[:start] + body.rstrip("\n") + text[end:], encoding="utf-8")


if __name__ == "__main__":
    _rewrite()
