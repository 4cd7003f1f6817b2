"""Fuzzing the window's settings file (issue 36): the panels' values and the window's state
replaced by any JSON value, a dict of the run's options with any values, or any text. Whatever
the file holds, the window starts, shows no error, and what it would run is a valid RunSpec."""

from __future__ import annotations

import json
from typing import Any

from ctxpatch.app.main_window import MainWindow
from ctxpatch.core import spec
from fuzz_json import JSON
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

KEYS = ["panels/model", "panels/input", "window/geometry", "window/main_splitter",
        "window/right_splitter"]
OPTIONS = st.dictionaries(st.sampled_from([*spec.names(), "recent", "placement", "x"]),
                          JSON | st.integers(min_value=-(10**40), max_value=10**40), max_size=6)
VALUES = st.one_of(JSON.map(json.dumps), OPTIONS.map(json.dumps), st.text(max_size=40),
                   st.integers(min_value=-(2**63), max_value=2**63 - 1))  # (what QSettings holds)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(KEYS), VALUES, min_size=1, max_size=3))
def test_any_settings_file_starts_the_window(qtbot: Any, keep: Any, tmp_path: Any,
                                             values: dict[str, Any]) -> None:
    from PySide6.QtCore import QSettings

    stored = QSettings(str(tmp_path / f"s{abs(hash(str(values)))}.ini"),
                       QSettings.Format.IniFormat)
    for key, value in values.items():
        stored.setValue(key, value)
    stored.sync()
    w = MainWindow(settings=stored, autoload=False)
    keep(w)
    w.close()
    assert not w.banner.isVisible(), w.last_error
    spec.from_options({**w.model_panel.spec_options(), **w.input_panel.values(), "image": None})
