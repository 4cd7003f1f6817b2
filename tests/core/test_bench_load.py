"""`ctxpatch bench --load N`: the busy processes beside the timed runs stop with the bench, on a
normal end, on Ctrl+C (SIGINT to the bench) and on an error, and by themselves when the bench is
killed outright or their time limit passes: no burner outlives the bench."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ctxpatch.app.cli import main
from ctxpatch.core.bench import background_load

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    """Whether a process runs (a zombie waiting to be reaped does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _gone(pids: list[int], patience: float = 30.0) -> bool:
    """Whether every process in ``pids`` has ended, waiting up to ``patience`` seconds (a
    liveness check on a shared machine, not a timing assertion)."""
    end = time.monotonic() + patience
    while time.monotonic() < end:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")


def test_burners_run_in_the_block_and_stop_after_it() -> None:
    with background_load(2) as pids:
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    assert not any(_alive(p) for p in pids)
    with background_load(0) as none:
        assert none == []


def test_an_interrupt_or_an_error_stops_them() -> None:
    for exc in (KeyboardInterrupt, RuntimeError):
        seen: list[int] = []
        with pytest.raises(exc), background_load(2) as pids:
            seen += pids
            assert all(_alive(p) for p in pids)
            raise exc()
        assert len(seen) == 2 and not any(_alive(p) for p in seen)


CHILD = """
import sys, time
from ctxpatch.core.bench import background_load
with background_load(2) as pids:
    print(*pids, flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_ctrl_c_or_a_kill_of_the_bench_stops_them(sig: signal.Signals) -> None:
    """SIGINT (Ctrl+C: the burners, in sessions of their own, do not get it) ends them through
    the block's cleanup; SIGKILL leaves no cleanup, and each burner sees its parent gone."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT)
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        proc.send_signal(sig)
        proc.wait(timeout=60)
        assert _gone(pids), [p for p in pids if _alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_burner_stops_at_its_limit_by_itself() -> None:
    with background_load(1, limit_s=0.2) as pids:
        assert _gone(pids)  # while the block still runs


def test_the_load_option_is_checked_before_any_work(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--model", "no/such-model", "--query", "q", "--load", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--load" in err and "Traceback" not in err
