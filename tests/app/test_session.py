"""Sessions: save and reopen without recomputing, the run history, an old schema, a damaged
file, and the autosave offered back after a crash."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from ctxpatch.app.main_window import MainWindow
from ctxpatch.app.session import autosave_path, load_session
from ctxpatch.core.errors import UserError

FIXTURE = Path(__file__).parent / "fixtures" / "session_v0.json"


@pytest.fixture
def fresh(qtbot: Any, keep: Any, settings: Any) -> Any:
    def make(**kw: Any) -> MainWindow:
        w = MainWindow(settings=settings, autoload=False, **kw)
        keep(w)
        w.show()
        return w
    return make


def _run(qtbot: Any, w: MainWindow, tokens: int, method: str = "direct") -> None:
    w.input_panel.max_tokens.setValue(tokens)
    w.model_panel.method.setCurrentText(method)
    with qtbot.waitSignal(w.run_finished, timeout=60_000) as blocker:
        w.start_run()
    assert blocker.args == ["completed"], w.last_error


def test_save_reopen_and_reexport_without_recomputing(qtbot: Any, fresh: Any, tiny_model_dir: str,
                                                       tmp_path: Path) -> None:
    w = fresh(model=tiny_model_dir)
    w.input_panel.context.setPlainText("Alice lives in Paris.")
    w.input_panel.query.setPlainText("Where does Alice live?")
    _run(qtbot, w, 3)
    _run(qtbot, w, 4, "stable")
    assert len(w.files.history) == 2 and w.history_panel.runs.count() == 2
    panes = w.generation.pane_texts()
    assert w.save_session(str(tmp_path / "s.json"))
    assert w.export("json", str(tmp_path / "a.json"))

    again = fresh()
    assert again.open_session(str(tmp_path / "s.json"))
    assert again.model is None  # nothing was loaded or recomputed
    assert len(again.state.steps) == 4 and again.generation.pane_texts() == panes
    assert again.input_panel.query.toPlainText() == "Where does Alice live?"
    assert again.model_panel.method.currentText() == "stable"
    assert again.export("json", str(tmp_path / "b.json"))
    a, b = (json.loads((tmp_path / n).read_text()) for n in ("a.json", "b.json"))
    assert a["steps"] == b["steps"] and a["summary"] == b["summary"] and a["prompt"] == b["prompt"]
    again.history_panel.chosen.emit(0)  # the first run, from the history
    assert len(again.state.steps) == 3 and again.controls.rows()
    again.plots.overlay.setChecked(True)  # compare runs: the other run's curves, 3 metrics
    assert again.plots.overlay_count() == 3
    table = again.plots.comparison.text()  # Figure 4 in numbers: this run and the other one
    assert again.plots.comparison.isVisible() and table.count("<tr>") == 3 and "4/4" in table


def test_an_old_schema_session_opens(fresh: Any) -> None:
    w = fresh()
    assert w.open_session(str(FIXTURE)), w.last_error
    assert len(w.state.steps) == 3 and len(w.files.history) == 1
    assert w.input_panel.context.toPlainText() == "Alice lives in Paris."
    assert "Alice lives in Paris." in w.generation.pane_texts()[0]


def test_a_damaged_session_is_one_clear_error_and_harms_nothing(fresh: Any, tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(FIXTURE.read_text())
    bad = tmp_path / "bad.json"
    bad.write_text(FIXTURE.read_text()[:5000])  # truncated
    w = fresh()
    w.input_panel.query.setPlainText("my unsaved question")
    assert not w.open_session(str(bad))
    assert "damaged" in w.last_error and "\n" not in w.last_error and w.banner.isVisible()
    assert w.input_panel.query.toPlainText() == "my unsaved question"
    assert good.read_text() == FIXTURE.read_text() and w.open_session(str(good))
    with pytest.raises(UserError, match="schema 7"):
        bad.write_text(json.dumps({"format": "ctxpatch-session", "schema_version": 7, "runs": []}))
        load_session(bad)


def test_the_autosave_is_offered_back_after_a_crash(qtbot: Any, fresh: Any,
                                                    tiny_model_dir: str) -> None:
    w = fresh(model=tiny_model_dir)
    w.input_panel.context.setPlainText("Alice lives in Paris.")
    w.input_panel.query.setPlainText("Where?")
    _run(qtbot, w, 3)
    assert autosave_path().is_file()  # written after the run; a crash would leave it
    crashed = autosave_path().read_text()
    w.close()
    assert not autosave_path().is_file()  # a clean exit removes it
    autosave_path().write_text(crashed)  # as if the process had died
    again = fresh()
    again.offer_autosave()
    assert again.notice.isVisible() and "did not close cleanly" in again.notice.label.text()
    again.notice.button.click()
    assert len(again.state.steps) == 3 and not again.notice.isVisible()
    again.close()


# -- issue 19: bad autosaves and sessions, large sessions ---------------------------------------
def _fixture() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


def _json(mutate: Any) -> bytes:
    data = _fixture()
    mutate(data)
    return json.dumps(data).encode()


def _set(path: str, value: Any) -> Any:
    """A mutation: the fixture with ``value`` at ``path`` ("run.steps.1.match")."""
    def mutate(data: Any) -> None:
        *parents, last = path.split(".")
        for key in parents:
            data = data[int(key)] if isinstance(data, list) else data[key]
        data[int(last) if isinstance(data, list) else last] = value
    return mutate


NESTED = b'{"format": "ctxpatch-session", "schema_version": 1, "runs": ' + b"[" * 100_000
#: (case, file bytes, what the one line says)
BAD = [
    ("random bytes", bytes(range(256)) * 4, "not JSON"),
    ("empty", b"", "not JSON"),
    ("truncated", FIXTURE.read_bytes()[:5000], "not JSON"),
    ("not UTF-8", b'{"format": "ctxpatch-session", "saved": "\xff\xfe"}', "not JSON"),
    ("deeply nested", NESTED + b"]" * 100_000 + b"}", "nested too deeply"),
    ("a list", b"[1, 2, 3]", "not a ctxpatch session"),
    ("newer schema", json.dumps({"format": "ctxpatch-session", "schema_version": 7}).encode(),
     "update ctxpatch"),
    ("runs a string", _json(lambda d: d.update(schema_version=1, runs="abc")), "runs: Input"),
    ("inputs a list", _json(_set("inputs", [])), "inputs: Input should be"),
    ("options a string", _json(lambda d: d.update(schema_version=1, options="x", runs=[])),
     "options: Input should be"),
    ("a match as text", _json(_set("run.steps.1.match", "yes")), "run.steps[1].match"),
    ("a token as a number", _json(_set("run.steps.0.baseline_token", 5)),
     "run.steps[0].baseline_token"),
    ("top-k null", _json(_set("run.steps.2.top_k", None)), "run.steps[2].top_k"),
    ("a metric as text", _json(_set("run.steps.0.linf", "1.5")), "got '1.5'"),
    ("a huge number of new tokens", _json(_set("inputs.max_new_tokens", 10**30)),
     "inputs.max_new_tokens"),
    ("a huge token id", _json(_set("run.steps.0.patched_token.id", 2**40)), "less than"),
    ("a huge float", _json(_set("run.steps.0.tvd", 10**400)), "run.steps[0].tvd"),
    ("a huge layer count", _json(_set("run.model.num_layers", 10**12)), "num_layers"),
    ("steps out of order", _json(_set("run.steps.1.step", 5000)), "numbered 5000"),
    ("a layer key that is not a number", _json(_set("run.steps.0.patch_norms", {"x": {}})),
     "patch_norms.x"),
    ("a plan with an unknown field", _json(_set("run.controllability.plan", [{"x": 1}])),
     "plan[0]"),
    ("missing max_new_tokens", _json(lambda d: d["run"]["settings"].pop("max_new_tokens")),
     "max_new_tokens: Field required"),
]


@pytest.fixture
def clean_state() -> Any:
    """No autosave (nor one moved aside) before and after the test."""
    def clear() -> None:
        folder = autosave_path().parent
        for p in folder.glob("autosave.json*") if folder.is_dir() else ():
            p.rmdir() if p.is_dir() else p.unlink()
    clear()
    yield autosave_path()
    clear()


@pytest.mark.parametrize("case,content,says", BAD, ids=[c[0] for c in BAD])
def test_a_bad_autosave_is_moved_aside_and_the_window_starts(fresh: Any, clean_state: Path,
                                                             case: str, content: bytes,
                                                             says: str) -> None:
    clean_state.parent.mkdir(parents=True, exist_ok=True)
    clean_state.write_bytes(content)
    w = fresh()
    w.offer_autosave()  # what `ctxpatch` does at every start: it must return, whatever the file
    message = w.last_error
    assert w.banner.isVisible() and not w.notice.isVisible()
    assert "\n" not in message and "internal error" not in message and "autosave" in message
    assert "moved aside" in message, message
    assert not clean_state.exists()
    (aside,) = clean_state.parent.glob("autosave.json.bad-*")
    assert aside.read_bytes() == content and str(aside) in message  # kept to look at
    assert w.open_session(str(FIXTURE)) and len(w.state.steps) == 3  # the window works


def test_an_autosave_folder_is_moved_aside(fresh: Any, clean_state: Path) -> None:
    clean_state.mkdir(parents=True)
    w = fresh()
    w.offer_autosave()
    assert "not a file" in w.last_error and not clean_state.exists()


def test_an_old_autosave_is_offered_and_a_good_one_stays(fresh: Any, clean_state: Path) -> None:
    clean_state.parent.mkdir(parents=True, exist_ok=True)
    clean_state.write_bytes(FIXTURE.read_bytes())
    w = fresh()
    w.offer_autosave()
    assert w.notice.isVisible() and not w.banner.isVisible()
    assert "1 run(s)" in w.notice.label.text() and "(saved 2026-11-01" in w.notice.label.text()
    assert clean_state.read_bytes() == FIXTURE.read_bytes()
    w.notice.button.click()
    assert len(w.state.steps) == 3


def test_an_autosave_that_cannot_be_moved_is_left_and_named(fresh: Any, clean_state: Path,
                                                           monkeypatch: Any) -> None:
    from ctxpatch.app import session as app_session

    def refuse(path: Path) -> Path:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(app_session, "move_aside", refuse)
    clean_state.parent.mkdir(parents=True, exist_ok=True)
    clean_state.write_bytes(b"garbage")
    w = fresh()
    w.offer_autosave()
    assert "could not be moved aside (Permission denied)" in w.last_error
    assert clean_state.read_bytes() == b"garbage"  # left as it was, the window started


@pytest.mark.parametrize("case,content,says", BAD, ids=[c[0] for c in BAD])
def test_opening_a_bad_session_is_one_line_and_changes_nothing(fresh: Any, tmp_path: Path,
                                                               case: str, content: bytes,
                                                               says: str) -> None:
    w = fresh()
    assert w.open_session(str(FIXTURE))
    w.input_panel.query.setPlainText("my unsaved question")
    before = (list(w.state.steps), list(w.files.history), w.generation.pane_texts())
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    assert not w.open_session(str(bad))
    message = w.last_error
    assert message.startswith(f"the session {bad} is ") and says in message, message
    assert "\n" not in message and "internal error" not in message and w.banner.isVisible()
    assert (list(w.state.steps), list(w.files.history), w.generation.pane_texts()) == before
    assert w.input_panel.query.toPlainText() == "my unsaved question"
    assert bad.read_bytes() == content


def test_a_session_never_ticks_trust_remote_code(fresh: Any, tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_bytes(_json(lambda d: d.update(
        schema_version=1, runs=[d["run"]], current=0,
        options={"model": "x", "trust_remote_code": True, "allow_pickle": True})))
    w = fresh()
    assert w.open_session(str(path)), w.last_error
    assert not w.model_panel.trust.isChecked() and not w.model_panel.pickle.isChecked()


def big_session(path: Path, n: int) -> Path:
    """A session whose run has ``n`` steps (the fixture's three, repeated)."""
    data = _fixture()
    run = data.pop("run")
    template = [json.dumps(s) for s in run["steps"]]
    steps = []
    for i in range(n):
        step = json.loads(template[i % 3])
        step["step"], step["position"] = i, 36 + i
        steps.append(step)
    run = {**run, "steps": steps, "settings": {**run["settings"], "max_new_tokens": n}}
    path.write_text(json.dumps({**data, "schema_version": 1, "runs": [run], "current": 0}))
    return path


def test_replaying_a_long_run_redraws_once() -> None:
    """The cause of minutes-long opening: every step of a reopened run redrew every view."""
    from ctxpatch.app.report import fill_state
    from ctxpatch.app.state import RunState
    from ctxpatch.core.record import read_record

    run = read_record(_fixture()["run"])
    long = type(run)(run.settings, run.model, run.prompt, run.steps * 3000, run.record)
    state, events = RunState(), []
    state.subscribe(events.append)
    with state.batch():
        fill_state(state, long)
    assert events == ["reset"] and len(state.steps) == 9000 and not state.running


@pytest.mark.slow
def test_a_9000_step_session_opens_on_the_worker(qtbot: Any, fresh: Any, tmp_path: Path) -> None:
    import time

    path = big_session(tmp_path / "big.json", 9000)
    w = fresh()
    progress: list[str] = []
    w.worker_created.connect(lambda worker: worker.progress.connect(
        lambda message, done, total: progress.append(message)))
    start = time.perf_counter()
    with qtbot.waitSignal(w.session_opened, timeout=180_000) as blocker:
        assert w.open_session(str(path))
        assert w.busy and time.perf_counter() - start < 1.0  # the GUI thread is free meanwhile
    assert blocker.args == ["completed"], w.last_error
    assert time.perf_counter() - start < 90  # it took over 150 s (quadratic) before issue 19
    assert len(w.state.steps) == 9000 and len(w.files.history) == 1 and progress
    assert w.plots.curves[("linf", "patched")].getData()[0].size == 9000
    assert w.status_label.text() == f"Opened the session {path}"


def test_opening_a_large_session_can_be_cancelled(qtbot: Any, fresh: Any, tmp_path: Path) -> None:
    path = big_session(tmp_path / "big.json", 3000)
    w = fresh()
    assert w.open_session(str(FIXTURE)) and len(w.state.steps) == 3
    with qtbot.waitSignal(w.session_opened, timeout=120_000) as blocker:
        assert w.open_session(str(path))
        w.cancel()  # Esc
    assert blocker.args == ["cancelled"]
    assert len(w.state.steps) == 3 and len(w.files.history) == 1 and not w.busy
    assert "cancelled" in w.status_label.text()


def test_a_bad_large_session_fails_on_the_worker_with_one_line(qtbot: Any, fresh: Any,
                                                              tmp_path: Path) -> None:
    path = big_session(tmp_path / "big.json", 3000)
    path.write_text(path.read_text().replace('"match": true', '"match": "true"', 1))
    w = fresh()
    with qtbot.waitSignal(w.session_opened, timeout=120_000) as blocker:
        assert w.open_session(str(path))
    assert blocker.args == ["failed"] and "match: Input should be a valid boolean" in w.last_error
    assert "\n" not in w.last_error and not w.state.steps


# -- issue 21: the option values are core.options' -----------------------------------------------
def _options_session(where: str, key: str, value: Any) -> bytes:
    """A schema-1 session with ``value`` as option ``key`` of its options or its run's settings."""
    def mutate(data: dict[str, Any]) -> None:
        data.update(schema_version=1, runs=[data.pop("run")], current=0, options={})
        target = data["options"] if where == "options" else data["runs"][0]["settings"]
        target[key] = value
    return _json(mutate)


def test_sessions_read_the_option_values_of_core_options(tmp_path: Path) -> None:
    """Adding a value in core.options is the only edit for sessions to read it; an unknown value
    is one line naming the field."""
    from ctxpatch.app.session import SessionError
    from ctxpatch.core import options

    single = {"dtype": options.DTYPES, "method": options.METHODS,
              "absorb": options.ABSORB_MODES, "scope": options.SCOPES,
              "output_control": options.OUTPUT_CONTROLS}
    cases = [(where, key, v) for where in ("options", "settings")
             for key, values in single.items() for v in (*values, None)]
    cases += [(where, "disabled", [kind]) for where in ("options", "settings")
              for kind in options.PATCH_KINDS]
    cases += [("options", "device_map", v) for v in ("one device", *options.DEVICE_MAPS)]
    cases += [("settings", "on_fault", v) for v in options.ON_FAULT]
    path = tmp_path / "s.json"
    for where, key, value in cases:
        path.write_bytes(_options_session(where, key, value))
        load_session(path)
    bad = [(where, key, "nonsense") for where in ("options", "settings") for key in single]
    bad += [("options", "disabled", ["nonsense"]), ("options", "device_map", "nonsense"),
            ("settings", "on_fault", "nonsense")]
    for where, key, value in bad:
        path.write_bytes(_options_session(where, key, value))
        with pytest.raises(SessionError, match=rf"\.{key}(\[0\])?: Input should be .*"
                                               "got 'nonsense'"):
            load_session(path)


def test_the_session_schema_spells_no_option_value() -> None:
    """No ``Literal[...]`` of app/session.py repeats a value of core.options."""
    import ast

    from ctxpatch.app import session as app_session
    from ctxpatch.core import options

    tree = ast.parse(Path(app_session.__file__).read_text())
    spelled = {node.value for literal in ast.walk(tree) if isinstance(literal, ast.Subscript)
               and isinstance(literal.value, ast.Name) and literal.value.id == "Literal"
               for node in ast.walk(literal.slice) if isinstance(node, ast.Constant)}
    values = {*options.DTYPES, *options.METHODS, *options.ABSORB_MODES, *options.SCOPES,
              *options.PATCH_KINDS, *options.OUTPUT_CONTROLS, *options.DEVICE_MAPS,
              *options.ON_FAULT}
    assert "one device" in spelled and not spelled & values


def test_overlays_keep_a_nan_as_the_summaries_do(fresh: Any, monkeypatch: Any) -> None:
    """A run past a numerical fault stores its NaN L-inf as null: its overlay shows NaN (a gap,
    as `core.results.nan_max` would report it), never 0.0 (a perfect token)."""
    import math

    w = fresh()
    assert w.open_session(str(FIXTURE)), w.last_error
    other = json.loads(json.dumps(w.files.history[0]))
    other["steps"][1]["linf"] = None
    other["steps"][1]["tvd"] = None
    w.files.history = [other, w.files.history[0]]
    w.files.history_index = 1
    drawn: list[Any] = []
    monkeypatch.setattr(w.plots, "set_overlays", lambda runs, shown: drawn.extend(runs))
    w.plots.overlay.setChecked(True)
    w.files.update_overlays()
    (_, series), = drawn[-1:]
    assert math.isnan(series["linf"][1]) and math.isnan(series["tvd"][1])
    assert series["linf"][0] == other["steps"][0]["linf"]
