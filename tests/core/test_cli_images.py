"""`ctxpatch compare --image` and `verify` on saved tiny image+text model folders; bad images and
an image given to a text-only model are exit status 2 and one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from ctxpatch.app.cli import main
from ctxpatch.resources import sample_image_path
from tiny import save_tiny_folder, save_tiny_image_folder

pytestmark = pytest.mark.slow  # (the fast tier: pytest -m "not slow")


@pytest.fixture(scope="module", params=["gemma3", "llava", "llava_next", "idefics3"])
def image_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(save_tiny_image_folder(tmp_path_factory.mktemp(f"tiny-{request.param}-image"),
                                       request.param))


def _compare(folder: Path, image: str, *extra: str) -> list[str]:
    return ["compare", "--model", str(folder), "--image", image, "--query", "Hello world!",
            "--max-new-tokens", "3", "--quiet", *extra]


def _one_error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("ctxpatch: error: "), err
    return err[0]


def test_compare_with_an_image_then_verify(capsys: pytest.CaptureFixture[str], image_folder: Path,
                                           tmp_path: Path) -> None:
    picture = tmp_path / "cat.png"
    shutil.copy(sample_image_path(), picture)
    run, patches = tmp_path / "run.json", tmp_path / "p.safetensors"
    assert main(_compare(image_folder, str(picture), "--json", str(run), "--save-patches",
                         str(patches), "--verify", "--report", str(tmp_path / "r.html"))) == 0
    out = capsys.readouterr().out
    assert "token match 3/3" in out
    record = json.loads(run.read_text())
    image = record["prompt"]["image"]
    assert image["path"] == str(picture.resolve()) and len(image["sha256"]) == 64
    assert "image" in [s["kind"] for s in record["prompt"]["segments"]]
    assert record["verification"]["ok"]
    assert "data:image/png;base64," in (tmp_path / "r.html").read_text()
    assert "Context image: cat.png" in (tmp_path / "r.html").read_text()
    # verify finds the picture at its recorded path
    assert main(["verify", str(patches), "--model", str(image_folder)]) == 0
    assert "3/3 tokens match" in capsys.readouterr().out
    # moved: verify asks for it, then takes it by --image (checked by hash)
    moved = tmp_path / "moved.png"
    picture.rename(moved)
    line = _one_error_line(capsys, ["verify", str(patches), "--model", str(image_folder)])
    assert "--image" in line and "gone" in line
    assert main(["verify", str(patches), "--model", str(image_folder), "--image", str(moved)]) == 0
    capsys.readouterr()
    other = tmp_path / "other.png"
    from PIL import Image

    Image.new("RGB", (9, 9)).save(other)
    line = _one_error_line(capsys, ["verify", str(patches), "--model", str(image_folder),
                                    "--image", str(other)])
    assert "not the image these patches were made with" in line


def test_image_errors(capsys: pytest.CaptureFixture[str], image_folder: Path,
                      tmp_path: Path) -> None:
    (tmp_path / "notes.png").write_text("not a picture")
    assert "no such image file" in _one_error_line(
        capsys, _compare(image_folder, str(tmp_path / "missing.png")))
    notes = str(tmp_path / "notes.png")
    assert "cannot read" in _one_error_line(capsys, _compare(image_folder, notes))
    assert "folder, not an image" in _one_error_line(capsys, _compare(image_folder, str(tmp_path)))


def test_image_for_a_text_only_model(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    folder = save_tiny_folder(tmp_path / "text-only")
    line = _one_error_line(capsys, _compare(folder, sample_image_path()))
    assert "reads text only" in line


def test_unsupported_image_text_family_is_named(capsys: pytest.CaptureFixture[str],
                                                tmp_path: Path) -> None:
    from transformers import AutoConfig

    AutoConfig.for_model("llama4").save_pretrained(tmp_path)
    line = _one_error_line(capsys, _compare(tmp_path, sample_image_path()))
    assert "'llama4' is not supported yet" in line and "LLaVA" in line
