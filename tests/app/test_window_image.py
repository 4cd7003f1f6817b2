"""An image in the window: chosen, dropped or from the preset; the run on a tiny image+text
model; a bad file or a text-only model is a message and nothing typed is lost."""

from __future__ import annotations

from typing import Any

import pytest
from ctxpatch.app.main_window import MainWindow
from ctxpatch.resources import presets, sample_image_path
from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
from PySide6.QtGui import QDropEvent
from tiny_images import ALL_FAMILIES
from windows import open_window, run_to_end

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
    assert "cannot read" in w.last_error and "notes.png" in w.last_error
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


# -- every image+text family (issue 18) ------------------------------------------------------
EXACT = 1e-6  # of the logit scale, in float64


@pytest.fixture(scope="module", params=ALL_FAMILIES)
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[str, str]:
    from tiny_images import save_any_image_folder

    kind = request.param
    return kind, str(save_any_image_folder(tmp_path_factory.mktemp(f"tiny-{kind}-window"), kind))


def _image_token_texts(w: MainWindow) -> set[str]:
    """The texts of the image segment's own marks (special or added tokens: ``<image>``,
    ``[IMG_BREAK]``, ``<row_1_col_1>``, ...), which the prompt view must not spell out."""
    prompt = w.state.started.prompt
    tok = w.model.handle.tokenizer
    added = set(tok.get_added_vocab())
    plain = {tok.bos_token, tok.eos_token, tok.pad_token}
    ids = {i for seg in prompt.segments if seg.kind == "image" for i in seg.ids}
    return {t for t in tok.convert_ids_to_tokens(sorted(ids)) if t in added and t not in plain}


def test_dropping_a_picture_runs_on_each_family(qtbot: Any, keep: Any, settings: Any,
                                                family_dir: tuple[str, str]) -> None:
    """Drop the sample picture on the window of each family's tiny model and run in float64:
    the patched text-only run equals the run with the picture; the prompt view shows the
    picture's tokens as one labelled block (a thumbnail and its name), never spelled out."""
    kind, model = family_dir
    w = _window(keep, settings, model)
    w.model_panel.dtype.setCurrentText("float64")
    _drop(w, sample_image_path())
    assert w.input_panel.image_path == sample_image_path()
    assert _run(qtbot, w) == "completed", (kind, w.last_error)
    assert w.model.info["dtype"] == "float64"
    steps = w.state.steps
    assert len(steps) == N
    for s in steps:
        assert s.patched.match, (kind, s.step)
        assert s.patched.linf <= EXACT * s.logit_scale, (kind, s.step, s.patched.linf)
    prompt = w.state.started.prompt
    kinds = [seg.kind for seg in prompt.segments]
    assert kinds.count("image") == 1, kinds  # the picture's tokens: one segment
    image = next(seg for seg in prompt.segments if seg.kind == "image")
    config = w.model.handle.model.config
    token = getattr(config, "image_token_id", None)
    token = config.image_token_index if token is None else token
    assert token in image.ids and not [seg for seg in prompt.segments
                                       if seg.kind != "image" and token in seg.ids]
    baseline, patched = w.generation.pane_texts()
    assert baseline.count("[image: sample.png]") == 1, baseline  # one labelled block
    assert "[image:" not in patched
    html = w.generation.baseline.view.toHtml()
    assert html.count("<img") == 1 and "<img" not in w.generation.patched.view.toHtml()
    marks = _image_token_texts(w)
    assert marks, kind  # (each family's picture has marks of its own)
    shown = baseline.split("Hello world!")[0]  # the prompt before the query, as drawn
    assert not [m for m in marks if m in shown], (kind, marks, shown)
