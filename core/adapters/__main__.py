"""``python -m ctxpatch.core.adapters [README.md]``: print the supported families table, or rewrite it in
the given README between its markers."""

from __future__ import annotations

import sys
from pathlib import Path

from . import families_markdown, readme_with_families

if len(sys.argv) > 1:
    path = Path(sys.argv[1])
    path.write_text(readme_with_families(path.read_text(encoding="utf-8")), encoding="utf-8")
else:
    sys.stdout.write(families_markdown())
