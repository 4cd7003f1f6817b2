"""accelerate's big-model placement (issue 10): tiny random models, one dense with a post-norm
scale (Gemma 3) and one mixture of experts (Mixtral), loaded with a ``max_memory`` that keeps
the first layers in CPU memory and offloads the rest to disk, give the same float64 results as
the model loaded whole; the patches saved from the offloaded run verify on the whole model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ctxpatch.core.compare import RunSpec, iter_token_patches
from ctxpatch.core.errors import UserError
from ctxpatch.core.export import save_patches
from ctxpatch.core.loading import load_model
from ctxpatch.core.placement import Placement, parse_max_memory
from ctxpatch.core.prompt import build_prompt
from ctxpatch.core.verify import read_patches, verify_patches
from tiny import gemma3_config, save_tiny_folder, tiny_config

CONTEXT, QUERY, TOKENS = "The quick brown fox jumps over the lazy dog.", "Hello world!", 4


@pytest.fixture(scope="module", params=["gemma3", "mixtral"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = gemma3_config(layers=4) if request.param == "gemma3" else tiny_config("mixtral")
    return Path(save_tiny_folder(tmp_path_factory.mktemp(f"offload-{request.param}"), config))


def _budget(whole: torch.nn.Module) -> int:
    """CPU memory for the embedding, the head and about a third of the layers (float64)."""
    from accelerate.utils import compute_module_sizes

    sizes = compute_module_sizes(whole)
    layer = sizes["model.layers.0"]
    return int(sizes[""] - sizes["model.layers"] + 2.5 * layer)


@pytest.fixture(scope="module")
def pair(folder: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    whole = load_model(str(folder), dtype="float64", device="cpu")
    offload = tmp_path_factory.mktemp("offload-folder")
    placed = load_model(str(folder), dtype="float64", placement=Placement(
        "auto", {"cpu": _budget(whole.model)}, str(offload)))
    return whole, placed


def _run(loaded, **kw):  # type: ignore[no-untyped-def]
    prompt = build_prompt(loaded.tokenizer, CONTEXT, QUERY)
    settings = RunSpec(max_new_tokens=TOKENS, keep_patches=True, **kw)
    return prompt, settings, list(iter_token_patches(loaded, prompt, settings))


def test_layers_are_split_between_memory_and_disk(pair) -> None:  # type: ignore[no-untyped-def]
    _, placed = pair
    where = {k: v for k, v in placed.model.hf_device_map.items() if ".layers." in k}
    assert "cpu" in where.values() and "disk" in where.values(), where
    offloaded = [p for p in placed.model.parameters() if p.device.type == "meta"]
    assert offloaded  # really offloaded: the weights are not in memory
    assert "disk" in placed.describe()["placement"]


@pytest.mark.parametrize("method,absorb,scope", [
    ("direct", "context", "all-positions"), ("stable", "context", "query"),
    ("direct", "all", "all-positions"), ("stable", "all", "query")])
def test_offloaded_equals_whole(pair, method, absorb, scope) -> None:  # type: ignore[no-untyped-def]
    whole, placed = pair
    kw = dict(method=method, absorb=absorb, scope=scope)
    _, _, a = _run(whole, **kw)
    _, _, b = _run(placed, **kw)
    assert len(a) == len(b) == TOKENS
    for x, y in zip(a, b, strict=True):
        assert x.baseline_token == y.baseline_token and x.patched.token == y.patched.token
        assert y.patched.match and y.patched.linf <= 1e-6 * y.logit_scale
        assert abs(x.logit_scale - y.logit_scale) <= 1e-12 * x.logit_scale
        assert max(abs(p - q) for p, q in zip(x.baseline_top_k.probs, y.baseline_top_k.probs,
                                              strict=True)) <= 1e-12
        for name, arr in x.patches.items():  # the same patches, wherever the weights were
            assert float(abs(arr - y.patches[name]).max()) <= 1e-6 * (float(abs(arr).max()) + 1e-30)


def test_the_controllability_plan_reads_offloaded_scales(pair) -> None:  # type: ignore[no-untyped-def]
    from ctxpatch.core.controllability import plan

    whole, placed = pair
    assert plan(placed, RunSpec()) == plan(whole, RunSpec())


def test_patches_from_an_offloaded_run_verify(pair, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    whole, placed = pair
    prompt, settings, steps = _run(placed)
    path = tmp_path / "p.safetensors"
    save_patches(path, steps, "tiny", "float64", settings)
    checks = verify_patches(whole, read_patches(path))
    assert all(c.match and c.linf <= 1e-6 * c.scale for c in checks)
    with pytest.raises(UserError, match="offloaded"):
        verify_patches(placed, read_patches(path))


def test_placement_errors(folder: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="malformed max_memory") as info:  # worded as in Python
        parse_max_memory(["cpu:8GiB"])
    assert info.value.words("cli").startswith("malformed --max-memory 'cpu:8GiB'")
    assert parse_max_memory(["cpu=1.5KiB", "cuda:1=2GB"]) == {"cpu": 1536, 1: 2 * 10**9}
    with pytest.raises(UserError, match="need device_map"):
        load_model(str(folder), placement=Placement(None, {"cpu": 10}))
    # a checkpoint whose tensors load as stored offloads to disk in place (read from the
    # safetensors, no folder); one that is converted on loading (Mixtral's fused experts)
    # needs a folder, and says so in one line
    try:
        placed = load_model(str(folder), dtype="float64",
                            placement=Placement("auto", {"cpu": 100_000}))
    except UserError as exc:
        assert "give --offload-folder DIR" in exc.words("cli") and "mixtral" in str(folder)
        assert "give offload_folder=..." in str(exc)
    else:
        assert "disk" in placed.model.hf_device_map.values() and "gemma3" in str(folder)
    with pytest.raises(UserError, match="even offload cannot fit"):
        Placement("auto", {}, str(tmp_path / "offload")).check_disk(10**18)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        load_model(str(folder), placement=Placement("auto", {}, str(tmp_path / "file")))


def test_the_memory_estimate_counts_weights_and_the_run_caches(folder: Path) -> None:
    """Known before loading, from the safetensors headers and config.json: the weights at the
    chosen dtype, and the two KV caches a comparison keeps (2 x layers x kv heads x head size
    values per token each)."""
    import json

    from ctxpatch.core.footprint import estimate

    loaded = load_model(str(folder), dtype="float64", device="cpu")
    params = sum(p.numel() for p in loaded.model.parameters())  # tied weights once
    fp = estimate(str(folder), "bfloat16")
    assert fp is not None and fp.bytes == 2 * params
    config = json.loads((folder / "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head
    assert fp.run_cache_bytes(1000) == 2 * 1000 * per_token * 2
    assert "KV caches per 1,000 tokens" in fp.describe()


def test_command_line_placement(capsys: pytest.CaptureFixture[str], folder: Path, pair,  # type: ignore[no-untyped-def]
                                tmp_path: Path) -> None:
    from ctxpatch.app.cli import main

    argv = ["compare", "--model", str(folder), "--context", CONTEXT, "--query", QUERY,
            "--max-new-tokens", "3", "--quiet", "--dtype", "float64",
            "--json", str(tmp_path / "r.json")]
    assert main([*argv, "--device-map", "auto", "--max-memory", f"cpu={_budget(pair[0].model)}",
                 "--offload-folder", str(tmp_path / "off")]) == 0
    assert "token match 3/3" in capsys.readouterr().out
    import json

    assert "disk" in json.loads((tmp_path / "r.json").read_text())["model"]["placement"]
    for bad, says in ((["--max-memory", "cpu=lots"], "malformed --max-memory"),
                      (["--device-map", "auto", "--max-memory", "gpu=1GB"],
                       "malformed --max-memory"),
                      (["--offload-folder", str(tmp_path)], "need --device-map")):
        assert main([*argv, *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
