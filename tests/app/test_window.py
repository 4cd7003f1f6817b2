"""The window on a tiny random model saved as a folder: runs, cancel, errors, settings, export."""

from __future__ import annotations

import json
from typing import Any

import pytest
from ctxpatch.app.main_window import MainWindow
from PySide6.QtCore import Qt
from windows import open_window, run_to_end

N = 6  # tokens per run
LAYERS = 4  # tests/tiny.py llama_config


@pytest.fixture
def window(qtbot: Any, keep: Any, settings: Any, tiny_model_dir: str) -> MainWindow:
    return open_window(keep, settings, tiny_model_dir, "Alice lives in Paris.",
                       "Where does Alice live?", N)


_run = run_to_end


def test_a_run_fills_both_panes_and_the_plots(qtbot: Any, window: MainWindow) -> None:
    assert _run(qtbot, window) == "completed", window.last_error
    steps = window.state.steps
    assert len(steps) == N
    baseline, patched = window.generation.pane_texts()
    # each pane shows its prompt, then exactly the generated tokens
    assert baseline.endswith("".join(s.baseline_text for s in steps))
    assert patched.endswith("".join(s.patched.text for s in steps))
    assert "Alice lives in Paris." in baseline and "Alice lives in Paris." not in patched
    assert all(s.patched.match for s in steps)  # float32 on a tiny model: exact
    assert max(s.patched.linf for s in steps) < 1e-3 < max(s.control.linf for s in steps)
    counts = window.plots.point_counts()
    assert set(counts.values()) == {N}, counts
    assert window.patches.heatmap_shape() == (LAYERS, N)
    assert "Done" in window.status_label.text()
    rows = window.controls.rows()  # the controllability tab: one row per patched layer
    assert [r[0] for r in rows] == [str(i) for i in range(LAYERS)]
    assert all(r[-1] == "all conditions held" for r in rows), rows
    assert rows[0][1] == "attention" and "mlp.down_proj.weight" in rows[0][3]
    assert window.model is not None and window.model.info["family"].startswith("Llama")


def test_selecting_a_token_shows_both_top_k_lists(qtbot: Any, window: MainWindow) -> None:
    assert _run(qtbot, window) == "completed"
    window.state.select(2)
    html = window.generation.details.toPlainText()
    s = window.state.steps[2]
    assert "Token 3" in html and s.baseline_top_k.texts[0].strip() in html
    assert window.plots.cursors["linf"].value() == 3
    window.patches.scale.setCurrentIndex(1)
    assert window.state.relative


def test_cancel_stops_before_the_next_token(qtbot: Any, window: MainWindow) -> None:
    window.input_panel.max_tokens.setValue(30)

    def on_worker(worker: Any) -> None:
        worker.token_done.connect(lambda _: worker.requestInterruption(),
                                  Qt.ConnectionType.DirectConnection)

    with qtbot.waitSignal(window.model_ready, timeout=60_000):
        window.load_model()
    qtbot.waitUntil(lambda: not window.busy)
    window.worker_created.connect(on_worker)
    assert _run(qtbot, window) == "cancelled"
    assert len(window.state.steps) == 1
    assert "Cancelled" in window.status_label.text()


def test_bad_model_path_shows_an_error_and_a_second_run_works(
        qtbot: Any, window: MainWindow, tiny_model_dir: str, tmp_path: Any) -> None:
    missing = str(tmp_path / "no-such-model")
    window.model_panel.model.setCurrentText(missing)
    assert _run(qtbot, window) == "failed"
    assert window.banner.isVisible()
    assert "no-such-model" in window.last_error
    assert "\n" not in window.last_error and "Traceback" not in window.last_error
    assert window.input_panel.run.isEnabled()
    window.model_panel.model.setCurrentText(tiny_model_dir)
    assert _run(qtbot, window) == "completed"
    assert len(window.state.steps) == N


def test_bad_input_is_one_line_and_keeps_the_text(qtbot: Any, window: MainWindow) -> None:
    window.input_panel.query.setPlainText("")
    assert _run(qtbot, window) == "failed"
    assert "query is empty" in window.last_error
    assert window.input_panel.context.toPlainText() == "Alice lives in Paris."
    window.model_panel.layers.setText("7:")
    window.input_panel.query.setPlainText("Where?")
    assert _run(qtbot, window) == "failed"
    assert "out of range" in window.last_error


def test_settings_persist(qtbot: Any, keep: Any, window: MainWindow, settings: Any) -> None:
    window.input_panel.context.setPlainText("Remember me.\nTwo lines.")
    window.model_panel.method.setCurrentText("stable")
    window.close()
    again = MainWindow(settings=settings, autoload=False)
    keep(again)
    assert again.input_panel.context.toPlainText() == "Remember me.\nTwo lines."
    assert again.model_panel.method.currentText() == "stable"
    assert again.input_panel.max_tokens.value() == N


def test_export_json_and_csv(qtbot: Any, window: MainWindow, tmp_path: Any) -> None:
    assert not window.export("json", str(tmp_path / "early.json"))  # nothing to export yet
    assert "nothing to export" in window.last_error
    assert _run(qtbot, window) == "completed"
    assert window.export("json", str(tmp_path / "run.json"))
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["schema_version"] == 1 and len(record["steps"]) == N
    assert record["settings"]["context"] == "Alice lives in Paris."
    assert window.export("csv", str(tmp_path / "run.csv"))
    assert len((tmp_path / "run.csv").read_text().strip().splitlines()) == N + 1


def test_frozen_output_is_an_ablation_in_the_window(qtbot: Any, window: MainWindow) -> None:
    window.model_panel.patches.setCurrentIndex(2)  # no output patches
    assert _run(qtbot, window) == "completed"
    assert window.state.started.settings["disabled"] == ["output"]
    assert max(s.patched.linf for s in window.state.steps) > 1e-3  # the shift is not absorbed
    assert window.controls.rows()[0][3] == "—"


def test_presets_fill_the_inputs(window: MainWindow) -> None:
    window.input_panel._on_preset(1)
    assert window.input_panel.query.toPlainText().startswith("Write a single-sentence weather")
    assert window.model_panel.absorb.currentText() == "all"


def test_the_window_opens_without_importing_torch(tmp_path: Any) -> None:
    """Start-up stays fast: torch and transformers load with the model, in the background."""
    import os
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from PySide6.QtCore import QSettings\n"
        "from PySide6.QtWidgets import QApplication\n"
        "from ctxpatch.app.main_window import MainWindow\n"
        "app = QApplication([])\n"
        f"w = MainWindow(settings=QSettings({str(tmp_path / 's.ini')!r}, "
        "QSettings.Format.IniFormat), autoload=False)\n"
        "w.show(); app.processEvents()\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules), flush=True)\n"
        "import os; os._exit(0)\n"
    )
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]


def test_pickled_weights_need_the_checkbox(qtbot: Any, window: MainWindow, tmp_path: Any) -> None:
    import shutil

    import torch
    from safetensors.torch import load_file

    folder = tmp_path / "pickled"
    shutil.copytree(window.model_panel.spec(), folder)
    torch.save(load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    window.model_panel.model.setCurrentText(str(folder))
    assert _run(qtbot, window) == "failed" and "only pickled weights" in window.last_error
    window.model_panel.pickle.setChecked(True)
    assert _run(qtbot, window) == "completed"


def test_a_too_long_context_is_one_line_in_the_window(qtbot: Any, window: MainWindow) -> None:
    window.input_panel.context.setPlainText("word " * 600)  # the tiny model has 512 positions
    assert _run(qtbot, window) == "failed"
    assert window.last_error.startswith("input too long") and window.banner.isVisible()
    assert window.input_panel.context.toPlainText() == "word " * 600  # nothing lost
    window.input_panel.context.setPlainText("Alice lives in Paris.")
    assert _run(qtbot, window) == "completed"


def test_placement_offloads_to_disk_and_stays_exact(qtbot: Any, window: MainWindow,
                                                     tmp_path: Any) -> None:
    panel = window.model_panel
    panel.placement.setCurrentText("auto")
    assert not panel.device.isEnabled() and panel.max_memory.isEnabled()
    panel.max_memory.setText("cpu=12parsecs")
    assert _run(qtbot, window) == "failed"
    assert "malformed 'max memory'" in window.last_error  # the window names its control
    panel.max_memory.setText("cpu=120KB")
    panel.offload_folder.setText(str(tmp_path / "offload"))
    assert _run(qtbot, window) == "completed", window.last_error
    assert "disk" in panel.loaded_label.text()
    assert all(s.patched.match for s in window.state.steps)
    assert window.model is not None and window.model.key[3][0] == "auto"
