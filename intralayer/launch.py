"""Run a course program on N ranks from a notebook or a test: ``run("intralayer.programs.collectives", 4)``.

torchrun (``--standalone``) runs with the notebook's own interpreter, so the venv need not be on
``PATH``, inside a small agent (``python -m intralayer.launch REPORT <torchrun options>``) that
writes torchrun's ``ChildFailedError`` as JSON: each failed rank's exit code and the error record
(message, traceback, timestamp) that ``errors.record``, which decorates every course program's
``main``, writes. If a rank fails or the timeout passes, every process is stopped and a
:class:`LaunchError` says which rank failed, how, and — from the stacks ranks print when stopped
(:func:`distributed.setup`) — what the others were doing.

The test suite sets :data:`POOL_ENV` for the notebooks it executes: there the same program runs,
with torchrun's environment (``RANK``, ``WORLD_SIZE``, …), on ranks of :mod:`intralayer.ranks`'
warm pool (about 0.2 s a launch instead of torchrun's 6 s, measured here: torchrun and four
ranks each import torch). torchrun itself is tested where it is the subject (tests/test_launch.py,
test_faults.py, test_concurrency.py, test_gpu_check.py); a reader's notebook always uses torchrun.
"""
from __future__ import annotations

import json
import math
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from .distributed import TIMEOUT_ENV

MAX_RANKS_HERE = 8
TAIL_LINES = 25
#: Set to "1" (by tests/conftest.py, for the notebooks nbval executes): :func:`run` uses the rank pool.
POOL_ENV = "INTRALAYER_LAUNCH_ON_POOL"

#: The thread pools every torchrun rank gets: one thread each, as on the warm pool's ranks.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


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
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc}", "-m", module, *map(str, args)]


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
    if a rank fails or the job takes longer than ``timeout`` seconds; no process of the
    job outlives the call, also when the caller is interrupted (``KeyboardInterrupt``).
    """
    _check(module, nproc, timeout)
    if os.environ.get(POOL_ENV) == "1":
        result = _in_pool(module, nproc, args, timeout, env)
    else:
        result = _torchrun(module, nproc, args, timeout, env)
    if show and result.output:
        print(result.output, end="" if result.output.endswith("\n") else "\n")
    return result


def _torchrun(module: str, nproc: int, args, timeout: float, env: dict[str, str] | None) -> LaunchResult:
    logs = Path(tempfile.mkdtemp(prefix="intralayer-launch-"))
    # One thread per rank, whatever the caller's shell says (an inherited OMP_NUM_THREADS changed the
    # kernels' blocking, and so the last bits of the errors the chapters print): the same settings as the
    # warm pool's ranks (ranks.SERVER_ENV, less its hidden CUDA device). Only ``env`` may ask for more.
    child_env = {**os.environ, **ONE_THREAD, **(env or {}), "PYTHONUNBUFFERED": "1"}
    # The process group gives up a little before the launch does, so that a rank
    # waiting for a dead peer reports the collective it was in.
    child_env.setdefault(TIMEOUT_ENV, str(max(5.0, 0.8 * timeout)))
    cmd = command(module, nproc, args)
    cmd[1:3] = ["-m", __name__, str(logs / "failures.json"), "--log-dir", str(logs / "ranks"), "--redirects", "3"]
    start = time.monotonic()
    try:
        with open(logs / "torchrun.log", "w") as agent_log:
            proc = subprocess.Popen(cmd, stdout=agent_log, stderr=subprocess.STDOUT,
                                    env=child_env, start_new_session=True)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = None
            finally:  # also on KeyboardInterrupt in a notebook: take every rank down
                stop(proc)
        result = LaunchResult(module, nproc, time.monotonic() - start, _streams(logs, "stdout"),
                              _streams(logs, "stderr"))
        if code is None:
            raise LaunchError(_timeout_message(module, nproc, timeout, result))
        if code != 0:
            report = logs / "failures.json"
            failures = {int(r): f for r, f in json.loads(report.read_text()).items()} if report.exists() else {}
            agent = (logs / "torchrun.log").read_text(errors="replace")
            raise LaunchError(_failure_message(module, nproc, code, result, failures, agent))
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    return result


def stop(proc: subprocess.Popen, grace: float = 3.0) -> None:
    """Stop torchrun and every worker it started (workers run in sessions of their own)."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    with suppress(ProcessLookupError):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for kill in ("terminate", "kill"):
        for p in family:
            with suppress(psutil.NoSuchProcess):
                getattr(p, kill)()
        _, family = psutil.wait_procs(family, timeout=grace)
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _streams(logs: Path, stream: str) -> dict[int, str]:
    """Each rank's ``stdout`` or ``stderr``, from torchrun's ``<run>/attempt_0/<rank>/<stream>.log``."""
    found = {int(p.parent.name): p.read_text(errors="replace") for p in logs.glob(f"ranks/*/attempt_*/*/{stream}.log")}
    return dict(sorted(found.items()))


def _tail(text: str, n: int = TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


_LOST_PEER = re.compile(r"closed by peer|reset by peer|Broken pipe", re.I)   # it failed because another did
#: A frame, in a traceback (``line 5, in f``) or in the stack faulthandler prints (``line 5 in f``).
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+),? in (?P<func>\S+)', re.M)
_STACK_HEAD = re.compile(r"^.*\(most recent call first\):\s*$", re.M)     # one per thread
_OUTSIDE = re.compile(r"^<|[/\\](?:site|dist)-packages[/\\]torch[/\\]")


class _Rank:
    """How one rank ended, from torchrun's failure record for it (``failure``: its exit code
    and the error record it wrote, if any) and its stderr."""

    def __init__(self, stderr: str, failure: dict | None = None):
        text = re.sub(r"^\[rank\d+\]:\s?", "", stderr, flags=re.M)
        heads = list(_STACK_HEAD.finditer(text))
        stacks = [_frames(text[h.end():e]) for h, e in zip(heads, [h.start() for h in heads[1:]] + [len(text)])]
        waiting = [f for f in stacks if any(file.endswith("distributed_c10d.py") for file, _, _ in f)]
        self.stack = bool(heads)          # it printed its stack: it was still running when stopped
        self.frames = (waiting or stacks or [[]])[-1][::-1]     # outermost first; main thread last
        self.text = text[:heads[0].start()] if heads else text
        self.code = (failure or {}).get("exitcode")
        record = ((failure or {}).get("error") or {}).get("message")
        record = record if isinstance(record, dict) else {}    # written by ``errors.record``
        self.error = record.get("message", "") or ("(no message)" if record else "")
        self.time = float(record.get("extraInfo", {}).get("timestamp", math.inf))
        if not self.stack:
            self.frames = _frames(record.get("extraInfo", {}).get("py_callstack", ""))
        self.collective = next((fn for file, _, fn in self.frames if file.endswith("distributed_c10d.py")), None)
        self.timed_out = bool(self.error and self.collective and "timed out" in self.error.lower())
        self.lost_peer = bool(self.error and not self.timed_out and _LOST_PEER.search(self.error))
        self.ended = None     # how it ended without an error record, unless stopped while running
        if self.code and not self.error and not self.stack:
            sig = -self.code
            name = signal.Signals(sig).name if sig in signal.valid_signals() else "?"
            self.ended = f"was killed by signal {sig} ({name})" if sig > 0 else f"exited with code {self.code}"

    def doing(self) -> str:
        """'in all_reduce at prog.py:54 in main', 'at prog.py:47 in main, not in a collective'."""
        own = [(f, n, fn) for f, n, fn in self.frames if not _OUTSIDE.search(f)]
        where = ""
        if own:
            rel = os.path.relpath(own[-1][0]) if os.path.isabs(own[-1][0]) else own[-1][0]
            where = f"at {own[-1][0] if rel.startswith('..') else rel}:{own[-1][1]} in {own[-1][2]}"
        if self.collective:
            return f"in {self.collective} {where}".rstrip()
        return f"{where}, not in a collective" if where else "not in a collective"


def _frames(text: str) -> list[tuple[str, int, str]]:
    return [(m["file"], int(m["line"]), m["func"]) for m in _FRAME.finditer(text)]


def _failure_message(module: str, nproc: int, code: int, result: LaunchResult,
                     failures: dict[int, dict], agent_log: str = "") -> str:
    """Blame one rank: one that raised an error of its own, else one a signal killed or
    that exited with an error code and no record (a SIGTERM last: torchrun stops the others
    with it, and a rank it stops before its stack is printed looks the same), else one that
    timed out waiting, else the first to write an error record; then say what the others did."""
    ranks = {r: _Rank(result.stderr.get(r, ""), failures.get(r)) for r in sorted({*result.stderr, *failures})}
    order = ([r for r, i in ranks.items() if i.error and not i.lost_peer and not i.timed_out]
             + sorted((r for r, i in ranks.items() if i.ended), key=lambda r: ranks[r].code == -signal.SIGTERM)
             + [r for r, i in ranks.items() if i.timed_out]
             + sorted((r for r, i in ranks.items() if i.error), key=lambda r: ranks[r].time))
    lines = [f"{module} on {nproc} ranks failed (torchrun exit code {code})."]
    if not order:
        lines += ["No rank recorded an error; last lines of torchrun's own log:", _tail(agent_log)]
    else:
        rank, c = order[0], ranks[order[0]]
        if c.error:
            what = (f": it timed out in {c.collective} waiting for a peer" if c.timed_out
                    else f" in {c.collective}" if c.collective else "")
            lines += [f"Rank {rank} failed{what}; last lines of its stderr:", _tail(c.text)]
        else:
            why = ": a crash, the out-of-memory killer or a kill from outside ended it" if c.code < 0 else ""
            lines.append(f"Rank {rank} {c.ended} and wrote no traceback{why}.")
            lines += ["Last lines of its stderr:", _tail(c.text)] if c.text.strip() else []
        absent = [r for r, i in ranks.items() if c.timed_out and i.stack and i.collective != c.collective]
        if absent:        # stopped elsewhere than in the collective it timed out in: never joined it
            lines.append(f"Missing from {c.collective}: " + "; ".join(f"rank {r}, {ranks[r].doing()}" for r in absent) + ".")
        notes = [f"  rank {r} also failed{f' in {i.collective}' if i.collective else ''}: "
                 + (i.error if len(i.error) <= 160 else i.error[:157] + "...") if i.error
                 else f"  rank {r} {i.ended}" if i.ended
                 else f"  rank {r} was still running when torchrun stopped it; it was {i.doing()}"
                 for r, i in ranks.items() if r != rank and (i.error or i.ended or i.stack)]
        lines += ["The other ranks:", *notes] if notes else []
    if result.output:
        lines += ["Rank 0's output before the failure:", _tail(result.output, 10)]
    return "\n".join(lines)


def _timeout_message(module: str, nproc: int, timeout: float, result: LaunchResult) -> str:
    lines = [f"{module} on {nproc} ranks did not finish within its {timeout:g} s timeout; every rank was stopped."]
    for rank, text in result.stderr.items():
        info = _Rank(text)
        lines += [f"When stopped, rank {rank} was {info.doing()}."] if info.stack else []
        lines += [f"Rank {rank}'s last lines of stderr:", _tail(info.text, 8)] if info.text.strip() else []
    return "\n".join(lines)


def _agent(report: str, argv: list[str]) -> None:
    """torchrun, in this process, writing its ``ChildFailedError`` to ``report`` as JSON."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run as torchrun
    try:
        torchrun(parse_args(argv))
    except ChildFailedError as e:
        Path(report).write_text(json.dumps({r: {"exitcode": f.exitcode, "error": f.error_file_data}
                                            for r, f in e.failures.items()}))
        raise SystemExit(1) from None


if __name__ == "__main__":
    _agent(sys.argv[1], sys.argv[2:])


# ---------------------------------------------------------------------------- on the pool's ranks

def run_module(module: str, argv: list[str]) -> int:
    """``python -m module argv…`` inside a rank of :mod:`intralayer.ranks`; its exit code (``SystemExit``
    as the interpreter reads it)."""
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    return 0


def _in_pool(module: str, nproc: int, args=(), timeout: float = 120.0, env: dict | None = None) -> LaunchResult:
    """:func:`run`'s contract on warm pool ranks (:data:`POOL_ENV`, set by the tests): a ``LaunchResult``,
    or ``LaunchError`` naming each failed rank with the tail of its stderr. torchrun is tested where it
    is the subject (test_launch, test_faults, the chapters)."""
    from . import ranks

    env = {TIMEOUT_ENV: str(max(5.0, 0.8 * timeout)), **(env or {})}
    start = time.monotonic()
    outcomes = ranks.run(run_module, nproc, (module, [str(a) for a in args]), deadline=timeout, env=env,
                         stop_on_failure=True)
    result = LaunchResult(module, nproc, time.monotonic() - start, {o.rank: o.stdout for o in outcomes},
                          {o.rank: o.stderr for o in outcomes})
    bad = [o for o in outcomes if not (o.ok and o.value == 0)]
    if bad:
        late = any(o.exitcode is None for o in outcomes)
        codes = {o.rank: o.value if o.error is None and o.exitcode == 0 else o.exitcode for o in outcomes}
        head = (f"{module} on {nproc} pool ranks did not finish within {timeout:g} s" if late
                else f"{module} on {nproc} pool ranks failed: exit codes {codes}")
        tails = [f"rank {o.rank}'s last lines of stderr:\n" + "\n".join(o.stderr.rstrip().splitlines()[-25:])
                 for o in outcomes if o.stderr.strip()]
        raise LaunchError("\n".join([head, *tails]))
    return result
