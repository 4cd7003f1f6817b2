"""Checking a command's output paths before any work (nothing computed is lost, nothing read is
overwritten). Torch-free: the command line calls it before a model loads.

``-`` names standard output wherever a text output is written (JSON, CSV); binary outputs (the
patches file, a PDF report) and the report with its plots folder need a file name.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from .errors import UserError

#: the output name meaning standard output
STDOUT = "-"


def _real(path: str | os.PathLike[str]) -> Path:
    """The path with symlinks and ``..`` resolved (what a write would actually touch)."""
    return Path(os.path.realpath(os.path.expanduser(os.fspath(path))))


def _inside(path: Path, folder: Path) -> bool:
    return folder == path or folder in path.parents


def check_outputs(outputs: Mapping[str, str | None], inputs: Iterable[str | None] = (),
                  text: Iterable[str] = ()) -> None:
    """Refuse, before any work, an output that cannot be written, that would overwrite an input
    of the run (a file, or an existing file inside an input folder such as the model's), or that
    names the same file as another output (symlinks resolved).

    Args:
        outputs: option name (``--json``) -> the path given, or None when not asked for.
        inputs: the paths the run reads (model folder or file, patches file, picture); names
            that are not existing paths (a hub id, ``demo``) are ignored.
        text: the options among ``outputs`` that may be ``-`` (standard output).

    Raises:
        UserError: one line naming the option, the path and what to do.
    """
    text = set(text)
    read = [_real(p) for p in inputs if p and os.path.exists(os.path.expanduser(p))]
    seen: dict[Path, str] = {}
    to_stdout = [opt for opt, p in outputs.items() if p == STDOUT]
    for opt in to_stdout:
        if opt not in text:
            raise UserError(f"{opt} cannot go to standard output ('-'): give a file name")
    if len(to_stdout) > 1:
        raise UserError(f"only one output can go to standard output ('-'): "
                        f"{' and '.join(to_stdout)} both ask for it")
    for opt, path in outputs.items():
        if path is None or path == STDOUT:
            continue
        if not path.strip():
            raise UserError(f"{opt} is empty: give a file name")
        real = _real(path)
        for source in read:
            if real == source or (source.is_dir() and _inside(real, source) and real.exists()):
                raise UserError(f"{opt} {path} would overwrite {source}, which this run reads: "
                                "choose another file name")
        if real in seen:
            raise UserError(f"{opt} and {seen[real]} name the same file ({path}): "
                            "give each its own name")
        seen[real] = opt
        parent = real.parent
        if not parent.is_dir():
            raise UserError(f"cannot write {path}: folder {parent} does not exist")
        if not os.access(parent, os.W_OK):
            raise UserError(f"cannot write {path}: folder {parent} is not writable")
        if real.is_dir():
            raise UserError(f"cannot write {path}: it is a folder")
        if real.exists() and not real.is_file():
            raise UserError(f"cannot write {path}: it is not a regular file (a pipe or a device)")


#: what a report is written as, by its suffix (anything else is refused, not written as HTML)
REPORT_SUFFIXES = (".html", ".htm", ".pdf")


def input_at(folder: str | os.PathLike[str], inputs: Iterable[str | None]) -> str | None:
    """The first of ``inputs`` (existing paths; a hub id or "demo" is skipped) that an output
    ``folder`` is, lies in or holds, symlinks resolved; None when the folder touches none (an
    adapter folder, a prompt set's output folder)."""
    where = _real(folder)
    for source in (p for p in inputs if p and os.path.exists(os.path.expanduser(p))):
        real = _real(source)
        if _inside(real, where) or _inside(where, real):
            return source
    return None


def check_report(path: str | None, inputs: Iterable[str | None] = ()) -> Path | None:
    """The report's plots folder (``NAME_plots`` beside it), refused before any work when it
    exists as a file or holds an input of the run (the plots would replace it), or when the
    report's name is not .html or .pdf; None when no report is asked for."""
    if path is None:
        return None
    report = Path(path)
    if report.suffix.lower() not in REPORT_SUFFIXES:
        raise UserError(f"the report {path} must end in .html or .pdf (it is written as one of "
                        "those): rename it")
    plots = report.with_name(f"{report.stem}_plots")
    if plots.exists() and not plots.is_dir():
        raise UserError(f"cannot write the report's plots into {plots}: a file has that name "
                        "(move it, or name the report differently)")
    folder = _real(plots)
    for source in (p for p in inputs if p and os.path.exists(os.path.expanduser(p))):
        real = _real(source)
        if _inside(real, folder):
            held = "" if real == folder else f", which holds {source}"
            raise UserError(f"the report's plots go into {plots}{held}, which this run reads: "
                            "name the report differently")
    return plots


def run_inputs(model: str | None, image: str | None, *more: str | None) -> list[str | None]:
    """The paths a run reads, for `check_outputs`: its model (a folder, a file, or a demo's
    cache folder), its picture, and ``more`` (a patches file)."""
    from .footprint import DEMOS, demo_folder

    folder = str(demo_folder(model)) if model in DEMOS else model
    return [folder, image, *more]
