"""Prompt sets on a Ray cluster (``ctxpatch reproduce --ray auto|ADDRESS``).

One actor per GPU of the cluster (or, without GPUs, per CPU slot) loads the model once per
dtype and runs the (prompt, setting) jobs it is handed, one at a time; each record streams back
to the driver, which checks and writes it (`core.experiments.save_record`) the moment it
arrives, so the driver's folder is the only one written. An actor that dies has its job handed
to another (a new actor takes its place while the cluster has room); Ctrl+C (or
``should_stop``) ends the actors (their runs in flight with them) and keeps every record already
written. Ray is an optional extra (``pip install "ctxpatch[cluster]"``), imported here only.
"""

from __future__ import annotations

import importlib.util
import os
import typing
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .errors import UserError
from .experiments import Job, record_line, save_record

INSTALL = 'pip install "ctxpatch[cluster]"'


def check_ray(address: str) -> None:
    """``--ray``'s value and Ray itself, before any run.

    Raises:
        UserError: Ray is not installed (one line: what to install), or an empty address.
    """
    if not address.strip():
        raise UserError("--ray needs auto or a cluster's address (host:port of ray start --head)")
    if importlib.util.find_spec("ray") is None:
        raise UserError(f"--ray needs Ray, which is not installed: {INSTALL}")


def run_on_ray(address: str, model: str, out: Path, jobs: Sequence[Job], tokens: int,
               device: str = "auto", say: Callable[[str], None] = print,
               should_stop: Callable[[], bool] | None = None, image: str | None = None,
               on_record: Callable[[Job, dict[str, Any]], None] | None = None,
               on_submit: Callable[[Job, Any], None] | None = None,
               actors: int | None = None) -> dict[str, dict[str, Any]]:
    """`core.experiments.run_grid` on a Ray cluster: the same records, written here as they
    arrive. Connects to ``address`` (``auto``: the running local cluster, else a new one on
    this machine) unless Ray is already initialised (then that cluster is used and left
    running). ``on_submit(job, actor)`` is called as a job is handed to an actor; ``actors``
    caps their number (default: one per GPU, else one per CPU slot)."""
    import ray

    from .experiments import check_resumable

    records = check_resumable(out, jobs, model, tokens, device, image)
    for i, job in enumerate(jobs):
        if job.name in records:
            say(f"[{i + 1}/{len(jobs)}] {job.name}: reusing {out / 'runs' / job.name}.json")
    pending = [j for j in jobs if j.name not in records]
    if not pending:
        return records
    (out / "runs").mkdir(parents=True, exist_ok=True)
    started = not ray.is_initialized()
    if started:
        say(f"connecting to the Ray cluster {address}" if address != "auto"
            else "starting or joining a local Ray cluster")
        _init(ray, address)
    try:
        _Driver(ray, model, out, tokens, device, image, say, should_stop, on_record, on_submit,
                actors).run(pending, records, len(jobs))
    finally:
        if started:
            ray.shutdown()
    return records


def _init(ray: Any, address: str) -> None:
    import logging

    kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.ERROR}
    try:
        if address == "auto":
            ray.init(**kwargs)  # RAY_ADDRESS, else the latest local `ray start`, else a new one
        else:
            ray.init(address=address, **kwargs)
    except ConnectionError as exc:
        raise UserError(f"--ray {address}: no Ray cluster answers there ({exc}); start one with "
                        "ray start --head, or use --ray auto (a cluster that asks for a token: "
                        "run with RAY_AUTH_MODE=token set)") from None


class _Actor:
    """A cluster worker's model, loaded once per dtype; runs one job at a time."""

    def __init__(self, model: str, tokens: int, device: str, image: str | None,
                 threads: int) -> None:
        import torch

        torch.set_num_threads(max(1, threads))
        self.args = (model, tokens, device, image)
        self.loaded: Any = None

    def run(self, job: Job) -> dict[str, Any]:
        from .experiments import run_job

        model, tokens, device, image = self.args
        if self.loaded is not None and str(self.loaded.dtype).removeprefix("torch.") != job.dtype:
            self.loaded = None  # free the other precision first
        record, self.loaded = run_job(job, model, tokens, device, image, self.loaded)
        return record

    def pid(self) -> int:
        return os.getpid()


class _Driver:
    """Hands the jobs to the actors, one each at a time (an actor's loaded dtype first), writes
    each record as it arrives, retries a dead actor's job elsewhere, and stops cleanly."""

    def __init__(self, ray: Any, model: str, out: Path, tokens: int, device: str,
                 image: str | None, say: Callable[[str], None],
                 should_stop: Callable[[], bool] | None,
                 on_record: Callable[[Job, dict[str, Any]], None] | None,
                 on_submit: Callable[[Job, Any], None] | None, actors: int | None) -> None:
        self.ray, self.out, self.say = ray, out, say
        self.should_stop, self.on_record, self.on_submit = should_stop, on_record, on_submit
        resources = ray.cluster_resources()
        gpus = int(resources.get("GPU", 0))
        self.slots = gpus or max(1, int(resources.get("CPU", 1)))
        if actors is not None:
            self.slots = min(self.slots, actors)
        options = {"num_gpus": 1, "num_cpus": 1} if gpus else {"num_cpus": 1}
        threads = 4 if gpus else 1
        cls = ray.remote(**options)(_Actor)
        self.make = lambda: cls.remote(model, tokens, device, image, threads)
        self.unit = "GPU" if gpus else "CPU slot"

    def run(self, pending: list[Job], records: dict[str, dict[str, Any]], total: int) -> None:
        ray = self.ray
        queue = deque(pending)
        count = min(self.slots, len(pending))
        self.say(f"{len(pending)} runs on {count} actors (one per {self.unit})")
        actors = [self.make() for _ in range(count)]
        idle = list(actors)
        dtype: dict[int, str | None] = {id(a): None for a in actors}
        flight: dict[Any, tuple[Any, Job]] = {}
        replacements = 2 * count
        done = total - len(pending)
        try:
            while queue or flight:
                if self.should_stop is not None and self.should_stop():
                    raise KeyboardInterrupt
                while idle and queue:
                    actor = idle.pop()
                    job = _pick(queue, dtype[id(actor)])
                    flight[actor.run.remote(job)] = (actor, job)
                    if self.on_submit is not None:
                        self.on_submit(job, actor)
                ready, _ = ray.wait(list(flight), num_returns=1, timeout=0.5)
                for ref in ready:
                    actor, job = flight.pop(ref)
                    record = self._result(ref, job)
                    if record is None:  # the actor died: its job goes to another
                        actors.remove(actor)
                        queue.appendleft(job)
                        if replacements > 0:
                            replacements -= 1
                            fresh = self.make()
                            actors.append(fresh)
                            dtype[id(fresh)] = None
                            idle.append(fresh)
                        elif not actors:
                            raise RuntimeError("every Ray actor died (see the cluster's logs: "
                                               "out of memory?)")
                        continue
                    save_record(self.out, job, record)
                    records[job.name] = record
                    done += 1
                    if self.on_record is not None:
                        self.on_record(job, record)
                    self.say(f"[{done}/{total}] {job.name}: {record_line(record)}")
                    dtype[id(actor)] = job.dtype
                    idle.append(actor)
        finally:  # done, or Ctrl+C, a stop, a failure: the actors end, and their runs with
            for actor in actors:  # them (an actor's task cannot be force-cancelled on its own)
                ray.kill(actor)

    def _result(self, ref: Any, job: Job) -> dict[str, Any] | None:
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return typing.cast(dict[str, Any], self.ray.get(ref))
        except RayActorError:
            self.say(f"{job.name}: its actor died; the run is retried on another")
            return None
        except RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, UserError):
                raise UserError(cause.args[0]) from None
            if isinstance(cause, KeyboardInterrupt):
                raise KeyboardInterrupt from None
            raise RuntimeError(f"{job.name} failed on the cluster: {type(cause).__name__}: "
                               f"{cause}") from None


def _pick(queue: deque[Job], dtype: str | None) -> Job:
    """The next job in the actor's loaded dtype, else the next one (the queue is grouped by
    dtype, so an actor changes precision at most once per group)."""
    for i, job in enumerate(queue):
        if job.dtype == dtype:
            del queue[i]
            return job
    return queue.popleft()
