"""Chapter 07: collective matmuls on real ranks — checked, timed, and traced with torch.profiler.

Part 1 (always). Every schedule of ``allgather_matmul`` and ``matmul_reduce_scatter``
(ring, bidirectional, chunked, sequential) against the unfused versions — ``comm.all_gather``
then ``F.linear``, ``F.linear`` then ``comm.reduce_scatter`` — for 2-D and 3-D inputs,
``dim`` 0 and 1, 1 and 2 chunks: outputs, input and weight gradients (float64). And
``mlp_microbatches`` on two micro-batches, sequential and overlapped, forward and
backward, against the dense MLP. Rank 0 prints the largest differences over all ranks.

With ``--time`` (and ``--out FILE``), rank 0 also writes what it measured:

Part 2. The share of a tensor- and sequence-parallel block's step (forward + backward)
spent inside collectives (``comm.accounting`` times them), in the run of median length.
Part 3. One step, forward and backward, of a sequence-parallel MLP,
``matmul_reduce_scatter(gelu(allgather_matmul(x, W1)), W2)``, with each schedule:
sequential in one piece (the unfused collectives), sequential in ``--chunks`` pieces,
chunked and overlapped, the ring, the bidirectional ring. Every one of ``--repeats`` runs
is kept, round robin, so that run i of a schedule can be held against run i of another.
Part 4. The tensor-parallel MLP on two micro-batches, sequential and overlapped, forward
and backward.
Part 5. One ring step's pieces alone and together: a shard's matmul, its send/recv to the
neighbours, and the two at once (how much of the transfer the matmul beside it hides).

With ``--trace DIR``, ``--trace-runs`` more runs of each (parts 3 and 4), round robin, under
``torch.profiler``, each in a range named ``run: <schedule> #<i>`` (the chapter draws each
schedule's median run); each rank writes its Chrome trace (it opens in Perfetto) to
``DIR/rank<r>.json``. Times come from the CPU clock on gloo and from CUDA events on GPUs,
where the trace also holds the GPU's timeline (NCCL's kernels, the matmuls). Every tensor
is built on the rank's device.

Laptop (gloo, CPU)::

    torchrun --standalone --nproc-per-node 2 -m intralayer.programs.overlap_tp --time --trace traces

A GPU node (NCCL, one GPU per rank; not yet run on GPUs)::

    torchrun --standalone --nproc-per-node 8 -m intralayer.programs.overlap_tp --time \\
        --tokens 16384 --hidden 8192 --dtype bfloat16 --trace traces

A cluster: the same on every node with ``--nnodes N --node-rank i --rdzv-backend c10d
--rdzv-endpoint HOST:PORT`` in place of ``--standalone``; a tensor-parallel group that spans
nodes sends its collectives over the network between them (chapter 07 models the cost).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

from intralayer import comm, distributed, overlap
from intralayer.model import Block
from intralayer.programs.common import error_label
from intralayer.sequence_parallel import ParallelBlock

#: Part 3's schedules: (name, schedule, chunks): chunks=None means the --chunks option.
VARIANTS = (("sequential", "sequential", 1), ("sequential, chunked", "sequential", None),
            ("chunked, overlapped", "chunked", None), ("ring", "ring", 1), ("bidirectional ring", "bidirectional", 1))


# ---------------------------------------------------------------------------- part 1

def correctness(d) -> list[dict]:
    """Each schedule against the unfused ops (float64, this rank's own inputs, seeded by rank)."""
    P, r, g, dev = d.world_size, d.rank, d.group, d.device
    rows = []
    for shape, dim in (((4, 6), 0), ((4, 2, 6), 0), ((2, 4, 6), 1)):
        for schedule in overlap.SCHEDULES:
            for chunks in (1, 2):
                gen = torch.Generator(device=dev).manual_seed(1000 * len(rows) + r)

                def randn(*s):
                    return torch.randn(*s, generator=gen, dtype=torch.float64, device=dev)

                mine, W = randn(*shape), randn(10, 6)
                # all-gather side: the unfused version on the same shard
                a, wa = mine.clone().requires_grad_(), W.clone().requires_grad_()
                ref = F.linear(comm.all_gather(a, dim, g), wa)
                dy = randn(*ref.shape)
                ref.backward(dy)
                b, wb = mine.clone().requires_grad_(), W.clone().requires_grad_()
                overlap.allgather_matmul(b, wb, g, chunks, dim, schedule).backward(dy)
                errs = [_diff(b.grad, a.grad), _diff(wb.grad, wa.grad)]
                errs.insert(0, _diff(overlap.allgather_matmul(mine, W, g, chunks, dim, schedule), ref.detach()))
                # reduce-scatter side: every rank its own full-length x
                x = randn(*shape[:dim], shape[dim] * P, *shape[dim + 1:])
                c, wc = x.clone().requires_grad_(), W.clone().requires_grad_()
                ref2 = comm.reduce_scatter(F.linear(c, wc), dim, g)
                dys = randn(*ref2.shape)
                ref2.backward(dys)
                e, we = x.clone().requires_grad_(), W.clone().requires_grad_()
                out2 = overlap.matmul_reduce_scatter(e, we, g, chunks, dim, schedule)
                out2.backward(dys)
                errs += [_diff(out2, ref2), _diff(e.grad, c.grad), _diff(we.grad, wc.grad)]
                rows.append(dict(shape=list(mine.shape), dim=dim, schedule=schedule, chunks=chunks, errs=errs))
    return rows


def mlp_check(d) -> list[dict]:
    """mlp_microbatches, sequential and overlapped, against the dense MLP, forward and backward."""
    P, r, g, dev = d.world_size, d.rank, d.group, d.device
    gen = torch.Generator(device=dev).manual_seed(7)                          # the same on every rank
    h, ffn = 6, 4 * P
    X, FC1, FC2, dY = (torch.randn(*s, generator=gen, dtype=torch.float64, device=dev)
                       for s in ((8, h), (ffn, h), (h, ffn), (8, h)))
    xd, f1, f2 = X.clone().requires_grad_(), FC1.clone().requires_grad_(), FC2.clone().requires_grad_()
    dense = F.linear(F.gelu(F.linear(xd, f1)), f2)                                # (8, h)
    dense.backward(dY)
    rows = []
    for ov in (False, True):
        x = X.clone().requires_grad_()
        fc1 = FC1.chunk(P, 0)[r].clone().requires_grad_()                       # (ffn/t, h)
        fc2 = FC2.chunk(P, 1)[r].clone().requires_grad_()                       # (h, ffn/t)
        y = overlap.mlp_microbatches(x, fc1, fc2, g, overlap=ov, micro_batches=2)
        y.backward(dY)
        rows.append(dict(overlap=ov, errs=[_diff(y.detach(), dense.detach()), _diff(x.grad, xd.grad),
                                           _diff(fc1.grad, f1.grad.chunk(P, 0)[r]),
                                           _diff(fc2.grad, f2.grad.chunk(P, 1)[r])]))
    return rows


def _diff(got, want) -> float:
    got, want = got.detach(), want.detach()
    torch.testing.assert_close(got, want)                    # float64 defaults: rtol 1e-7, atol 1e-7
    return float((got - want).abs().max())


# ---------------------------------------------------------------------------- timing

class Clock:
    """Wall time of a piece of work on the rank's device: CUDA events on a GPU, the CPU clock otherwise."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def time(self, fn) -> float:
        if self.cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            return start.elapsed_time(stop) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def measure(clock: Clock, fns: dict, repeats: int) -> dict:
    """Every one of ``repeats`` runs of each of ``fns``, in seconds, after one warm-up each.

    The runs go round robin (one of each, then again), so a change in the machine's load
    touches every variant alike and run i of one variant can be held against run i of
    another; the ranks start each run together.
    """
    times = {name: [] for name in fns}
    for rep in range(repeats + 1):
        for name, fn in fns.items():
            dist.barrier()
            took = clock.time(fn)
            if rep:
                times[name].append(took)
    return times


def mlp_step(x, W1, W2, g, schedule, chunks):
    """Forward and backward of a sequence-parallel MLP: all-gather matmul → GELU → matmul reduce-scatter."""
    def run():
        for w in (W1, W2):
            w.grad = None
        h = F.gelu(overlap.allgather_matmul(x, W1, g, chunks, 0, schedule))    # (T, 4h/t)
        y = overlap.matmul_reduce_scatter(h, W2, g, chunks, 0, schedule)       # (T/t, h)
        y.sum().backward()
    return run


def block_share(d, tokens, hidden, repeats, clock) -> dict:
    """Part 2: a TP+SP block's step and the time its collectives took (comm.accounting), the median run."""
    P, g = d.world_size, d.group
    torch.manual_seed(0)
    s, b = tokens // 8, 2
    block = ParallelBlock.from_dense(Block(hidden, 8).to(d.device), g, sequence_parallel=True)
    x = torch.randn(s // P, b, hidden, device=d.device, requires_grad=True)
    runs = []
    for rep in range(repeats + 1):                                             # the first is a warm-up
        dist.barrier()
        with comm.accounting() as acc:
            took = clock.time(lambda: block(x).sum().backward())
        if rep:
            runs.append((took, sum(rec.seconds for rec in acc.records)))
    total, in_comm = sorted(runs)[len(runs) // 2]                              # the median run
    return dict(s=s, b=b, h=hidden, step=total, comm=in_comm)


def contention(d, tokens, hidden, dtype, repeats, clock) -> dict:
    """Part 5: one ring step's pieces alone and together: a shard's matmul, the shard's
    send/recv to the neighbours, and the matmul with the send/recv in flight."""
    P, g, dev = d.world_size, d.group, d.device
    gen = torch.Generator(device=dev).manual_seed(2 + d.rank)
    shard = torch.randn(tokens // P, hidden, generator=gen, device=dev, dtype=dtype)        # (T/t, h)
    W = torch.randn(4 * hidden // P, hidden, generator=gen, device=dev, dtype=dtype)         # (4h/t, h)

    def both():
        pending = comm.ring_exchange_start([shard], 1, g)
        F.linear(shard, W)
        pending.wait()

    return measure(clock, {"matmul": lambda: F.linear(shard, W),
                        "send/recv": lambda: comm.ring_exchange_start([shard], 1, g).wait(),
                        "together": both}, repeats)


def timings(d, tokens, hidden, chunks, repeats, dtype, trace_dir, trace_runs) -> dict:
    P, g, dev = d.world_size, d.group, d.device
    clock = Clock(dev)
    out = dict(sizes=dict(tokens=tokens, hidden=hidden, P=P, chunks=chunks, repeats=repeats, dtype=str(dtype),
                          device=dev.type, trace_runs=trace_runs if trace_dir is not None else 0))
    out["block"] = block_share(d, tokens, hidden, repeats, clock)
    gen = torch.Generator(device=dev).manual_seed(1 + d.rank)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev, dtype=dtype)

    x = randn(tokens // P, hidden)                                                          # (T/t, h)
    W1 = (randn(4 * hidden // P, hidden) / hidden ** 0.5).requires_grad_()                 # (4h/t, h)
    W2 = (randn(hidden, 4 * hidden // P) / hidden ** 0.5).requires_grad_()                 # (h, 4h/t)
    runs = {name: mlp_step(x, W1, W2, g, schedule, chunks if k is None else k) for name, schedule, k in VARIANTS}
    xm = randn(tokens, hidden)                                                              # replicated
    for ov in (False, True):
        name = f"two micro-batches, {'overlapped' if ov else 'sequential'}"

        def micro(ov=ov):
            for w in (W1, W2):
                w.grad = None
            overlap.mlp_microbatches(xm, W1, W2, g, ov).sum().backward()
        runs[name] = micro
    out["step"] = measure(clock, runs, repeats)
    out["contention"] = contention(d, tokens, hidden, dtype, 2 * repeats, clock)
    if trace_dir is not None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        dist.barrier()
        with profile(activities=activities) as prof:
            for i in range(trace_runs):                                 # round robin, as the timed runs
                for name, fn in runs.items():
                    dist.barrier()
                    with record_function(f"run: {name} #{i}"):
                        fn()
                        if dev.type == "cuda":
                            torch.cuda.synchronize()
        folder = Path(trace_dir)
        folder.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(folder / f"rank{d.rank}.json"))
    return out


# ---------------------------------------------------------------------------- main

@record
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time", action="store_true", help="also measure (parts 2-4)")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens T of the sequence (all ranks together)")
    ap.add_argument("--hidden", type=int, default=128, help="hidden size h (the MLP is h → 4h → h)")
    ap.add_argument("--chunks", type=int, default=4, help="pieces of the chunked schedules")
    ap.add_argument("--repeats", type=int, default=20, help="timed runs of each variant (all are kept)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--out", help="write rank 0's measurements to this JSON file")
    ap.add_argument("--trace", metavar="DIR", help="write each rank's torch.profiler trace to DIR/rank<r>.json")
    ap.add_argument("--trace-runs", type=int, default=3, help="runs of each variant under the profiler (with --trace)")
    a = ap.parse_args(argv)
    with distributed.setup() as d:
        if a.tokens % (d.world_size * a.chunks) or (4 * a.hidden) % d.world_size:
            raise ValueError(f"--tokens {a.tokens} must split into {d.world_size} ranks × {a.chunks} chunks and "
                             f"4·--hidden {4 * a.hidden} into {d.world_size} ranks")
        rows, mlp = correctness(d), mlp_check(d)
        every = [None] * d.world_size
        dist.all_gather_object(every, (rows, mlp))
        measured = timings(d, a.tokens, a.hidden, a.chunks, a.repeats, getattr(torch, a.dtype),
                           a.trace, a.trace_runs) if a.time else None
        if measured is not None:
            gathered = [None] * d.world_size
            dist.all_gather_object(gathered, measured)
        if d.is_main:
            print(f"P = {d.world_size} ranks ({d.backend}, {d.device.type}); collective matmuls vs unfused, "
                  "float64, largest difference over all ranks")
            print(f"{'shard shape':11} {'dim':>3} {'schedule':>13} {'chunks':>6}   all-gather matmul: out    dX    dW"
                  f"   matmul reduce-scatter: out    dX    dW")
            for i, row in enumerate(every[0][0]):
                worst = [max(rank[0][i]["errs"][j] for rank in every) for j in range(6)]
                print(f"{str(tuple(row['shape'])):11} {row['dim']:3d} {row['schedule']:>13} {row['chunks']:6d}   "
                      + "".join(f"{error_label(w):>7}" for w in worst[:3]) + "      "
                      + "".join(f"{error_label(w):>7}" for w in worst[3:]))
            print("two micro-batches vs the dense MLP:    out     dX   dfc1   dfc2")
            for i, row in enumerate(every[0][1]):
                worst = [max(rank[1][i]["errs"][j] for rank in every) for j in range(4)]
                print(f"  {'overlapped' if row['overlap'] else 'sequential':36}"
                      + "".join(f"{error_label(w):>7}" for w in worst))
            print("all checks passed on every rank")
            if a.out and measured is not None:
                with open(a.out, "w") as f:
                    json.dump(dict(ranks=gathered), f)


if __name__ == "__main__":
    main()
