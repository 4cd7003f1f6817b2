"""ctxpatch as a library, for notebooks and scripts: the same comparisons, checks and files as the
command line (``ctxpatch compare`` / ``ctxpatch verify``) and the window.

    import ctxpatch

    model = ctxpatch.load("demo")                       # or a hub id, a folder, "smollm2"
    run = ctxpatch.compare(model, absorb="all", query="Write a single-sentence weather "
                           "forecast for Mars, from the perspective of a slightly annoyed robot:",
                           max_new_tokens=5)
    run.summary["patched"]["matches"]                   # 5
    run.save_patches("mars.safetensors")
    ctxpatch.verify("mars.safetensors", model=model).ok  # True

Options are the fields of `ctxpatch.core.spec.RunSpec`, the command line's long names with
underscores (``max_new_tokens``, ``method``, ``absorb``, ``scope``, ``layers``,
``output_control``, ``disabled``, ``top_k``, ``on_fault``, ...), with the same defaults and the
same checks: a bad option raises `OptionError` (a `ValueError`) with a one-line message, before
any work. This package never imports the window (``ctxpatch.app``) except to draw a report.
``progress`` is called with each finished step; ``cancel`` (a ``threading.Event`` or a function
returning True) stops the run between layers and tokens, as the window's Esc does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# In a checkout the packages sit beside this folder (app/, core/, resources/); once installed,
# setuptools puts them inside it (pyproject's package-dir). Either way they are ctxpatch.*.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.path.isdir(os.path.join(os.path.dirname(__file__), "core")) and os.path.isfile(
        os.path.join(_ROOT, "core", "__init__.py")):
    __path__.append(_ROOT)  # noqa: F821 - the package's own search path

from ctxpatch.core import __version__  # noqa: E402
from ctxpatch.core.errors import Cancelled, UserError  # noqa: E402

__all__ = ["Cancelled", "OptionError", "Run", "UserError", "VerifyResult", "__version__",
           "compare", "compile", "dynamics", "load", "reproduce", "verify"]


class OptionError(UserError, ValueError):
    """A bad option or input, with the command line's one-line message."""


#: compare's command-line options that write files: a `Run` has methods for them instead
_FILE_OPTIONS = {"json": "Run.to_json", "csv": "Run.to_csv", "save_patches": "Run.save_patches",
                 "report": "Run.report", "quiet": None}


def _stop_fn(cancel: Any) -> Callable[[], bool] | None:
    if cancel is None:
        return None
    if callable(getattr(cancel, "is_set", None)):
        return cancel.is_set
    if callable(cancel):
        return cancel
    raise OptionError("cancel must be a threading.Event or a function returning True to stop")


def _spec(options: dict[str, Any]) -> Any:
    """A `RunSpec` from keyword arguments (`core.spec.from_options`), as an `OptionError`."""
    from .core.spec import from_options

    try:
        return from_options(options)
    except UserError as exc:
        raise OptionError(str(exc)) from None


def load(model: str = "demo", *, dtype: str = "float32", device: str = "auto",
         device_map: str | None = None, max_memory: dict[str, str] | list[str] | None = None,
         offload_folder: str | None = None, trust_remote_code: bool = False,
         allow_pickle: bool = False, progress: Callable[[str, int, int], None] | None = None,
         cancel: Any = None) -> Any:
    """Load a model once for many runs (`ctxpatch.core.loading.LoadedModel`): "demo",
    "smollm2", a hub id (the local cache first) or a model folder."""
    from .core.runs import load as load_spec

    spec = _spec({"model": model, "dtype": dtype, "device": device, "device_map": device_map,
                  "max_memory": max_memory, "offload_folder": offload_folder,
                  "trust_remote_code": trust_remote_code, "allow_pickle": allow_pickle})
    stop = _stop_fn(cancel)
    try:
        return load_spec(spec, progress=progress, should_stop=stop)
    except UserError as exc:
        raise OptionError(str(exc)) from None


@dataclass
class Run:
    """One comparison: typed steps (`ctxpatch.core.results.StepResult`), the summary, and the
    run record that ``compare --json`` writes for the same options (`to_dict`). Its files are
    checked against the run's inputs (the model's folder, the picture) before they are
    written."""

    steps: list[Any]
    record: dict[str, Any]
    spec: Any  # ctxpatch.core.spec.RunSpec, as the run resolved it
    image: Any = None  # ctxpatch.core.images.ImageInfo of the context's picture
    made_with: Any = None  # what the patches were made with (core.export.patches_made_with)

    @property
    def summary(self) -> dict[str, Any]:
        return self.record["summary"]

    @property
    def analysis(self) -> dict[str, Any] | None:
        """The analyses asked with ``analyze=[...]`` (``"lens"``, ``"geometry"``), as the run
        JSON's ``analysis`` holds them (../shared/ANALYSIS.md "Contracts"); None without."""
        return self.record.get("analysis")

    def to_dict(self) -> dict[str, Any]:
        """The run record (DESIGN.md "Run JSON"), a copy."""
        import copy

        return copy.deepcopy(self.record)

    def _check(self, path: str | Path) -> None:
        from .core.outputs import check_outputs, run_inputs

        try:
            check_outputs({"path": str(path)}, run_inputs(self.spec.model, self.spec.image))
        except UserError as exc:
            raise OptionError(str(exc)) from None

    def to_json(self, path: str | Path) -> None:
        from .core.export import write_json

        self._check(path)
        write_json(path, self.record)

    def to_csv(self, path: str | Path) -> None:
        from .core.export import steps_csv, write_text

        self._check(path)
        write_text(path, steps_csv(self.steps))

    def save_patches(self, path: str | Path) -> int:
        """The patches file (needs ``compare(..., keep_patches=True)``, the default here);
        returns the number of tensors."""
        from .core.export import save_patches

        self._check(path)
        return save_patches(path, self.steps, self.spec.model, self.spec.dtype, self.spec,
                            image=self.image, made_with=self.made_with)

    def report(self, path: str | Path) -> list[Path]:
        """The HTML report, or PDF when ``path`` ends in .pdf, with its plots beside it (drawn
        by the window's report writer: Qt is imported here, and only here)."""
        from .core.outputs import check_report, run_inputs
        from .core.record import read_record

        self._check(path)
        inputs = run_inputs(self.spec.model, self.spec.image)
        try:
            plots = check_report(str(path), inputs)
        except UserError as exc:
            raise OptionError(str(exc)) from None
        from .app.report import write_report

        return write_report(read_record(self.record), path, plots, inputs)

    def to_frame(self) -> Any:
        """One row per step (the CSV's columns) as a pandas DataFrame (pandas must be
        installed)."""
        try:
            import pandas as pd
        except ImportError:
            raise OptionError("Run.to_frame needs pandas: pip install pandas") from None
        import csv
        import io

        from .core.export import steps_csv

        rows = list(csv.DictReader(io.StringIO(steps_csv(self.steps))))
        return pd.DataFrame(rows).apply(pd.to_numeric, errors="ignore")


def compare(model: Any = "demo", *, context: str = "", query: str = "", image: str | None = None,
            progress: Callable[[Any], None] | None = None, cancel: Any = None,
            verify: bool = False, **options: Any) -> Run:
    """Run one comparison, as ``ctxpatch compare`` does, and return the `Run`.

    Args:
        model: a model from `load`, or anything ``--model`` accepts (loaded here, with the
            ``dtype``, ``device``, ... options).
        context, query, image: the prompt, as on the command line.
        progress: called with each `StepResult` as it is finished.
        cancel: a ``threading.Event`` (or a function) that stops the run when set.
        verify: after the run, write each step's patches into the weights and compare
            (``run.record["verification"]``), as ``--verify`` does.
        **options: the run's options by their `ctxpatch.core.spec.RunSpec` names
            (``max_new_tokens``, ``method``, ``absorb``, ``scope``, ``layers``,
            ``output_control``, ``disabled``, ``top_k``, ``on_fault``, ...). The patches are
            kept (``save_patches`` works) unless ``keep_patches=False``.
    """
    from .core.export import patches_made_with
    from .core.loading import LoadedModel
    from .core.runs import compare as run_compare
    from .core.runs import load as load_spec
    from .core.runs import prepare, verify_run

    for key in options:
        if key in _FILE_OPTIONS:
            instead = _FILE_OPTIONS[key]
            raise OptionError(f"option {key!r} writes a file on the command line"
                              + (f": use {instead}(path) on the result" if instead else ""))
    loaded = model if isinstance(model, LoadedModel) else None
    if loaded is not None:
        options.setdefault("dtype", str(loaded.dtype).removeprefix("torch."))
    options.setdefault("keep_patches", True)
    if verify is True:
        options["keep_patches"] = True
    elif verify is not False:
        raise OptionError(f"option verify must be True or False, not {verify!r}")
    spec = _spec({**options, "model": loaded.spec if loaded is not None else model,
                  "context": context, "query": query, "image": image})
    stop = _stop_fn(cancel)
    try:
        picture = prepare(spec)
        if loaded is None:
            loaded = load_spec(spec, should_stop=stop)
        elif str(loaded.dtype).removeprefix("torch.") != spec.dtype:
            raise UserError(f"this model is loaded in {loaded.dtype}, not {spec.dtype}: load "
                            "it again with that dtype")
        done = run_compare(loaded, spec, picture, on_step=progress, should_stop=stop)
    except UserError as exc:
        raise OptionError(str(exc)) from None
    if verify:
        verify_run(loaded, done)
    made_with = (patches_made_with(loaded, done.prompt.image is not None)
                 if spec.keep_patches else None)  # (the weights' fingerprint, for save_patches)
    return Run(done.steps, done.record, done.spec, done.prompt.image, made_with)


def dynamics(context: str, query: str, model: Any = "demo", *,
             progress: Callable[[int, int], None] | None = None, cancel: Any = None,
             keep_patches: bool = True, **options: Any) -> Any:
    """Context dynamics (how the patches grow as the context is read), as ``ctxpatch
    dynamics`` computes them; returns a `ctxpatch.core.dynamics.Dynamics` (``to_dict()`` is the
    ``--json`` record; ``norm``, ``increment``, ``lens``, ``attribution``, ``lens_logit``, ...
    are arrays).

    Args:
        context, query: the prompt; the context is read token by token, the query fixed.
        model: a model from `load`, or anything ``--model`` accepts (loaded here).
        progress: called with (prefixes done, context tokens) after each prefix.
        cancel: a ``threading.Event`` (or a function) that stops the run when set
            (`Cancelled` is raised).
        keep_patches: keep every prefix's patches on the result (``.patches``).
        **options: the command's options by their `ctxpatch.core.spec.RunSpec` names
            (``dtype``, ``device``, ``chat_template``, ``method``, ``layers``,
            ``output_control``, ...: `ctxpatch.core.dynamics.OPTIONS`).
    """
    from .core.dynamics import OPTIONS
    from .core.dynamics import dynamics as run_dynamics
    from .core.loading import LoadedModel
    from .core.runs import load as load_spec
    from .core.runs import prepare

    for key in options:
        if key not in OPTIONS:
            raise OptionError(f"unknown option {key!r} for dynamics: use one of "
                              f"{', '.join(sorted(set(OPTIONS) - {'context', 'query', 'model'}))}")
    loaded = model if isinstance(model, LoadedModel) else None
    if loaded is not None:
        options.setdefault("dtype", str(loaded.dtype).removeprefix("torch."))
    spec = _spec({**options, "model": loaded.spec if loaded is not None else model,
                  "context": context, "query": query})
    stop = _stop_fn(cancel)
    try:
        prepare(spec)
        if loaded is None:
            loaded = load_spec(spec, should_stop=stop)
        elif str(loaded.dtype).removeprefix("torch.") != spec.dtype:
            raise UserError(f"this model is loaded in {loaded.dtype}, not {spec.dtype}: load "
                            "it again with that dtype")
        return run_dynamics(loaded, spec, progress, stop, keep_patches)
    except UserError as exc:
        raise OptionError(str(exc)) from None


@dataclass(frozen=True)
class VerifyResult:
    """``ctxpatch verify``'s answer: ``ok``, the counts and the per-step checks."""

    ok: bool
    matches: int
    steps: int
    worst: float  # the largest L-inf relative to the logit scale
    tolerance: float
    checks: list[Any]
    conditioning: dict[str, Any] | None

    def __bool__(self) -> bool:
        return self.ok


def verify(patches: str | Path, *, model: Any = None, tolerance: float | None = None,
           dtype: str | None = None, image: str | None = None,
           progress: Callable[[int, int], None] | None = None, cancel: Any = None
           ) -> VerifyResult:
    """Write saved patches into a copy of the weights, run plain transformers, and compare, as
    ``ctxpatch verify`` does. ``model``: a model from `load` (its dtype is used), anything
    ``--model`` accepts, or None for the one the file names."""
    from .core.loading import LoadedModel
    from .core.runs import default_tolerance, verdict
    from .core.verify import image_pixels, read_patches, recorded_image, verify_patches

    try:
        default_tolerance("float64", tolerance)
        pf = read_patches(patches)
        if isinstance(model, LoadedModel):
            loaded = model
            dtype = str(model.dtype).removeprefix("torch.")
        else:
            dtype = dtype or pf.metadata.get("dtype", "float32")
            loaded = load(model or pf.metadata.get("model") or "demo", dtype=dtype)
        pixels = image_pixels(loaded, recorded_image(pf, image))
        checks = verify_patches(loaded, pf, progress=progress, should_stop=_stop_fn(cancel),
                                pixels=pixels)
        result = verdict(checks, default_tolerance(dtype, tolerance))
    except OptionError:
        raise
    except UserError as exc:
        raise OptionError(str(exc)) from None
    return VerifyResult(result.ok, result.matches, result.steps, result.worst,
                        result.tolerance, checks, pf.conditioning)


def compile(context: str, queries: Any, *, held_out: Any = (), model: Any = "demo",
            rank: int = 8, ridge: float = 1e-3, max_new_tokens: int = 8,
            progress: Callable[[str], None] | None = None, cancel: Any = None,
            **options: Any) -> Any:
    """Compile ``context`` into one weight delta per layer from the training ``queries`` (a
    string or a list; ``held_out``: at least one query the fit never sees), as ``ctxpatch
    compile`` does (../shared/ANALYSIS.md A4); returns a
    `ctxpatch.core.compile.Compiled` with ``evaluate(ranks=..., ridges=...)``,
    ``generate(query)``, ``save_adapter(folder)`` (a PEFT LoRA) and ``to_dict()``.
    ``model``: a model from `load` or anything ``--model`` accepts (loaded with ``options``:
    ``dtype``, ``device``, ...)."""
    from .core.compile import compile_context, rank_limit
    from .core.compile_record import check_rank, check_request
    from .core.loading import LoadedModel

    queries = [queries] if isinstance(queries, str) else list(queries)
    held_out = [held_out] if isinstance(held_out, str) else list(held_out)
    try:
        check_request(queries, held_out, rank, ridge, (), max_new_tokens, front="python",
                      context=context)
        loaded = model if isinstance(model, LoadedModel) else load(model, **options)
        check_rank(rank_limit(loaded), rank, front="python")
        return compile_context(loaded, context, queries, held_out, rank=rank, ridge=ridge,
                               max_new_tokens=max_new_tokens, say=progress,
                               should_stop=_stop_fn(cancel))
    except OptionError:
        raise
    except UserError as exc:
        raise OptionError(str(exc)) from None


def reproduce(prompts: Any = 5, *, out: str | Path = "ctxpatch-reproduction",
              model: str = "demo", ray: str | None = None,
              progress: Callable[[str], None] | None = None, cancel: Any = None,
              **options: Any) -> Any:
    """Run a prompt set's grid, as ``ctxpatch reproduce`` does, into ``out`` (runs/, the
    report, summary.json, summary.csv, prompts.csv; an interrupted set resumes there).

    Args:
        prompts: the first N of the paper's five prompts, a .jsonl/.csv file of rows (query,
            optionally context, image, id), or ``"demo-set"``.
        ray: ``"auto"`` or a Ray cluster's address: the runs go to its actors
            (``pip install "ctxpatch[cluster]"``).
        **options: ``dtypes``, ``methods``, ``absorb``, ``layers`` (a spec or a list of them),
            ``analyze``, ``max_new_tokens``, ``device``, ``sweep`` (layers, or "none"),
            ``image``, ``resamples``, ``seed`` (strings as on the command line, or lists).
    Returns:
        `ctxpatch.app.reproduce_set.SetResult`: ``report`` (its path), ``statistics`` (the
        intervals per setting), ``summary`` and ``records``. The report is drawn with Qt.
    """
    import inspect

    from .app.reproduce_set import execute, request

    known = set(inspect.signature(request).parameters) - {"prompts", "model", "out", "ray"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise OptionError(f"reproduce: unknown option {unknown[0]!r} (known: "
                          f"{', '.join(sorted(known))})")
    stop = _stop_fn(cancel)
    try:
        req = request(prompts, model=model, out=out, ray=ray, **options)
        return execute(req, progress or (lambda line: None), stop)
    except OptionError:
        raise
    except UserError as exc:
        raise OptionError(str(exc)) from None
    except KeyboardInterrupt:  # (how a set stops: a cancel is `Cancelled`, as elsewhere here)
        if stop is not None and stop():
            raise Cancelled("the prompt set was cancelled; its finished runs are kept") from None
        raise
