"""A program whose ranks misbehave on purpose: ``raise`` or ``hang``.

``raise``: rank 1 raises a RuntimeError carrying ``FAILURE_TEXT`` while rank 0 sleeps.
``raise-in-barrier``: the same, while rank 0 waits for rank 1 in a barrier (so rank 0
fails too, with gloo's "connection closed by peer", as a consequence of rank 1's error).
``hang``: every rank sleeps forever after set-up, so only the launch timeout ends it.
"""
from __future__ import annotations

import sys
import time

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from intralayer import distributed

FAILURE_TEXT = "deliberate failure on rank 1: the-walrus-9317"


@record
def main(argv=None) -> None:
    mode = (sys.argv[1:] if argv is None else argv)[0]
    with distributed.setup() as d:
        if d.is_main:
            print(f"rank 0 started ({mode})", flush=True)
        if mode in ("raise", "raise-in-barrier") and d.rank == 1:
            raise RuntimeError(FAILURE_TEXT)
        if mode == "raise-in-barrier":
            dist.barrier()
        while True:
            time.sleep(1)


if __name__ == "__main__":
    main()
