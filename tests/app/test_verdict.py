"""Issue 35 #3: one verdict per run, in the same words in the window's Controllability tab, the
report and ``ctxpatch compare``. On a tiny float64 Gemma 3 whose post-FF scale ``m = 1 + w`` has
an exact zero and whose down rows make ``N(h)_0`` tiny, method direct's scale patches are
unbounded (as on the demo): every condition held, so all three say so, and each reports the
unbounded patches as conditioning (the tab used to count them as a failed condition)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import gemma3_config, tiny_loaded
from windows import open_window, run_to_end

HELD = "conditions: held at every patched layer and step"
CONTEXT, QUERY, TOKENS = "The quick brown fox jumps over the lazy dog.", "Hello world!", 3


@pytest.fixture(scope="module")
def unbounded_gemma(tmp_path_factory: pytest.TempPathFactory) -> str:
    from ctxpatch.core.loading import quiet_transformers

    loaded = tiny_loaded(gemma3_config(layers=4), dtype=torch.float32)
    with torch.no_grad():
        for layer in loaded.model.model.layers:
            layer.mlp.down_proj.weight[0] *= 1e-9  # N(h)_0 tiny
            layer.post_feedforward_layernorm.weight[1] = -1.0  # m_1 = 1 + w = 0
    folder = tmp_path_factory.mktemp("unbounded-gemma")
    with quiet_transformers():
        loaded.model.save_pretrained(folder)
        loaded.tokenizer.save_pretrained(folder)
    return str(folder)


def _compare(folder: str, report: Path, capsys: Any) -> list[str]:
    from ctxpatch.app.cli import main

    code = main(["compare", "--model", folder, "--dtype", "float64", "--method", "direct",
                 "--context", CONTEXT, "--query", QUERY, "--max-new-tokens", str(TOKENS),
                 "--report", str(report)])
    err = capsys.readouterr().err.splitlines()
    assert code == 0, err[-5:]
    return err


def test_tab_report_and_command_line_give_one_verdict(
        qtbot: Any, keep: Any, settings: Any, unbounded_gemma: str, tmp_path: Path,
        capsys: Any) -> None:
    report = tmp_path / "r.html"
    err = _compare(unbounded_gemma, report, capsys)
    verdict = [line for line in err if line.startswith("conditions:")]
    conditioning = [line for line in err if line.startswith("conditioning:")]
    assert verdict == [HELD], err
    assert len(conditioning) == 1 and "unbounded (over 100x)" in conditioning[0], err

    html = report.read_text(encoding="utf-8")
    assert f"<p>{HELD}.<br>" in html
    assert "unbounded (over 100x)" in html and "Faults over all" not in html

    w = open_window(keep, settings, unbounded_gemma, CONTEXT, QUERY, tokens=TOKENS)
    w.model_panel.dtype.setCurrentText("float64")
    w.model_panel.method.setCurrentText("direct")
    assert run_to_end(qtbot, w) == "completed", w.last_error
    tab = re.sub(r"<[^>]+>", " ", w.controls.summary.text())
    assert f"After {TOKENS} token(s): {HELD}." in tab, tab
    assert "failed" not in tab and "unbounded (over 100x)" in tab, tab
    cells = [r[-1] for r in w.controls.rows()]
    assert any("unbounded (conditioning)" in c for c in cells), cells
    assert all(c.startswith("all conditions held") for c in cells), cells
    # every cell's whole text is in its tooltip, with what its symbols mean
    item = w.controls.table.item(0, w.controls.table.columnCount() - 1)
    assert item.text() in item.toolTip() and "dm = dv / N(h)" in item.toolTip()


def test_a_failed_condition_is_the_same_words_everywhere(
        qtbot: Any, keep: Any, settings: Any, tmp_path: Path, capsys: Any) -> None:
    """The negative control: a zero row of the last down matrix makes N(h)_j = 0 (divided by
    one) at every token; the command line, the report and the tab all say it failed there."""
    from ctxpatch.core.loading import quiet_transformers

    loaded = tiny_loaded(gemma3_config(layers=4), dtype=torch.float32)
    with torch.no_grad():
        loaded.model.model.layers[3].mlp.down_proj.weight[5] = 0.0
    folder = tmp_path / "m"
    with quiet_transformers():
        loaded.model.save_pretrained(folder)
        loaded.tokenizer.save_pretrained(folder)
    report = tmp_path / "r.html"
    err = _compare(str(folder), report, capsys)
    verdict = [line for line in err if line.startswith("conditions:")]
    assert verdict == [f"conditions: failed in 1 layer(s): layer 3: N(h)_j = 0 at {TOKENS} "
                       "token(s) (divided by one)"], err
    assert f"<p>{verdict[0]}.<br>" in report.read_text(encoding="utf-8")
    w = open_window(keep, settings, str(folder), CONTEXT, QUERY, tokens=TOKENS)
    w.model_panel.dtype.setCurrentText("float64")
    w.model_panel.method.setCurrentText("direct")
    assert run_to_end(qtbot, w) == "completed", w.last_error
    assert f"After {TOKENS} token(s): {verdict[0]}." in w.controls.summary.text()
