"""intralayer.ranks, the pool behind the labs and the library's multi-rank tests: rank 0's output,
one log per rank, typed outcomes, a LaunchError naming a failed rank's error, a deadline that stops
every rank, a fork server with one thread, and no rank left behind."""
from __future__ import annotations

import multiprocessing.forkserver
import time

import psutil
import pytest

from intralayer import launch, ranks
from tests import orphans
from tests.programs.misbehave import FAILURE_TEXT

MISBEHAVE = "tests.programs.misbehave"


def test_a_program_runs_on_three_pool_ranks_with_torchruns_environment(pool):
    result = pool("intralayer.programs.hello_allreduce", 3, timeout=60)
    assert result.output.strip() == "3 ranks, gloo: the all-reduce of the rank numbers 0 … 2 left 3 on every rank: correct"
    assert sorted(result.stdout) == [0, 1, 2] and result.stdout[1] == result.stdout[2] == ""
    assert result.nproc == 3 and result.seconds > 0
    assert not orphans.alive()


def test_the_fork_server_has_one_thread_and_a_warm_job_is_fast(pool):
    pool("intralayer.programs.hello_allreduce", 2, timeout=60)
    server = psutil.Process(multiprocessing.forkserver._forkserver._forkserver_pid)
    assert len(server.threads()) == 1, "forking a process with threads is unsafe"
    start = time.monotonic()
    pool("intralayer.programs.hello_allreduce", 4, timeout=60)
    took = time.monotonic() - start
    assert took < 3.0 or psutil.getloadavg()[0] > 3, f"a 4-rank job from the warm pool took {took:.1f} s"


def test_outcomes_are_typed_values_and_errors():
    outcomes = ranks.run(launch.run_module, 2, ("tests.programs.misbehave", ["raise"]), deadline=60, stop_on_failure=True)
    assert [o.rank for o in outcomes] == [0, 1]
    failed = outcomes[1]
    assert failed.error["type"] == "RuntimeError" and FAILURE_TEXT in failed.error["message"]
    assert any(file.endswith("misbehave.py") for file, _, _ in failed.error["frames"])
    assert not failed.ok and failed.exitcode == 1


def test_a_rank_that_raises_fails_the_run_with_its_traceback_and_the_others_are_stopped(pool):
    with pytest.raises(launch.LaunchError) as info:
        pool(MISBEHAVE, 2, args=["raise"], timeout=60)
    text = str(info.value)
    assert "failed" in text and "rank 1's last lines of stderr" in text and FAILURE_TEXT in text, text
    assert "1: 1" in text, text
    assert not orphans.alive()


def test_a_hanging_job_is_stopped_at_the_deadline(pool):
    start = time.monotonic()
    with pytest.raises(launch.LaunchError, match="did not finish within 6 s"):
        pool(MISBEHAVE, 2, args=["hang"], timeout=6)
    assert 6 <= time.monotonic() - start < 6 + 2 * ranks.GRACE_S + 5
    assert not orphans.alive()


@pytest.mark.parametrize("call, words", [
    (lambda: ranks.run(launch.run_module, 0, ("x", [])), "world=0 must be a whole number of ranks ≥ 1"),
    (lambda: ranks.run(launch.run_module, 2, ("x", []), deadline=0), "deadline=0 must be a positive"),
])
def test_bad_input_names_the_rule(call, words):
    with pytest.raises(ValueError, match=words):
        call()
