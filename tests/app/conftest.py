"""App tests: offscreen Qt, settings in a temporary file, a tiny model saved as a folder."""

from __future__ import annotations

import os
import tempfile

import pytest

# QSettings and the log follow XDG paths on Linux: keep the user's own out of the tests
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="ctxpatch-config-")
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="ctxpatch-state-")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tiny import save_tiny_folder

    return str(save_tiny_folder(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture
def settings(tmp_path):  # type: ignore[no-untyped-def]
    from PySide6.QtCore import QSettings

    return QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)


#: Windows are closed after their test but never destroyed mid-session: destroying a window
#: whose pyqtgraph items still have Python-owned menus can deadlock inside Qt when Python's
#: garbage collector runs during the C++ destructor (seen as a hang in QObject::~QObject).
_KEPT: list[object] = []


@pytest.fixture
def keep(qtbot):  # type: ignore[no-untyped-def]
    """Register a window: shown for the test, closed after it, kept alive to the end."""
    windows: list[object] = []
    yield windows.append
    for w in windows:
        w.close()  # type: ignore[attr-defined]
        _KEPT.append(w)
    qtbot.wait(1)
