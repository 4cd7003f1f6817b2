"""``ctxpatch reproduce`` on a tiny model: the grid, the sweep, one report; and it resumes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from app.cli import main


def test_reproduce_runs_the_grid_and_resumes(qtbot: Any, tiny_model_dir: str, tmp_path: Path,
                                             capsys: Any) -> None:
    argv = ["reproduce", "--model", tiny_model_dir, "--out", str(tmp_path), "--prompts", "2",
            "--max-new-tokens", "3", "--sweep", "0,3"]
    assert main(argv) == 0
    runs = sorted(p.stem for p in (tmp_path / "runs").glob("*.json"))
    assert runs == sorted([f"{d}-{m}-p{p}" for d in ("float32", "bfloat16")
                           for m in ("direct", "stable") for p in (1, 2)] + ["sweep-s0", "sweep-s3"])
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
