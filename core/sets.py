"""A prompt set's grid: every (prompt, setting) once, where a setting is a precision, a method,
an absorb mode and a choice of layers (``ctxpatch reproduce --prompts FILE``).

The jobs come grouped by precision (the model is loaded once per dtype, serially and in each
cluster actor), then by setting, then in the set's order. Every job is checked before any run
(`check_jobs`): a row that a setting cannot run (an empty context with absorb context...) is
refused with its line.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import UserError
from .experiments import Job, job_spec
from .options import ABSORB_MODES, METHODS
from .promptset import PromptRow

_UNSAFE = re.compile(r"[^A-Za-z0-9.+-]")


@dataclass(frozen=True)
class Setting:
    """One column of the grid: what every prompt of the set is run with."""

    dtype: str
    method: str
    absorb: str = "all"
    layers: str = "all"

    @property
    def name(self) -> str:
        """The setting's file-safe name: ``float32-direct`` for the paper's protocol (absorb
        all, every layer), with ``-context`` and ``-L<layers>`` otherwise."""
        parts = [self.dtype, self.method]
        if self.absorb != "all":
            parts.append(self.absorb)
        if self.layers != "all":
            parts.append("L" + _UNSAFE.sub("_", self.layers.replace(":", "to")))
        return "-".join(parts)

    @property
    def label(self) -> str:
        extra = [f"absorb {self.absorb}"] if self.absorb != "all" else []
        extra += [f"layers {self.layers}"] if self.layers != "all" else []
        return " ".join([self.dtype, self.method, *extra])


def parse_list(text: str, what: str, allowed: Sequence[str] | None = None,
               sep: str = ",") -> list[str]:
    """A comma-separated option (``--methods direct,stable``), checked, duplicates dropped."""
    items = [t.strip() for t in text.split(sep) if t.strip()]
    if not items:
        raise UserError(f"{what} {text!r}: give at least one value")
    if allowed is not None:
        for item in items:
            if item not in allowed:
                raise UserError(f"{what} {text!r}: unknown {item!r} (use {', '.join(allowed)}, "
                                "separated by commas)")
    return list(dict.fromkeys(items))


def settings(dtypes: Sequence[str], methods: Sequence[str] = METHODS,
             absorbs: Sequence[str] = ("all",), layers: Sequence[str] = ("all",)
             ) -> list[Setting]:
    """The grid's settings, dtype outermost (one load per dtype)."""
    for a in absorbs:
        if a not in ABSORB_MODES:
            raise UserError(f"--absorb {a!r}: use {' or '.join(ABSORB_MODES)}")
    return [Setting(d, m, a, ly) for d in dtypes for m in methods for a in absorbs
            for ly in layers]


def set_jobs(rows: Sequence[PromptRow], grid: Sequence[Setting], analyze: Sequence[str] = ()
             ) -> list[Job]:
    """Every (prompt, setting) once: ``{setting}-{prompt id}`` under runs/."""
    return [Job(f"{s.name}-{r.id}", s.dtype, s.method, i, s.layers, s.absorb,
                tuple(sorted(analyze)), r.context, r.query, r.image, r.id, s.name)
            for s in grid for i, r in enumerate(rows)]


def check_jobs(jobs: Sequence[Job], rows: Sequence[PromptRow], model: str, tokens: int,
               device: str, where: str) -> None:
    """Every job's options and prompt checked as a comparison checks them (`RunSpec.validate`,
    `core.spec.check_request`), before any run; the first problem names the row's line."""
    from .spec import check_request

    lines = {r.id: r.line for r in rows}
    for job in jobs:
        spec = job_spec(job, model, tokens, device, None)
        try:
            spec.validate()
            check_request(spec)
        except UserError as exc:
            line = lines.get(job.prompt_id)
            at = f"{where}, line {line}" if line else f"prompt {job.prompt_id}"
            raise UserError(f"{at} ({job.setting}): {exc.args[0]}") from None


def sweep_jobs(row: PromptRow, dtype: str, absorb: str, layers: Sequence[int],
               analyze: Sequence[str] = ()) -> list[Job]:
    """The start-layer sweep (patch layers s..L-1) on the set's first prompt, method direct."""
    return [Job(f"sweep-s{s}", dtype, "direct", 0, f"{s}:", absorb, tuple(sorted(analyze)),
                row.context, row.query, row.image, row.id) for s in layers]


def run_jobs(model: str, out: Path, jobs: Sequence[Job], tokens: int, device: str = "auto",
             say: Callable[[str], None] = print, should_stop: Callable[[], bool] | None = None,
             ray: str | None = None, image: str | None = None,
             on_record: Callable[[Job, dict[str, Any]], None] | None = None
             ) -> dict[str, dict[str, Any]]:
    """Every job run (or reused) here, one after the other (`core.experiments.run_grid`), or
    with ``ray`` (``auto`` or a cluster's address) by the actors of a Ray cluster
    (`core.cluster.run_on_ray`); either way the records are checked and written here as they
    arrive, and a stop keeps what finished."""
    from .experiments import run_grid

    if ray is None:
        return run_grid(model, out, jobs, tokens, device, say, should_stop, image, on_record)
    from .cluster import run_on_ray

    return run_on_ray(ray, model, out, jobs, tokens, device, say, should_stop, image, on_record)


def write_summary(out: Path, data: dict[str, Any], stats: dict[str, Any]) -> list[Path]:
    """summary.json (``data`` with the statistics), summary.csv (one row per setting,
    `core.setstats.TABLE`), prompts.csv (one row per prompt and setting) and, only when pyarrow
    is installed, summary.parquet: ``pandas.read_csv(out / "summary.csv")`` in a notebook."""
    import csv
    import io

    from .export import atomic_write, write_json, write_text
    from .setstats import PROMPT_TABLE, TABLE, prompt_rows, table_rows

    write_json(out / "summary.json", {**data, "statistics": stats})
    written = [out / "summary.json"]
    for name, columns, rows in (("summary.csv", TABLE, table_rows(stats)),
                                ("prompts.csv", PROMPT_TABLE, prompt_rows(stats))):
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=list(columns), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        write_text(out / name, buffer.getvalue())
        written.append(out / name)
    try:
        import pyarrow as pa  # optional: never a dependency of ours
        import pyarrow.parquet as pq
    except ImportError:
        return written
    table = pa.Table.from_pylist(table_rows(stats))
    atomic_write(out / "summary.parquet", lambda tmp: pq.write_table(table, tmp))
    return written + [out / "summary.parquet"]
