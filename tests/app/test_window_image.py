"""An image in the window: chosen, dropped or from the preset; the run on a tiny image+text
model; a bad file or a text-only model is a message and nothing typed is lost."""

from __future__ import annotations

from typing import Any

import pytest
from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
from PySide6.QtGui import QDropEvent
from windows import open_window, run_to_end

from app.main_window import MainWindow
from resources import presets, sample_image_path

N = 4


@pytest.fixture(scope="module")
def image_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tiny import save_tiny_image_folder

    return str(save_tiny_image_folder(tmp_path_factory.mktemp("tiny-gemma3-image"), "gemma3"))


def _window(keep: Any, settings: Any, model: str) -> MainWindow:
    return open_window(keep, settings, model, query="Hello world!", tokens=N)


_run = run_to_end


def _drop(w: MainWindow, path: str) -> None:
    data = QMimeData()
    data.setUrls([QUrl.fromLocalFile(path)])
    panel = w.input_panel
    event = QDropEvent(QPointF(5, 5), Qt.DropAction.CopyAction, data, Qt.MouseButton.NoButton,
                       Qt.KeyboardModifier.NoModifier)
    panel.dropEvent(event)


def test_the_sample_preset_runs_on_an_image_text_model(
        qtbot: Any, keep: Any, settings: Any, image_model_dir: str, tmp_path: Any) -> None:
    w = _window(keep, settings, image_model_dir)
    index = next(i for i, p in enumerate(presets()) if p.get("image") == "sample")
    w.input_panel._on_preset(index + 1)
    assert w.input_panel.image_path == sample_image_path()
    assert w.input_panel.image_thumb.pixmap() is not None
    assert w.input_panel.context.toPlainText() == ""
    w.input_panel.max_tokens.setValue(N)
    assert _run(qtbot, w) == "completed", w.last_error
    steps = w.state.steps
    assert len(steps) == N and all(s.patched.match for s in steps)
    record = w.current_record()
    assert record["prompt"]["image"]["path"] == sample_image_path()
    assert record["settings"]["image"] == sample_image_path()
    assert w.export("report", str(tmp_path / "r.html"))
    assert "Context image: sample.png" in (tmp_path / "r.html").read_text()
    assert all(not hasattr(v, "dtype") for v in vars(w.state.started.prompt).values())
    # the with-context pane shows the picture and names it; the patched pane has neither
    baseline, patched = w.generation.pane_texts()
    assert "[image: sample.png]" in baseline and "[image:" not in patched
    assert "<img" in w.generation.baseline.view.toHtml()
    assert "<img" not in w.generation.patched.view.toHtml()


def test_dropping_files(qtbot: Any, keep: Any, settings: Any, image_model_dir: str,
                        tmp_path: Any) -> None:
    w = _window(keep, settings, image_model_dir)
    _drop(w, sample_image_path())
    assert w.input_panel.image_path == sample_image_path()
    notes = tmp_path / "notes.png"
    notes.write_text("not a picture")
    _drop(w, str(notes))
    assert "cannot use" in w.last_error and "notes.png" in w.last_error
    assert w.input_panel.image_path == sample_image_path()  # the good one is kept
    w.input_panel.image_clear.click()
    assert w.input_panel.image_path == ""


def test_an_image_for_a_text_only_model_is_a_message(qtbot: Any, keep: Any, settings: Any,
                                                      tiny_model_dir: str) -> None:
    w = _window(keep, settings, tiny_model_dir)
    w.input_panel.context.setPlainText("Alice lives in Paris.")
    w.input_panel.set_image(sample_image_path())
    assert _run(qtbot, w) == "failed"
    assert "reads text only" in w.last_error
    assert w.input_panel.context.toPlainText() == "Alice lives in Paris."
    assert w.input_panel.image_path == sample_image_path()
    assert "reads text only" in w.input_panel.image_label.text() or w.input_panel.image_path
    w.input_panel.set_image("")
    assert _run(qtbot, w) == "completed", w.last_error


def test_an_image_run_reopens_from_a_session(qtbot: Any, keep: Any, settings: Any,
                                             image_model_dir: str, tmp_path: Any) -> None:
    w = _window(keep, settings, image_model_dir)
    w.input_panel.set_image(sample_image_path())
    assert _run(qtbot, w) == "completed", w.last_error
    path = str(tmp_path / "session.json")
    assert w.save_session(path)
    other = _window(keep, settings, image_model_dir)
    other.input_panel.set_image("")
    assert other.open_session(path)
    assert other.input_panel.image_path == sample_image_path()  # the input comes back
    assert len(other.state.steps) == N  # the run, reopened without recomputing
    recorded = w.current_record()["prompt"]["image"]["sha256"]
    assert other.state.started.prompt.image.sha256 == recorded
    assert "<img" in other.generation.baseline.view.toHtml()
