"""Without numba (the ``fast`` extra left out, issue 31): a stable comparison in a process where
``import numba`` fails runs its secular solves on torch, says nothing about the missing extra,
and gives the patches and logits of the run in this process (compiled where numba is installed
here, on torch where it is not). Covers the torch path on a CPU even where numba is installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
#: a second process, numba made unimportable before ctxpatch is imported
WITHOUT_NUMBA = f"""
import sys
sys.modules["numba"] = None  # (import numba now raises ModuleNotFoundError)
sys.path[:0] = [{str(HERE.parent)!r}, {str(HERE)!r}]
import numpy as np
from test_no_numba import stable_run
from ctxpatch.core import secular_jit
np.savez(sys.argv[1], **stable_run())
assert secular_jit.kernel() is None
"""


def stable_run() -> dict[str, Any]:
    """A stable comparison on the tiny Gemma 3 (float64, absorb all, no control, 3 tokens) as
    arrays: each step's tokens, the patched side's distance to the full context's logits and
    its top probabilities, the layers' hard cases, and every patch vector."""
    import torch
    from ctxpatch.core.compare import RunSpec, iter_token_patches
    from ctxpatch.core.prompt import build_prompt
    from tiny import gemma3_config, tiny_loaded

    loaded = tiny_loaded(gemma3_config(layers=4))
    prompt = build_prompt(loaded.tokenizer, "", "The quick brown fox jumps over the lazy dog.")
    settings = RunSpec(max_new_tokens=3, absorb="all", keep_patches=True, method="stable",
                        control=False)
    with torch.no_grad():
        steps = list(iter_token_patches(loaded, prompt, settings))
    out: dict[str, Any] = {
        "tokens": np.array([[s.baseline_token, s.patched.token] for s in steps]),
        "linf": np.array([s.patched.linf for s in steps]),
        "scale": np.array([s.logit_scale for s in steps]),
        "probs": np.array([s.patched.top_k.probs for s in steps]),
        "hard": np.array([[bool(i["hard_case"]) for i in s.layer_info.values()] for s in steps]),
    }
    for s in steps:
        assert s.patches is not None
        out.update({f"{s.step} {key}": value for key, value in s.patches.items()})
    return out


def test_a_stable_run_without_numba_is_the_run_here(tmp_path: Path) -> None:
    saved = tmp_path / "without.npz"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run([sys.executable, "-c", WITHOUT_NUMBA, str(saved)], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "numba" not in proc.stderr.lower(), proc.stderr[-3000:]  # (a missing extra: silent)
    with np.load(saved) as without:
        other = {key: without[key] for key in without.files}
    here = stable_run()
    assert here.keys() == other.keys() and len(here) > 5
    np.testing.assert_array_equal(here["tokens"], other["tokens"])
    np.testing.assert_array_equal(here["hard"], other["hard"])
    # the solves agree to a few float64 ulps (the order of the sums, the compiled early stop):
    # logits to 1e-9 of their scale, as tests/core/test_control_row.py's whole runs
    np.testing.assert_allclose(here["linf"], other["linf"], rtol=0, atol=1e-9 * here["scale"].max())
    np.testing.assert_allclose(here["probs"], other["probs"], rtol=1e-9, atol=1e-12)
    for key in here.keys() - {"tokens", "linf", "scale", "probs", "hard"}:
        np.testing.assert_allclose(here[key], other[key], rtol=1e-10, atol=1e-13, err_msg=key)
