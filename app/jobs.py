"""The jobs the worker thread runs: load a model, run a comparison, open a large session.

A job is a function ``job(should_stop, progress)`` returning an iterator of plain payloads. This
module is the only place in `app/` that touches the model, and it runs only on the worker thread;
core is imported inside the jobs so that opening the window never waits for torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

StopFn = Callable[[], bool]
ProgressFn = Callable[[str, int, int], None]
Task = Callable[[StopFn, ProgressFn], Iterator[Any]]  # what the worker runs (not experiments.Job)


@dataclass(frozen=True)
class ModelReady:
    """A loaded model. ``handle`` is opaque to the GUI: it is only passed back to `run_job`."""

    handle: Any
    key: tuple[str, str, str, tuple[str, str, str]]  # (spec, dtype, device, placement) as asked
    info: dict[str, Any]  # LoadedModel.describe(): class, family, dtype, device, layers, versions
    has_chat_template: bool
    takes_images: bool  # an image+text model with its processor
    output_controls: tuple[str, ...]
    seconds: float


@dataclass(frozen=True)
class RunStarted:
    """What a run is about to do, before its first token."""

    settings: dict[str, Any]  # the run's RunSpec.to_dict(), resolved (device, control row)
    prompt: Any  # core.prompt.Prompt (plain ids and segments)
    layers: tuple[int, ...]  # the patched layers
    num_layers: int
    output_control: str  # "scale", "matrix", "bias" or "experts"
    model: dict[str, Any]
    plan: tuple[Any, ...] = ()  # core.controllability.LayerPlan per patched layer
    record: dict[str, Any] | None = None  # set when the run was reopened from its record


def load_job(spec: str, dtype: str, device: str,
             placement: tuple[str, str, str] = ("one device", "", ""),
             trust_remote_code: bool = False, allow_pickle: bool = False) -> Task:
    """Load a model; ``placement``: the device map, max memory and offload folder as typed."""

    def job(should_stop: StopFn, progress: ProgressFn) -> Iterator[Any]:
        from ..core.loading import load_model
        from ..core.placement import Placement
        from ..core.prompt import has_chat_template

        start = time.perf_counter()
        progress(f"Loading {spec}…", 0, 0)
        loaded = load_model(spec, dtype=dtype, device=device, progress=progress,
                            should_stop=should_stop, trust_remote_code=trust_remote_code,
                            allow_pickle=allow_pickle, placement=Placement.from_text(*placement))
        yield ModelReady(
            handle=loaded,
            key=(spec, dtype, device, placement),
            info=loaded.describe(),
            has_chat_template=has_chat_template(loaded.tokenizer, loaded.processor),
            takes_images=loaded.processor is not None,
            output_controls=tuple(loaded.adapter.output_controls),
            seconds=time.perf_counter() - start,
        )

    return job


def run_job(model: ModelReady, options: dict[str, Any]) -> Task:
    """A comparison of ``options`` (`core.spec.RunSpec` fields by name, checked here: a bad one
    fails the job with its one line): one `RunStarted`, then one `core.results.StepResult` per
    token, then (analyses asked) one `AnalysisReady`. An ``image`` is a picture's path, absorbed
    with the context (image+text models)."""

    def job(should_stop: StopFn, progress: ProgressFn) -> Iterator[Any]:
        from dataclasses import replace

        from ..core.compare import iter_token_patches
        from ..core.plan import RunPlan
        from ..core.runs import prepare, prompt_of
        from ..core.spec import from_options

        loaded = model.handle
        spec = from_options(options)
        prompt = prompt_of(loaded, spec, prepare(spec))
        plan = RunPlan.build(loaded, prompt, spec)  # (its spec says which control row runs)
        yield RunStarted(
            settings={**plan.spec.to_dict(), "device": str(loaded.device)},
            prompt=replace(prompt, pixels=None),  # the window gets no tensors
            layers=tuple(plan.sites),
            num_layers=int(model.info["num_layers"]),
            output_control=plan.patch.output_control,
            model=model.info,
            plan=tuple(plan.report),
        )
        # (the window's progress follows the tokens as they arrive in RunState)
        steps = []
        for step in iter_token_patches(loaded, prompt, plan.spec, should_stop, plan):
            steps.append(step)
            yield step
        transfer = None
        if "transfer" in plan.spec.analyze and steps and not should_stop():
            ready = transfer_ready(loaded, steps, plan.spec.scope, prompt.pixels, should_stop,
                                   progress)
            transfer = ready.section
            yield ready
        if plan.spec.analyze and steps and not should_stop():
            from ..core.analysis import analysis_section

            # here, not on the GUI thread: the geometry of 20 demo tokens takes 1-2 s
            progress("Analysing the run's patches…", len(steps), len(steps))
            yield AnalysisReady(len(steps), analysis_section(steps, plan.spec.analyze, transfer),
                                transfer)

    return job


@dataclass(frozen=True)
class TransferReady:
    """A run's transfer (`core.transfer.transfer`'s JSON-ready section), computed after its
    last token."""

    section: dict[str, Any]


def transfer_ready(loaded: Any, steps: list[Any], scope: str, pixels: Any, should_stop: StopFn,
                   progress: ProgressFn) -> TransferReady:
    """The transfer of a run's steps, with progress ("Transfer: pass d of n") and cancel
    between passes (`core.errors.Cancelled`: the run keeps its steps, without a transfer)."""
    from ..core.transfer import transfer

    n = len(steps)
    progress(f"Transfer: each of {n} tokens' patches at every token…", 0, 0)
    section = transfer(loaded, steps, scope, pixels=pixels, should_stop=should_stop,
                       progress=lambda done, total: progress(
                           f"Transfer: pass {done} of {total}", done, total))
    return TransferReady(section)


@dataclass(frozen=True)
class AnalysisReady:
    """A finished run's analyses (`core.analysis.analysis_section`), computed on the worker."""

    steps: int  # how many steps they cover
    section: dict[str, Any] | None
    transfer: dict[str, Any] | None = None  # the `TransferReady` section it includes


@dataclass(frozen=True)
class SessionReady:
    """A session file read and checked, with the run it shows rebuilt (no model involved)."""

    path: str
    data: dict[str, Any]  # app.session.load_session: the JSON data, schema 1
    index: int | None  # the run shown (None: a session without runs)
    run: Any  # core.record.RunRecord of that run (plain steps, no tensors), or None


def session_job(path: str) -> Task:
    """Open a session: read and check it, then rebuild the run it shows. A 9,000-token run takes
    seconds to check and rebuild, so a large file is read here, never on the GUI thread."""

    def job(should_stop: StopFn, progress: ProgressFn) -> Iterator[Any]:
        from ..core.errors import Cancelled
        from .session import load_session, shown_run

        progress(f"Reading the session {path}…", 0, 2)
        data = load_session(path, should_stop)
        if should_stop():
            raise Cancelled
        progress(f"Rebuilding the runs of {path}…", 1, 2)
        index, run = shown_run(data, f"the session {path}")
        progress(f"Opened {path}", 2, 2)
        yield SessionReady(path, data, index, run)

    return job


@dataclass(frozen=True)
class KnockoutReady:
    """The knock-out of one step (`core.knockout.knockout`'s plain dict)."""

    step: int
    result: dict[str, Any]


def knockout_job(model: ModelReady, step: Any, scope: str) -> Task:
    """The knock-out of each patched layer at ``step`` (a `core.results.StepResult` that kept
    its patches, opaque here), one reduced forward per layer, with progress and cancel."""

    def job(should_stop: StopFn, progress: ProgressFn) -> Iterator[Any]:
        from ..core.knockout import knockout

        token = step.step + 1
        progress(f"Knock-out at token {token}…", 0, 0)
        result = knockout(model.handle, step, scope, should_stop=should_stop,
                          progress=lambda done, total: progress(
                              f"Knock-out at token {token}: pass {done} of {total}", done, total))
        yield KnockoutReady(step.step, result)

    return job


@dataclass(frozen=True)
class DynamicsReady:
    """A context-dynamics result as its plain record (`core.dynamics.Dynamics.to_dict`)."""

    record: dict[str, Any]


def dynamics_job(model: ModelReady, options: dict[str, Any]) -> Task:
    """The context dynamics of ``options`` (`core.dynamics.OPTIONS` by name: the context read
    token by token, the query fixed), one comparison step per context prefix, with progress
    ("context prefix i of n") and cancel between prefixes and layers."""

    def job(should_stop: StopFn, progress: ProgressFn) -> Iterator[Any]:
        from ..core.dynamics import dynamics
        from ..core.spec import from_options

        spec = from_options(options)
        progress("Dynamics: tokenizing the context…", 0, 0)
        result = dynamics(model.handle, spec, should_stop=should_stop,
                          progress=lambda done, total: progress(
                              f"Dynamics: context prefix {done} of {total}", done, total))
        yield DynamicsReady(result.to_dict())

    return job
