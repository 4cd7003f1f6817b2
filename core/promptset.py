"""Prompt sets for ``ctxpatch reproduce --prompts``: rows of context, query, an optional picture
and an optional id, read from JSONL or CSV and checked whole before any run.

A set is refused up front, with the file's line number, for a row without a query, a picture
that is not a file, a duplicate id, an unknown column or a value that is not text: one line, and
nothing is written. The paper's five prompts (`core.experiments.PAPER_PROMPTS`) are the default
set (ids p1..p5); ``demo-set`` names the bundled set of varied prompts
(resources/prompts-demo.jsonl).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .errors import UserError

COLUMNS = ("id", "context", "query", "image")
#: the bundled set's name on the command line and in the API
DEMO_SET = "demo-set"
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,79}$")


@dataclass(frozen=True)
class PromptRow:
    """One prompt of a set: its id (a run's file name ends with it), the context (may be
    empty), the query, an image's resolved path (or None) and the line it came from."""

    id: str
    context: str
    query: str
    image: str | None = None
    line: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def paper_set(n: int | None = None) -> list[PromptRow]:
    """The paper's prompts (the first ``n``), ids p1..p5, as queries with no context."""
    from .experiments import PAPER_PROMPTS

    return [PromptRow(f"p{i + 1}", "", q, None, i + 1)
            for i, q in enumerate(PAPER_PROMPTS[:n])]


def demo_set_path() -> str:
    from importlib import resources

    return str(resources.files("ctxpatch.resources").joinpath("prompts-demo.jsonl"))


def read_set(source: str | Path) -> list[PromptRow]:
    """The rows of a JSONL (``.jsonl``/``.json``) or CSV (``.csv``) file, or of the bundled
    ``demo-set``, checked (see the module's docstring).

    Raises:
        UserError: an unreadable file, an unknown format, or the first bad row (its line).
    """
    path = Path(demo_set_path() if str(source) == DEMO_SET else source).expanduser()
    where = str(source)
    if not path.is_file():
        raise UserError(f"--prompts {where}: no such file (give a .jsonl or .csv prompt set, "
                        f"a number of the paper's prompts 1-5, or {DEMO_SET})")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--prompts {where}: cannot read it as UTF-8 text ({exc})") from None
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        raw = list(_jsonl(text, where))
    elif suffix in (".csv", ".tsv"):
        raw = list(_csv(text, where, "\t" if suffix == ".tsv" else ","))
    else:
        raise UserError(f"--prompts {where}: give a .jsonl or .csv file (one prompt a row)")
    if not raw:
        raise UserError(f"--prompts {where}: the file holds no prompts")
    rows: list[PromptRow] = []
    seen: dict[str, int] = {}
    for index, (line, values) in enumerate(raw):
        row = _row(values, line, index, path.parent, where)
        if row.id in seen:
            raise UserError(f"{where}, line {line}: id {row.id!r} is already the id of line "
                            f"{seen[row.id]} (ids must be unique)")
        seen[row.id] = line
        rows.append(row)
    return rows


def _jsonl(text: str, where: str) -> Any:
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            values = json.loads(line)
        except (ValueError, RecursionError) as exc:  # (RecursionError: nested too deep)
            raise UserError(f"{where}, line {n}: not a JSON object ({exc.args[0]})") from None
        if not isinstance(values, dict):
            raise UserError(f"{where}, line {n}: not a JSON object (give "
                            '{"context": ..., "query": ...} on each line)')
        yield n, values


def _csv(text: str, where: str, delimiter: str) -> Any:
    reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delimiter)
    header = [h.strip().lower() for h in (reader.fieldnames or [])]
    unknown = [h for h in header if h not in COLUMNS]
    if unknown or "query" not in header:
        raise UserError(f"{where}, line 1: the header must name the columns query and optionally "
                        f"context, image, id (not {', '.join(unknown) or 'without query'})")
    reader.fieldnames = header
    start = 2
    for values in reader:
        if None in values:  # more cells than the header names
            raise UserError(f"{where}, line {start}: more cells than the header's "
                            f"{len(header)} columns")
        yield start, {k: v for k, v in values.items() if v not in (None, "") or k == "query"}
        start = reader.line_num + 1


def _row(values: dict[str, Any], line: int, index: int, folder: Path, where: str) -> PromptRow:
    at = f"{where}, line {line}"
    unknown = sorted(set(values) - set(COLUMNS))
    if unknown:
        raise UserError(f"{at}: unknown key {unknown[0]!r} (a row holds {', '.join(COLUMNS)})")
    for key, value in values.items():
        if value is not None and not isinstance(value, str):
            raise UserError(f"{at}: {key} must be text, not {type(value).__name__}")
    query = values.get("query") or ""
    if not query.strip():
        raise UserError(f"{at}: no query (every row needs one)")
    rid = values.get("id") or f"p{index + 1}"
    if not _ID.match(rid):
        raise UserError(f"{at}: id {rid!r} may hold only letters, digits, '.', '_' and '-' "
                        "(at most 80, starting with a letter or digit)")
    image = values.get("image") or None
    if image is not None:
        picture = Path(image).expanduser()
        picture = picture if picture.is_absolute() else folder / picture
        if not picture.is_file():
            raise UserError(f"{at}: image {image!r} is not a file (a path relative to the "
                            "prompt set's folder, or absolute)")
        image = str(picture.resolve())
    return PromptRow(rid, values.get("context") or "", query, image, line)


def fingerprint(rows: Sequence[PromptRow]) -> str:
    """A short hash of the rows' ids and texts (and pictures' paths): the set's identity."""
    data = json.dumps([[r.id, r.context, r.query, r.image] for r in rows], ensure_ascii=False)
    return hashlib.sha256(data.encode("utf-8")).hexdigest()[:16]
