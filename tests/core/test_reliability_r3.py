"""Issue 36 (reliability, round three): the command line's and the library's writes. Each test
fails before its fix."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from ctxpatch.app.cli import main
from ctxpatch.core.errors import UserError
from ctxpatch.core.export import write_text
from ctxpatch.core.outputs import check_report
from tiny import save_tiny_folder


def test_a_rewrite_keeps_a_private_file_private(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    out.write_text("old")
    out.chmod(0o600)
    write_text(out, "new")
    assert out.read_text() == "new" and stat.S_IMODE(out.stat().st_mode) == 0o600
    fresh = tmp_path / "fresh.json"
    write_text(fresh, "x")  # a new file: a normal file's mode under the umask
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o666 & ~umask


def test_a_write_through_a_symlink_keeps_the_link(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    real = tmp_path / "real" / "run.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_text(link, "new")
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_text() == "new"
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["run.json"]  # no temporary


# -- the report (cases 4, 6, 22) -------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_folder(tmp_path_factory.mktemp("m") / "model")


def _compare(model: Path, *more: str) -> list[str]:
    return ["compare", "--model", str(model), "--context", "a b c", "--query", "d e",
            "--max-new-tokens", "2", "--quiet", *more]


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def test_the_plots_never_replace_an_input(model: Path, tmp_path: Path) -> None:
    """`--report in/X.html` puts its plots in in/X_plots/: refused, before any work, when that
    folder holds a file the run reads (here the model itself is in it)."""
    inside = tmp_path / "X_plots"
    shutil.copytree(model, inside)
    before = _tree(tmp_path)
    assert main(_compare(inside, "--report", str(tmp_path / "X.html"))) == 2
    assert _tree(tmp_path) == before
    with pytest.raises(UserError, match="would overwrite"):
        check_report(str(tmp_path / "X.html"), [str(inside / "config.json")])
    assert check_report(str(tmp_path / "Y.html"), [str(inside / "config.json")]) == \
        tmp_path / "Y_plots"


@pytest.mark.parametrize("name", ["r.png", "r.txt", "r"])
def test_a_report_name_that_is_neither_html_nor_pdf_is_refused(model: Path, tmp_path: Path,
                                                               capsys: Any, name: str) -> None:
    assert main(_compare(model, "--report", str(tmp_path / name))) == 2
    assert "must end in .html or .pdf" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_report_leaves_the_previous_one(model: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl+C while the plots are written: the previous report and plots stay as they were and
    no temporary is left (before: X_plots/ half rewritten, sometimes a .tmp inside)."""
    report = tmp_path / "X.html"
    assert main(_compare(model, "--report", str(report))) == 0
    before = _tree(tmp_path)
    assert "X.html" in before and any(k.startswith("X_plots/") for k in before)
    real = Path.write_bytes
    calls = []

    def interrupted(self: Path, data: bytes) -> int:
        calls.append(self)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", interrupted)
    assert main(_compare(model, "--context", "x y z", "--report", str(report))) == 130
    monkeypatch.undo()
    assert _tree(tmp_path) == before and len(calls) == 3


def test_a_failed_move_puts_the_previous_report_back(model: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The report's last move fails (a full disk): the plots already moved are taken back, a
    file of the user's in the plots folder stays, the previous report is intact."""
    from ctxpatch.core import export

    report = tmp_path / "X.html"
    assert main(_compare(model, "--report", str(report))) == 0
    (tmp_path / "X_plots" / "notes.txt").write_text("mine")
    before = _tree(tmp_path)
    real = export.install

    def full(tmp: Any, path: Any) -> None:
        if Path(path).name == "X.html":
            raise OSError(28, "No space left on device")
        real(tmp, path)

    monkeypatch.setattr(export, "install", full)
    assert main(_compare(model, "--context", "x y z", "--report", str(report))) == 2
    assert _tree(tmp_path) == before


@pytest.mark.slow
def test_sigterm_leaves_the_whole_report_or_none(model: Path, tmp_path: Path) -> None:
    """SIGTERM at any moment of a run with a report (late ones land while the plots and the
    report are written): exit 143, and either the report with all its plots or nothing; no
    temporary, no traceback."""
    def start(out: Path) -> subprocess.Popen[str]:
        out.mkdir()
        return subprocess.Popen([sys.executable, "-m", "ctxpatch.app",
                                 *_compare(model, "--report", str(out / "X.html"))],
                                stderr=subprocess.PIPE, text=True)

    def files(out: Path) -> list[str]:
        return sorted(str(p.relative_to(out)) for p in out.rglob("*"))

    began = time.monotonic()
    whole = start(tmp_path / "whole")
    assert whole.wait(timeout=300) == 0
    wall = time.monotonic() - began
    complete = files(tmp_path / "whole")
    assert "X.html" in complete and len(complete) > 2
    for fraction in (0.5, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98):
        out = tmp_path / f"at{fraction}"
        child = start(out)
        time.sleep(wall * fraction)
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=300)
        assert "Traceback" not in err, err
        # 0: it had finished; -15: killed while Python started or shut down (before the
        # command began, or after its outputs were whole)
        assert child.returncode in (0, 143, -signal.SIGTERM), (child.returncode, err)
        assert files(out) in ([], complete), (fraction, child.returncode, files(out))
