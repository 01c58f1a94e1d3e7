"""Chapter 00: the smallest complete torch.distributed program — set up, one all-reduce, check.

torchrun starts one copy of this program per rank and tells each, through environment
variables, its rank and the world size. Each copy picks a backend (NCCL when every rank
on this machine can have a GPU, gloo on the CPU otherwise), joins the default process
group, contributes its rank number to one all-reduce (a sum) and checks that it got
0 + 1 + … + (n−1) = n(n−1)/2. Rank 0 prints. The course's other programs do the same set-up
through :func:`intralayer.distributed.setup`, which also names a failing rank in its error.

Laptop (gloo, CPU)::

    torchrun --standalone --nproc-per-node 2 -m intralayer.programs.hello_allreduce

One GPU node (NCCL)::

    torchrun --standalone --nproc-per-node 8 -m intralayer.programs.hello_allreduce

A cluster (run on every node; the rendezvous host is one of them)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint $HEAD_NODE:29500 -m intralayer.programs.hello_allreduce
"""
from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    rank = int(os.environ["RANK"])                          # set by torchrun, 0 … n−1
    world_size = int(os.environ["WORLD_SIZE"])              # n, the number of ranks
    local_rank = int(os.environ["LOCAL_RANK"])              # this rank's number on its machine
    if torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]):
        backend, device = "nccl", torch.device("cuda", local_rank)     # one GPU per rank
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
        if os.environ["LOCAL_WORLD_SIZE"] == os.environ["WORLD_SIZE"]:  # every rank on this machine
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    # Meet the others at MASTER_ADDR:MASTER_PORT; a collective that waits longer than the
    # timeout raises instead of hanging (a rank that died never answers).
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    try:
        x = torch.tensor([float(rank)], device=device)      # (1,): this rank's contribution
        dist.all_reduce(x)                                  # in place: the sum, on every rank
        ok = torch.tensor([int(x.item() == world_size * (world_size - 1) // 2)], device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)           # 1 only if every rank got it right
        if rank == 0:
            print(f"{world_size} ranks, {backend}: the all-reduce of the rank numbers 0 … {world_size - 1} "
                  f"left {x.item():.0f} on every rank: {'correct' if ok.item() else 'WRONG'}")
        if not ok.item():
            raise SystemExit(f"rank {rank}: the all-reduce gave {x.item()}")
    finally:
        dist.destroy_process_group()       # leave the group, on success or error


if __name__ == "__main__":
    main()
