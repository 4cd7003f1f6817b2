"""``python -m ctxpatch.core.adapters [docs/FAMILIES.md]``: print the supported families table,
or rewrite it in the given file between its markers (`TABLE_MARKERS`)."""

from __future__ import annotations

import sys
from pathlib import Path

from . import families_markdown, with_families_table

if len(sys.argv) > 1:
    path = Path(sys.argv[1])
    path.write_text(with_families_table(path.read_text(encoding="utf-8")), encoding="utf-8")
else:
    sys.stdout.write(families_markdown())
