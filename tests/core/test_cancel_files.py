"""Cancellation and interruption leave no half-written file: converting the demo, and every
atomic write (exports, reports, patches, sessions) interrupted mid-write."""

from __future__ import annotations

from pathlib import Path

import pytest
from ctxpatch.core.errors import Cancelled
from ctxpatch.core.export import atomic_write, write_text


@pytest.mark.slow
@pytest.mark.parametrize("stop_at", [1, 3])
def test_cancel_while_converting_the_demo_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop_at: int) -> None:
    """Cancelled before reading the tokenizer, or after the 4-bit parts were joined into one
    GGUF: neither the joined file nor a partial model folder is left behind (only the empty
    lock file that serialises conversions)."""
    from ctxpatch.core.loading import ensure_demo

    monkeypatch.setenv("CTXPATCH_CACHE", str(tmp_path))
    checks: list[int] = []

    def should_stop() -> bool:
        checks.append(1)
        return len(checks) >= stop_at

    with pytest.raises(Cancelled):
        ensure_demo(should_stop=should_stop)
    # (the conversion's lock file stays: deleting a lock another process may hold is a race)
    left = [p for p in tmp_path.rglob("*") if p.is_file() and p.suffix != ".lock"]
    assert left == [], left
    assert not any("partial" in p.name for p in tmp_path.rglob("*"))


class Interrupted(BaseException):
    """Like KeyboardInterrupt or a cancel raised inside a write."""


def test_an_interrupted_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "report.html"
    write_text(target, "the previous report")

    def half(tmp: str) -> None:
        Path(tmp).write_text("<html>half of a rep")
        raise Interrupted

    with pytest.raises(Interrupted):
        atomic_write(target, half)
    assert target.read_text() == "the previous report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]
