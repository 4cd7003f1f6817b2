"""``ctxpatch reproduce`` on a prompt set: the request (every option checked before any run),
its runs (here or on a Ray cluster, `core.sets.run_jobs`), the statistics
(`core.setstats`), summary.json with summary.csv and prompts.csv (`core.sets.write_summary`)
and the report (`app.reproduce.write_reproduction`). The command line, the Python API
(``ctxpatch.reproduce``) and the window's File > Run a prompt set… all call `execute`.

No Qt here until the report is drawn.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import UserError
from ..core.options import ANALYSES, DTYPES, METHODS


def add_set_arguments(p: argparse.ArgumentParser) -> None:
    """The grid's options beyond ``--dtypes`` and ``--prompts``, and the cluster's."""
    p.add_argument("--methods", default="direct,stable",
                   help="methods to run, separated by commas (default direct,stable)")
    p.add_argument("--absorb", default="all",
                   help="absorb modes, separated by commas: all (the paper's protocol, the "
                        "default) and/or context (needs each row's context)")
    p.add_argument("--layers", action="append", default=None, metavar="SPEC",
                   help="patched layers of each run: all (default), a start '10:', a range, a "
                        "list '0,5,17'; repeat the option for a grid of several")
    p.add_argument("--analyze", default=None, metavar="A,B",
                   help="add analyses to every run: lens, geometry, transfer, comma-separated, "
                        "or all")
    p.add_argument("--resamples", type=int, default=None,
                   help="bootstrap resamples of the 95%% intervals (default 2000)")
    p.add_argument("--seed", type=int, default=None,
                   help="the bootstrap's random seed (default 0)")
    p.add_argument("--ray", default=None, metavar="auto|ADDRESS",
                   help="run the (prompt, setting) runs on a Ray cluster: auto (a running "
                        "local cluster, else a new one on this machine) or a head's address "
                        "(ray start --head); one actor per GPU or CPU slot, the model loaded "
                        "once per actor (pip install \"ctxpatch[cluster]\")")


@dataclass
class SetRequest:
    """A reproduction, checked: which prompts, which grid, where the runs go."""

    model: str = "demo"
    out: Path = Path("ctxpatch-reproduction")
    rows: list[Any] = field(default_factory=list)  # core.promptset.PromptRow
    where: str = "the paper's prompts"  # the set's source, for messages
    paper: bool = True  # the paper's prompts (the report lists them as the paper does)
    dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    absorbs: list[str] = field(default_factory=lambda: ["all"])
    layers: list[str] = field(default_factory=lambda: ["all"])
    analyze: tuple[str, ...] = ()
    tokens: int = 20
    device: str = "auto"
    sweep: list[int] | None = None  # None: five spread over the model; []: none
    image: str | None = None  # the paper's image run (Figure 5)
    ray: str | None = None
    resamples: int = 2000
    seed: int = 0


#: the most bootstrap resamples (the statistics come after the whole set: an absurd count must
#: be refused before it, not run out of memory after hours of runs)
MAX_RESAMPLES = 100_000


def request(prompts: Any = 5, *, model: str = "demo", out: str | Path = "ctxpatch-reproduction",
            dtypes: Any = "float32,bfloat16", methods: Any = "direct,stable",
            absorb: Any = "all", layers: Any = None, analyze: Any = None,
            max_new_tokens: int = 20, device: str = "auto", sweep: Any = None,
            image: str | None = None, ray: str | None = None, resamples: int | None = None,
            seed: int | None = None) -> SetRequest:
    """A `SetRequest` from loose values (the command line's strings, or the API's lists),
    every check made before any run.

    Raises:
        UserError: a bad option or a bad row of the prompt set (with its line).
    """
    from ..core import promptset
    from ..core.experiments import PAPER_PROMPTS
    from ..core.outputs import run_inputs
    from ..core.spec import parse_layers

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file: give a folder (new, or an earlier "
                        "reproduction's, which resumes)")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    text = str(prompts)
    if text.isdigit():
        n = int(text)
        if not 1 <= n <= len(PAPER_PROMPTS):
            raise UserError(f"--prompts must be between 1 and {len(PAPER_PROMPTS)} (or a "
                            f"prompt set's file, or {promptset.DEMO_SET})")
        rows, where, paper = promptset.paper_set(n), "the paper's prompts", True
    else:
        rows, where, paper = promptset.read_set(text), text, False
    _check_out(out, run_inputs(model, image, None if paper else text, *(r.image for r in rows)))
    req = SetRequest(model=model, out=out, rows=rows, where=where, paper=paper,
                     dtypes=_listed(dtypes, "--dtypes", DTYPES),
                     methods=_listed(methods, "--methods", METHODS),
                     absorbs=_listed(absorb, "--absorb", ("all", "context")),
                     tokens=max_new_tokens, device=device, image=image, ray=ray)
    if layers:
        req.layers = list(dict.fromkeys([layers] if isinstance(layers, str) else layers))
        for spec in req.layers:
            try:
                parse_layers(spec, None)
            except UserError as exc:
                raise UserError(f"--layers {spec!r}: {exc.args[0]}") from None
    if analyze:
        from ..core.spec import _commas

        try:
            chosen = _commas(ANALYSES)(analyze if isinstance(analyze, str) else ",".join(analyze))
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise UserError(f"--analyze {analyze!r}: {exc}") from None
        req.analyze = tuple(sorted(chosen))
    if sweep is not None:
        req.sweep = _sweep(sweep)
    for name, value, low, high in (("--resamples", resamples, 100, MAX_RESAMPLES),
                                   ("--seed", seed, 0, 2**32 - 1)):
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise UserError(f"{name} must be a whole number from {low} to {high:,}")
            setattr(req, name.removeprefix("--"), value)
    if ray is not None:
        from ..core.cluster import check_ray

        check_ray(ray)
    return req


def _check_out(out: Path, inputs: Sequence[str | None]) -> None:
    """Refuse an output folder that is, holds or lies inside what the set reads (the prompt
    set's file, a row's picture, the model's folder or the demo's cache): the set writes
    summary.csv, prompts.csv, the report and the runs there, over whatever has those names.

    Raises:
        UserError: one line naming the folder and the input.
    """
    from ..core.outputs import input_at

    given = input_at(out, inputs)
    if given is not None:
        raise UserError(f"--out {out} would write beside or over {given}, which the set "
                        "reads: give a folder of its own")


def _listed(value: Any, what: str, allowed: Sequence[str]) -> list[str]:
    from ..core.sets import parse_list

    text = value if isinstance(value, str) else ",".join(map(str, value))
    return parse_list(text, what, allowed)


def _sweep(value: Any) -> list[int]:
    if isinstance(value, str):
        if value.strip().lower() == "none":
            return []
        from .reproduce import _sweep as parse

        return parse(value) or []
    return [int(x) for x in value]


def request_of(args: argparse.Namespace) -> SetRequest:
    """The command line's `SetRequest`."""
    return request(args.prompts, model=args.model, out=args.out, dtypes=args.dtypes,
                   methods=args.methods, absorb=args.absorb, layers=args.layers,
                   analyze=args.analyze, max_new_tokens=args.max_new_tokens, device=args.device,
                   sweep=args.sweep, image=_image(args.image), ray=args.ray,
                   resamples=args.resamples, seed=args.seed)


def _image(value: str | None) -> str | None:
    if value is None:
        return None
    from ..resources import sample_image_path

    return sample_image_path() if value == "sample" else value


@dataclass
class SetResult:
    """What a reproduction wrote and its numbers."""

    report: Path
    records: dict[str, dict[str, Any]]
    summary: list[dict[str, Any]]  # Figure 4's rows, per setting
    statistics: dict[str, Any]  # core.setstats.set_statistics


def jobs_of(req: SetRequest) -> list[Any]:
    from ..core.sets import set_jobs, settings

    return set_jobs(req.rows, settings(req.dtypes, req.methods, req.absorbs, req.layers),
                    req.analyze)


def check(req: SetRequest) -> list[Any]:
    """Every check that needs no run: the grid's jobs, the sweep's range, the image run's model,
    and the saved runs this folder would reuse (never mixed with other options). Returns the
    set's jobs."""
    from ..core.experiments import check_resumable
    from ..core.sets import check_jobs
    from .reproduce import _check_sweep_range, _image_model_check

    jobs = jobs_of(req)
    check_jobs(jobs, req.rows, req.model, req.tokens, req.device, req.where)
    if req.sweep:
        _check_sweep_range(req.model, req.sweep)
    if req.image is not None:
        from ..core.images import read_image

        read_image(req.image)  # a bad file fails before any run
        _image_model_check(req.model)
    check_resumable(req.out, [*jobs, *_saved_sweep(req)], req.model, req.tokens, req.device)
    return jobs


def _saved_sweep(req: SetRequest) -> list[Any]:
    """The sweep's jobs whose runs this folder already holds (the sweep runs after the whole
    grid: a folder of another set must be refused before the grid, not after it)."""
    from ..core.sets import sweep_jobs

    if req.sweep is not None:
        layers = list(req.sweep)
    else:  # (the default sweep's layers need the model: those saved are what could clash)
        names = (p.stem.removeprefix("sweep-s") for p in (req.out / "runs").glob("sweep-s*.json"))
        layers = sorted(int(n) for n in names if n.isdigit())
    return sweep_jobs(req.rows[0], req.dtypes[0], req.absorbs[0], layers, req.analyze)


@dataclass
class SetRun:
    """A finished set's runs and numbers, before its report is drawn (plain data: the window's
    worker hands it to the GUI thread, which draws)."""

    records: dict[str, dict[str, Any]]
    jobs: list[Any]
    summary: list[dict[str, Any]]
    sweep: list[dict[str, Any]]
    statistics: dict[str, Any]


def run_set(req: SetRequest, say: Callable[[str], None],
            should_stop: Callable[[], bool] | None = None,
            on_record: Callable[[Any, dict[str, Any]], None] | None = None) -> SetRun:
    """Run the set (and the sweep and the image run), then write summary.json and the tables;
    no Qt. A stop (``should_stop``, Ctrl+C) raises KeyboardInterrupt with every finished run
    kept under ``out/runs``."""
    from ..core import experiments as ex
    from ..core.sets import run_jobs, sweep_jobs, write_summary
    from ..core.setstats import set_statistics

    jobs = check(req)
    req.out.mkdir(parents=True, exist_ok=True)
    records = run_jobs(req.model, req.out, jobs, req.tokens, req.device, say, should_stop,
                       req.ray, on_record=on_record)
    num_layers = int(next(iter(records.values()))["model"]["num_layers"])
    layers = req.sweep if req.sweep is not None else ex.default_sweep(num_layers)
    if any(x >= num_layers for x in layers):
        raise UserError(f"--sweep {','.join(map(str, layers))}: the model has layers 0 to "
                        f"{num_layers - 1}")
    sweep = sweep_jobs(req.rows[0], req.dtypes[0], req.absorbs[0], layers, req.analyze)
    if sweep:
        records.update(run_jobs(req.model, req.out, sweep, req.tokens, req.device, say,
                                should_stop, None, on_record=on_record))
    if req.image is not None:
        records.update(ex.run_grid(req.model, req.out, ex.image_grid(req.dtypes), req.tokens,
                                   req.device, say, should_stop, image=req.image))
    stats = set_statistics(records, jobs, req.resamples, req.seed)
    rows = ex.summary(records, jobs)
    sweep_rows = ex.sweep_rows(records, layers)
    data = {"model": req.model, "prompts": {"source": req.where,
                                            "rows": [r.to_dict() for r in req.rows]},
            "tokens": req.tokens, "summary": rows, "sweep": sweep_rows}
    write_summary(req.out, data, stats)
    return SetRun(records, jobs, rows, sweep_rows, stats)


def write_report(req: SetRequest, done: SetRun) -> SetResult:
    """report.html and plots/ (Qt: on the GUI thread where there is one)."""
    from .reproduce import write_reproduction

    report = write_reproduction(req, done.records, done.summary, done.sweep, done.statistics,
                                done.jobs)
    return SetResult(report, done.records, done.summary, done.statistics)


def execute(req: SetRequest, say: Callable[[str], None],
            should_stop: Callable[[], bool] | None = None,
            on_record: Callable[[Any, dict[str, Any]], None] | None = None) -> SetResult:
    """`run_set`, then `write_report`."""
    return write_report(req, run_set(req, say, should_stop, on_record))
