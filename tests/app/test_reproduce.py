"""``ctxpatch reproduce`` on a tiny model: the grid, the sweep, one report; and it resumes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from ctxpatch.app.cli import main
from tiny_images import ALL_FAMILIES

pytestmark = pytest.mark.slow  # (the fast tier: pytest -m "not slow")


def test_reproduce_runs_the_grid_and_resumes(qtbot: Any, tiny_model_dir: str, tmp_path: Path,
                                             capsys: Any) -> None:
    argv = ["reproduce", "--model", tiny_model_dir, "--out", str(tmp_path), "--prompts", "2",
            "--max-new-tokens", "3", "--sweep", "0,3"]
    assert main(argv) == 0
    runs = sorted(p.stem for p in (tmp_path / "runs").glob("*.json"))
    assert runs == sorted([f"{d}-{m}-p{p}" for d in ("float32", "bfloat16")
                           for m in ("direct", "stable") for p in (1, 2)]
                          + ["sweep-s0", "sweep-s3"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(r["dtype"], r["method"]) for r in summary["summary"]] == [
        ("float32", "direct"), ("float32", "stable"), ("bfloat16", "direct"),
        ("bfloat16", "stable")]
    assert summary["summary"][0]["match_rate"] == 1.0 and summary["summary"][0]["tokens"] == 6
    assert [r["start_layer"] for r in summary["sweep"]] == [0, 3]
    assert all(r["matches"] == 3 for r in summary["sweep"])  # suffixes of layers are exact
    report = (tmp_path / "report.html").read_text()
    assert report.count("data:image/png;base64,") == 1 + 1 + 4  # figure 4, sweep, 4 x figure 3
    assert (tmp_path / "plots" / "figure4.svg").is_file()
    capsys.readouterr()
    # a second call reuses every saved run; a damaged one is redone
    (tmp_path / "runs" / "float32-stable-p2.json").write_text("{trunc")
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.count("reusing") == 9 and "float32-stable-p2: match 3/3" in err


def test_reproduce_rejects_bad_options(tmp_path: Path, capsys: Any) -> None:
    assert main(["reproduce", "--dtypes", "float8", "--out", str(tmp_path)]) == 2
    assert "unknown dtype 'float8'" in capsys.readouterr().err
    assert main(["reproduce", "--prompts", "9", "--out", str(tmp_path)]) == 2
    assert "--prompts must be between 1 and 5" in capsys.readouterr().err


def test_reproduce_adds_the_image_run(qtbot: Any, tmp_path: Path, capsys: Any) -> None:
    """``--image`` adds Figure 5: the bundled picture in the context of an image+text model,
    both methods in each precision, one plot and a table in the report."""
    from tiny import save_tiny_image_folder

    model = str(save_tiny_image_folder(tmp_path / "model", "gemma3"))
    out = tmp_path / "out"
    assert main(["reproduce", "--model", model, "--out", str(out), "--prompts", "1",
                 "--max-new-tokens", "3", "--sweep", "0", "--image"]) == 0
    runs = sorted(p.stem for p in (out / "runs").glob("image-*.json"))
    assert runs == sorted(f"image-{d}-{m}" for d in ("float32", "bfloat16")
                          for m in ("direct", "stable"))
    record = json.loads((out / "runs" / "image-float32-direct.json").read_text())
    assert record["prompt"]["image"]["path"].endswith("sample.png")
    assert record["summary"]["patched"]["matches"] == 3
    report = (out / "report.html").read_text()
    assert "Figure 5: a picture in the context" in report
    assert (out / "plots" / "figure5.png").is_file()


def test_reproduce_image_run_needs_an_image_text_model(tiny_model_dir: str, tmp_path: Path,
                                                       capsys: Any) -> None:
    assert main(["reproduce", "--model", tiny_model_dir, "--out", str(tmp_path), "--image"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "reads text only" in err[0]
    assert not (tmp_path / "runs").exists()  # refused before any run


@pytest.mark.parametrize("kind", ALL_FAMILIES)
def test_reproduce_image_runs_for_each_family(qtbot: Any, kind: str, tmp_path: Path,
                                              capsys: Any) -> None:
    """``ctxpatch reproduce --image`` on each image+text family's tiny model, in float64: both
    image runs are saved, exact (the patched run equals the run with the picture within 1e-6 of
    the logit scale), and in the report's Figure 5 and its table of every run."""
    from tiny_images import save_any_image_folder

    model = str(save_any_image_folder(tmp_path / "model", kind))
    out = tmp_path / "out"
    assert main(["reproduce", "--model", model, "--out", str(out), "--prompts", "1",
                 "--max-new-tokens", "2", "--dtypes", "float64", "--sweep", "0", "--image"]) == 0
    names = [f"image-float64-{m}" for m in ("direct", "stable")]
    assert sorted(p.stem for p in (out / "runs").glob("image-*.json")) == names
    for name in names:
        record = json.loads((out / "runs" / f"{name}.json").read_text())
        assert record["prompt"]["image"]["path"].endswith("sample.png")
        assert record["summary"]["patched"]["matches"] == 2, (kind, name)
        for s in record["steps"]:
            assert s["match"] and s["linf"] <= 1e-6 * s["logit_scale"], (kind, name, s["linf"])
    err = capsys.readouterr().err
    assert all(f"{name}: match 2/2" in err for name in names), err
    report = (out / "report.html").read_text()
    assert "Figure 5: a picture in the context" in report
    assert all(f"<td>{name}</td>" in report for name in names)
    assert (out / "plots" / "figure5.png").is_file()
