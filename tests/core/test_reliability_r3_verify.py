"""Issue 36, round 3: ``verify`` and the patches file (docs/RELIABILITY.md, "Round 3").

Verify reads the file's header before anything else and never overwrites the model or the
picture it names; the file records a fingerprint of the weights (and, with a picture, the
processor) and verify refuses other weights; a file without patch tensors, or with steps
without them, is refused, which bounds the work; crafted metadata is one line naming the field,
never a TypeError, an OverflowError or a RecursionError; any mutation of the metadata verifies
or gives one line (hypothesis).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from cli_case import CASE, _digest  # (and the `folder` fixture: tests/core/conftest.py)
from ctxpatch.app.cli import main
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import save_tiny_folder


@pytest.fixture(scope="module")
def patches(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("patches") / "p.safetensors"
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        assert main(["compare", "--model", str(folder), *CASE, "--save-patches", str(path),
                     "--quiet"]) == 0
    return path


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _line(argv: list[str]) -> str:
    """The one error line of a command that must fail with exit status 2."""
    code, _, err = _run(argv)
    assert code == 2, err
    assert "Traceback" not in err and "internal error" not in err, err
    lines = err.strip().splitlines()
    assert lines and lines[-1].startswith("ctxpatch: error: "), err
    assert all(not line.startswith("ctxpatch: error") for line in lines[:-1]), err
    return lines[-1]


def _meta(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        return dict(f.metadata())


def _rewrite(src: Path, dst: Path, *, metadata: dict[str, str] | None = None,
             keep: Any = None) -> Path:
    """``src`` again as ``dst``, with ``metadata`` instead of its own and only the tensors whose
    names ``keep`` accepts."""
    from safetensors.numpy import load_file, save_file

    tensors = {k: v for k, v in load_file(str(src)).items() if keep is None or keep(k)}
    save_file(tensors, str(dst), metadata=_meta(src) if metadata is None else metadata)
    return dst


def _with(src: Path, dst: Path, **changes: Any) -> Path:
    """``src`` with metadata values replaced (JSON-encoded unless given as a string)."""
    metadata = _meta(src)
    for key, value in changes.items():
        metadata[key] = value if isinstance(value, str) else json.dumps(value)
    return _rewrite(src, dst, metadata=metadata)


# --- case 1: the header first; outputs never overwrite the model or the picture it names -----

def test_verify_json_over_the_named_model_s_config_is_refused(folder: Path, patches: Path) -> None:
    before = _digest(folder)
    line = _line(["verify", str(patches), "--json", str(folder / "config.json")])
    assert "--json" in line and "would overwrite" in line
    assert _digest(folder) == before


@pytest.fixture(scope="module")
def image_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A tiny Gemma 3 image+text folder, a picture, and the patches of a run with it."""
    from ctxpatch.resources import sample_image_path
    from tiny import save_tiny_image_folder

    base = tmp_path_factory.mktemp("image-run")
    model = Path(save_tiny_image_folder(base / "gemma3", "gemma3"))
    picture = base / "cat.png"
    shutil.copy(sample_image_path(), picture)
    path = base / "p.safetensors"
    code, _, err = _run(["compare", "--model", str(model), "--image", str(picture), "--query",
                         "Hello world!", "--max-new-tokens", "2", "--quiet",
                         "--save-patches", str(path)])
    assert code == 0, err
    return model, picture, path


@pytest.mark.slow
def test_verify_json_over_the_recorded_picture_is_refused(image_run) -> None:  # type: ignore[no-untyped-def]
    model, picture, path = image_run
    before = picture.read_bytes()
    line = _line(["verify", str(path), "--model", str(model), "--json", str(picture)])
    assert "would overwrite" in line and "cat.png" in line
    assert picture.read_bytes() == before


# --- case 8: what was checked, and the weights the patches were made for --------------------

def test_verify_says_what_it_checked(folder: Path, patches: Path) -> None:
    from safetensors.numpy import load_file

    code, out, err = _run(["verify", str(patches), "--model", str(folder)])
    assert code == 0, err
    n = len(load_file(str(patches)))
    assert "verified: 2/2" in out
    assert f"checked: 2 step(s) with {n} patch tensor(s)" in out
    assert "fingerprint matched" in out


def test_a_file_without_patch_tensors_is_refused(folder: Path, patches: Path,
                                                 tmp_path: Path) -> None:
    bare = _rewrite(patches, tmp_path / "bare.safetensors", keep=lambda k: False)
    line = _line(["verify", str(bare), "--model", str(folder)])
    assert "holds no patch tensors" in line  # (it said "verified: 2/2")


def test_a_step_without_patch_tensors_is_refused(folder: Path, patches: Path,
                                                 tmp_path: Path) -> None:
    cut = _rewrite(patches, tmp_path / "cut.safetensors", keep=lambda k: k.startswith("step.0."))
    line = _line(["verify", str(cut), "--model", str(folder)])
    assert "lists 2 steps, but 1 of them have no patch tensors (step 1 first)" in line


def _scaled_copy(folder: Path, dst: Path, name: str, factor: float) -> Path:
    from safetensors.numpy import load_file, save_file

    shutil.copytree(folder, dst)
    weights = load_file(str(dst / "model.safetensors"))
    weights[name] = weights[name] * factor
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_other_weights_are_refused(folder: Path, patches: Path, tmp_path: Path) -> None:
    other = _scaled_copy(folder, tmp_path / "scaled", "lm_head.weight", 1.01)
    line = _line(["verify", str(patches), "--model", str(other)])
    assert "differ from those these patches were made for (lm_head.weight)" in line
    assert "--model" in line


def test_a_file_without_a_fingerprint_still_verifies_and_says_so(folder: Path, patches: Path,
                                                                 tmp_path: Path) -> None:
    metadata = _meta(patches)
    del metadata["weights"]
    old = _rewrite(patches, tmp_path / "old.safetensors", metadata=metadata)
    code, out, err = _run(["verify", str(old), "--model", str(folder)])
    assert code == 0, err
    assert "verified: 2/2" in out and "weights not checked" in out and "fingerprint" in out


def test_a_format_1_file_still_verifies(folder: Path, patches: Path, tmp_path: Path) -> None:
    metadata = {k: v for k, v in _meta(patches).items()
                if k in ("model", "dtype", "method", "absorb", "scope", "steps")}
    old = _rewrite(patches, tmp_path / "v1.safetensors",
                   metadata={**metadata, "format": "ctxpatch-patches/1"})
    code, out, err = _run(["verify", str(old), "--model", str(folder)])
    assert code == 0, err
    assert "weights not checked" in out


def test_the_fingerprint_catches_a_scale_of_any_one_parameter(folder: Path) -> None:
    import torch
    from ctxpatch.core.errors import UserError
    from ctxpatch.core.patchfile import compare_weights, weights_fingerprint
    from ctxpatch.core.runs import load
    from ctxpatch.core.spec import RunSpec

    loaded = load(RunSpec(model=str(folder), dtype="float32", device="cpu"))
    recorded = weights_fingerprint(loaded.model)
    again = load(RunSpec(model=str(folder), dtype="float32", device="cpu"))
    assert weights_fingerprint(again.model) == recorded  # loaded again: identical
    assert compare_weights(recorded, again.model, "m").startswith("fingerprint matched")
    params = dict(again.model.named_parameters())
    assert len(params) == len(recorded["tensors"]) > 5
    for name, p in params.items():
        original = p.detach().clone()
        with torch.no_grad():
            p.mul_(1.01)
        with pytest.raises(UserError, match=f"differ from those .*\\({name}\\)"):
            compare_weights(recorded, again.model, "m")
        with torch.no_grad():
            p.copy_(original)
    # another dtype is not compared (its bytes differ), and says so
    wide = load(RunSpec(model=str(folder), dtype="float64", device="cpu"))
    assert "not checked" in compare_weights(recorded, wide.model, "m")


@pytest.mark.slow
def test_the_image_processor_is_recorded_and_checked(image_run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model, _, path = image_run
    recorded = json.loads(_meta(path)["processor"])
    assert recorded["processor"].endswith("Processor") and recorded["image_processor"]
    code, out, err = _run(["verify", str(path), "--model", str(model)])
    assert code == 0 and "fingerprint matched" in out, err
    other = _with(path, tmp_path / "o.safetensors",
                  processor={**recorded, "image_processor": "SomeOtherImageProcessorFast"})
    line = _line(["verify", str(other), "--model", str(model)])
    assert "SomeOtherImageProcessorFast" in line and recorded["image_processor"] in line


# --- case 12: the work is bounded before it starts -------------------------------------------

def test_a_file_listing_100000_steps_is_refused_at_once(folder: Path, patches: Path,
                                                        tmp_path: Path) -> None:
    steps = json.loads(_meta(patches)["steps"])
    many = _with(patches, tmp_path / "many.safetensors", steps=[steps[0]] * 100_000)
    start = time.perf_counter()
    line = _line(["verify", str(many), "--model", str(folder)])
    assert time.perf_counter() - start < 30
    assert "(steps: step 1 holds" in line and "each step adds one generated token" in line
    # steps that grow as a run's do, but only the first with patches: refused as well
    first = steps[0]
    grown = [{**first, "full_input_ids": first["full_input_ids"] + [5] * t} for t in range(300)]
    grown[1] = steps[1]
    line = _line(["verify", str(_with(patches, tmp_path / "g.safetensors", steps=grown)),
                  "--model", str(folder)])
    assert "298 of them have no patch tensors (step 2 first)" in line


def test_positions_beyond_a_gpt2_model_are_refused(tmp_path: Path) -> None:
    from tiny import tiny_config

    config = tiny_config("gpt2")
    config.n_positions = 32
    gpt2 = Path(save_tiny_folder(tmp_path / "gpt2", config))
    path = tmp_path / "p.safetensors"
    code, _, err = _run(["compare", "--model", str(gpt2), "--context", "Alice.", "--query",
                         "Where?", "--max-new-tokens", "2", "--quiet", "--save-patches",
                         str(path)])
    assert code == 0, err
    steps = json.loads(_meta(path)["steps"])
    pad = [5] * 30
    longer = [{**s, "full_input_ids": pad + s["full_input_ids"],
               "reduced_position_ids": [len(pad) + len(s["full_input_ids"]) - 1]}
              for s in steps]
    for s in longer:
        s["reduced_input_ids"] = s["reduced_input_ids"][-1:]
    line = _line(["verify", str(_with(path, tmp_path / "l.safetensors", steps=longer)),
                  "--model", str(gpt2)])
    assert "beyond this model's 32" in line  # (it was an IndexError)


# --- case 15: crafted metadata is one line naming the field --------------------------------

def _step_list(patches: Path) -> list[dict[str, Any]]:
    return json.loads(_meta(patches)["steps"])  # type: ignore[no-any-return]


CRAFTED = {
    "an image record that is a list": ("image", [1, 2], "image"),
    "an image record of wrong types": ("image", {"path": 5, "sha256": [], "width": "9",
                                                 "height": 9, "format": "PNG"}, "image.path"),
    "conditioning values that are strings": ("conditioning", {"max_entry_ratio": "big",
                                                              "bound": 100.0},
                                             "conditioning.max_entry_ratio"),
    "a conditioning place without its layer": ("conditioning",
                                               {"max_abs_scale_patch": 1.0,
                                                "max_abs_scale_patch_at": {"step": 0}},
                                               "conditioning.max_abs_scale_patch_at.layer"),
    "a null bound": ("conditioning", {"bound": None}, "conditioning.bound"),
    "steps nested 100,000 deep": ("steps", "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    "steps that are not JSON": ("steps", "[{", "steps: not JSON"),
    "steps that are an object": ("steps", {"0": 1}, "steps"),
    "a scope that is not one": ("scope", "sideways", "scope"),
    "a dtype that is not one": ("dtype", "int4", "dtype"),
    "a weights record of wrong types": ("weights", {"dtype": "float32", "sha256": 7,
                                                    "tensors": {}}, "weights.sha256"),
}


@pytest.mark.parametrize("key,value,where", CRAFTED.values(), ids=CRAFTED.keys())
def test_crafted_metadata_is_one_line_naming_the_field(folder: Path, patches: Path,
                                                       tmp_path: Path, key: str, value: Any,
                                                       where: str) -> None:
    bad = _with(patches, tmp_path / "bad.safetensors", **{key: value})
    line = _line(["verify", str(bad), "--model", str(folder)])
    assert where in line, line
    assert line.endswith("save the patches again"), line


@pytest.mark.parametrize("field,value,where", [
    ("full_input_ids", ["x"], "steps[1].full_input_ids[0]"),
    ("full_input_ids", [10**30], "steps[1].full_input_ids[0]"),
    ("reduced_input_ids", [], "steps[1].reduced_input_ids"),
    ("reduced_position_ids", [10**30], "steps[1].reduced_position_ids[0]"),
    ("reduced_position_ids", [-1], "steps[1].reduced_position_ids[0]"),
    ("reduced_position_ids", 3, "steps[1].reduced_position_ids"),
], ids=["a string id", "an id of 10**30", "no reduced ids", "a position of 10**30",
        "a negative position", "positions that are a number"])
def test_crafted_steps_are_one_line_naming_the_field(folder: Path, patches: Path,
                                                     tmp_path: Path, field: str, value: Any,
                                                     where: str) -> None:
    steps = _step_list(patches)
    steps[1][field] = value
    line = _line(["verify", str(_with(patches, tmp_path / "s.safetensors", steps=steps)),
                  "--model", str(folder)])
    assert f"is not a valid ctxpatch patches file ({where}:" in line, line


def test_positions_beyond_the_step_s_own_sequence_are_refused(folder: Path, patches: Path,
                                                             tmp_path: Path) -> None:
    steps = _step_list(patches)
    steps[0]["reduced_position_ids"] = [10**6] * len(steps[0]["reduced_input_ids"])
    line = _line(["verify", str(_with(patches, tmp_path / "s.safetensors", steps=steps)),
                  "--model", str(folder)])
    assert "(steps: step 0's reduced_position_ids reach 1000000, beyond its" in line


# --- fuzz: any mutation of the metadata verifies or gives one line ---------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.sampled_from([10**30, -1, 0])
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=8)


def _paths(value: Any, here: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON value (the value itself too)."""
    out = [here]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*here, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*here, i))
    return out


def _mutated(metadata: dict[str, str], data: Any) -> dict[str, str]:
    from ctxpatch.core.patchfile import JSON_KEYS

    metadata = dict(metadata)
    key = data.draw(st.sampled_from(sorted({*metadata, *JSON_KEYS})), label="key")
    if key not in metadata:  # a key the file lacks (image, processor), with any JSON value
        metadata[key] = json.dumps(data.draw(JSON_VALUES, label="value"))
        return metadata
    how = data.draw(st.sampled_from(["replace", "delete", "text"]), label="how")
    if how == "text" or key not in JSON_KEYS:
        if how == "delete":
            del metadata[key]
        else:
            metadata[key] = data.draw(st.text(max_size=20) | st.sampled_from(
                ["", "null", "[]", "{}", "1e400", "NaN", "-1", "query", "float64"]), label="text")
        return metadata
    value = json.loads(metadata[key])
    where = data.draw(st.sampled_from(_paths(value)), label="where")
    if not where:
        value = None if how == "delete" else data.draw(JSON_VALUES, label="value")
    else:
        holder = value
        for part in where[:-1]:
            holder = holder[part]
        if how == "delete":
            del holder[where[-1]]
        else:
            holder[where[-1]] = data.draw(JSON_VALUES, label="value")
    metadata[key] = json.dumps(value)
    return metadata


FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@pytest.mark.slow
@FUZZ
@given(data=st.data())
def test_any_mutation_of_the_metadata_verifies_or_is_one_line(folder, patches,  # type: ignore[no-untyped-def]
                                                              tmp_path_factory, data) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "p.safetensors"
    _rewrite(patches, path, metadata=_mutated(_meta(patches), data))
    raw = path.read_bytes()
    code, _, err = _run(["verify", str(path), "--model", str(folder)])
    assert "Traceback" not in err and "internal error" not in err, err
    assert code in (0, 1, 2), (code, err)  # 1: a verification that did not reproduce
    if code == 2:
        errors = [line for line in err.splitlines() if line.startswith("ctxpatch: error")]
        assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
    assert path.read_bytes() == raw


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_mutation_of_the_metadata_reads_or_is_one_line(patches, data) -> None:  # type: ignore[no-untyped-def]
    """The header alone, fast: read and checked, or one `UserError` line."""
    from ctxpatch.core.errors import UserError
    from ctxpatch.core.patchfile import check_header

    try:
        check_header(_mutated(_meta(patches), data), "p.safetensors")
    except UserError as exc:
        assert "\n" not in str(exc)


def test_the_python_api_records_the_fingerprint_too(folder: Path, tmp_path: Path) -> None:
    import ctxpatch

    run = ctxpatch.compare(str(folder), context="Alice lives in Paris.", query="Where?",
                           max_new_tokens=2, device="cpu")
    path = tmp_path / "api.safetensors"
    run.save_patches(path)
    assert json.loads(_meta(path)["weights"])["dtype"] == "float32"
    assert ctxpatch.verify(path, model=str(folder)).ok
    other = _scaled_copy(folder, tmp_path / "scaled", "model.norm.weight", 1.01)
    with pytest.raises(ctxpatch.OptionError, match=r"differ .*\(model\.norm\.weight\)"):
        ctxpatch.verify(path, model=str(other))
