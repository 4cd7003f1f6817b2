"""The command-line tests' shared case: a context and a query of two tokens, and a digest of
a folder's files (inputs byte-identical after a refused command)."""

from __future__ import annotations

import hashlib
from pathlib import Path

CASE = ["--context", "Alice lives in Paris.", "--query", "Where?", "--max-new-tokens", "2"]


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if p.is_file()}
