"""Issue 19, the command line: outputs never destroy inputs or each other, ``-`` is standard
output, weights that do not load completely are refused, verify refuses malformed patches and
options, and late failures become one line before any work (docs/RELIABILITY.md, round 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_case import CASE, _digest  # (and the `folder` fixture: tests/core/conftest.py)
from ctxpatch.app.cli import main
from tiny import llama_config, save_tiny_folder


@pytest.fixture(scope="module")
def patches(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("patches") / "p.safetensors"
    assert main(["compare", "--model", str(folder), *CASE, "--save-patches", str(path),
                 "--quiet"]) == 0
    return path


def _err(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2, captured.err
    lines = captured.err.strip().splitlines()
    assert lines and lines[-1].startswith("ctxpatch: error: "), captured.err
    assert "Traceback" not in captured.err and "internal error" not in captured.err
    return lines[-1]


# --- outputs that would destroy inputs or each other --------------------------------------

@pytest.mark.parametrize("option,name", [("--json", "config.json"),
                                         ("--save-patches", "model.safetensors"),
                                         ("--csv", "tokenizer.json")])
def test_an_output_over_a_model_file_is_refused(capsys, folder: Path, option: str,  # type: ignore[no-untyped-def]
                                                name: str) -> None:
    before = _digest(folder)
    line = _err(capsys, ["compare", "--model", str(folder), *CASE, option, str(folder / name)])
    assert "would overwrite" in line and option in line
    assert _digest(folder) == before


def test_an_output_through_a_symlink_to_an_input_is_refused(capsys, folder: Path,  # type: ignore[no-untyped-def]
                                                            tmp_path: Path) -> None:
    link = tmp_path / "innocent.json"
    link.symlink_to(folder / "config.json")
    before = _digest(folder)
    assert "would overwrite" in _err(capsys, ["compare", "--model", str(folder), *CASE,
                                              "--json", str(link)])
    assert _digest(folder) == before


def test_two_outputs_naming_one_file_are_refused(capsys, folder: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    x = tmp_path / "x"
    line = _err(capsys, ["compare", "--model", str(folder), *CASE, "--json", str(x),
                         "--csv", str(x)])
    assert "same file" in line and not x.exists()


def test_verify_json_over_its_patches_is_refused(capsys, patches: Path, folder: Path) -> None:  # type: ignore[no-untyped-def]
    before = patches.read_bytes()
    line = _err(capsys, ["verify", str(patches), "--model", str(folder), "--json", str(patches)])
    assert "would overwrite" in line
    assert patches.read_bytes() == before


def test_binary_outputs_cannot_go_to_stdout(capsys, folder: Path) -> None:  # type: ignore[no-untyped-def]
    line = _err(capsys, ["compare", "--model", str(folder), *CASE, "--save-patches", "-"])
    assert "standard output" in line
    line = _err(capsys, ["compare", "--model", str(folder), *CASE, "--json", "-", "--csv", "-"])
    assert "only one output" in line


def test_dash_is_standard_output(capsys, folder: Path, patches: Path, tmp_path: Path,  # type: ignore[no-untyped-def]
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["compare", "--model", str(folder), *CASE, "--csv", "-", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("step,") and len(out.splitlines()) == 3
    assert main(["verify", str(patches), "--model", str(folder), "--json", "-"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["ok"] is True  # stdout is the JSON alone
    assert "verified: 2/2" in captured.err
    assert not (tmp_path / "-").exists()


def test_the_report_s_plots_folder_as_a_file_is_refused_before_work(capsys, folder: Path,  # type: ignore[no-untyped-def]
                                                                    tmp_path: Path) -> None:
    (tmp_path / "r_plots").write_text("mine")
    line = _err(capsys, ["compare", "--model", str(folder), *CASE, "--quiet",
                         "--report", str(tmp_path / "r.html")])
    assert "r_plots" in line and (tmp_path / "r_plots").read_text() == "mine"


# --- weights that do not load completely --------------------------------------------------

def test_a_missing_weight_tensor_is_refused_by_name(capsys, folder: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from safetensors.numpy import load_file, save_file

    cut = tmp_path / "cut"
    cut.mkdir()
    for p in folder.iterdir():
        (cut / p.name).write_bytes(p.read_bytes())
    tensors = load_file(str(cut / "model.safetensors"))
    gone = "model.layers.1.mlp.up_proj.weight"
    del tensors[gone]
    save_file(tensors, str(cut / "model.safetensors"), metadata={"format": "pt"})
    line = _err(capsys, ["compare", "--model", str(cut), *CASE, "--quiet"])
    assert gone in line and "lacks" in line


def test_a_tokenizer_larger_than_the_embedding_is_refused(capsys, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from tiny import tiny_loaded

    small = llama_config(layers=1, vocab=64)  # the tiny tokenizer has more than 64 tokens
    loaded = tiny_loaded(small)
    loaded.model.save_pretrained(tmp_path)
    from tiny import tiny_tokenizer

    tiny_tokenizer().save_pretrained(tmp_path)
    line = _err(capsys, ["compare", "--model", str(tmp_path), *CASE, "--quiet"])
    assert "tokenizer" in line and "64 rows" in line


def test_no_decoder_layers_is_refused(capsys, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = llama_config(layers=1)
    config.num_hidden_layers = 0
    config.save_pretrained(tmp_path)
    assert "no decoder layers" in _err(capsys, ["compare", "--model", str(tmp_path), *CASE])


def test_a_cut_tokenizer_says_which_file(capsys, folder: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    for p in folder.iterdir():
        (tmp_path / p.name).write_bytes(p.read_bytes())
    data = (tmp_path / "tokenizer.json").read_bytes()
    (tmp_path / "tokenizer.json").write_bytes(data[: len(data) // 2])
    line = _err(capsys, ["compare", "--model", str(tmp_path), *CASE])
    assert "cannot read the tokenizer" in line and "damaged" in line


def test_a_config_that_is_not_json_says_so(capsys, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "config.json").write_text("{ this is not json")
    line = _err(capsys, ["compare", "--model", str(tmp_path), *CASE])
    assert "cannot read" in line and "config.json" in line and "not found" not in line


# --- verify: malformed files and options --------------------------------------------------

def _rewrite(src: Path, dst: Path, *, steps=None, extra=None, drop=None, scale=None) -> Path:  # type: ignore[no-untyped-def]
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    with safe_open(str(src), framework="np") as f:
        metadata = dict(f.metadata())
    tensors = load_file(str(src))
    if steps is not None:
        metadata["steps"] = json.dumps(steps)
    if extra:
        tensors.update(extra)
    for key in drop or ():
        del tensors[key]
    if scale is not None:
        key = sorted(tensors)[0]
        tensors[key] = tensors[key] * scale
    save_file(tensors, str(dst), metadata=metadata)
    return dst


def test_verify_refuses_patches_for_an_unlisted_step(capsys, patches: Path, folder: Path,  # type: ignore[no-untyped-def]
                                                     tmp_path: Path) -> None:
    import numpy as np

    bad = _rewrite(patches, tmp_path / "b.safetensors",
                   extra={"step.99.model.layers.0.mlp.up_proj.weight.delta":
                          np.zeros(3, np.float32)})
    assert "step 99" in _err(capsys, ["verify", str(bad), "--model", str(folder)])


def test_verify_refuses_an_empty_step_list(capsys, patches: Path, folder: Path,  # type: ignore[no-untyped-def]
                                           tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(str(patches), framework="np") as f:
        metadata = dict(f.metadata())
    metadata["steps"] = "[]"
    import numpy as np

    save_file({"unused": np.zeros(1, np.float32)}, str(tmp_path / "e.safetensors"), metadata)
    # (an unexpected tensor name would be refused too; the empty list is said first)
    assert "no steps" in _err(capsys, ["verify", str(tmp_path / "e.safetensors"),
                                       "--model", str(folder)])


def test_verify_refuses_infinite_entries(capsys, patches: Path, folder: Path,  # type: ignore[no-untyped-def]
                                         tmp_path: Path) -> None:
    bad = _rewrite(patches, tmp_path / "i.safetensors", scale=float("inf"))
    assert "infinite" in _err(capsys, ["verify", str(bad), "--model", str(folder)])


def test_verify_refuses_a_lone_u_vector(capsys, patches: Path, folder: Path,  # type: ignore[no-untyped-def]
                                        tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    v = next(k for k in load_file(str(patches)) if k.endswith(".v"))
    bad = _rewrite(patches, tmp_path / "u.safetensors", drop=[v])
    assert "lacks its v vector" in _err(capsys, ["verify", str(bad), "--model", str(folder)])


def test_verify_refuses_token_ids_beyond_the_vocabulary(capsys, patches: Path, folder: Path,  # type: ignore[no-untyped-def]
                                                        tmp_path: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(patches), framework="np") as f:
        steps = json.loads(f.metadata()["steps"])
    steps[0]["full_input_ids"][-1] = 10**9
    bad = _rewrite(patches, tmp_path / "t.safetensors", steps=steps)
    assert "vocabulary" in _err(capsys, ["verify", str(bad), "--model", str(folder)])


def test_verify_refuses_a_patch_of_the_wrong_shape(capsys, patches: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    other = Path(save_tiny_folder(tmp_path / "wider", llama_config(layers=2)))
    config = json.loads((other / "config.json").read_text())
    config["intermediate_size"] *= 2
    from tiny import tiny_loaded
    from transformers import LlamaConfig

    tiny_loaded(LlamaConfig(**config),
                dtype=__import__("torch").float32).model.save_pretrained(other)
    assert "shape" in _err(capsys, ["verify", str(patches), "--model", str(other)])


@pytest.mark.parametrize("value", ["-1", "nan", "0", "inf"])
def test_verify_refuses_a_bad_tolerance(capsys, patches: Path, value: str) -> None:  # type: ignore[no-untyped-def]
    assert "--tolerance" in _err(capsys, ["verify", str(patches), "--tolerance", value])


# --- late failures become one line before any work ---------------------------------------

@pytest.mark.parametrize("device", ["meta", "xla"])
def test_devices_we_do_not_run_on(capsys, folder: Path, device: str) -> None:  # type: ignore[no-untyped-def]
    line = _err(capsys, ["compare", "--model", str(folder), *CASE, "--device", device])
    assert device in line


def test_absurd_top_k(capsys, folder: Path) -> None:  # type: ignore[no-untyped-def]
    assert "top-k" in _err(capsys, ["compare", "--model", str(folder), *CASE,
                                    "--top-k", "1000000000"])


def test_empty_model_name(capsys) -> None:  # type: ignore[no-untyped-def]
    assert "no model given" in _err(capsys, ["compare", "--model", "", *CASE])


def test_a_fifo_is_not_called_a_folder(capsys, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    line = _err(capsys, ["compare", "--model", str(fifo), *CASE])
    assert "pipe" in line and "is a file" not in line


def test_layers_syntax_message_has_no_placeholder_range(capsys, folder: Path) -> None:  # type: ignore[no-untyped-def]
    line = _err(capsys, ["compare", "--model", str(folder), *CASE, "--layers", "x"])
    assert "999" not in line and "malformed layers" in line


def test_reproduce_refuses_a_bad_sweep_and_an_out_file_before_any_run(capsys,  # type: ignore[no-untyped-def]
                                                                      tmp_path: Path) -> None:
    line = _err(capsys, ["reproduce", "--out", str(tmp_path / "r"), "--sweep", "a,b"])
    assert "--sweep" in line and not (tmp_path / "r").exists()
    (tmp_path / "file").write_text("mine")
    line = _err(capsys, ["reproduce", "--out", str(tmp_path / "file")])
    assert "is a file" in line and (tmp_path / "file").read_text() == "mine"


def test_reproduce_refuses_a_sweep_beyond_the_model(capsys, folder: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    line = _err(capsys, ["reproduce", "--model", str(folder), "--out", str(tmp_path / "r"),
                         "--sweep", "0,7"])
    assert "layers 0 to 1" in line and not (tmp_path / "r").exists()


# --- order of writing ---------------------------------------------------------------------

def test_the_data_is_written_before_the_report(capsys, folder: Path, tmp_path: Path,  # type: ignore[no-untyped-def]
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A report that fails late (here: its last move) loses nothing: the run JSON, the CSV and
    the patches are already written, and the plots moved into place are taken back."""
    from ctxpatch.core import export as core_export

    real_install = core_export.install

    def full_disk_in_the_plots(tmp, path):  # type: ignore[no-untyped-def]
        if Path(path).name == "r.html":  # the last move, once the plots are in place
            raise OSError(28, "No space left on device")
        return real_install(tmp, path)

    monkeypatch.setattr(core_export, "install", full_disk_in_the_plots)
    code = main(["compare", "--model", str(folder), *CASE, "--quiet",
                 "--json", str(tmp_path / "r.json"), "--csv", str(tmp_path / "r.csv"),
                 "--save-patches", str(tmp_path / "p.safetensors"),
                 "--report", str(tmp_path / "r.html")])
    assert code != 0
    assert json.loads((tmp_path / "r.json").read_text())["steps"]
    assert (tmp_path / "r.csv").is_file() and (tmp_path / "p.safetensors").is_file()
    assert not (tmp_path / "r_plots").exists() and not (tmp_path / "r.html").exists()
    capsys.readouterr()


# --- pictures -----------------------------------------------------------------------------

def test_bad_pictures_are_one_clean_line(capsys, folder: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A decompression bomb (a tiny PNG that claims 20,000 x 20,000 pixels), random bytes (no
    BytesIO repr in the message) and a FIFO (not "a folder"), each one line before any work,
    and no Pillow warning on stderr."""
    import os
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 20000, 20000,
                                                                       8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(b"\x00" * 1000)) + chunk(b"IEND", b""))
    noise = tmp_path / "noise.png"
    noise.write_bytes(os.urandom(300))
    fifo = tmp_path / "fifo.png"
    os.mkfifo(fifo)
    for path, words in ((bomb, "too large"), (noise, "cannot read"), (fifo, "pipe")):
        line = _err(capsys, ["compare", "--model", str(folder), *CASE, "--image", str(path)])
        assert words in line and "BytesIO" not in line and "folder" not in line, line
        assert "Warning" not in capsys.readouterr().err


def test_a_full_disk_while_saving_patches_is_one_line(capsys, folder: Path, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """safetensors reports a failed write (a full disk) as its own SafetensorError: one line,
    exit 2, no temporary file left."""
    import safetensors.numpy
    from safetensors import SafetensorError

    def full(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: "
                              "StorageFull, message: \"No space left on device\" })")

    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    line = _err(capsys, ["compare", "--model", str(folder), *CASE, "--quiet",
                         "--save-patches", str(tmp_path / "p.safetensors")])
    assert "cannot write" in line and "disk full" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_json_is_valid_whatever_the_record_holds(tmp_path: Path) -> None:
    """A reopened session may carry infinities or NaN in fields the schema keeps as they are
    (found by the session fuzz test: an export then failed with 'Out of range float values');
    every JSON we write says null for them."""
    import math

    from ctxpatch.core.export import write_json

    write_json(tmp_path / "r.json", {"a": math.inf, "b": [math.nan, 1.0], "c": {"d": -math.inf}})
    assert json.loads((tmp_path / "r.json").read_text()) == {"a": None, "b": [None, 1.0],
                                                             "c": {"d": None}}
