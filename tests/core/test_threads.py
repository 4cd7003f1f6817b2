"""A CPU run on a busy machine takes at most as many threads as there are idle cores
(`core.threads`, docs/PERFORMANCE.md "A busy machine"), and torch's thread count is put back
after it; ``CTXPATCH_THREADS`` and ``OMP_NUM_THREADS`` override the choice."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from ctxpatch.core.compare import RunSpec, iter_token_patches
from ctxpatch.core.prompt import build_prompt
from ctxpatch.core.threads import ENV, busy_cores, choose_threads, run_threads
from tiny import llama_config, tiny_loaded

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_idle_cores_decide() -> None:
    assert choose_threads(2, 0.0, 2) == 2  # a quiet laptop: every core
    assert choose_threads(2, 0.4, 2) == 2
    assert choose_threads(2, 1.0, 2) == 1  # one core busy elsewhere
    assert choose_threads(2, 9.0, 2) == 1  # never fewer than one
    assert choose_threads(8, 3.0, 8) == 5
    assert choose_threads(4, 0.0, 16) == 4  # never more than torch would take
    assert choose_threads(2, None, 2) == 2  # unknown (not Linux): unchanged


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="Linux only")
def test_the_probe_counts_cores() -> None:
    busy = busy_cores(0.05)
    assert busy is not None and 0.0 <= busy <= (__import__("os").cpu_count() or 1) + 0.5


def test_a_fixed_count_is_set_for_the_block_and_put_back(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    torch.set_num_threads(2)
    monkeypatch.setenv(ENV, "1")
    with run_threads(CPU) as n:
        assert n == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), run_threads(CPU):
        raise RuntimeError()
    assert torch.get_num_threads() == 2
    with run_threads(SimpleNamespace(type="cuda")) as n:  # a GPU run: the CPU threads stay
        assert n == 2 and torch.get_num_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv(ENV, "auto")
    with run_threads(CPU) as n:  # the user's OpenMP setting stands
        assert n == 2


def test_a_run_takes_the_count_and_gives_it_back(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = tiny_loaded(llama_config(), dtype=torch.float32)
    prompt = build_prompt(loaded.tokenizer, "", "the quick brown fox")
    torch.set_num_threads(2)
    monkeypatch.setenv(ENV, "1")
    seen = [torch.get_num_threads() for _ in iter_token_patches(
        loaded, prompt, RunSpec(max_new_tokens=3, absorb="all"))]
    assert seen == [1, 1, 1] and torch.get_num_threads() == 2


@pytest.mark.parametrize("value", ["abc", "2.5", "0", "-1", "100000"])
def test_a_bad_thread_count_is_one_line(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """A count that is not a whole number of threads from 1 to the cores is refused in one
    line naming the variable (it was ignored, or passed to torch as 100000 threads)."""
    import torch
    from ctxpatch.core.errors import UserError

    monkeypatch.setenv(ENV, value)
    before = torch.get_num_threads()
    with pytest.raises(UserError, match=rf"^{ENV}='{value}': give a whole number of threads"):
        with run_threads(torch.device("cpu")):
            pass
    assert torch.get_num_threads() == before
