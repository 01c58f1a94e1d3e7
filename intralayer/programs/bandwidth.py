"""Chapter 00: time each collective over a range of message sizes (for the α–β fit).

First, for each collective, the profiler records what the backend ran for one call:
gloo and NCCL need not run the ring of chapter 00 (gloo runs a reduce-scatter as an
all-reduce of a copy of the whole tensor, of which each rank keeps its chunk). Then for
every size S (bytes of float32) and collective, each rank runs a few warm-up calls,
then ``--repeats`` timed calls between barriers; the time of a call is the slowest
rank's, and the reported time is the fastest repeat (the least disturbed by the other
processes on a small machine). Rank 0 prints a table and, with ``--out``, writes the
measurements as JSON.

Laptop (gloo, CPU)::

    torchrun --standalone --nproc-per-node 2 -m intralayer.programs.bandwidth --out bw.json

One GPU node (NCCL; larger messages show the link's bandwidth)::

    torchrun --standalone --nproc-per-node 8 -m intralayer.programs.bandwidth --max-bytes 1073741824
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from intralayer import distributed
from intralayer.collectives import OPS
from intralayer.comm import bus_factor


def one_call(op: str, S: int, n: int, device) -> callable:
    """A closure running collective ``op`` with payload S bytes (nccl-tests' definition)."""
    elems = max(n, S // 4 // n * n)                                  # float32, divisible by n
    full = torch.ones(elems, device=device)                          # (S/4,)
    part = torch.ones(elems // n, device=device)                     # (S/4n,)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, part)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(part, full)
    if op == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full)
    raise ValueError(f"unknown collective {op!r}")


def backend_calls(op: str, d: distributed.Dist) -> list[str]:
    """What the backend ran for one call of ``op``, as the profiler saw it.

    The backend's own events (``gloo:…``, ``nccl:…``) and any ``aten::clone``, a full
    copy of a tensor made on the way, in the order they started.
    """
    from torch.profiler import profile

    call = one_call(op, 1024, d.world_size, d.device)
    with profile() as prof:
        call()
    return [e.name for e in prof.events() if e.name.startswith(("gloo:", "nccl:")) or e.name == "aten::clone"]


def measure(op: str, S: int, d: distributed.Dist, repeats: int, warmup: int = 2) -> float:
    call = one_call(op, S, d.world_size, d.device)
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        dist.barrier()
        if d.device.type == "cuda":
            torch.cuda.synchronize(d.device)
        t0 = time.perf_counter()
        call()
        if d.device.type == "cuda":
            torch.cuda.synchronize(d.device)
        slowest = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=d.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        times.append(slowest.item())
    return min(times)


@record
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min-bytes", type=int, default=256)
    p.add_argument("--max-bytes", type=int, default=16 << 20)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if not 0 < a.min_bytes <= a.max_bytes:
        p.error(f"need 0 < --min-bytes ({a.min_bytes}) ≤ --max-bytes ({a.max_bytes})")
    if a.repeats < 1:
        p.error(f"--repeats {a.repeats} must be ≥ 1")
    sizes = []
    S = a.min_bytes
    while S <= a.max_bytes:
        sizes.append(S)
        S *= 4
    with distributed.setup() as d:
        n = d.world_size
        ran = {op: backend_calls(op, d) for op in OPS}
        results = {op: [measure(op, S, d, a.repeats) for S in sizes] for op in OPS}
        if d.is_main:
            print(f"{n} ranks, {d.backend} on {d.device.type}; what the backend ran (profiler):")
            for op in OPS:
                print(f"  {op:15} {', '.join(ran[op])}")
            print(f"time: fastest of {a.repeats} calls, slowest rank; busbw = S/t × bus factor")
            print(f"{'S bytes':>10} " + " ".join(f"{op + ' µs':>17}" for op in OPS))
            for i, S in enumerate(sizes):
                print(f"{S:10d} " + " ".join(f"{results[op][i] * 1e6:17.1f}" for op in OPS))
            big = sizes[-1]
            print("busbw at the largest size (GB/s): " + ", ".join(
                f"{op} {big / results[op][-1] * bus_factor(op, n) / 1e9:.2f}" for op in OPS))
            if a.out:
                with open(a.out, "w") as f:
                    json.dump({"n": n, "backend": d.backend, "sizes": sizes, "times": results,
                               "backend_calls": ran}, f, indent=1)


if __name__ == "__main__":
    main()
