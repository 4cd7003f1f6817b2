"""Issue 36, the window's cases (docs/RELIABILITY.md "Round 3 (issue 36)" > "Window"): nothing
lost, nothing wrong, no crash on hostile files.

- a crashed session's autosave is kept, and offered back, until its user decides (#3);
- the window's writes never overwrite what the run reads (#5);
- a pipe as the picture is refused before it is opened, on drop and at Run (#11);
- window settings of the wrong type or an absurd size are dropped, and the window starts (#16);
- a picture the run would refuse (BMP, SVG) is refused when dropped, the previous one kept (#25).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from ctxpatch.app.main_window import MainWindow
from ctxpatch.resources import sample_image_path
from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
from PySide6.QtGui import QDropEvent
from PySide6.QtWidgets import QToolButton
from windows import open_window, run_to_end


def _drop(w: MainWindow, path: str) -> None:
    data = QMimeData()
    data.setUrls([QUrl.fromLocalFile(path)])
    event = QDropEvent(QPointF(5, 5), Qt.DropAction.CopyAction, data, Qt.MouseButton.NoButton,
                       Qt.KeyboardModifier.NoModifier)
    w.input_panel.dropEvent(event)


# -- #11 a pipe as the picture --------------------------------------------------------------------
@contextmanager
def unblocked(fifo: Path, after: float = 5.0) -> Iterator[dict[str, bool]]:
    """A guard for code that must not open ``fifo``: if something is still blocked opening it for
    reading ``after`` seconds in, a writer opens it (which lets that open return), so that a
    regression fails the test instead of hanging it. ``blocked`` says whether that happened."""
    seen = {"blocked": False}
    stop = threading.Event()

    def watch() -> None:
        if stop.wait(after):
            return
        try:  # succeeds only while a reader waits in open()
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return
        seen["blocked"] = True
        os.close(fd)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join()


def test_a_pipe_as_the_picture_is_refused_before_it_is_opened(
        qtbot: Any, keep: Any, settings: Any, tiny_model_dir: str, tmp_path: Path) -> None:
    fifo = tmp_path / "picture.png"
    os.mkfifo(fifo)
    w = open_window(keep, settings, tiny_model_dir, query="Hello world!")
    w.input_panel.set_image(sample_image_path())
    with unblocked(fifo) as guard:
        _drop(w, str(fifo))  # (a drop and Image… both come here)
    assert not guard["blocked"], "the drop opened the pipe"
    assert "is not a" in w.last_error and "(a pipe or a device)" in w.last_error
    assert str(fifo) in w.last_error and "\n" not in w.last_error and w.banner.isVisible()
    assert w.input_panel.image_path == sample_image_path()  # the previous picture kept

    # at Run: the picture chosen is a pipe by then (replaced after it was chosen)
    chosen = tmp_path / "chosen.png"
    chosen.write_bytes(Path(sample_image_path()).read_bytes())
    assert w.input_panel.set_image(str(chosen))
    chosen.unlink()
    os.mkfifo(chosen)
    w.banner.hide()
    with unblocked(chosen) as guard:
        assert run_to_end(qtbot, w) == "failed"
    assert not guard["blocked"], "the run opened the pipe"
    assert "(a pipe or a device)" in w.last_error and str(chosen) in w.last_error
    assert w.model is None  # refused before a model loaded for it
    assert w.input_panel.query.toPlainText() == "Hello world!"


# -- #25 what the run refuses, the drop refuses ---------------------------------------------------
def test_a_bmp_or_an_svg_is_refused_when_dropped(qtbot: Any, keep: Any, settings: Any,
                                                  tiny_model_dir: str, tmp_path: Path) -> None:
    from PIL import Image

    bmp = tmp_path / "picture.bmp"
    Image.new("RGB", (8, 8), "red").save(bmp)
    svg = tmp_path / "drawing.svg"
    svg.write_text('<svg xmlns="http://www.w3.org/2000/svg" width="8" height="8">'
                   '<rect width="8" height="8" fill="red"/></svg>')
    w = open_window(keep, settings, tiny_model_dir, query="Hello world!")
    _drop(w, sample_image_path())
    assert w.input_panel.image_path == sample_image_path()
    for path, says in ((bmp, "is a BMP image: use a PNG, JPEG, WebP or GIF file"),
                       (svg, "cannot read")):
        w.banner.hide()
        _drop(w, str(path))
        assert says in w.last_error and str(path) in w.last_error, w.last_error
        assert "\n" not in w.last_error and w.banner.isVisible()
        assert w.input_panel.image_path == sample_image_path()  # the previous picture kept
        # the same line as the run's own reader gives
        from ctxpatch.core.errors import UserError
        from ctxpatch.core.images import read_image

        with pytest.raises(UserError) as refused:
            read_image(path)
        assert w.last_error == refused.value.words("window")


# -- #16 window settings of the wrong type or an absurd size --------------------------------------
DEEP = "[" * 100_000 + "]" * 100_000
BAD_SETTINGS = [  # (case, settings key, value written, the key named in the log)
    ("recent a number", "panels/model", {"recent": 5, "method": "stable"}, "recent"),
    ("recent of a thousand", "panels/model", {"recent": ["m"] * 1000, "method": "stable"},
     "recent"),
    ("recent of numbers", "panels/model", {"recent": [1, 2], "method": "stable"}, "recent"),
    ("10**30 new tokens", "panels/input", {"max_new_tokens": 10**30, "query": "kept"},
     "max_new_tokens"),
    ("new tokens a text", "panels/input", {"max_new_tokens": "many", "query": "kept"},
     "max_new_tokens"),
    ("new tokens 1e400", "panels/input", '{"max_new_tokens": 1e400, "query": "kept"}',
     "max_new_tokens"),
    ("a context that is a number", "panels/input", {"context": 5, "query": "kept"}, "context"),
    ("chat template a text", "panels/input", {"chat_template": "yes", "query": "kept"},
     "chat_template"),
    ("an image that is a list", "panels/input", {"image": [1], "query": "kept"}, "image"),
    ("dtype a number", "panels/model", {"dtype": 5, "method": "stable"}, "dtype"),
    ("layers a list", "panels/model", {"layers": ["x"], "method": "stable"}, "layers"),
    ("a placement of the wrong kind", "panels/model",
     {"device_map": 3, "max_memory": 7, "offload_folder": [], "method": "stable"}, "device_map"),
    ("disabled not a list of kinds", "panels/model", {"disabled": "input", "method": "stable"},
     "disabled"),
    ("model panel not a dict", "panels/model", [1, 2], "panels/model"),
    ("input panel nested 100,000 deep", "panels/input", DEEP, "panels/input"),
    ("geometry a text", "window/geometry", "garbage", "window/geometry"),
    ("a splitter a number", "window/main_splitter", 5, "window/main_splitter"),
]


@pytest.mark.parametrize("case,key,value,named", BAD_SETTINGS, ids=[c[0] for c in BAD_SETTINGS])
def test_bad_window_settings_are_dropped_and_the_window_starts(
        qtbot: Any, keep: Any, settings: Any, caplog: Any, case: str, key: str, value: Any,
        named: str) -> None:
    import json
    import logging

    settings.setValue(key, value if isinstance(value, str | int) else json.dumps(value))
    settings.sync()
    with caplog.at_level(logging.WARNING, logger="ctxpatch"):
        w = MainWindow(settings=settings, autoload=False)  # it used to raise here
    keep(w)
    w.show()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(named in m and "the window settings" in m for m in warned), warned
    assert not w.banner.isVisible()
    model, inputs = w.model_panel.save(), w.input_panel.save()
    assert model["recent"] in ([], ["demo"]) and model["dtype"] == "float32"
    assert model["layers"] == "all" and model["device_map"] == "one device"
    assert 1 <= inputs["max_new_tokens"] <= 4096 and inputs["image"] == ""
    assert isinstance(inputs["context"], str) and inputs["chat_template"] is False
    if isinstance(value, dict) and "method" in value:  # the good values beside a bad one stay
        assert model["method"] == "stable"
    if isinstance(value, dict) and "query" in value or "1e400" in str(value):
        assert inputs["query"] == "kept"
    from ctxpatch.core.spec import from_options

    from_options({**w.model_panel.spec_options(), **w.input_panel.values(), "image": None})


# -- #3 a crashed session is kept, and offered back, until its user decides -----------------------
FIXTURE = Path(__file__).parent / "fixtures" / "session_v0.json"  # a session of one 3-token run


@pytest.fixture
def no_autosaves() -> Iterator[None]:
    """No autosave of any session (nor one moved aside) before and after the test."""
    from ctxpatch.app.session import autosave_path

    def clear() -> None:
        folder = autosave_path().parent
        for p in folder.glob("autosave*") if folder.is_dir() else ():
            p.rmdir() if p.is_dir() else p.unlink()
    clear()
    yield
    clear()


def autosave_files() -> list[Path]:
    """The autosaves there are (a session's that did not close cleanly, each)."""
    from ctxpatch.app.session import autosave_path

    folder = autosave_path().parent
    return sorted(folder.glob("autosave*.json")) if folder.is_dir() else []


def _crashed() -> Path:
    """The autosave a crash left (an hour old)."""
    import time

    from ctxpatch.app.session import autosave_path

    path = autosave_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(FIXTURE.read_bytes())
    os.utime(path, (time.time() - 3600, time.time() - 3600))
    return path


def test_a_screenshot_leaves_a_crashed_session_s_autosave_and_the_settings(
        qtbot: Any, no_autosaves: None, tiny_model_dir: str, tmp_path: Path, monkeypatch: Any,
        capsys: Any) -> None:
    import sys

    from ctxpatch.app.cli import main
    from PySide6.QtCore import QSettings

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    crashed = _crashed()
    user = QSettings("ctxpatch", "ctxpatch")
    user.setValue("panels/input", '{"query": "my own question"}')
    user.sync()
    kept = Path(user.fileName()).read_bytes()
    code = main(["--screenshot", str(tmp_path / "shot.png"), "--model", tiny_model_dir,
                 "--absorb", "all", "--query", "Where?", "--max-new-tokens", "2"])
    assert code == 0, capsys.readouterr().err
    assert autosave_files() == [crashed] and crashed.read_bytes() == FIXTURE.read_bytes()
    assert Path(user.fileName()).read_bytes() == kept  # nor the user's window settings


def test_a_crashed_session_is_offered_back_until_its_user_decides(
        qtbot: Any, keep: Any, settings: Any, no_autosaves: None, tiny_model_dir: str) -> None:

    crashed = _crashed()
    first = open_window(keep, settings, tiny_model_dir, query="Where?", tokens=2)
    first.offer_autosave()
    assert first.notice.isVisible() and "restore its 1 run(s)" in first.notice.label.text()
    assert run_to_end(qtbot, first) == "completed"  # a run before answering the offer
    assert crashed.read_bytes() == FIXTURE.read_bytes()  # it used to be overwritten here
    (own,) = [p for p in autosave_files() if p != crashed]  # the first window's, beside it
    # ... and the first window crashes (it is left open: its files are what a crash leaves)

    second = open_window(keep, settings, tiny_model_dir)
    second.offer_autosave()  # the newest first, then the older one
    assert "restore its 1 run(s)" in second.notice.label.text()
    assert "(then 1 more)" in second.notice.label.text()
    second.close()  # a clean exit without answering: both are kept
    assert sorted(autosave_files()) == sorted([crashed, own])

    third = open_window(keep, settings, tiny_model_dir)
    third.offer_autosave()
    assert "(then 1 more)" in third.notice.label.text()
    third.notice.findChild(QToolButton).click()  # ✕: declined; the older one is offered next
    assert third.notice.isVisible() and "(saved 2026-11-01" in third.notice.label.text()
    assert "then" not in third.notice.label.text()
    third.notice.button.click()  # Restore
    assert len(third.state.steps) == 3 and not third.notice.isVisible()
    assert third.input_panel.context.toPlainText() == "Alice lives in Paris."
    assert run_to_end(qtbot, third) == "completed"
    assert len(third.files.history) == 2  # the restored run and the new one
    third.close()  # decided, both: nothing left to offer
    assert autosave_files() == []
    fourth = open_window(keep, settings, tiny_model_dir)
    fourth.offer_autosave()
    assert not fourth.notice.isVisible()


def test_a_restore_keeps_the_runs_made_before_it(qtbot: Any, keep: Any, settings: Any,
                                                  no_autosaves: None, tiny_model_dir: str) -> None:
    from ctxpatch.app.session import load_session

    crashed = _crashed()
    w = open_window(keep, settings, tiny_model_dir, query="Where?", tokens=2)
    w.offer_autosave()
    assert run_to_end(qtbot, w) == "completed"
    w.notice.button.click()
    assert len(w.files.history) == 2 and len(w.state.steps) == 3  # the restored run shown
    (own,) = autosave_files()  # the restored file is in this window's autosave now
    assert own != crashed and len(load_session(own)["runs"]) == 2


# -- #5 the window's writes never overwrite what the run reads ------------------------------------
def test_the_window_never_writes_over_what_its_run_reads(
        qtbot: Any, keep: Any, settings: Any, tiny_model_dir: str, tmp_path: Path,
        monkeypatch: Any) -> None:
    import shutil

    model = Path(tiny_model_dir)
    files = {p: p.read_bytes() for p in model.rglob("*") if p.is_file()}
    picture = tmp_path / "picture.png"
    picture.write_bytes(Path(sample_image_path()).read_bytes())
    w = open_window(keep, settings, tiny_model_dir, query="Where?", tokens=2)
    assert run_to_end(qtbot, w) == "completed", w.last_error
    w.input_panel.set_image(str(picture))

    def refused(target: Path, write: Any, w: MainWindow = w) -> str:
        w.banner.hide()
        assert not write(str(target))
        assert w.banner.isVisible() and "\n" not in w.last_error
        assert "which this run reads: " in w.last_error, w.last_error
        return w.last_error

    for kind in ("json", "csv", "report"):
        said = refused(model / "config.json", lambda p, k=kind: w.export(k, p))
        assert said.startswith(f"the {'run JSON' if kind == 'json' else kind.upper()}"
                               if kind != "report" else "the report"), said
        refused(picture, lambda p, k=kind: w.export(k, p))
    refused(model / "model.safetensors", w.save_session)
    refused(model / "tokenizer.json", lambda p: w.export("json", p))
    # a report whose plots folder (NAME_plots beside it) would be the model's folder
    plotted = tmp_path / "m_plots"
    shutil.copytree(model, plotted)
    w.model_panel.model.setCurrentText(str(plotted))
    refused(tmp_path / "m.html", lambda p: w.export("report", p))
    assert not (tmp_path / "m.html").exists() and not (plotted / "linf.png").exists()
    # the demo: its cache folder
    demo = tmp_path / "demo-cache"
    demo.mkdir()
    (demo / "config.json").write_text("{}")
    from ctxpatch.core import footprint

    monkeypatch.setattr(footprint, "demo_folder", lambda name="demo": demo)
    w.model_panel.model.setCurrentText("demo")
    refused(demo / "config.json", lambda p: w.export("json", p))
    assert (demo / "config.json").read_text() == "{}"
    assert {p: p.read_bytes() for p in model.rglob("*") if p.is_file()} == files  # untouched
    assert picture.read_bytes() == Path(sample_image_path()).read_bytes()

    # a run reopened from a session, in a window that has loaded nothing: the run's own model
    session = tmp_path / "s.json"
    assert w.save_session(str(session))
    other = open_window(keep, settings, "demo")
    assert other.open_session(str(session)) and other.model is None
    refused(model / "config.json", lambda p: other.export("json", p), other)
    assert other.export("json", str(tmp_path / "run.json"))  # elsewhere it writes


def test_a_screenshot_over_its_model_is_refused(
        qtbot: Any, tiny_model_dir: str, tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    """``ctxpatch --screenshot F --model M``: F is checked against M before Qt starts. (A
    screenshot never opens on the settings' model: it runs the command line's options over the
    documented defaults, issue 35 #5; the window checks against what it opens on all the
    same.)"""
    import json
    import shutil
    import sys

    from ctxpatch.app.cli import main
    from PySide6.QtCore import QSettings

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")  # (a copy: it was overwritten)
    user = QSettings("ctxpatch", "ctxpatch")
    user.setValue("panels/model", json.dumps({"model": str(model), "absorb": "all"}))
    user.setValue("panels/input", json.dumps({"query": "Where?", "max_new_tokens": 2}))
    user.sync()
    target = model / "config.json"
    before = target.read_bytes()
    try:
        code = main(["--screenshot", str(target), "--model", str(model)])
    finally:
        user.remove("panels")
        user.sync()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "would overwrite" in err[-1], (err, target.read_bytes()[:20])
    assert target.read_bytes() == before


def test_a_screenshot_that_cannot_be_saved_leaves_the_file_there_was(
        qtbot: Any, no_autosaves: None, tiny_model_dir: str, tmp_path: Path, monkeypatch: Any,
        capsys: Any) -> None:
    """(found while testing #5: Qt's save truncated the file, then failed on a name that is not
    a picture's)"""
    import sys

    from ctxpatch.app.cli import main

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    code = main(["--screenshot", str(notes), "--model", tiny_model_dir, "--absorb", "all",
                 "--query", "Where?", "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith(f"ctxpatch: error: cannot write {notes}"), err
    assert notes.read_text() == "my notes" and [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
