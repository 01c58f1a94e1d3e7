"""Ranks that fail on purpose, for ``tests/test_faults.py``.

``python -m tests.programs.fault_checks SCENARIO PID_DIR`` under torchrun. Every rank
first writes its process id to ``PID_DIR/rank<r>.pid``, so that the test can check
afterwards that none of them is still alive; ``PID_DIR`` is unique to the test, so it
also marks the job's processes in the process table. The last rank misbehaves:

``raise``
    It raises a RuntimeError carrying ``FAILURE_TEXT`` while the others wait for it in an
    all-reduce.
``sigkill``
    It kills itself with SIGKILL just before an all-reduce that the others enter: a rank
    that dies without a word, as one the out-of-memory killer picks does.
``absent``
    It sleeps forever instead of joining the all-reduce that the others enter: only the
    process-group timeout ends their wait.
``hang``
    Every rank sleeps forever once all are up; rank 0 prints ``READY`` first.

The all-reduce runs on a group made by ``distributed.new_group``, whose timeout is the
launcher's ``INTRALAYER_PG_TIMEOUT`` (a few seconds in the tests). Set-up gets a longer
one of its own: on a loaded machine ranks start seconds apart, and a short timeout would
end the rendezvous before the fault under test happens.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from intralayer import distributed

FAILURE_TEXT = "deliberate failure in fault_checks: the-narwhal-4471"
READY = "fault_checks ready"
SCENARIOS = ("raise", "sigkill", "absent", "hang")
SETUP_TIMEOUT_S = 60.0


@record
def main(argv=None) -> None:
    scenario, pid_dir = (sys.argv[1:] if argv is None else argv)[:2]
    if scenario not in SCENARIOS:
        raise SystemExit(f"unknown scenario {scenario!r}; expected one of {SCENARIOS}")
    with distributed.setup(timeout_s=SETUP_TIMEOUT_S) as d:
        Path(pid_dir, f"rank{d.rank}.pid").write_text(str(os.getpid()))
        group = distributed.new_group(list(range(d.world_size)))   # INTRALAYER_PG_TIMEOUT
        dist.barrier()                    # every rank is up and has written its pid
        if d.is_main:
            print(f"{READY} ({scenario})", flush=True)
        last = d.rank == d.world_size - 1
        if scenario == "hang" or (scenario == "absent" and last):
            while True:
                time.sleep(1)
        if scenario == "raise" and last:
            raise RuntimeError(FAILURE_TEXT)
        if scenario == "sigkill" and last:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(torch.ones(4), group=group)
        raise AssertionError(f"rank {d.rank}: the all-reduce returned without its missing peer")


if __name__ == "__main__":
    main()
