"""``ctxpatch compare --help`` names the supported families without importing torch (issue 35
#7: 3.4 s and 650 MB for a help text): `core.family_names` holds the registry's line, and must
equal it (rewrite it with ``python -m ctxpatch.core.family_names`` after adding an adapter)."""

from __future__ import annotations

import subprocess
import sys

from ctxpatch.core.adapters import supported_families
from ctxpatch.core.family_names import FAMILIES


def test_the_help_s_families_are_the_registry_s() -> None:
    assert FAMILIES == supported_families(), "run: python -m ctxpatch.core.family_names"


def test_compare_help_imports_neither_torch_nor_transformers() -> None:
    code = ("import sys\nfrom ctxpatch.app.cli import main\n"
            "assert main(['compare', '--help']) == 0\n"
            "print(sorted(m for m in ('torch', 'transformers', 'numpy', 'PySide6') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "supported families (model types): Gemma 2 / Gemma 3" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-300:]
