"""Run a course program on N ranks from a notebook or a test.

``run("intralayer.programs.collectives", nproc=4)`` starts
``python -m torch.distributed.run --standalone --nproc-per-node 4 -m <module>`` with
the interpreter that runs the notebook (so the virtual environment need not be on
``PATH``; ``!torchrun`` in a cell fails silently when it is not). Each rank's output goes
to its own log file; rank 0's standard output is shown when the run ends. If any rank
fails, or the timeout passes, every process of the job is stopped and a
:class:`LaunchError` carries the failing rank's last lines of standard error. The rank
it blames is the one that failed first for a reason of its own, not one that only lost
its peer: a rank that raised, else one a signal killed (named with the signal: it leaves
no traceback), else one that timed out waiting; and it says what the other ranks were
doing, which collective they waited in and which rank never joined it (from the stack
each rank prints when stopped, see :mod:`intralayer.distributed`).

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
import torch

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


#: What a rank's error says when it only lost a peer that failed first.
_CONSEQUENCE = re.compile(r"closed by peer|reset by peer|DistBackendError|DistNetworkError|Broken pipe", re.I)
#: What it says when it gave up waiting for a peer (gloo: "Timed out waiting 3000ms for
#: recv operation"; NCCL: "Watchdog caught collective operation timeout").
_TIMED_OUT = re.compile(r"timed out|timeout", re.I)
#: The prefix torch puts before each line of a rank's traceback.
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?", re.M)
#: A frame, in a traceback (``line 5, in f``) or in faulthandler's stack (``line 5 in f``).
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+),? in (?P<func>\S+)')
#: The head of each thread's stack in faulthandler's dump (see ``distributed.setup``).
_STACK_HEAD = re.compile(r"^.*\(most recent call first\):\s*$", re.M)
#: One rank in torchrun's failure summary.
_FAILURE = re.compile(r"rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*"
                      r"exitcode\s*:\s*(?P<code>-?\d+)\s*\(pid:\s*(?P<pid>\d+)\)")
#: Workers torchrun itself signalled (with SIGTERM, then SIGKILL if they lingered).
_SIGNALLED = re.compile(r"(?:Sending process|Unable to shutdown process) (\d+)")
#: Frames of torch itself, in this interpreter's install or any (site|dist)-packages.
_TORCH_DIR = str(Path(torch.__file__).resolve().parent) + os.sep
_IN_TORCH = re.compile(r"[/\\](?:site|dist)-packages[/\\]torch[/\\]")
ERROR_CHARS = 160


@dataclass
class _Rank:
    """What one rank's stderr and torchrun's log say about how it ended."""

    text: str = ""                # its stderr, less the stack printed on SIGTERM
    error: str = ""               # the last line of its traceback; "" if it wrote none
    frames: list = field(default_factory=list)   # traceback or stack, outermost first
    stack: bool = False           # ``frames`` is the stack it printed when stopped
    code: int | None = None       # its exit code, where torchrun lists it as failed
    signalled: bool = False       # torchrun sent it the signal that ended it

    @property
    def traceback(self) -> bool:
        return bool(self.error)

    @property
    def killed(self) -> str | None:
        """'signal 9 (SIGKILL)' if a signal torchrun did not send ended it before it wrote
        a traceback (a rank that aborts on its way out after one is blamed for that one)."""
        if self.traceback or self.code is None or self.code >= 0 or self.signalled:
            return None
        try:
            name = signal.Signals(-self.code).name
        except ValueError:
            return f"signal {-self.code}"
        return f"signal {-self.code} ({name})"

    @property
    def ended(self) -> str | None:
        """How it ended without a traceback: 'was killed by signal 9 (SIGKILL)' or
        'exited with code 3'; None if it wrote one, or ended well, or torchrun stopped it."""
        if self.traceback or self.code is None or self.code == 0 or self.signalled:
            return None
        return f"was killed by {self.killed}" if self.code < 0 else f"exited with code {self.code}"

    @property
    def lost_peer(self) -> bool:
        """Its error only says that a peer went away (it failed because another did)."""
        return (self.traceback and not self.timed_out
                and bool(_CONSEQUENCE.search(self.error) or _CONSEQUENCE.search(_tail(self.text, 8))))

    @property
    def timed_out(self) -> bool:
        """It gave up waiting in a collective (the process-group timeout)."""
        return self.traceback and self.collective is not None and bool(_TIMED_OUT.search(self.error))

    @property
    def collective(self) -> str | None:
        """The ``torch.distributed`` function it was in: the outermost frame there."""
        for file, _, func in self.frames:
            if file.endswith("distributed_c10d.py"):
                return func
        return None

    @property
    def where(self) -> str | None:
        """``file:line in function`` of its innermost frame outside torch and the interpreter."""
        for file, line, func in reversed(self.frames):
            if not (file.startswith("<") or _IN_TORCH.search(file) or os.path.abspath(file).startswith(_TORCH_DIR)):
                try:
                    here = os.path.relpath(file)
                except ValueError:              # another drive, on Windows
                    here = file
                return f"{file if here.startswith('..') else here}:{line} in {func}"
        return None

    def doing(self) -> str:
        """'in all_reduce at prog.py:54 in main', 'at prog.py:47 in main, not in a collective'."""
        where = f" at {self.where}" if self.where else ""
        if self.collective:
            return f"in {self.collective}{where}"
        return f"{where.strip()}, not in a collective" if where else "not in a collective"


def _frames(lines: list[str]) -> list[tuple[str, int, str]]:
    return [(m["file"], int(m["line"]), m["func"]) for line in lines if (m := _FRAME.match(line))]


def _parse_stderr(raw: str) -> _Rank:
    text = _RANK_PREFIX.sub("", raw)
    info = _Rank()
    heads = list(_STACK_HEAD.finditer(text))
    if heads:  # the stack faulthandler printed on SIGTERM: one block per Python thread
        blocks = [text[h.end():(heads[i + 1].start() if i + 1 < len(heads) else len(text))]
                  for i, h in enumerate(heads)]
        stacks = [_frames(b.splitlines())[::-1] for b in blocks]
        in_c10d = [f for f in stacks if any(file.endswith("distributed_c10d.py") for file, _, _ in f)]
        info.frames = (in_c10d or stacks)[-1]   # the main thread is listed last
        info.stack = bool(info.frames)
        text = text[:heads[0].start()]
    info.text = text
    at = text.rfind("Traceback (most recent call last):")
    if at >= 0:
        lines = text[at:].splitlines()[1:]
        error = next((ln for ln in lines if ln.strip() and not ln[0].isspace()), "")
        info.error = error.strip() or "(no message)"
        if not info.stack:
            info.frames = _frames(lines)
    return info


def _ranks(stderr: dict[int, str], agent_log: str = "") -> dict[int, _Rank]:
    ranks = {r: _parse_stderr(text) for r, text in sorted(stderr.items())}
    signalled = set(_SIGNALLED.findall(agent_log))
    for m in _FAILURE.finditer(agent_log):
        info = ranks.setdefault(int(m["rank"]), _Rank())
        info.code = int(m["code"])
        info.signalled = m["pid"] in signalled
    return dict(sorted(ranks.items()))


def _root_cause(agent_log: str) -> int | None:
    """The rank torchrun names as the first observed failure."""
    m = re.search(r"Root Cause.*?rank\s*:\s*(\d+)", agent_log, re.S)
    return int(m.group(1)) if m else None


def _culprit(ranks: dict[int, _Rank], agent_log: str) -> int | None:
    """The rank to blame: one that raised an error of its own, else one a signal killed,
    else one that timed out waiting, else one that exited with an error code but no
    traceback, else torchrun's root cause (whose timing can favour a rank that only lost
    its peer), else any that wrote a traceback."""
    failed = [r for r, i in ranks.items() if i.traceback]
    root = _root_cause(agent_log)
    for group in ([r for r in failed if not ranks[r].lost_peer and not ranks[r].timed_out],
                  [r for r, i in ranks.items() if i.killed],
                  [r for r in failed if ranks[r].timed_out],
                  [r for r, i in ranks.items() if i.ended],
                  [root] if root in failed else [],
                  failed):
        if group:
            return group[0]
    return None


def _short(error: str) -> str:
    return error if len(error) <= ERROR_CHARS else error[:ERROR_CHARS - 3] + "..."


def _failure_message(module: str, nproc: int, code: int, result: LaunchResult, agent_log: str) -> str:
    ranks = _ranks(result.stderr, agent_log)
    rank = _culprit(ranks, agent_log)
    lines = [f"{module} on {nproc} ranks failed (torchrun exit code {code})."]
    if rank is None:
        lines.append("No rank wrote a traceback; last lines of torchrun's own log:")
        lines.append(_tail(agent_log))
    else:
        c = ranks[rank]
        if c.traceback:
            what = (f": it timed out in {c.collective or 'a collective'} waiting for a peer" if c.timed_out
                    else f" in {c.collective}" if c.collective else "")
            lines.append(f"Rank {rank} failed{what}; last lines of its stderr:")
            lines.append(_tail(c.text))
        else:
            why = (": a crash, the out-of-memory killer or a kill from outside ended it" if c.killed else "")
            lines.append(f"Rank {rank} {c.ended} and wrote no traceback{why}.")
            if c.text.strip():
                lines += ["Last lines of its stderr:", _tail(c.text)]
        if c.timed_out and c.collective:
            # A rank stopped elsewhere than in that collective never joined it. (A rank that
            # printed no stack, or failed too, cannot be placed: the notes below list it.)
            absent = [r for r, i in ranks.items()
                      if r != rank and i.stack and not i.traceback and i.collective != c.collective]
            if absent:
                lines.append(f"Missing from {c.collective}: "
                             + "; ".join(f"rank {r}, {ranks[r].doing()}" for r in absent) + ".")
        notes = []
        for r, i in ranks.items():
            if r == rank:
                continue
            if i.traceback:
                place = f" in {i.collective}" if i.collective else ""
                notes.append(f"  rank {r} also failed{place}: {_short(i.error)}")
            elif i.ended:
                notes.append(f"  rank {r} {i.ended}")
            elif i.stack:
                notes.append(f"  rank {r} was still running when torchrun stopped it; it was {i.doing()}")
            elif i.signalled:
                notes.append(f"  rank {r} was still running when torchrun stopped it")
        if notes:
            lines += ["The other ranks:", *notes]
    if result.output:
        lines += ["Rank 0's output before the failure:", _tail(result.output, 10)]
    return "\n".join(lines)


def _timeout_message(module: str, nproc: int, timeout: float, logs: Path) -> str:
    lines = [f"{module} on {nproc} ranks did not finish within its {timeout:g} s timeout; every rank was stopped."]
    for rank, info in _ranks(_read_streams(logs, "stderr")).items():
        if info.stack:
            lines.append(f"When stopped, rank {rank} was {info.doing()}.")
        if info.text.strip():
            lines += [f"Rank {rank}'s last lines of stderr:", _tail(info.text, 8)]
    return "\n".join(lines)
