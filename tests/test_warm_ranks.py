"""tests/warm_ranks.py, the launcher of the library's multi-rank tests, keeps launch.run's contract:
rank 0's output, one log per rank, a LaunchError naming a failed rank's error, a timeout that stops
every rank, and no process of a job left behind."""
from __future__ import annotations

import time

import psutil
import pytest

from intralayer import launch
from tests import warm_ranks
from tests.programs.misbehave import FAILURE_TEXT

MISBEHAVE = "tests.programs.misbehave"


def job_processes() -> list[psutil.Process]:
    """Leaders and ranks the warm server forked that are still alive (the server itself waits)."""
    server = warm_ranks._Server.current
    if server is None:
        return []
    try:
        return psutil.Process(server.proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_a_program_runs_on_three_forked_ranks_with_torchruns_environment():
    result = warm_ranks.run("intralayer.programs.hello_allreduce", 3, timeout=60)
    assert result.output.strip() == "3 ranks, gloo: the all-reduce of the rank numbers 0 … 2 left 3 on every rank: correct"
    assert sorted(result.stdout) == [0, 1, 2] and result.stdout[1] == result.stdout[2] == ""
    assert result.nproc == 3 and result.seconds > 0
    assert not job_processes()


def test_a_rank_that_raises_fails_the_run_with_its_traceback_and_the_others_are_stopped():
    with pytest.raises(launch.LaunchError) as info:
        warm_ranks.run(MISBEHAVE, 2, args=["raise"], timeout=60)
    text = str(info.value)
    assert "failed" in text and "rank 1's last lines of stderr" in text and FAILURE_TEXT in text, text
    assert "'1': 1" in text or "1: 1" in text, text
    assert not job_processes()


def test_a_hanging_job_is_stopped_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(launch.LaunchError, match="did not finish within 6 s"):
        warm_ranks.run(MISBEHAVE, 2, args=["hang"], timeout=6)
    assert 6 <= time.monotonic() - start < 25
    assert not job_processes()
