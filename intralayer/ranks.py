"""One pool of warm ranks, for the labs' checks and the library's multi-rank tests.

``run(target, world, args)`` calls ``target(*args)`` on ``world`` gloo ranks and returns
one :class:`Outcome` per rank. Everything in it is the standard library's or torch's
:

- the ranks are :mod:`multiprocessing` processes of the ``forkserver`` start method with
  this module preloaded, so the fork server imports torch once (a first check takes about
  1.7 s here, a later one about 0.2 s) and every rank of every later job is forked from it —
  safe, because the fork server has one thread (:data:`SERVER_ENV`; tests/test_ranks.py
  checks it) and only imports modules;
- they meet through a ``FileStore`` in the job's own folder (``init_method=file://``, read
  by :func:`intralayer.distributed.setup` from ``INTRALAYER_INIT_METHOD``): no port to pick;
- a rank hands back what ``target`` returned, or the exception it raised, through a pipe,
  as a typed outcome; what it prints goes to files the caller reads;
- at the deadline every rank still running gets SIGTERM (its stack goes to its stderr:
  :func:`intralayer.distributed.setup`), then SIGKILL; and should the caller die first, each
  rank's own alarm ends it a little later: nothing is left running.

The ranks run on the CPU, one thread each (``OMP_NUM_THREADS=1``, no CUDA device): labs and
tests are for a laptop. Programs for GPUs are launched with torchrun (:mod:`intralayer.launch`).
"""
from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed  # noqa: F401  (imported once, in the fork server, for every rank)

#: How the ranks are started (reported by the labs' checks).
START_METHOD = "forkserver"
#: Seconds between SIGTERM (the ranks print their stacks) and SIGKILL.
GRACE_S = 3.0


@dataclass
class Outcome:
    """What one rank did: ``value`` returned, or ``error`` raised (its type, text and frames)."""

    rank: int
    value: object = None
    error: dict | None = None
    exitcode: int | None = None          # None: still running at the deadline (then stopped)
    stdout: str = ""
    stderr: str = ""
    messages: list = field(default_factory=list)   # what the rank sent with report() before it ended

    @property
    def ok(self) -> bool:
        return self.error is None and self.exitcode == 0


def error_info(exc: BaseException) -> dict:
    """An exception as plain data: type, message, and every frame (file, line, qualified name)."""
    frames, tb = [], exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        frames.append((code.co_filename, tb.tb_lineno, getattr(code, "co_qualname", code.co_name)))
        tb = tb.tb_next
    return {"type": type(exc).__name__, "message": str(exc).strip(), "frames": frames,
            "traceback": "".join(traceback.format_exception(exc))[-6000:]}


_conn = None


def report(message) -> None:
    """From inside a rank: hand ``message`` to the caller now (it arrives even if the rank dies later)."""
    if _conn is None:
        raise RuntimeError("report() is for code running on a rank of intralayer.ranks.run")
    _conn.send(("message", message))


def _rank(rank: int, world: int, folder: str, target, args, env: dict, conn, alarm_s: int) -> None:
    """The body of one rank, in a process forked from the fork server."""
    global _conn
    _conn = conn
    signal.alarm(alarm_s)                          # the last resort if the caller is gone
    for fd, name in ((1, "out"), (2, "err")):
        os.dup2(os.open(os.path.join(folder, f"rank{rank}.{name}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), INTRALAYER_INIT_METHOD=f"file://{folder}/store",
                      OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    # A program that calls init_process_group itself (env://) meets on rank 0's TCPStore instead, at the
    # free port run() chose (a port derived from the folder's name collided with one in use: EADDRINUSE).
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.set_num_threads(1)
    try:
        reply = ("value", target(*args))
    except BaseException as exc:                    # SystemExit too: what the rank's code did is the answer
        reply = ("error", error_info(exc))
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        conn.send(reply)
    except Exception as exc:                        # a value that cannot be pickled
        conn.send(("error", error_info(exc)))
    conn.close()
    os._exit(1 if reply[0] == "error" else 0)       # no teardown: a broken group may hang in it


#: What the fork server imports once for every rank: torch, and the labs with every chapter's checks
#: (which import the whole library). Not torch._dynamo: the labs' dispatch modes opt out of it
#: (:class:`intralayer.record.Mode`).
PRELOAD = [__name__, "intralayer.labs"]


#: The fork server's environment: one thread (NumPy's and torch's thread pools would otherwise start
#: threads at import, and forking a process with threads is unsafe), no CUDA device.
SERVER_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "CUDA_VISIBLE_DEVICES": ""}


def _context():
    """The forkserver context, its server started (or restarted) with :data:`SERVER_ENV`."""
    import multiprocessing.forkserver

    ctx = multiprocessing.get_context(START_METHOD)
    ctx.set_forkserver_preload(PRELOAD)
    saved = {k: os.environ.get(k) for k in SERVER_ENV}
    os.environ.update(SERVER_ENV)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return ctx


@contextlib.contextmanager
def _without_main():
    """Start a rank without its re-running the caller's ``__main__``: multiprocessing would have
    each rank import it again (in a notebook, ipykernel and all it imports: seconds per rank).
    A target is a module's function, so a rank needs nothing from ``__main__``."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _free_port() -> int:
    """A port no process listens on now, as the system hands one out (bind to port 0)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(target, world: int, args: tuple = (), *, deadline: float = 60.0, env: dict | None = None,
        stop_on_failure: bool = False) -> list[Outcome]:
    """Run ``target(*args)`` on ``world`` ranks; one :class:`Outcome` per rank, in rank order.

    ``target`` must be a function of an importable module (not of ``__main__``). ``deadline`` counts from
    the start of the ranks; ``stop_on_failure`` stops the others when one fails, as torchrun does.
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world={world!r} must be a whole number of ranks ≥ 1")
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not 0 < deadline < float("inf"):
        raise ValueError(f"deadline={deadline!r} must be a positive, finite number of seconds")
    ctx = _context()
    folder = tempfile.mkdtemp(prefix="intralayer-ranks-")
    env = {"MASTER_PORT": str(_free_port()), **(env or {})}   # for a program that meets by env:// itself
    outcomes = [Outcome(r) for r in range(world)]
    procs, conns = [], {}
    try:
        for r in range(world):
            receive, send = ctx.Pipe(duplex=False)
            rank_args = (r, world, folder, target, args, dict(env or {}), send, int(deadline + 3 * GRACE_S + 5))
            p = ctx.Process(target=_rank, args=rank_args, daemon=True)
            try:
                with _without_main():
                    p.start()
            except (EOFError, ConnectionError):          # the fork server died: start another, once
                time.sleep(0.5)
                ctx = _context()
                p = ctx.Process(target=_rank, args=rank_args, daemon=True)
                with _without_main():
                    p.start()
            send.close()
            procs.append(p)
            conns[receive] = r
        _collect(procs, conns, outcomes, time.monotonic() + deadline, stop_on_failure)
        stop(procs)                                   # the late ones print their stacks, then end
        for o in outcomes:
            for kind in ("out", "err"):
                path = Path(folder, f"rank{o.rank}.{kind}")
                setattr(o, "stdout" if kind == "out" else "stderr", path.read_text(errors="replace")
                        if path.exists() else "")
        return outcomes
    finally:
        stop(procs)
        for c in conns:
            c.close()
        shutil.rmtree(folder, ignore_errors=True)


def _collect(procs, conns, outcomes, until: float, stop_on_failure: bool) -> None:
    """Read every rank's messages and outcome until all have ended or the deadline passes."""
    open_conns, running = dict(conns), {p.sentinel: r for r, p in enumerate(procs)}
    while running or open_conns:
        ready = multiprocessing.connection.wait([*open_conns, *running], timeout=max(0.0, until - time.monotonic()))
        if not ready:
            break                                       # late: stopped in run's finally
        for item in ready:
            if item in open_conns:
                o = outcomes[open_conns[item]]
                try:
                    kind, payload = item.recv()
                except (EOFError, OSError):
                    del open_conns[item]
                    continue
                if kind == "message":
                    o.messages.append(payload)
                else:
                    o.value, o.error = (payload, None) if kind == "value" else (None, payload)
            else:
                r = running.pop(item)
                procs[r].join()
                outcomes[r].exitcode = procs[r].exitcode
        failed = [o for o in outcomes if o.error is not None or o.exitcode not in (None, 0)]
        if stop_on_failure and failed:                  # torchrun's rule: the others are stopped
            stop([p for r, p in enumerate(procs) if outcomes[r].error is None])
    for r, p in enumerate(procs):                       # exit codes of ranks that ended in the last round
        if outcomes[r].exitcode is None and not p.is_alive():
            outcomes[r].exitcode = p.exitcode


def stop(procs) -> None:
    """SIGTERM every rank still alive, then SIGKILL after :data:`GRACE_S`; return when all have ended."""
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.terminate()
    until = time.monotonic() + GRACE_S
    for p in alive:
        p.join(max(0.0, until - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join()
