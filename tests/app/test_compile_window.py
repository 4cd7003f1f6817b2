"""Run > Compile the context… (issue 33, ANALYSIS.md A4) on a tiny float64 Llama: the dialog's
table is the core's `evaluate()` computed apart, cancel stops and leaves the window usable,
the report and the session carry the numbers, and every bad input is one line that starts
nothing and writes nothing."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from windows import open_window

CONTEXT = "Zorblat is a small village in the mountains."
QUERY = "Zorblat is famous for"
HELD = ["The quick brown fox", "Where is Zorblat?"]


def _window(qtbot: Any, keep: Any, settings: Any, model: str) -> Any:
    w = open_window(keep, settings, model, CONTEXT, QUERY)
    w.model_panel.dtype.setCurrentText("float64")
    with qtbot.waitSignal(w.model_ready, timeout=60_000):
        w.load_model()
    qtbot.waitUntil(lambda: not w.busy, timeout=30_000)
    return w


def _compile(qtbot: Any, w: Any, d: Any, timeout: int = 300_000) -> None:
    assert d.compile(), w.last_error
    qtbot.waitUntil(lambda: not w.busy, timeout=timeout)


def _dialog(w: Any, rank: int = 4, sweep: str = "2,4", tokens: int = 2) -> Any:
    d = w.open_compile()
    d.held_out.setPlainText("\n".join(HELD))
    d.rank.setValue(rank)
    d.ridge.setText("1e-3")
    d.sweep.setText(sweep)
    d.tokens.setValue(tokens)
    return d


def test_the_table_is_the_cores_evaluation_and_the_session_and_report_keep_it(
        qtbot: Any, keep: Any, settings: Any, tiny_model_dir: str, tmp_path: Path) -> None:
    from ctxpatch.app.compile_view import CURVE, number
    from ctxpatch.core.compile import compile_context

    w = _window(qtbot, keep, settings, tiny_model_dir)
    d = _dialog(w)
    assert d.queries.toPlainText() == QUERY  # the window's query by default
    _compile(qtbot, w, d)
    assert d.status.text().startswith("Compiled"), (d.status.text(), w.last_error)

    # the core, apart, on the same model and inputs
    expected = compile_context(w.model.handle, CONTEXT, [QUERY], HELD, rank=4, ridge=1e-3,
                               max_new_tokens=2)
    result = expected.evaluate()
    rows = [*result["train"], *result["held_out"]]
    table = d.table_values()
    assert [r["query"] for r in table] == [QUERY, *HELD]
    assert [r["set"] for r in table] == ["train", "held-out", "held-out"]
    for got, want in zip(table, rows, strict=True):
        assert got["match"] == f"{want['match']}/{want['tokens']}"
        for key in ("retained", "linf", "tvd"):
            assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), key
        assert got["answer"] == want["answer"]
        assert got["full_context_answer"] == want["full_context_answer"]
    assert rows[0]["retained"] > 0.2  # the fit moves the training query toward the context

    def flat(points: Any) -> list[Any]:
        return [p["pooled"][s][k] for p in points for s in ("train", "held_out")
                for k in ("retained", "match")]

    curve = expected.evaluate(ranks=[2, 4])
    assert [p["rank"] for p in d.record["curve"]] == [2, 4]
    assert flat(d.record["curve"]) == pytest.approx(flat(curve), rel=1e-9)
    assert d.figure.graphics.isVisible()
    assert d.export_button.isEnabled()

    # the adapter: written on the worker into a new folder, named in the record
    assert d.export_adapter(str(tmp_path / "lora"))
    qtbot.waitUntil(lambda: not w.busy, timeout=60_000)
    assert (tmp_path / "lora" / "adapter_config.json").is_file(), w.last_error
    assert d.record["adapter"] == str(tmp_path / "lora")

    # the window's report carries the compile section and its numbers, the curve as PNG+SVG
    report = tmp_path / "r.html"
    assert w.export("report", str(report)), w.last_error
    text = report.read_text()
    assert "Compiled context" in text
    for r in rows:
        assert f"<td>{number(r['retained'])}</td>" in text
        assert f"<td>{number(r['linf'])}</td>" in text
    assert {f"{CURVE}.png", f"{CURVE}.svg"} <= {p.name for p in (tmp_path / "r_plots").iterdir()}

    # the session keeps the result; reopened, the dialog shows it without recomputing
    session = tmp_path / "s.json"
    assert w.save_session(str(session))
    assert json.loads(session.read_text())["compile"]["train"][0]["retained"] == pytest.approx(
        rows[0]["retained"])
    d.show_record(None)
    assert d.table.rowCount() == 0 and w.files.compiled is None
    created: list[Any] = []
    w.worker_created.connect(created.append)
    assert w.open_session(str(session))
    w.open_compile()
    assert created == []  # nothing recomputed
    again = d.table_values()
    assert again == table
    assert not d.export_button.isEnabled()  # a reopened result keeps no weights
    assert not d.export_adapter(str(tmp_path / "lora2"))
    assert "Compile first" in w.last_error and not (tmp_path / "lora2").exists()


def test_cancel_stops_and_leaves_the_window_usable(qtbot: Any, keep: Any, settings: Any,
                                                   tiny_model_dir: str) -> None:
    w = _window(qtbot, keep, settings, tiny_model_dir)
    d = _dialog(w, sweep="")
    assert d.compile()
    assert w.job_kind == "compile" and d.cancel_button.isEnabled()
    d.reject()  # Esc in the dialog: cancels its job, keeps it open
    qtbot.waitUntil(lambda: not w.busy, timeout=120_000)
    assert d.status.text() == "Compile cancelled; the window is as it was"
    assert d.table.rowCount() == 0 and w.files.compiled is None
    assert d.compile_button.isEnabled() and not d.cancel_button.isEnabled()
    _compile(qtbot, w, d)  # and it compiles afterwards
    assert d.table.rowCount() == 3 and not d.figure.graphics.isVisible()


def test_bad_input_is_one_line_and_starts_nothing(qtbot: Any, keep: Any, settings: Any,
                                                  tiny_model_dir: str, tmp_path: Path) -> None:
    w = _window(qtbot, keep, settings, tiny_model_dir)
    d = _dialog(w, sweep="")
    created: list[Any] = []
    w.worker_created.connect(created.append)

    def refused(words: str) -> None:
        assert not d.compile()
        assert words in w.last_error and "\n" not in w.last_error, w.last_error
        assert d.status.text() == w.last_error and w.banner.isVisibleTo(w)
        assert created == []

    d.held_out.setPlainText("  \n")
    refused("Held-out queries: give at least one held-out query")
    d.held_out.setPlainText(HELD[0])
    for ridge, words in (("-1", "Ridge must be a finite number >= 0"),
                         ("nan", "Ridge must be a finite number >= 0"),
                         ("inf", "Ridge must be a finite number >= 0"),
                         ("abc", "Ridge: 'abc' is not a number")):
        d.ridge.setText(ridge)
        refused(words)
    d.ridge.setText("0")
    d.sweep.setText("2,x")
    refused("Sweep ranks: 'x' is not a rank")
    d.sweep.setText("0")
    refused("Sweep ranks must be at least 1, not 0")
    d.sweep.setText("")
    d.queries.setPlainText("")
    refused("Training queries: give at least one training query")
    d.queries.setPlainText(QUERY)
    w.input_panel.context.setPlainText("   ")
    refused("the context is empty")
    w.input_panel.context.setPlainText(CONTEXT)
    assert d.rank.minimum() == 1  # rank 0 cannot be typed

    # above the matrices (the tiny Llama's are 32 x 64): refused on the worker before any fit
    d.rank.setValue(33)
    assert d.compile()
    qtbot.waitUntil(lambda: not w.busy, timeout=60_000)
    assert re.search(r"Rank 33 is above the size of this model's matrices .* choose 1 to 32",
                     w.last_error), w.last_error
    assert "\n" not in w.last_error and d.table.rowCount() == 0
    assert d.status.text().startswith("Compile failed: Rank 33")

    # Export adapter: nothing compiled yet, a folder that is not empty, the model's folder
    assert not d.export_adapter(str(tmp_path / "a"))
    assert "Compile first" in w.last_error
    d.rank.setValue(2)
    _compile(qtbot, w, d)
    full = tmp_path / "full"
    full.mkdir()
    (full / "mine.txt").write_text("mine")
    created.clear()
    for folder, words in ((full, "is not empty"), (Path(tiny_model_dir), "which this run reads"),
                          (tmp_path / "mine.txt", "is a file")):
        if folder.name == "mine.txt":
            folder.write_text("mine")
        assert not d.export_adapter(str(folder))
        assert words in w.last_error and "\n" not in w.last_error, w.last_error
        assert created == []
    assert sorted(p.name for p in full.iterdir()) == ["mine.txt"]
    (tmp_path / "empty").mkdir()  # an empty folder (made in the chooser) is fine
    assert d.export_adapter(str(tmp_path / "empty"))
    qtbot.waitUntil(lambda: not w.busy, timeout=60_000)
    assert (tmp_path / "empty" / "adapter_model.safetensors").is_file(), w.last_error


def test_a_session_without_compile_results_still_opens(qtbot: Any, keep: Any, settings: Any,
                                                        tiny_model_dir: str,
                                                        tmp_path: Path) -> None:
    from ctxpatch.app.session import load_session

    w = open_window(keep, settings, tiny_model_dir, CONTEXT, QUERY)
    path = tmp_path / "old.json"
    assert w.save_session(str(path))
    data = json.loads(path.read_text())
    assert "compile" not in data  # (written only when there is one)
    w.files.compiled = {"rank": 1}
    assert w.open_session(str(path)) and w.files.compiled is None
    # a damaged compile result is the session's one-line problem, nothing changes
    data["compile"] = {"rank": 0, "ridge": 0.1, "train": [], "held_out": [],
                       "pooled": {"train": {"retained": None, "match": 0, "tokens": 0},
                                  "held_out": {"retained": None, "match": 0, "tokens": 0}}}
    path.write_text(json.dumps(data))
    with pytest.raises(Exception, match=r"compile\.rank"):
        load_session(path)


def test_compile_report_on_the_command_line_carries_the_numbers(tmp_path: Path,
                                                                 tiny_model_dir: str) -> None:
    from ctxpatch.app.cli import main
    from ctxpatch.app.compile_view import CURVE, number

    out = tmp_path / "c.json"
    rc = main(["compile", "--model", tiny_model_dir, "--dtype", "float64", "--context", CONTEXT,
               "--query", QUERY, "--held-out", HELD[0], "--rank", "2", "--sweep", "1,2",
               "--max-new-tokens", "2", "--json", str(out), "--report",
               str(tmp_path / "c.html"), "--quiet"])
    assert rc == 0
    data = json.loads(out.read_text())
    text = (tmp_path / "c.html").read_text()
    assert "Compiled context" in text and "Answers side by side" in text
    for r in (*data["train"], *data["held_out"]):
        row = (f"<td>{number(r['retained'])}</td><td>{number(r['linf'])}</td>"
               f"<td>{number(r['tvd'])}</td>")
        assert row in text
    assert [p["rank"] for p in data["curve"]] == [1, 2]
    assert {p.name for p in (tmp_path / "c_plots").iterdir()} == {f"{CURVE}.png",
                                                                   f"{CURVE}.svg"}
    assert text.count("data:image/png;base64,") == 1
