"""The worker thread without a window, driven by fake jobs (STYLE.md 20)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from ctxpatch.app.jobs import RunStarted
from ctxpatch.app.worker import Worker
from ctxpatch.core.errors import Cancelled, UserError
from PySide6.QtCore import Qt


def _record(worker: Worker) -> list[tuple[str, Any]]:
    events: list[tuple[str, Any]] = []
    for name in ("run_started", "token_done", "loaded", "failed"):
        getattr(worker, name).connect(lambda x, n=name: events.append((n, x)))
    worker.progress.connect(lambda m, d, t: events.append(("progress", d)))
    worker.completed.connect(lambda: events.append(("completed", None)))
    worker.cancelled.connect(lambda: events.append(("cancelled", None)))
    return events


def _started() -> RunStarted:
    return RunStarted(settings={"max_new_tokens": 3}, prompt=None, layers=(0,), num_layers=1,
                      output_control="scale", model={})


def _run(qtbot: Any, job: Any) -> list[tuple[str, Any]]:
    worker = Worker(job)
    events = _record(worker)
    with qtbot.waitSignal(worker.finished, timeout=10_000):
        worker.start()
    qtbot.wait(10)  # let queued signals arrive
    worker.deleteLater()
    return events


def test_three_results_then_an_error_arrive_in_order(qtbot: Any) -> None:
    def job(should_stop: Any, progress: Any) -> Iterator[Any]:
        yield _started()
        for i in range(3):
            progress("token", i + 1, 3)
            yield f"step {i}"
        raise RuntimeError("boom")

    events = _run(qtbot, job)
    names = [n for n, _ in events]
    assert names == ["run_started", "progress", "token_done", "progress", "token_done",
                     "progress", "token_done", "failed"]
    assert [x for n, x in events if n == "token_done"] == ["step 0", "step 1", "step 2"]
    assert events[-1][1].startswith("internal error: RuntimeError: boom")


def test_completed_after_the_last_result(qtbot: Any) -> None:
    def job(should_stop: Any, progress: Any) -> Iterator[Any]:
        yield from ("a", "b")

    assert [n for n, _ in _run(qtbot, job)] == ["token_done", "token_done", "completed"]


def test_user_error_is_its_own_message(qtbot: Any) -> None:
    def job(should_stop: Any, progress: Any) -> Iterator[Any]:
        raise UserError("model folder /x does not exist")
        yield  # pragma: no cover

    assert _run(qtbot, job) == [("failed", "model folder /x does not exist")]


def test_cancel_stops_before_the_next_token(qtbot: Any) -> None:
    produced: list[int] = []
    gate = threading.Event()

    def job(should_stop: Any, progress: Any) -> Iterator[Any]:
        for i in range(5):
            if should_stop():  # what core does between layers and tokens
                return
            produced.append(i)
            yield i
            gate.wait(5)

    worker = Worker(job)
    events = _record(worker)

    def on_token(_: Any) -> None:  # runs on the worker thread, as soon as token 0 is out
        worker.requestInterruption()
        gate.set()

    worker.token_done.connect(on_token, Qt.ConnectionType.DirectConnection)
    with qtbot.waitSignal(worker.finished, timeout=10_000):
        worker.start()
    qtbot.wait(10)
    assert produced == [0]
    assert [n for n, _ in events] == ["token_done", "cancelled"]


def test_cancelled_inside_core_is_a_cancel_not_a_failure(qtbot: Any) -> None:
    def job(should_stop: Any, progress: Any) -> Iterator[Any]:
        yield "a"
        raise Cancelled

    assert [n for n, _ in _run(qtbot, job)] == ["token_done", "cancelled"]
