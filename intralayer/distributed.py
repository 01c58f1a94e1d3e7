"""Process-group set-up used by every program in :mod:`intralayer.programs`.

A program calls :func:`setup` once, as a context manager::

    with setup() as d:          # d.rank, d.world_size, d.device, d.group
        ...

Keep everything that holds the process group — the ``Dist``, parallel modules — inside a
function (``def main(): with setup() as d: ...``), so it is freed when the function
returns. Left as module globals, it is freed during interpreter shutdown, after the
group was destroyed, and gloo then aborts now and then ("terminate called without an
active exception"): measured here in 6 of 8 runs of a two-rank script with globals and no
final barrier, 1 of 12 with the barrier, 0 of 12 with a function.

It reads the rank and world size that ``torchrun`` puts in the environment, chooses
NCCL with ``cuda:LOCAL_RANK`` when every local rank has a GPU and gloo on the CPU
otherwise, gives the process group a timeout so that a missing rank is reported rather
than waited for forever, and destroys the group on the way out, error or not. Inside the
``with`` block (until an error leaves it), SIGTERM makes the rank print its Python stack
to stderr before it dies: torchrun stops the other ranks with SIGTERM when one fails (and
the launcher does at its timeout), and the stack says where each was, waiting in which
collective or in none, which :mod:`intralayer.launch` puts in its error message.
"""
from __future__ import annotations

import faulthandler
import math
import os
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

#: Seconds a collective may wait for a peer before the process group gives up. The
#: launcher passes its own value down through this variable (see :mod:`launch`).
TIMEOUT_ENV = "INTRALAYER_PG_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0

#: Where the ranks meet instead of MASTER_ADDR:MASTER_PORT, e.g. ``file:///tmp/job/store``
#: (a FileStore): how :mod:`intralayer.ranks` starts its ranks.
INIT_ENV = "INTRALAYER_INIT_METHOD"

_REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Dist:
    """What a program needs to know about its place in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    group: dist.ProcessGroup

    @property
    def is_main(self) -> bool:
        """Only rank 0 prints: ranks' prints interleave otherwise."""
        return self.rank == 0


def choose_backend(local_world_size: int) -> tuple[str, str]:
    """``("nccl", "cuda")`` when every local rank can have its own GPU, else ``("gloo", "cpu")``."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        return "nccl", "cuda"
    return "gloo", "cpu"


def timeout_seconds() -> float:
    """The process-group timeout: ``$INTRALAYER_PG_TIMEOUT`` or 60 s."""
    raw = os.environ.get(TIMEOUT_ENV, "")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a positive, finite number of seconds")
    return value


class setup:
    """Initialise the default process group from torchrun's environment.

    Use it as ``with setup() as d:``. Outside ``torchrun`` (no ``RANK`` in the
    environment) it raises a ``RuntimeError`` that says how to launch the program.
    """

    def __init__(self, timeout_s: float | None = None):
        self.timeout_s = timeout_seconds() if timeout_s is None else float(timeout_s)
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s={timeout_s} must be a positive, finite number of seconds")
        self.info: Dist | None = None
        self._stack_on_sigterm = False

    def __enter__(self) -> Dist:
        required = _REQUIRED[:4] if os.environ.get(INIT_ENV) else _REQUIRED
        missing = [k for k in required if k not in os.environ]
        if missing:
            raise RuntimeError(
                f"environment variables {', '.join(missing)} are not set: start this program "
                "with torchrun (or intralayer.launch.run from a notebook), not with plain python"
            )
        self._stack_on_sigterm = _stack_on_sigterm(True)
        try:
            return self._init()
        except BaseException:      # no __exit__ follows a failed __enter__
            if self._stack_on_sigterm:
                self._stack_on_sigterm = _stack_on_sigterm(False)
            raise

    def _init(self) -> Dist:
        rank = int(os.environ["RANK"])
        world = int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])
        local_world = int(os.environ["LOCAL_WORLD_SIZE"])
        # One thread per rank: N ranks on a laptop otherwise fight over every core.
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        backend, kind = choose_backend(local_world)
        if backend == "gloo" and local_world == world:
            # Every rank is on this machine: keep gloo's sockets on loopback.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_name())
        if kind == "cuda":
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        dist.init_process_group(
            backend=backend,
            init_method=os.environ.get(INIT_ENV) or None,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=self.timeout_s),
            device_id=device if kind == "cuda" else None,
        )
        self.info = Dist(rank, world, local_rank, device, backend, dist.group.WORLD)
        return self.info

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None and self._stack_on_sigterm:
            # This rank is failing on its own: its traceback says where. A stack printed
            # while it tears down would say "not in the collective" and wrongly mark it as
            # the rank the others waited for.
            self._stack_on_sigterm = _stack_on_sigterm(False)
        try:
            if dist.is_initialized():
                if exc_type is None:
                    dist.barrier()    # leave together: no rank tears down while a peer still talks
                dist.destroy_process_group()
        finally:
            if self._stack_on_sigterm:
                self._stack_on_sigterm = _stack_on_sigterm(False)
        return False


def _stack_on_sigterm(on: bool) -> bool:
    """Have SIGTERM print every Python thread's stack to stderr, then end the process as
    before (``on``), or stop doing so. True if the dump was switched on.

    ``faulthandler`` writes from the signal handler itself, so the stack shows even while
    the main thread is blocked inside a collective, where a Python-level handler would
    not run. Where it cannot (no ``faulthandler.register`` on Windows, a stderr without a
    file descriptor) nothing changes.
    """
    if not hasattr(faulthandler, "register"):
        return False
    try:
        if on:
            faulthandler.register(signal.SIGTERM, file=sys.stderr, all_threads=True, chain=True)
        else:
            faulthandler.unregister(signal.SIGTERM)
    except (AttributeError, ValueError, OSError, RuntimeError):
        return False
    return on


def _loopback_name() -> str:
    """The loopback interface's name: ``lo0`` on macOS, ``lo`` elsewhere."""
    return "lo0" if sys.platform == "darwin" else "lo"


def new_group(ranks: list[int], timeout_s: float | None = None) -> dist.ProcessGroup:
    """A sub-group of ``ranks`` with the same timeout rule as the default group.

    Every rank of the job must call this with the same list, even ranks not in it
    (``torch.distributed.new_group`` requires it).
    """
    if not dist.is_initialized():
        raise RuntimeError("new_group needs the default process group: call it inside setup()")
    world = dist.get_world_size()
    bad = [r for r in ranks if not 0 <= r < world]
    if bad or len(set(ranks)) != len(ranks) or not ranks:
        raise ValueError(f"ranks {ranks} must be distinct ranks of the job (0..{world - 1})")
    t = timeout_seconds() if timeout_s is None else timeout_s
    return dist.new_group(ranks=sorted(ranks), timeout=timedelta(seconds=t))
