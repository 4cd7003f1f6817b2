"""``ctxpatch --screenshot FILE [compare options]``: run in the window, save a PNG, exit."""

from __future__ import annotations

import sys
from typing import Any

import pytest
from ctxpatch.app.cli import main
from PySide6.QtGui import QImage


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


def test_screenshot_to_an_unwritable_place_fails_before_any_work(tmp_path: Any,
                                                                 capsys: Any) -> None:
    code = main(["--screenshot", str(tmp_path / "no" / "shot.png"), "--query", "q"])
    assert code == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("option", [["--json", "run.json"], ["--no-control"], ["--verify"],
                                    ["--keep-bos"]])
def test_compare_only_options_are_refused_by_the_window(option: list[str], capsys: Any) -> None:
    """Not silently dropped: one line naming the option and where it works."""
    code = main([*option, "--query", "q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f"ctxpatch: error: {option[0]} is for 'ctxpatch compare'")


def test_trust_flags_on_the_command_line_tick_the_boxes_for_this_start(
        qtbot: Any, keep: Any, settings: Any) -> None:
    from ctxpatch.app.main_window import MainWindow

    w = MainWindow(settings=settings, autoload=False,
                   options={"trust_remote_code": True, "allow_pickle": True})
    keep(w)
    assert w.model_panel.trust_flags() == {"trust_remote_code": True, "allow_pickle": True}
    assert "trust_remote_code" not in w.model_panel.save()  # never remembered


def test_a_screenshot_format_qt_cannot_write_fails_before_the_run(tmp_path: Any, capsys: Any,
                                                                  monkeypatch: Any) -> None:
    """Issue 36 #22: `--screenshot shot.xyz` failed only after the whole run, with no reason."""
    from ctxpatch.app import gui

    monkeypatch.setattr(gui, "_screenshot", lambda app, window, path: 0)  # (the run, the save)
    code = main(["--screenshot", str(tmp_path / "shot.xyz"), "--query", "q"])
    assert code == 2
    assert "Qt cannot save a picture as XYZ (name it .png)" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_screenshot_runs_the_documented_defaults_not_the_last_session(
        qtbot: Any, settings: Any) -> None:
    """Issue 35 #5: `ctxpatch --screenshot F --model demo` ran method stable, left by the last
    window session, where its help says "(default direct)"."""
    import json

    from ctxpatch.app.main_window import MainWindow
    from ctxpatch.core.spec import RunSpec

    settings.setValue("panels/model", json.dumps({"method": "stable", "layers": "2:"}))
    settings.sync()
    kept = MainWindow(settings=settings, autoload=False)  # a window of the user's: as left
    assert kept.model_panel.method.currentText() == "stable"
    kept.close()
    shot = MainWindow(settings=settings, autoload=False, persistent=False,
                      options={"max_new_tokens": 3})
    options = shot.model_panel.spec_options()
    assert options["method"] == RunSpec().method == "direct" and options["layers"] == "all"
    shot.close()


def test_the_analyses_given_on_the_command_line_tick_the_windows_boxes(
        tmp_path: Any, capsys: Any, monkeypatch: Any) -> None:
    """``ctxpatch --analyze lens`` opens the window with Lens ticked (and only it); an unknown
    analysis is one line, exit 2, before Qt starts."""
    from ctxpatch.app import gui

    seen: list[Any] = []
    monkeypatch.setattr(gui, "_screenshot", lambda app, window, path: seen.append(window) or 0)
    code = main(["--screenshot", str(tmp_path / "shot.png"), "--query", "q", "--analyze",
                 "lens"])
    assert code == 0, capsys.readouterr().err
    boxes = seen[0].model_panel.analyses
    assert boxes["lens"].isChecked() and not boxes["geometry"].isChecked()
    assert seen[0].model_panel.spec_options()["analyze"] == ["lens"]
    assert main(["--screenshot", str(tmp_path / "s2.png"), "--query", "q", "--analyze",
                 "lens,nope"]) == 2
    assert "unknown 'nope'" in capsys.readouterr().err and len(seen) == 1
