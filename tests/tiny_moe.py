"""Tiny configs of the mixture-of-experts families with shared experts or biased routers (issue 17).

``FAMILIES``: test name -> (model_type, config overrides), merged into `tiny.TINY`, so every
ground-truth test of tests/core/test_ground_truth.py runs on each of them.
"""

from __future__ import annotations

from typing import Any

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {}
