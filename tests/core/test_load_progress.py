"""Issue 35 #4: the demo's first use is one bar that only goes forward, stage i of n in words,
its size and time said before it starts. The conversion runs on a tiny model here (the real one
takes minutes): the GGUF reader, the tokenizer and the model load are stand-ins, and the stages,
the tensor loop, the save and the load of the saved folder are ctxpatch's own."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from ctxpatch.core import loading
from ctxpatch.core.progress import SCALE, Stages
from tiny import llama_config, tiny_loaded, tiny_tokenizer


def test_stages_only_go_forward() -> None:
    said: list[tuple[str, int, int]] = []
    stages = Stages(lambda m, d, t: said.append((m, d, t)), (1.0, 3.0))
    stages.stage(0, "a")
    stages.stage(0, "a", 1.0)  # the end of stage 1 = a quarter
    stages.stage(1, "b", 0.5)
    stages.stage(0, "a again")  # (a stage that restarts its own count: held, never back)
    stages.finish("done")
    assert [d for _, d, _ in said] == [0, 250, 625, 625, 1000]
    assert {t for *_, t in said} == {SCALE}
    assert said[2][0] == "Step 2 of 2: b" and said[-1][0] == "done"


def test_the_demo_s_first_use_is_one_forward_bar(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers
    import transformers.modeling_gguf_pytorch_utils as gguf

    monkeypatch.setenv("CTXPATCH_CACHE", str(tmp_path))
    tiny = tiny_loaded(llama_config(layers=2), dtype=__import__("torch").float32)

    def fake_gguf(work: Path) -> Path:
        (work / "demo.gguf").write_bytes(b"GGUF")
        return work / "demo.gguf"

    def fake_model(*_: Any, **__: Any) -> Any:
        for _ in gguf.tqdm(range(12)):  # (transformers' tensor loop, which ctxpatch counts)
            pass
        return tiny.model

    monkeypatch.setitem(loading._GGUF, "demo", fake_gguf)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: tiny_tokenizer(320) if k.get("gguf_file")
                        else _real_tokenizer(*a, **k))
    monkeypatch.setattr(loading, "checked_from_pretrained",
                        lambda auto, what, source, **kw: fake_model() if "gguf_file" in kw
                        else _REAL(auto, what, source, **kw))
    assert "1.1 GB" in (loading.first_use("demo") or "")  # (said before it starts)
    said: list[tuple[str, int, int]] = []
    loaded = loading.load_model("demo", progress=lambda m, d, t: said.append((m, d, t)))
    assert loaded.model.config.num_hidden_layers == 2
    assert all(t == SCALE for _, _, t in said), said
    done = [d for _, d, _ in said]
    assert done == sorted(done) and done[0] == 0 and done[-1] == SCALE, done
    steps = [int(m.group(1)) for m in (re.match(r"Step (\d) of 6: ", s) for s, _, _ in said) if m]
    assert steps == sorted(steps) and set(steps) == set(range(1, 7)), steps
    assert "1.1 GB float32 folder" in said[0][0] and "about 2 minutes" in said[0][0]
    assert any("tensor 12 of 12" in s for s, _, _ in said)
    assert said[-1][0] == "Loaded demo"
    assert loading.first_use("demo") is None  # converted: later loads say nothing of it


_REAL = loading.checked_from_pretrained
_real_tokenizer = __import__("transformers").AutoTokenizer.from_pretrained
