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

Options are the command line's long names with underscores (``max_new_tokens``, ``method``,
``absorb``, ``scope``, ``layers``, ``output_control``, ``disable``, ``top_k``, ...), with the
same defaults and the same checks: a bad option raises `OptionError` (a `ValueError`) with the
command line's one-line message, before any work. ``progress`` is called with each finished
step; ``cancel`` (a ``threading.Event`` or a function returning True) stops the run between
layers and tokens, as the window's Esc does.
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
           "compare", "load", "verify"]


class OptionError(UserError, ValueError):
    """A bad option or input, with the command line's one-line message."""


#: compare's options that write files: a `Run` has methods for them instead
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


def _options(command: str, given: dict[str, Any]) -> Any:
    """The command's options as the command line parses them (its defaults), with ``given``
    set by name; an unknown name is an `OptionError`."""
    from ctxpatch.app.cli import build_parser

    args = build_parser().parse_args([command] + (["x"] if command == "verify" else []))
    for key, value in given.items():
        if key not in vars(args) or key == "command":
            known = ", ".join(sorted(k for k in vars(args) if k != "command"))
            raise OptionError(f"unknown option {key!r}: use one of {known}")
        setattr(args, key, value)
    return args


def load(model: str = "demo", *, dtype: str = "float32", device: str = "auto",
         device_map: str | None = None, max_memory: dict[str, str] | list[str] | None = None,
         offload_folder: str | None = None, trust_remote_code: bool = False,
         allow_pickle: bool = False, progress: Callable[[str, int, int], None] | None = None,
         cancel: Any = None) -> Any:
    """Load a model once for many runs (`ctxpatch.core.loading.LoadedModel`): "demo",
    "smollm2", a hub id (the local cache first) or a model folder."""
    from ctxpatch.app.cli import placement
    from ctxpatch.core.loading import load_model

    if isinstance(max_memory, dict):
        max_memory = [f"{k}={v}" for k, v in max_memory.items()]
    args = _options("compare", {"model": model, "dtype": dtype, "device": device,
                                "device_map": device_map, "max_memory": max_memory,
                                "offload_folder": offload_folder})
    try:
        chosen = placement(args)
        return load_model(model, dtype=dtype, device=device, progress=progress,
                          should_stop=_stop_fn(cancel), trust_remote_code=trust_remote_code,
                          allow_pickle=allow_pickle, placement=chosen)
    except UserError as exc:
        raise OptionError(str(exc)) from None


@dataclass
class Run:
    """One comparison: typed steps (`ctxpatch.core.results.StepResult`), the summary, and the
    run record that ``compare --json`` writes for the same options (`to_dict`)."""

    steps: list[Any]
    record: dict[str, Any]
    model_id: str
    dtype: str
    settings: Any
    image: Any = None

    @property
    def summary(self) -> dict[str, Any]:
        return self.record["summary"]

    def to_dict(self) -> dict[str, Any]:
        """The run record (DESIGN.md "Run JSON"), a copy."""
        import copy

        return copy.deepcopy(self.record)

    def to_json(self, path: str | Path) -> None:
        from ctxpatch.core.export import write_json
        from ctxpatch.core.outputs import check_outputs

        check_outputs({"path": str(path)})
        write_json(path, self.record)

    def to_csv(self, path: str | Path) -> None:
        from ctxpatch.core.export import steps_csv, write_text
        from ctxpatch.core.outputs import check_outputs

        check_outputs({"path": str(path)})
        write_text(path, steps_csv(self.steps))

    def save_patches(self, path: str | Path) -> int:
        """The patches file (needs ``compare(..., keep_patches=True)``, the default here);
        returns the number of tensors."""
        from ctxpatch.core.export import save_patches
        from ctxpatch.core.outputs import check_outputs

        check_outputs({"path": str(path)})
        return save_patches(path, self.steps, self.model_id, self.dtype, self.settings,
                            image=self.image)

    def report(self, path: str | Path) -> list[Path]:
        """The HTML report, or PDF when ``path`` ends in .pdf, with its plots beside it."""
        from ctxpatch.app.report import write_report
        from ctxpatch.core.outputs import check_outputs, check_report
        from ctxpatch.core.records import run_from_record

        check_outputs({"path": str(path)})
        plots = check_report(str(path))
        return write_report(run_from_record(self.record), path, plots)

    def to_frame(self) -> Any:
        """One row per step (the CSV's columns) as a pandas DataFrame (pandas must be
        installed)."""
        try:
            import pandas as pd
        except ImportError:
            raise OptionError("Run.to_frame needs pandas: pip install pandas") from None
        import csv
        import io

        from ctxpatch.core.export import steps_csv

        rows = list(csv.DictReader(io.StringIO(steps_csv(self.steps))))
        return pd.DataFrame(rows).apply(pd.to_numeric, errors="ignore")


def compare(model: Any = "demo", *, context: str = "", query: str = "", image: str | None = None,
            progress: Callable[[Any], None] | None = None, cancel: Any = None,
            **options: Any) -> Run:
    """Run one comparison, as ``ctxpatch compare`` does, and return the `Run`.

    Args:
        model: a model from `load`, or anything ``--model`` accepts (loaded here, with the
            ``dtype``, ``device``, ... options).
        context, query, image: the prompt, as on the command line.
        progress: called with each `StepResult` as it is finished.
        cancel: a ``threading.Event`` (or a function) that stops the run when set.
        **options: compare's long option names with underscores. The patches are kept
            (``save_patches`` works) unless ``keep_patches=False``.
    """
    from ctxpatch.app.cli import check_request, run_extra
    from ctxpatch.core.loading import LoadedModel
    from ctxpatch.core.prompt import build_prompt
    from ctxpatch.core.runs import run_comparison

    keep = bool(options.pop("keep_patches", True))
    for key in options:
        if key in _FILE_OPTIONS:
            instead = _FILE_OPTIONS[key]
            raise OptionError(f"option {key!r} writes a file on the command line"
                              + (f": use {instead}(path) on the result" if instead else ""))
    loaded_given = isinstance(model, LoadedModel)
    spec = model.spec if loaded_given else model
    if loaded_given and "dtype" not in options:
        options["dtype"] = str(model.dtype).removeprefix("torch.")
    args = _options("compare", {**options, "model": spec, "context": context, "query": query,
                                "image": image})
    stop = _stop_fn(cancel)
    try:
        settings, picture = check_request(args)
        if keep:
            import dataclasses

            settings = dataclasses.replace(settings, keep_patches=True)
        if loaded_given:
            if str(model.dtype).removeprefix("torch.") != args.dtype:
                raise UserError(f"this model is loaded in {model.dtype}, not {args.dtype}: load "
                                "it again with that dtype")
            loaded = model
        else:
            loaded = load(spec, dtype=args.dtype, device=args.device, device_map=args.device_map,
                          max_memory=args.max_memory, offload_folder=args.offload_folder,
                          trust_remote_code=args.trust_remote_code,
                          allow_pickle=args.allow_pickle, cancel=cancel)
        prompt = build_prompt(loaded.tokenizer, args.context, args.query, args.chat_template,
                              image=picture, processor=loaded.processor)
        run = run_comparison(loaded, prompt, settings, run_extra(args, str(loaded.device)),
                             on_step=progress, should_stop=stop)
    except OptionError:
        raise
    except UserError as exc:
        raise OptionError(str(exc)) from None
    if args.verify:
        from ctxpatch.app.cli import _Progress, _verify_run

        run.record["verification"] = _verify_run(loaded, run.steps, settings, args.dtype,
                                                 _Progress(True), prompt.pixels)
    return Run(run.steps, run.record, spec, args.dtype, settings, prompt.image)


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
    from ctxpatch.core.loading import LoadedModel
    from ctxpatch.core.runs import default_tolerance, verdict
    from ctxpatch.core.verify import image_pixels, read_patches, recorded_image, verify_patches

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
