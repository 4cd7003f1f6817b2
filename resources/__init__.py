"""Packaged resources: presets (the paper's prompts), icons, the .desktop file.

Read through `importlib.resources`, so they work from a checkout, a wheel or a bundle.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any


def presets() -> list[dict[str, Any]]:
    """The prompt presets: name, context, query, absorb mode (the paper's five prompts first)."""
    text = resources.files(__name__).joinpath("presets.json").read_text(encoding="utf-8")
    data = json.loads(text)
    return list(data["presets"])
