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
