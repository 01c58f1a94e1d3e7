"""The tests' launcher for the library's multi-rank checks: ranks forked from one warm interpreter.

``run(module, nproc, ...)`` runs ``python -m module`` on ``nproc`` gloo ranks as ``launch.run``
does and returns the same :class:`intralayer.launch.LaunchResult` (or raises its
``LaunchError``), but does not start torchrun: each torchrun launch imports torch once per
rank and once for its agent, about 2 s of CPU each on the 2-core test machine, where the suite
is CPU-bound. Here a server per pytest worker (``python -m tests.warm_ranks``) imports torch
once; for each job it forks a leader in a session of its own, which picks a free port and forks
the ranks with the environment torchrun gives them (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``: rank 0 hosts the store, after the fork);
each runs the module as ``python -m`` would. When a rank fails, the leader stops the others
with SIGTERM, as torchrun does (they print their stacks: :func:`intralayer.distributed.setup`);
at the timeout the caller stops the whole session. Forking is safe for the reason
:mod:`intralayer.labs.runner` gives: one thread and no tensor operation before the fork.

torchrun stays tested where it is the subject: tests/test_launch.py, test_faults.py,
test_concurrency.py, test_gpu_check.py, and the chapters, whose launches are the reader's.
"""
from __future__ import annotations

import contextlib
import json
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from intralayer import distributed, launch   # torch and torch.distributed: imported once, before any fork
from intralayer.labs import runner
from intralayer.labs.check import Replies, stop_session

ROOT = Path(__file__).resolve().parents[1]


def _rank(rank: int, port: int, job: dict, folder: Path) -> None:
    """One rank, in a forked child: its output to files, torchrun's environment, the module as __main__."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        os.dup2(os.open(folder / f"{rank}.{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    n = str(job["nproc"])
    os.environ.update(job["env"], RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=n,
                      LOCAL_WORLD_SIZE=n, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.argv = [job["module"], *job["args"]]
    code = 0
    try:
        runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:                     # as the interpreter treats it
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _leader(job: dict, folder: Path) -> None:
    """Fork the ranks, wait for them; when one fails, SIGTERM the rest; write ``exit.json``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pids = {}
    for rank in range(job["nproc"]):
        pid = os.fork()
        if pid == 0:
            _rank(rank, port, job, folder)
        pids[pid] = rank
    exits: dict[int, int] = {}
    while len(exits) < len(pids):
        pid, status = os.wait()
        exits[pids[pid]] = os.waitstatus_to_exitcode(status)
        if exits[pids[pid]] != 0:
            for other, rank in pids.items():
                if rank not in exits:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(other, signal.SIGTERM)
    (folder / "exit.json").write_text(json.dumps(exits))


def serve() -> None:
    """For each job line on stdin: fork a leader in a new session and answer ``pid N``, then
    ``exit C`` (the labs' warm runner's protocol and code; its watchdog: 10 s past the timeout)."""
    for line in sys.stdin:
        job = json.loads(line)

        def leader(job=job) -> int:
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            _leader(job, Path(job["folder"]))
            return 0

        runner.fork_and_wait(leader, job["timeout"] + 10.0)


class _Server:
    current: "_Server | None" = None

    def __init__(self):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.warm_ranks"], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        self.replies = Replies(self.proc)

    @classmethod
    def get(cls) -> "_Server":
        if cls.current is None or cls.current.proc.poll() is not None:
            cls.current = cls()
        return cls.current

    def reply(self, word: str, until: float) -> int | None:
        got = self.replies.next(word, until)
        if got is None and self.proc.poll() is not None:
            raise RuntimeError("the warm rank server died")
        return got


def run(module: str, nproc: int, args=(), timeout: float = 120.0, env: dict | None = None,
        show: bool = False) -> launch.LaunchResult:
    """``launch.run``'s contract (result, ``LaunchError``, nothing left running) on forked ranks."""
    folder = Path(tempfile.mkdtemp(prefix="intralayer-warm-"))
    job = {"module": module, "nproc": nproc, "args": [str(a) for a in args], "folder": str(folder),
           "timeout": timeout, "env": {distributed.TIMEOUT_ENV: str(max(5.0, 0.8 * timeout)), **(env or {})}}
    server, start = _Server.get(), time.monotonic()
    try:
        server.proc.stdin.write((json.dumps(job) + "\n").encode())
        server.proc.stdin.flush()
        pid = server.reply("pid", start + 30.0)
        assert pid is not None, "the warm rank server did not fork the job within 30 s"
        late = server.reply("exit", start + timeout) is None
        if late and not stop_session(pid, server.replies):     # SIGTERM, then SIGKILL
            _Server.current = None                                 # a fresh server for the next job
            launch.stop(server.proc)
        read = {s: {int(p.name.split(".")[0]): p.read_text(errors="replace") for p in sorted(folder.glob(f"*.{s}"))}
                for s in ("stdout", "stderr")}
        result = launch.LaunchResult(module, nproc, time.monotonic() - start, read["stdout"], read["stderr"])
        exits = {int(r): c for r, c in json.loads((folder / "exit.json").read_text()).items()} \
            if (folder / "exit.json").exists() else {}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    failed = {r: c for r, c in exits.items() if c != 0}
    if late or failed or len(exits) != nproc:
        head = (f"{module} on {nproc} forked ranks did not finish within {timeout:g} s" if late
                else f"{module} on {nproc} forked ranks failed: exit codes {dict(sorted(exits.items()))}")
        tails = [f"rank {r}'s last lines of stderr:\n" + "\n".join(text.rstrip().splitlines()[-25:])
                 for r, text in result.stderr.items() if text.strip()]
        raise launch.LaunchError("\n".join([head, *tails]))
    if show and result.output:
        print(result.output, end="" if result.output.endswith("\n") else "\n")
    return result


if __name__ == "__main__":
    serve()
