"""Fuzzing session and autosave files (issue 19): random bytes, the bytes of a real session
mutated, and a real session with any field replaced by any JSON value or removed. Whatever the
file holds: no traceback escapes, no "internal error", one line; the file is not changed (an
unreadable autosave is only moved aside, its bytes intact); and what is accepted opens."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from ctxpatch.app.main_window import MainWindow
from ctxpatch.app.session import SessionError, autosave_path, load_session, shown_run
from ctxpatch.core.record import read_record
from fuzz_json import DELETE, JSON, paths
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FIXTURE = Path(__file__).parent / "fixtures" / "session_v0.json"
V0 = json.loads(FIXTURE.read_text())
V1 = {**{k: v for k, v in V0.items() if k != "run"}, "schema_version": 1,
      "options": {"model": "demo", "recent": ["demo"], "dtype": "float32", "layers": "all"},
      "runs": [V0["run"], V0["run"]], "current": 1}


PATHS = [(0, p) for p in paths(V0) if p] + [(1, p) for p in paths(V1) if p]


@st.composite
def edited(draw: Any) -> bytes:
    """A real session (schema 0 or 1) with one field replaced by any JSON value, or removed."""
    which, path = draw(st.sampled_from(PATHS))
    data = json.loads(json.dumps(V1 if which else V0))
    node = data
    for key in path[:-1]:
        node = node[key]
    value = draw(JSON | st.just(DELETE))
    if value is DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return json.dumps(data, allow_nan=True).encode()


@st.composite
def mutated(draw: Any) -> bytes:
    """The bytes of a real session with a few bytes replaced, and perhaps cut short."""
    raw = bytearray(FIXTURE.read_bytes())
    for _ in range(draw(st.integers(1, 4))):
        raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
    return bytes(raw[:draw(st.integers(0, len(raw)))] if draw(st.booleans()) else raw)


#: mostly edited sessions: they get past the JSON parser and reach the schema and the window
FILES = st.integers(0, 5).flatmap(
    lambda i: st.binary(max_size=600) if i == 0 else mutated() if i == 1 else edited())


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(content=FILES)
def test_reading_any_file_is_a_session_or_one_line(tmp_path_factory: Any, content: bytes) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "s.json"
    path.write_bytes(content)
    try:
        data = load_session(path)
    except SessionError as exc:
        assert "\n" not in str(exc) and "internal error" not in str(exc)
        assert str(exc).startswith(f"the session {path} is ")
    else:  # accepted: every run rebuilds (the schema covers all that `run_from_record` reads)
        for record in data["runs"]:
            read_record(record)
        index, run = shown_run(data, path)
        assert (index is None) == (run is None) == (not data["runs"])
    assert path.read_bytes() == content


@pytest.fixture
def window(qtbot: Any, keep: Any, settings: Any) -> MainWindow:
    w = MainWindow(settings=settings, autoload=False)
    keep(w)
    w.show()
    return w


def _clear_autosaves() -> None:
    folder = autosave_path().parent
    for p in folder.glob("autosave.json*") if folder.is_dir() else ():
        p.rmdir() if p.is_dir() else p.unlink()


def test_the_window_survives_any_session_or_autosave(window: MainWindow, tmp_path: Path) -> None:
    """File > Open session and the autosave check at start-up, on one window, many files."""
    w = window
    autosave = autosave_path()
    autosave.parent.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "s.json"

    @settings(max_examples=200, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(content=FILES)
    def check(content: bytes) -> None:
        _clear_autosaves()
        w.banner.hide()
        w.notice.hide()
        # the autosave: offered back when it reads, else moved aside (bytes intact) and one line
        autosave.write_bytes(content)
        w.offer_autosave()
        if autosave.exists():
            assert autosave.read_bytes() == content and not w.banner.isVisible()
            if w.notice.isVisible():
                w.notice.button.click()  # restore: it opens, or says why in one line
        else:
            (aside,) = autosave.parent.glob("autosave.json.bad-*")
            assert aside.read_bytes() == content and w.banner.isVisible()
        assert "\n" not in w.last_error and "internal error" not in w.last_error
        # File > Open session: it opens, or one line and nothing changes
        path.write_bytes(content)
        before = (list(w.state.steps), list(w.files.history))
        if w.open_session(str(path)):
            data = load_session(path)
            run = data["runs"][w.files.history_index] if data["runs"] else None
            assert len(w.state.steps) == (len(run["steps"]) if run else len(before[0]))
            summary = w.state.summary()
            assert summary["tokens"] == len(w.state.steps)
            assert all(math.isnan(x) or x >= 0 or x < 0 for x in w.state.series("patched", "linf"))
            for kind in ("json", "csv") if w.state.steps else ():  # and what opened exports
                assert w.export(kind, str(tmp_path / f"out.{kind}")), w.last_error
        else:
            assert "\n" not in w.last_error and "internal error" not in w.last_error
            assert w.last_error.startswith(f"the session {path} is ")
            assert (list(w.state.steps), list(w.files.history)) == before
        assert path.read_bytes() == content

    try:
        check()
    finally:
        _clear_autosaves()
