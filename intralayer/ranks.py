"""One pool of warm ranks for the labs' checks and the library's multi-rank tests, from the standard
library's and torch's parts: ``run(target, world, args)`` calls ``target(*args)`` on ``world`` gloo ranks
and returns one :class:`Outcome` per rank.

Ranks are ``multiprocessing`` forkserver processes with this module preloaded, so torch is imported
once (a first job takes about 1.7 s here, a later one 0.2 s) and every rank is forked from a server of
one thread (:data:`SERVER_ENV`). They meet through a ``FileStore`` in the job's folder
(``INTRALAYER_INIT_METHOD``, read by :func:`intralayer.distributed.setup`); what ``target`` returns or
raises comes back through a pipe, after what :func:`report` sent; what a rank prints goes to files. At
the deadline a rank gets SIGTERM (it prints its stack), then SIGKILL; if the caller dies, each rank's own
alarm ends it. Ranks run on the CPU, one thread each; GPU programs go through torchrun (:mod:`.launch`).
"""
from __future__ import annotations

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

START_METHOD = "forkserver"
GRACE_S = 3.0                       # seconds between SIGTERM and SIGKILL
#: What the fork server imports once: this module, and the labs with every chapter's checks.
PRELOAD = [__name__, "intralayer.labs"]
#: The fork server's environment: one thread (forking a process with threads is unsafe), no GPU.
SERVER_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


@dataclass
class Outcome:
    """What one rank did: ``value`` returned, or ``error`` raised (type, text and frames)."""

    rank: int
    value: object = None
    error: dict | None = None
    exitcode: int | None = None          # None: still running at the deadline (then stopped)
    stdout: str = ""
    stderr: str = ""
    messages: list = field(default_factory=list)   # what the rank sent with report(), in order

    @property
    def ok(self) -> bool:
        return self.error is None and self.exitcode == 0


def seconds(name: str, value) -> None:
    """``ValueError`` naming ``name`` unless ``value`` is a positive, finite number of seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{name}={value!r} must be a positive, finite number of seconds")


def error_info(exc: BaseException) -> dict:
    """An exception as plain data: type, message, every frame (file, line, qualified name)."""
    frames = [(f.f_code.co_filename, line, getattr(f.f_code, "co_qualname", f.f_code.co_name))   # (3.10: no qualname)
              for f, line in traceback.walk_tb(exc.__traceback__)]
    return {"type": type(exc).__name__, "message": str(exc).strip(), "frames": frames,
            "traceback": "".join(traceback.format_exception(exc))[-6000:]}


_conn = None


def report(message) -> None:
    """From inside a rank: hand ``message`` to the caller now (it arrives even if the rank dies later)."""
    if _conn is None:
        raise RuntimeError("report() is for code running on a rank of intralayer.ranks.run")
    _conn.send(("message", message))


def _rank(rank: int, world: int, folder: str, target, args, env: dict, conn, alarm_s: int) -> None:
    global _conn
    _conn = conn
    signal.alarm(alarm_s)                          # the last resort if the caller is gone
    for fd, name in ((1, "out"), (2, "err")):
        os.dup2(os.open(f"{folder}/rank{rank}.{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.stdout, sys.stderr = (open(fd, "w", buffering=1, closefd=False) for fd in (1, 2))
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), INTRALAYER_INIT_METHOD=f"file://{folder}/store",
                      MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"), **SERVER_ENV)
    torch.set_num_threads(1)
    try:
        reply = ("value", target(*args))
    except BaseException as exc:                    # SystemExit too: what the rank's code did is the answer
        reply = ("error", error_info(exc))
        traceback.print_exc()
    sys.stdout.flush(), sys.stderr.flush()
    try:
        conn.send(reply)
    except Exception as exc:                        # a value that cannot be pickled
        conn.send(("error", error_info(exc)))
    os._exit(1 if reply[0] == "error" else 0)       # no teardown: a broken group may hang in it


def _start(rank_args) -> multiprocessing.Process:
    """A rank from the fork server, started (or restarted, if it has just died) with :data:`SERVER_ENV`.
    Meanwhile ``__main__`` is hidden: multiprocessing would have the rank re-import it (in a notebook,
    ipykernel: seconds a rank), and a target is a module's function that needs nothing from it."""
    ctx = multiprocessing.get_context(START_METHOD)
    ctx.set_forkserver_preload(PRELOAD)
    saved, main, sys.modules["__main__"] = dict(os.environ), sys.modules["__main__"], types.ModuleType("__main__")
    os.environ.update(SERVER_ENV)
    try:
        for retry in (False, True):
            try:
                (p := ctx.Process(target=_rank, args=rank_args, daemon=True)).start()
                return p
            except (EOFError, ConnectionError):
                if retry:
                    raise
                time.sleep(0.5)
    finally:
        sys.modules["__main__"] = main
        os.environ.clear()
        os.environ.update(saved)


def run(target, world: int, args: tuple = (), *, deadline: float = 60.0, env: dict | None = None,
        stop_on_failure: bool = False) -> list[Outcome]:
    """``target(*args)`` on ``world`` ranks; one :class:`Outcome` per rank, in rank order.

    ``target`` is a function of an importable module. ``deadline`` counts from the start of the
    ranks; ``stop_on_failure`` stops the others when one fails, as torchrun does.
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world={world!r} must be a whole number of ranks ≥ 1")
    seconds("deadline", deadline)
    folder = tempfile.mkdtemp(prefix="intralayer-ranks-")
    with socket.socket() as sock:                   # for a program that meets by env:// itself
        sock.bind(("127.0.0.1", 0))
        env = {"MASTER_PORT": str(sock.getsockname()[1]), **(env or {})}
    outcomes, procs, conns = [Outcome(r) for r in range(world)], [], {}
    try:
        for r in range(world):
            receive, send = multiprocessing.Pipe(duplex=False)
            conns[receive] = r
            procs.append(_start((r, world, folder, target, args, env, send, int(deadline + 3 * GRACE_S + 5))))
            send.close()
        _collect(procs, dict(conns), outcomes, time.monotonic() + deadline, stop_on_failure)
        stop(procs)                                 # the late ones print their stacks, then end
        for o in outcomes:
            o.stdout, o.stderr = (f.read_text(errors="replace") if (f := Path(folder, f"rank{o.rank}.{k}")).exists()
                                  else "" for k in ("out", "err"))
        return outcomes
    finally:
        stop(procs)
        for c in conns:
            c.close()
        shutil.rmtree(folder, ignore_errors=True)


def _collect(procs, open_conns, outcomes, until: float, stop_on_failure: bool) -> None:
    """Read every rank's messages and outcome until all have ended (their pipes closed) or the deadline."""
    while open_conns and (ready := multiprocessing.connection.wait(list(open_conns), max(0.0, until - time.monotonic()))):
        for conn in ready:
            o = outcomes[open_conns[conn]]
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):             # the rank has ended
                del open_conns[conn]
                procs[o.rank].join()
                o.exitcode = procs[o.rank].exitcode
                continue
            if kind == "message":
                o.messages.append(payload)
            else:
                o.value, o.error = (payload, None) if kind == "value" else (None, payload)
        if stop_on_failure and any(o.error is not None or o.exitcode not in (None, 0) for o in outcomes):
            stop([p for r, p in enumerate(procs) if outcomes[r].error is None])
    for o in outcomes:                              # ended at the deadline, its pipe not read yet
        if o.exitcode is None and not procs[o.rank].is_alive():
            o.exitcode = procs[o.rank].exitcode


def stop(procs) -> None:
    """SIGTERM every rank still alive, SIGKILL after :data:`GRACE_S`; return when all have ended."""
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.terminate()
    until = time.monotonic() + GRACE_S
    for p in alive:
        p.join(max(0.0, until - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
