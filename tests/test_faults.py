"""Faults in a multi-process run: what the learner sees, and that nothing is left running.

Each test launches ``tests.programs.fault_checks`` (see its docstring for the scenarios)
through :func:`intralayer.launch.run` and checks three things:

* the launch ends by itself, long before its own timeout, with a :class:`LaunchError`
  (so it was the failure, not the launch timeout, that ended it);
* the message names what went wrong: the rank that raised and its traceback, the rank a
  signal killed and which signal, the collective the others were waiting in, and the rank
  that never joined it;
* no process of the job outlives the call. Every rank writes its process id to a file,
  and a thread polls the process table during the launch for every process whose command
  line holds the test's unique directory (torchrun and the ranks); afterwards none of
  them may still be alive.

The collective under test runs with a process-group timeout of ``PG_TIMEOUT`` seconds,
passed down through ``INTRALAYER_PG_TIMEOUT`` as the launcher does.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from intralayer import launch
from intralayer.distributed import TIMEOUT_ENV

ROOT = Path(__file__).resolve().parents[1]
from tests.programs import fault_checks

PROGRAM = "tests.programs.fault_checks"
PG_TIMEOUT = 3                 # seconds a collective waits for a missing peer
LAUNCH_TIMEOUT = 45            # the launch's own limit; no test here may need it
ENV = {"PYTHONPATH": str(ROOT), TIMEOUT_ENV: str(PG_TIMEOUT)}


# ------------------------------------------------------------------ the process table

def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _marked(token: str) -> list[psutil.Process]:
    """Live processes, other than this one, whose command line holds ``token``."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.pid != os.getpid() and any(token in part for part in (p.info["cmdline"] or [])) and _alive(p):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


class Job:
    """One launch's processes: a unique directory for the rank pid files, whose path on
    every command line of the job marks its processes, and a thread that records each
    such process while the launch runs (``psutil.Process`` keeps its start time, so a
    recycled pid is not mistaken for it)."""

    def __init__(self, tmp_path: Path):
        self.dir = tmp_path / f"faults-{uuid.uuid4().hex}"
        self.dir.mkdir()
        self.token = str(self.dir)
        self.seen: dict[int, psutil.Process] = {}
        self.cmdlines: dict[int, list[str]] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._done.is_set():
            for p in _marked(self.token):
                self.seen.setdefault(p.pid, p)
                # Keep the latest: a child caught between fork and exec still shows its
                # parent's command line (torchrun once looked like the `-c` launcher).
                self.cmdlines[p.pid] = p.info["cmdline"]
            self._done.wait(0.1)

    def __enter__(self) -> "Job":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        for p in list(self.seen.values()) + _marked(self.token):   # a failed test leaves nothing
            try:
                if _alive(p):
                    p.kill()
            except psutil.NoSuchProcess:
                pass

    def rank_pids(self) -> dict[int, int]:
        return {int(f.stem[4:]): int(f.read_text()) for f in self.dir.glob("rank*.pid")}

    def processes(self) -> list[psutil.Process]:
        """Every process of the job seen so far: the recorded ones and the ranks' own pids."""
        procs = dict(self.seen)
        for pid in self.rank_pids().values():
            if pid not in procs:
                try:
                    procs[pid] = psutil.Process(pid)
                except psutil.NoSuchProcess:
                    pass
        return list(procs.values())

    def assert_complete(self, nproc: int) -> None:
        """The check is not vacuous: every rank wrote its pid and torchrun was seen."""
        assert sorted(self.rank_pids()) == list(range(nproc)), f"pid files: {sorted(self.rank_pids())}"
        agents = [pid for pid, cmd in self.cmdlines.items() if "intralayer.launch" in cmd]   # torchrun's agent
        assert agents, f"torchrun was never seen; recorded: {list(self.cmdlines.values())}"

    def assert_none_left(self, within: float = 5.0) -> None:
        deadline = time.monotonic() + within
        while True:
            left = list({p.pid: p for p in self.processes() + _marked(self.token) if _alive(p)}.values())
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert not left, f"processes of the job outlived it: {[(p.pid, _cmdline(p)) for p in left]}"


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return getattr(p, "info", {}).get("cmdline") or []


def launch_fault(tmp_path: Path, scenario: str, nproc: int) -> tuple[str, float, Job]:
    """Launch ``scenario`` on ``nproc`` ranks; the LaunchError's message, the seconds the
    launch took, and the job (already checked to leave no process behind)."""
    with Job(tmp_path) as job:
        start = time.monotonic()
        with pytest.raises(launch.LaunchError) as info:
            launch.run(PROGRAM, nproc, args=[scenario, job.token], timeout=LAUNCH_TIMEOUT, env=ENV, show=False)
        elapsed = time.monotonic() - start
        job.assert_none_left()
    job.assert_complete(nproc)
    message = str(info.value)
    assert "did not finish within" not in message, f"only the launch timeout ended it:\n{message}"
    assert elapsed < LAUNCH_TIMEOUT
    return message, elapsed, job


# ------------------------------------------------------------------ 1. a rank raises

def test_a_rank_that_raises_is_reported_with_its_traceback_and_no_process_survives(tmp_path):
    """Rank 1 raises while rank 0 waits for it in an all-reduce. The launch fails at once
    (not at its timeout) with a LaunchError that blames rank 1, not rank 0 (which only lost
    its peer), and shows rank 1's traceback down to the line that raised; afterwards no
    rank and no torchrun is left in the process table."""
    message, elapsed, _ = launch_fault(tmp_path, "raise", 2)
    assert "failed (torchrun exit code" in message
    assert "Rank 1 failed; last lines of its stderr:" in message
    assert "Traceback (most recent call last):" in message
    assert "raise RuntimeError(FAILURE_TEXT)" in message        # the raising line itself
    assert f"RuntimeError: {fault_checks.FAILURE_TEXT}" in message
    assert ("rank 0 also failed in all_reduce" in message              # the consequence, named
            or "rank 0 was still running when torchrun stopped it; it was in all_reduce" in message), message   # or stopped there
    assert f"{fault_checks.READY} (raise)" in message            # rank 0's output so far


# ------------------------------------------------------------------ 2. a rank dies or hangs mid-collective

def test_a_rank_killed_by_a_signal_is_named_with_the_signal_and_the_collective(tmp_path):
    """Rank 2 of 3 SIGKILLs itself just before an all-reduce the others enter (as the
    out-of-memory killer would). The survivors do not wait for the timeout: gloo tells
    them the connection is gone. The dead rank wrote no traceback, so the message must
    still blame it, with its signal, rather than a survivor whose traceback only says
    "connection closed/reset by peer", and it says each survivor was in all_reduce."""
    nproc = 3                        # two survivors, both to be described
    message, elapsed, _ = launch_fault(tmp_path, "sigkill", nproc)
    dead = nproc - 1
    assert f"Rank {dead} was killed by signal 9 (SIGKILL) and wrote no traceback" in message
    for survivor in range(dead):
        assert (f"rank {survivor} also failed in all_reduce" in message
                or f"rank {survivor} was still running when torchrun stopped it; it was in all_reduce" in message), message
    assert "Rank 0 failed" not in message and "Rank 1 failed" not in message, message


def test_a_rank_that_never_joins_a_collective_is_named_after_the_timeout(tmp_path):
    """Rank 2 of 3 sleeps instead of joining an all-reduce that the others enter. After
    the process-group timeout (``INTRALAYER_PG_TIMEOUT``, 3 s here) a waiting rank fails;
    the message says it timed out in all_reduce and names the missing rank, with where that
    rank was when torchrun stopped it (``distributed.setup`` has each rank print its stack
    on SIGTERM): in the program, not in a collective."""
    nproc = 3      # rank 1 may time out or be stopped while waiting: either way not "missing"
    message, elapsed, _ = launch_fault(tmp_path, "absent", nproc)
    missing = nproc - 1
    assert elapsed >= PG_TIMEOUT, f"the wait ended after {elapsed:.1f} s, before the timeout"
    assert "timed out in all_reduce waiting for a peer" in message, message
    assert f"Timed out waiting {PG_TIMEOUT * 1000}ms" in message                # gloo's own words
    line = re.search(r"^Missing from all_reduce: (.*)$", message, re.M)
    assert line, message
    assert re.fullmatch(rf"rank {missing}, at \S*fault_checks\.py:\d+ in main, not in a collective\.",
                        line.group(1)), line.group(1)          # only rank 2, and where it was


# ------------------------------------------------------------------ 3. interrupting the cell

INTERRUPTED_CELL = """
import faulthandler, signal, sys
faulthandler.register(signal.SIGUSR1)      # the test asks for every thread's stack if this hangs
# As a kernel does while it runs a cell: SIGINT raises KeyboardInterrupt, whatever this process
# inherited (a process started with SIGINT ignored keeps it ignored, and would never return).
signal.signal(signal.SIGINT, signal.default_int_handler)
from intralayer import launch
launch.run({program!r}, 2, args=["hang", {token!r}], timeout=300, env={env!r})
"""


def test_interrupting_a_launch_stops_every_rank(tmp_path):
    """What a notebook's interrupt button does: SIGINT to the process that called
    ``launch.run`` (here a separate Python process, running a job whose ranks sleep
    forever), not to the job's processes, which run in sessions of their own. That process
    must end with KeyboardInterrupt within seconds, and torchrun and every rank must be
    gone by then: without ``run``'s clean-up they would sleep on, orphaned."""
    with Job(tmp_path) as job:
        code = INTERRUPTED_CELL.format(program=PROGRAM, token=job.token, env=ENV)
        cell = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **ENV},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while len(job.rank_pids()) < 2:          # both ranks are up, past set-up
                assert cell.poll() is None, f"the launch ended early:\n{cell.communicate()[1]}"
                assert time.monotonic() < deadline, "the ranks did not start within 60 s"
                time.sleep(0.1)
            time.sleep(0.5)                          # let the watcher record torchrun too
            sent = time.monotonic()
            cell.send_signal(signal.SIGINT)
            try:
                out, err = cell.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                cell.send_signal(signal.SIGUSR1)     # where it hangs, for the failure message
                time.sleep(2)
                cell.kill()
                out, err = cell.communicate()
                pytest.fail(f"the interrupted launch had not returned after 30 s; its stacks and stderr:\n{err[-6000:]}")
            took = time.monotonic() - sent
        finally:
            if cell.poll() is None:
                cell.kill()
                cell.wait()
        job.assert_none_left(within=3.0)
    job.assert_complete(2)
    assert cell.returncode != 0
    assert "KeyboardInterrupt" in err, err
    assert "LaunchError" not in err, err
    assert took < 15, f"the interrupted launch took {took:.1f} s to return"


# ------------------------------------------------------------------ the message, from canned logs

def _failures(codes: dict[int, int], errors: dict[int, str] = {}) -> dict[int, dict]:
    """What the launcher's torchrun agent reports, ``{rank: {exitcode, error}}``: the exit code
    of each failed rank and, for a rank that raised under ``errors.record``, its record."""
    return {rank: {"exitcode": code, "error": {"message": {"message": errors[rank], "extraInfo": {
        "py_callstack": LOST_PEER.replace("[rank0]: ", ""), "timestamp": "1"}}} if rank in errors else {}}
            for rank, code in codes.items()}


LOST_PEER = """[rank0]: Traceback (most recent call last):
[rank0]:   File "/x/prog.py", line 54, in main
[rank0]:     dist.all_reduce(t)
[rank0]:   File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3252, in all_reduce
[rank0]:     work.wait()
[rank0]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:2782.
"""
STOPPED_IN_BARRIER = """Current thread 0x00007f (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 4811 in barrier
  File "/x/prog.py", line 61 in main
  File "<frozen runpy>", line 88 in _run_code
"""


LOST_PEER_ERROR = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:2782."


@pytest.mark.parametrize("stopped", [False, True])
def test_a_sigterm_is_blamed_only_for_a_rank_that_printed_no_stack(stopped):
    """torchrun stops the other ranks with SIGTERM, on which every course rank prints its
    stack (``distributed.setup``). So a SIGTERM counts as the cause only for a rank that
    printed none; a rank that printed one is described by it (here: waiting in barrier),
    and the rank with an error record is blamed. Unit test on canned records."""
    failures = _failures({0: 1, 1: -15}, {0: LOST_PEER_ERROR})
    result = launch.LaunchResult("prog", 2, 1.0, stderr={0: LOST_PEER, 1: STOPPED_IN_BARRIER if stopped else ""})
    message = launch._failure_message("prog", 2, 1, result, failures)
    if stopped:
        assert "Rank 0 failed in all_reduce; last lines of its stderr:" in message
        assert "rank 1 was still running when torchrun stopped it; it was in barrier at /x/prog.py:61 in main" \
            in message
    else:
        assert "Rank 1 was killed by signal 15 (SIGTERM) and wrote no traceback" in message
        assert "rank 0 also failed in all_reduce: RuntimeError: [pair.cc:553] Connection closed by peer" in message


def test_a_sigkill_is_blamed_before_a_sigterm_without_a_stack():
    """Seen in CI: torchrun stopped a survivor with SIGTERM before it printed its stack, so two
    ranks ended by a signal without a word; the SIGKILL, not torchrun's SIGTERM, is the cause."""
    failures = _failures({0: 1, 1: -15, 2: -9}, {0: LOST_PEER_ERROR})
    result = launch.LaunchResult("prog", 3, 1.0, stderr={0: LOST_PEER, 1: "", 2: ""})
    message = launch._failure_message("prog", 3, 1, result, failures)
    assert "Rank 2 was killed by signal 9 (SIGKILL) and wrote no traceback" in message
    assert "rank 1 was killed by signal 15 (SIGTERM)" in message


def test_a_rank_that_exits_with_an_error_code_and_no_traceback_is_blamed():
    """``sys.exit(3)`` or ``os._exit(3)`` on one rank leaves no error record; it, not the
    peer that lost its connection to it, is the rank the message blames."""
    failures = _failures({0: 1, 1: 3}, {0: LOST_PEER_ERROR})
    result = launch.LaunchResult("prog", 2, 1.0, stderr={0: LOST_PEER, 1: "giving up: no data\n"})
    message = launch._failure_message("prog", 2, 1, result, failures)
    assert "Rank 1 exited with code 3 and wrote no traceback." in message
    assert "giving up: no data" in message
