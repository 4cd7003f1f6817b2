"""Issue 35, the first fifteen minutes (round two): a fresh window names the preset it opened on
and runs a prompt given on the command line over the documented defaults (#5); the details box
says what it is for before any hover, every run; an overlaid run of another prompt says so; the
plots' cursor names its token; the patch explorer's readout forgets the previous parameter's
cell (#7); the model box names what is loading and what a first use costs (#4)."""

from __future__ import annotations

from typing import Any

from windows import run_to_end

MARS = "Mars robot (paper, prompt 1)"


def _fresh(keep: Any, settings: Any, model: str, **options: Any) -> Any:
    from ctxpatch.app.main_window import MainWindow

    w = MainWindow(model=model, settings=settings, autoload=False, options=options or None)
    keep(w)
    w.show()
    return w


def test_a_fresh_window_names_its_preset_until_the_prompt_is_edited(
        keep: Any, settings: Any, tiny_model_dir: str) -> None:
    w = _fresh(keep, settings, tiny_model_dir)
    assert w.input_panel.preset.currentText() == MARS
    assert w.model_panel.absorb.currentText() == "all"  # (the preset's, said in --help)
    w.input_panel.query.setPlainText("Something else")
    assert w.input_panel.preset.currentText() == "Presets…"


def test_a_prompt_given_on_the_command_line_runs_over_the_documented_defaults(
        keep: Any, settings: Any, tiny_model_dir: str) -> None:
    """``ctxpatch --context A --query B`` on a fresh profile: absorb is the command line's
    documented default (context), not the Mars preset's (all)."""
    from ctxpatch.core.spec import RunSpec

    w = _fresh(keep, settings, tiny_model_dir, context="Alice lives in Paris.", query="Where?")
    assert w.model_panel.absorb.currentText() == RunSpec().absorb == "context"
    assert w.input_panel.preset.currentText() == "Presets…"


def test_details_hint_every_run_and_the_readout_follows_the_parameter(
        qtbot: Any, keep: Any, settings: Any, tiny_model_dir: str) -> None:
    from ctxpatch.app.panels.patch_panel import HOVER_HINT

    w = _fresh(keep, settings, tiny_model_dir)
    assert "Hover or click a generated token" in w.generation.details.toPlainText()
    w.input_panel.max_tokens.setValue(3)
    assert run_to_end(qtbot, w, timeout=120_000) == "completed"
    sizes = w.generation.splitter.sizes()  # (sized at the first token: a hover moves nothing)
    w.state.select(1)
    assert "Token 2" in w.generation.details.toPlainText()
    assert w.generation.splitter.sizes() == sizes
    w.state.reset(w.state.started)  # (what the next run does first: the hint again)
    assert "Hover or click a generated token" in w.generation.details.toPlainText()
    w.input_panel.query.setPlainText("Another question?")
    assert run_to_end(qtbot, w, timeout=120_000) == "completed"
    # the overlay says that the first run had another prompt; the cursor names its token
    w.plots.overlay.setChecked(True)
    assert "#1 " in w.plots.comparison.text() and "other prompt" in w.plots.comparison.text()
    w.state.select(1)
    token = w.state.steps[1].baseline_text.replace("\n", "↵")
    assert w.plots.cursor_label().startswith(f" 2: {token!r}"), w.plots.cursor_label()
    panel = w.patches
    panel.readout.setText(panel.cell_text(0, 0))
    first = panel.param.itemText(0)
    assert first in panel.readout.text()
    panel.param.setCurrentIndex(1)
    assert panel.readout.text() == HOVER_HINT


def test_the_model_box_names_what_is_loading_and_the_first_use(
        keep: Any, settings: Any, tiny_model_dir: str, tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("CTXPATCH_CACHE", str(tmp_path))  # (an empty cache: a first use)
    w = _fresh(keep, settings, tiny_model_dir)
    started: list[str] = []
    monkeypatch.setattr(w, "_start", lambda job, kind, message: started.append(message))
    w.model_panel.model.setCurrentText("")  # (the box's placeholder: the demo loads)
    w.load_model()
    assert started and w.model_panel.model.currentText() == "demo"
    label = w.model_panel.loaded_label
    assert label.text() == "loading demo… (first use: 1.1 GB, about 2 minutes)"
    assert "converting it once" in label.toolTip() and str(tmp_path) in label.toolTip()
