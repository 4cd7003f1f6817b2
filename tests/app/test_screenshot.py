"""``ctxpatch --screenshot FILE [compare options]``: run in the window, save a PNG, exit."""

from __future__ import annotations

import sys
from typing import Any

from PySide6.QtGui import QImage

from app.cli import main


def test_screenshot_runs_to_the_end_and_saves_the_window(
        qtbot: Any, tiny_model_dir: str, tmp_path: Any, monkeypatch: Any, capsys: Any) -> None:
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    png = tmp_path / "shot.png"
    code = main(["--screenshot", str(png), "--model", tiny_model_dir, "--context", "Alice lives "
                 "in Paris.", "--query", "Where does Alice live?", "--max-new-tokens", "3"])
    assert code == 0, capsys.readouterr().err
    image = QImage(str(png))
    assert not image.isNull() and image.width() > 800 and image.height() > 500


def test_screenshot_of_a_failing_run_exits_2_with_one_line(
        qtbot: Any, tmp_path: Any, monkeypatch: Any, capsys: Any) -> None:
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    png = tmp_path / "shot.png"
    code = main(["--screenshot", str(png), "--model", str(tmp_path / "missing"),
                 "--context", "c", "--query", "q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("ctxpatch: error:") and "missing" in err[-1]
    assert not png.exists()


def test_screenshot_to_an_unwritable_place_fails_before_any_work(tmp_path: Any, capsys: Any) -> None:
    code = main(["--screenshot", str(tmp_path / "no" / "shot.png"), "--query", "q"])
    assert code == 2
    assert "does not exist" in capsys.readouterr().err
