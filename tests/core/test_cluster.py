"""Prompt sets on a local Ray cluster (2 CPUs, started here): the same records as the serial
run, a killed actor's run retried elsewhere with every run once, a resumed set redoing nothing,
a stop keeping what finished. Skipped where Ray is not installed (``ctxpatch[cluster]``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from ctxpatch.core import experiments as ex  # noqa: E402
from ctxpatch.core.promptset import PromptRow  # noqa: E402
from ctxpatch.core.record import check_record  # noqa: E402
from ctxpatch.core.sets import set_jobs, settings  # noqa: E402
from tiny import comparable_record, save_tiny_folder  # noqa: E402

ROWS = [PromptRow("alice", "Alice lives in Paris.", "Where does Alice live?", None, 1),
        PromptRow("caps", "France: Paris. Japan:", "Tokyo. Italy:", None, 2),
        PromptRow("code", "def f(x):", "return", None, 3),
        PromptRow("mars", "", "Write a weather forecast for Mars:", None, 4)]
JOBS = set_jobs(ROWS, settings(["float32"], ["direct", "stable"]))  # 8 runs
TOKENS = 2


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """A local 2-CPU cluster (about 10 s to start on a 2-core machine; on an overloaded one its
    raylet may miss Ray's 30 s start-up deadline: tried twice)."""
    for attempt in (1, 2):
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                     logging_level="ERROR")
            break
        except Exception:
            ray.shutdown()
            if attempt == 2:
                raise
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_folder(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The serial run in one thread, as each CPU actor runs (the sums' order is the same)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _run(model: str, out: Path, said: list[str], **kw: Any) -> dict[str, dict[str, Any]]:
    from ctxpatch.core.cluster import run_on_ray

    return run_on_ray("auto", model, out, JOBS, TOKENS, "cpu", said.append, **kw)


def test_the_cluster_s_records_are_the_serial_run_s(cluster: None, model: str, tmp_path: Path,
                                                     one_thread: None) -> None:
    said: list[str] = []
    serial = ex.run_grid(model, tmp_path / "serial", JOBS, TOKENS, "cpu", said.append)
    written: list[str] = []
    on_ray = _run(model, tmp_path / "ray", said, on_record=lambda job, r: written.append(job.name))
    assert sorted(written) == sorted(j.name for j in JOBS)  # each once, written by the driver
    assert any("on 2 actors (one per CPU slot)" in line for line in said)
    for job in JOBS:
        a = comparable_record(serial[job.name])
        path = tmp_path / "ray" / "runs" / f"{job.name}.json"
        b = comparable_record(check_record(json.loads(path.read_text())))
        assert a == b, job.name
        assert comparable_record(on_ray[job.name]) == a


def test_a_killed_actor_s_run_is_retried_and_every_run_is_once(
        cluster: None, model: str, tmp_path: Path) -> None:
    said: list[str] = []
    written: list[str] = []
    killed: list[str] = []

    def kill_the_third(job: Any, actor: Any) -> None:
        if len(killed) == 0 and len(written) >= 2:  # mid-set, with its job in flight
            killed.append(job.name)
            ray.kill(actor)

    records = _run(model, tmp_path, said, on_record=lambda job, r: written.append(job.name),
                   on_submit=kill_the_third)
    assert killed and sorted(written) == sorted(j.name for j in JOBS)
    assert len(written) == len(set(written)) == len(JOBS)  # every run once
    assert f"{killed[0]}: its actor died; the run is retried on another" in said
    assert sorted(records) == sorted(j.name for j in JOBS)
    assert sorted(p.stem for p in (tmp_path / "runs").glob("*.json")) == sorted(records)


def test_a_stopped_set_keeps_what_finished_and_resumes(cluster: None, model: str,
                                                       tmp_path: Path) -> None:
    said: list[str] = []
    written: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        _run(model, tmp_path, said, on_record=lambda job, r: written.append(job.name),
             should_stop=lambda: len(written) >= 3)
    kept = {p.stem: p.stat().st_mtime_ns for p in (tmp_path / "runs").glob("*.json")}
    assert sorted(kept) == sorted(written) and len(kept) >= 3
    said.clear()
    again: list[str] = []
    _run(model, tmp_path, said, on_record=lambda job, r: again.append(job.name))
    assert sorted(again) == sorted(j.name for j in JOBS if j.name not in kept)  # no redo
    assert sum("reusing" in line for line in said) == len(kept)
    assert {n: (tmp_path / "runs" / f"{n}.json").stat().st_mtime_ns for n in kept} == kept
    assert ray.is_initialized()  # the tests' cluster is left running (it was not ours)
