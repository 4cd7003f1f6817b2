"""The built wheel carries everything (code and resources) and runs outside the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from tiny import gemma3_config, save_tiny_folder

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_wheel_installs_and_runs_outside_the_checkout(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(wheels), str(ROOT)], check=True, capture_output=True)
    (wheel,) = wheels.glob("ctxpatch-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry = next(n for n in names if n.endswith("entry_points.txt"))
        assert "ctxpatch = ctxpatch.app.cli:main" in z.read(entry).decode()
    assert {"ctxpatch/__init__.py", "ctxpatch/resources/presets.json", "ctxpatch/core/engine.py",
            "ctxpatch/app/main_window.py", "ctxpatch/core/adapters/llama.py",
            "ctxpatch/app/panels/plots_panel.py", "ctxpatch/resources/ctxpatch.desktop",
            "ctxpatch/resources/icons/ctxpatch-256.png", "ctxpatch/resources/sample.png",
            "ctxpatch/resources/LICENSE-sample.txt"} <= names
    # one namespace: nothing but ctxpatch (and its dist-info) at the top of site-packages
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == \
        {"ctxpatch"}
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(site), str(wheel)], check=True, capture_output=True)
    model = save_tiny_folder(tmp_path / "model", gemma3_config())
    code = (
        "import importlib.util, sys, ctxpatch\n"
        "from ctxpatch import core, resources\n"
        f"assert core.__file__.startswith({str(site)!r}), core.__file__\n"
        "assert all(importlib.util.find_spec(n) is None for n in ('core', 'app', 'resources'))\n"
        "assert len(resources.presets()) >= 5 and len(resources.icon_paths()) == 8\n"
        "from ctxpatch.core.images import read_image\n"
        "assert read_image(resources.sample_image_path())[1].width == 384\n"
        "from ctxpatch.app.cli import main\n"
        "assert main(['--version']) == 0\n"
        f"sys.exit(main(['compare', '--model', {str(model)!r}, '--context', 'The fox.', "
        "'--query', 'Hello', '--max-new-tokens', '3', '--quiet']))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ctxpatch 0.") and "token match 3/3" in out.stdout
