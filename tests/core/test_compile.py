"""Ground truths of `core.compile` (ANALYSIS.md A4) on float64 tiny random models."""

from __future__ import annotations

import copy

import pytest
import torch
from ctxpatch.core.compile import _logits, applied_, compile_context, ridge_lowrank
from ctxpatch.core.errors import Cancelled, UserError
from ctxpatch.core.patches import matrix_output_patch, rank1_input_patch
from tiny import gemma3_config, tiny_config, tiny_loaded

CONTEXT = "Zorblat is a small village."
QUERIES = ["Zorblat is famous for", "The quick brown fox"]


def _dense(lr):
    return lr.b.double() @ lr.a.double()


def test_one_example_is_theorem_1() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(7, 5, generator=g, dtype=torch.float64)
    z, z_c = torch.randn(5, generator=g, dtype=torch.float64), torch.randn(5, generator=g,
                                                                          dtype=torch.float64)
    fit = ridge_lowrank((w @ z_c - w @ z)[None], z[None], 0.0, rank=4)
    r = rank1_input_patch(w @ z_c, w @ z, z)
    assert torch.allclose(_dense(fit), torch.outer(r.u, r.a), atol=1e-12)
    shift, h = torch.randn(7, generator=g, dtype=torch.float64), z
    out = matrix_output_patch(shift, h)
    assert torch.allclose(_dense(ridge_lowrank(shift[None], h[None], 0.0, 1)),
                          torch.outer(out.u, out.a), atol=1e-12)


def _every_position(loaded, compiled, patched: bool):
    """(compiled or unpatched logits at every reduced position, the full context's there)."""
    out = []
    for ex in compiled.compiler.train:
        full = _logits(loaded.model, ex.full, len(ex.full))[list(ex.where)]
        with torch.inference_mode(), applied_(loaded.model, compiled.deltas if patched else []):
            q = _logits(loaded.model, ex.reduced, len(ex.reduced))
        out.append((q, full))
    return out


def test_llama_exact_at_every_training_position() -> None:
    loaded = tiny_loaded(tiny_config("llama"))
    compiled = compile_context(loaded, CONTEXT, QUERIES, rank=64, ridge=0.0, max_new_tokens=2)
    assert compiled.compiler.positions() <= 32  # (at most min(d_model, d_ff))
    for q, full in _every_position(loaded, compiled, True):
        assert (q - full).abs().max() <= 1e-8 * full.abs().max()
    for q, full in _every_position(loaded, compiled, False):  # the context matters
        assert (q - full).abs().max() > 1e-3 * full.abs().max()
    assert all(d.residual < 1e-10 for d in compiled.deltas)


def test_huge_ridge_is_the_unpatched_model() -> None:
    loaded = tiny_loaded(tiny_config("llama"))
    compiled = compile_context(loaded, CONTEXT, QUERIES[:1], rank=64, ridge=1e12,
                               max_new_tokens=3)
    ex = compiled.compiler.train[0]
    plain = _logits(loaded.model, ex.reduced, len(ex.reduced))
    with torch.inference_mode(), applied_(loaded.model, compiled.deltas):
        q = _logits(loaded.model, ex.reduced, len(ex.reduced))
    assert (q - plain).abs().max() <= 1e-8 * plain.abs().max()
    assert abs(compiled.evaluate()["train"][0]["retained"]) < 1e-6


def test_training_residual_never_rises_with_rank() -> None:
    loaded = tiny_loaded(tiny_config("llama"))
    compiled = compile_context(loaded, CONTEXT, QUERIES[:1], rank=1, ridge=0.0,
                               max_new_tokens=4)
    curve = compiled.evaluate(ranks=[1, 2, 4, 8, 16, 32])
    linf = [max(r["linf"] for r in e["train"]) for e in curve]
    first = [e["layers"][0]["residual"] for e in curve]
    assert all(b <= a * (1 + 1e-9) for a, b in zip(linf, linf[1:], strict=False)), linf
    assert all(b <= a * (1 + 1e-9) for a, b in zip(first, first[1:], strict=False)), first
    assert linf[-1] < 1e-8 * linf[0]


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3"])
def test_peft_adapter_gives_the_compiled_logits(family: str, tmp_path) -> None:
    peft = pytest.importorskip("peft")
    config = gemma3_config(layers=4) if family == "gemma3" else tiny_config(family)
    loaded = tiny_loaded(config)
    compiled = compile_context(loaded, CONTEXT, QUERIES[:1], rank=4, ridge=1e-3,
                               max_new_tokens=3)
    ex = compiled.compiler.train[0]
    with torch.inference_mode(), applied_(loaded.model, compiled.deltas):
        q = _logits(loaded.model, ex.reduced, len(ex.reduced))
    plain = _logits(loaded.model, ex.reduced, len(ex.reduced))
    compiled.save_adapter(tmp_path / "lora")
    wrapped = peft.PeftModel.from_pretrained(copy.deepcopy(loaded.model), tmp_path / "lora")
    with torch.inference_mode():
        got = wrapped(input_ids=torch.tensor([list(ex.reduced)])).logits[0].double()
    assert (got - q).abs().max() <= 1e-10 * q.abs().max()
    assert (q - plain).abs().max() > 1e-3 * q.abs().max()


def test_gemma_reports_its_residual_and_moves_toward_the_context() -> None:
    loaded = tiny_loaded(gemma3_config(layers=4))
    compiled = compile_context(loaded, CONTEXT, QUERIES[:1], rank=64, ridge=0.0,
                               max_new_tokens=4)
    result = compiled.to_dict()
    assert all(layer["residual"] > 0 for layer in result["layers"])  # lossy, and said
    assert result["train"][0]["retained"] > 0.5


def test_mixture_of_experts_refuses_in_one_line() -> None:
    loaded = tiny_loaded(tiny_config("mixtral"))
    with pytest.raises(UserError, match="mixture-of-experts") as info:
        compile_context(loaded, CONTEXT, QUERIES[:1])
    assert "\n" not in str(info.value)


def test_cancel_stops_and_restores_the_model() -> None:
    loaded = tiny_loaded(tiny_config("llama"))
    ids = [2, 40, 41, 42]
    before = _logits(loaded.model, ids, 4)
    calls = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) > 2

    with pytest.raises(Cancelled):
        compile_context(loaded, CONTEXT, QUERIES[:1], max_new_tokens=2, should_stop=stop)
    assert torch.equal(_logits(loaded.model, ids, 4), before)


def test_command_line(tmp_path, capsys) -> None:
    import json

    from ctxpatch.app.cli import main
    from tiny import save_tiny_folder

    folder = save_tiny_folder(tmp_path / "m")
    out = tmp_path / "c.json"
    rc = main(["compile", "--model", str(folder), "--context", CONTEXT, "--query", QUERIES[0],
               "--held-out", QUERIES[1], "--rank", "4", "--max-new-tokens", "3", "--json",
               str(out), "--adapter", str(tmp_path / "lora"), "--quiet"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert {"rank", "ridge", "train", "held_out", "adapter"} <= set(data)
    assert set(data["held_out"][0]) >= {"query", "match", "tokens", "retained", "linf",
                                        "answer", "full_context_answer"}
    assert (tmp_path / "lora" / "adapter_config.json").is_file()
    rc = main(["compile", "--model", str(folder), "--context", CONTEXT, "--query", "x",
               "--rank", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--rank" in err


def test_the_adapter_is_written_whole_or_not_at_all(tmp_path, monkeypatch) -> None:
    """A failure while the adapter is written (here the weights' file) leaves no folder, not a
    half adapter peft would try to load; an empty folder chosen for it gets the whole one."""
    pytest.importorskip("peft")
    import safetensors.torch

    loaded = tiny_loaded(tiny_config("llama"))
    compiled = compile_context(loaded, CONTEXT, QUERIES[:1], rank=2, max_new_tokens=1)

    def full_disk(*args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", full_disk)
        with pytest.raises(UserError, match="cannot write the adapter .*No space left"):
            compiled.save_adapter(tmp_path / "lora")
    assert list(tmp_path.iterdir()) == []  # no folder, no staged leftovers
    (tmp_path / "empty").mkdir()
    compiled.save_adapter(tmp_path / "empty")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in (tmp_path / "empty").iterdir()}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


#: the families whose MLPs are mixtures of experts (their tiny configs route tokens)
MOE = {"deepseek_v2", "deepseek_v3", "ernie4_5_moe", "ernie4_5_moe_routed", "gemma4_text_moe",
       "glm4_moe", "gpt_oss", "granitemoe", "granitemoehybrid", "jamba", "llama4_text",
       "mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "qwen3_next"}


def _every_family() -> dict[str, object]:
    from tiny import TINY

    return {"gemma3": lambda: gemma3_config(layers=4),
            **{name: (lambda name=name: tiny_config(name)) for name in TINY}}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(_every_family()))
def test_every_family_compiles_or_refuses_in_one_line(family: str) -> None:
    """Issue 33: every supported text family either compiles (and evaluates to finite numbers
    on its training and held-out queries) or, a mixture of experts, refuses in one line saying
    why; never a traceback."""
    loaded = tiny_loaded(_every_family()[family]())
    if family in MOE:
        with pytest.raises(UserError, match="mixture-of-experts") as info:
            compile_context(loaded, CONTEXT, QUERIES[:1], ["Where?"], rank=2, max_new_tokens=2)
        assert "\n" not in str(info.value)
        return
    result = compile_context(loaded, CONTEXT, QUERIES[:1], ["Where?"], rank=2,
                             max_new_tokens=2).evaluate()
    rows = [*result["train"], *result["held_out"]]
    assert len(rows) == 2 and all(r["tokens"] >= 1 for r in rows)
    assert all(r["linf"] is not None and r["linf"] == r["linf"] for r in rows)  # (not NaN)
