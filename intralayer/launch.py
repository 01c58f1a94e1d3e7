"""Run a course program on N ranks from a notebook or a test.

``run("intralayer.programs.collectives", nproc=4)`` starts
``python -m torch.distributed.run --standalone --nproc-per-node 4 -m <module>`` with
the interpreter that runs the notebook (so the virtual environment need not be on
``PATH``; ``!torchrun`` in a cell fails silently when it is not). Each rank's output goes
to its own log file; rank 0's standard output is shown when the run ends. If any rank
fails, or the timeout passes, every process of the job is stopped and a
:class:`LaunchError` carries the failing rank's last lines of standard error.

``--standalone`` makes torchrun pick a free port, so two launches at once do not collide.
"""
from __future__ import annotations

import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from .distributed import TIMEOUT_ENV

MAX_RANKS_HERE = 8
TAIL_LINES = 25


class LaunchError(RuntimeError):
    """A launch failed: a rank exited with an error, or the timeout passed."""


@dataclass
class LaunchResult:
    """What a finished launch leaves: each rank's output and the time it took."""

    module: str
    nproc: int
    seconds: float
    stdout: dict[int, str] = field(default_factory=dict)
    stderr: dict[int, str] = field(default_factory=dict)

    @property
    def output(self) -> str:
        """Rank 0's standard output: the only rank that prints."""
        return self.stdout.get(0, "")


def command(module: str, nproc: int, args: tuple | list = (), nnodes: int = 1) -> list[str]:
    """The torchrun command line for ``module`` on ``nproc`` ranks of this machine."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
        "-m", module, *map(str, args),
    ]


def _check(module: str, nproc: int, timeout: float) -> None:
    if not isinstance(module, str) or not module or "/" in module or module.endswith(".py"):
        raise ValueError(f"module {module!r} must be a dotted module name such as 'intralayer.programs.collectives'")
    if not isinstance(nproc, int) or not 1 <= nproc <= MAX_RANKS_HERE:
        raise ValueError(f"nproc={nproc!r} must be a whole number from 1 to {MAX_RANKS_HERE} on one machine")
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"timeout={timeout!r} must be a positive, finite number of seconds")


def run(module: str, nproc: int, args: tuple | list = (), timeout: float = 120.0,
        show: bool = True, env: dict[str, str] | None = None) -> LaunchResult:
    """Run ``python -m module *args`` on ``nproc`` ranks and wait for it.

    Prints rank 0's standard output when ``show`` is true. Raises :class:`LaunchError`
    naming the failing rank and holding its stderr tail if a rank fails, or if the
    whole job takes longer than ``timeout`` seconds; no process of the job outlives
    the call, also when the caller is interrupted (``KeyboardInterrupt``).
    """
    _check(module, nproc, timeout)
    logs = Path(tempfile.mkdtemp(prefix="intralayer-launch-"))
    child_env = dict(os.environ if env is None else {**os.environ, **env})
    child_env.setdefault("OMP_NUM_THREADS", "1")
    child_env["PYTHONUNBUFFERED"] = "1"
    # The process group gives up a little before the launch does, so that a rank
    # waiting for a dead peer reports the collective it was in.
    child_env.setdefault(TIMEOUT_ENV, str(max(5.0, 0.8 * timeout)))
    cmd = command(module, nproc, args)
    cmd[3:3] = ["--log-dir", str(logs), "--redirects", "3"]
    start = time.monotonic()
    with open(logs / "torchrun.log", "w") as agent_log:
        proc = subprocess.Popen(cmd, stdout=agent_log, stderr=subprocess.STDOUT,
                                env=child_env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:  # also on KeyboardInterrupt in a notebook: take every rank down
            stop(proc)
    if code is None:
        message = _timeout_message(module, nproc, timeout, logs)
        shutil.rmtree(logs, ignore_errors=True)
        raise LaunchError(message)
    result = LaunchResult(module, nproc, time.monotonic() - start,
                          _read_streams(logs, "stdout"), _read_streams(logs, "stderr"))
    agent = (logs / "torchrun.log").read_text(errors="replace")
    shutil.rmtree(logs, ignore_errors=True)
    if code != 0:
        raise LaunchError(_failure_message(module, nproc, code, result, agent))
    if show and result.output:
        print(result.output, end="" if result.output.endswith("\n") else "\n")
    return result


def stop(proc: subprocess.Popen, grace: float = 3.0) -> None:
    """Stop torchrun and every worker it started (workers run in sessions of their own)."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    alive = [p for p in family if p.is_running()]
    for p in alive:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(alive, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _rank_files(logs: Path, stream: str) -> dict[int, Path]:
    """``{rank: path}`` of torchrun's per-rank log files (``<run>/attempt_0/<rank>/<stream>.log``)."""
    found = {}
    for path in logs.glob(f"*/attempt_*/*/{stream}.log"):
        found[int(path.parent.name)] = path
    return found


def _read_streams(logs: Path, stream: str) -> dict[int, str]:
    return {r: p.read_text(errors="replace") for r, p in sorted(_rank_files(logs, stream).items())}


def _tail(text: str, n: int = TAIL_LINES) -> str:
    lines = text.rstrip().splitlines()
    return "\n".join(lines[-n:])


#: What a rank's traceback says when it only lost a peer that failed first.
_CONSEQUENCE = re.compile(r"closed by peer|reset by peer|DistBackendError|DistNetworkError|Broken pipe", re.I)


def _root_cause(agent_log: str) -> int | None:
    """The rank torchrun names as the first observed failure."""
    m = re.search(r"Root Cause.*?rank\s*:\s*(\d+)", agent_log, re.S)
    return int(m.group(1)) if m else None


def _culprit(stderr: dict[int, str], agent_log: str) -> int | None:
    """The rank to blame: one whose own error is not just a lost peer, else torchrun's
    root cause (whose timing can favour a rank that only lost its peer), else any."""
    failed = [r for r, text in sorted(stderr.items()) if "Traceback" in text]
    own = [r for r in failed if not _CONSEQUENCE.search(_tail(stderr[r], 8))]
    root = _root_cause(agent_log)
    for group in (own, [root] if root in failed else [], failed):
        if group:
            return group[0]
    return None


def _failure_message(module: str, nproc: int, code: int, result: LaunchResult, agent_log: str) -> str:
    rank = _culprit(result.stderr, agent_log)
    lines = [f"{module} on {nproc} ranks failed (torchrun exit code {code})."]
    if rank is not None:
        others = sorted(r for r, text in result.stderr.items() if "Traceback" in text and r != rank)
        also = f" (ranks {others} failed after it)" if others else ""
        lines.append(f"Rank {rank} failed{also}; last lines of its stderr:")
        lines.append(_tail(result.stderr[rank]))
    else:
        lines.append("No rank wrote a traceback; last lines of torchrun's own log:")
        lines.append(_tail(agent_log))
    if result.output:
        lines += ["Rank 0's output before the failure:", _tail(result.output, 10)]
    return "\n".join(lines)


def _timeout_message(module: str, nproc: int, timeout: float, logs: Path) -> str:
    lines = [f"{module} on {nproc} ranks did not finish within its {timeout:g} s timeout; every rank was stopped."]
    for rank, text in _read_streams(logs, "stderr").items():
        if text.strip():
            lines += [f"Rank {rank}'s last lines of stderr:", _tail(text, 8)]
    return "\n".join(lines)
