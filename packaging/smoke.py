"""Smoke test of the standalone bundle: start it offscreen, run a comparison on a tiny model in
the window (``--screenshot``) and headless, and print the bundle's size and where its stable
update solves: compiled by numba where the bundle carries it (built with the ``fast`` extra
installed; then a numba that does not compile fails the test), else on torch.

    python packaging/smoke.py build/bundle/dist/ctxpatch/ctxpatch
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> int:
    exe = Path(sys.argv[1]).resolve()
    numba = any(p.is_dir() for p in exe.parent.rglob("numba"))  # (bundled where installed)
    from tiny import gemma3_config, save_tiny_folder, save_tiny_image_folder, tiny_config

    sample = str(Path(__file__).resolve().parents[1] / "resources" / "sample.png")
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_folder(Path(tmp) / "model", gemma3_config())
        mixtral = save_tiny_folder(Path(tmp) / "mixtral", tiny_config("mixtral"))
        images = {kind: save_tiny_image_folder(Path(tmp) / kind, kind)
                  for kind in ("gemma3", "llava", "llava_next", "idefics3")}
        env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "HF_HUB_OFFLINE": "1",
               "XDG_CONFIG_HOME": tmp, "XDG_STATE_HOME": tmp}
        runs = [
            [str(exe), "--version"],
            [str(exe), "compare", "--model", str(model), "--context", "The fox.", "--query",
             "Hello", "--max-new-tokens", "3", "--quiet"],
            [str(exe), "compare", "--model", str(mixtral), "--context", "The fox.", "--query",
             "Hello", "--max-new-tokens", "3", "--quiet"],
            # the stable update: compiled by numba where bundled (core/secular_jit.py logs where
            # a numba there does not load or compile), else on torch
            [str(exe), "compare", "--model", str(model), "--context", "The fox.", "--query",
             "Hello", "--max-new-tokens", "3", "--method", "stable", "--quiet"],
            [str(exe), "--screenshot", str(Path(tmp) / "shot.png"), "--model", str(model),
             "--context", "The fox.", "--query", "Hello", "--max-new-tokens", "3"],
        ] + [[str(exe), "compare", "--model", str(folder), "--image", sample, "--query",
              "Describe it.", "--max-new-tokens", "3", "--quiet"] for folder in images.values()]
        for argv in runs:
            out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600,
                                 cwd=tmp)
            print(f"$ {' '.join(argv[:2])} ... -> exit {out.returncode}")
            print((out.stdout + out.stderr).strip()[-600:])
            if out.returncode != 0:
                return 1
            if "numba" in out.stderr:
                print("the bundle carries numba, but its stable update is not compiled")
                return 1
        assert (Path(tmp) / "shot.png").stat().st_size > 10_000
    print("the bundle's stable update: " + ("compiled by numba" if numba else
                                            "on torch (numba not bundled: no fast extra)"))
    size = sum(f.stat().st_size for f in exe.parent.rglob("*") if f.is_file())
    print(f"bundle {exe.parent}: {size / 1e9:.2f} GB in "
          f"{sum(1 for f in exe.parent.rglob('*') if f.is_file())} files")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
