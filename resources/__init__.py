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


def icon_paths() -> list[str]:
    """The application icon's PNG files, smallest first (for QIcon and the .desktop file)."""
    folder = resources.files(__name__).joinpath("icons")
    return [str(folder.joinpath(f"ctxpatch-{n}.png")) for n in (16, 24, 32, 48, 64, 128, 256, 512)
            if folder.joinpath(f"ctxpatch-{n}.png").is_file()]


def sample_image_path() -> str:
    """The bundled sample picture (a tortoiseshell cat on a wooden floor; CC0, see
    LICENSE-sample.txt)."""
    return str(resources.files(__name__).joinpath("sample.png"))
