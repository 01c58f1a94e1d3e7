"""Chapter 07: collective matmuls checked on real ranks, and timed sequential vs overlapped.

Part 1 (always). ``allgather_matmul`` and ``matmul_reduce_scatter`` against their unfused
versions — ``comm.all_gather`` then ``F.linear``, ``F.linear`` then ``comm.reduce_scatter``
— for 2-D and 3-D inputs, ``dim`` 0 and 1, 1 to 4 chunks: outputs, input and weight
gradients (``torch.testing.assert_close``, float32 defaults).

With ``--time`` (and ``--out FILE``), rank 0 also writes measured times and timelines:

Part 2. The share of a tensor- and sequence-parallel block's step (forward + backward)
spent inside collectives (``comm.accounting`` times them).
Part 3. Timelines of ``allgather_matmul`` and ``matmul_reduce_scatter`` with 1 chunk
(sequential) and 4 chunks (overlapped), best of several runs.
Part 4. A tensor-parallel MLP on two micro-batches, sequential and overlapped.
Part 5. The all-gather matmul's time against the number of chunks.

Laptop (gloo, CPU)::

    torchrun --standalone --nproc-per-node 2 -m intralayer.programs.overlap_tp --time

On GPUs: not yet — its tensors are built on the CPU and its timings use the CPU's clock
(a GPU needs CUDA events), so it runs on gloo only; making it device-agnostic is open work.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from intralayer import comm, distributed, overlap
from intralayer.model import Block
from intralayer.programs.tp_linear import error_label
from intralayer.sequence_parallel import ParallelBlock


def correctness(d) -> list[dict]:
    P, r, g = d.world_size, d.rank, d.group
    rows = []
    for shape, dim in (((8, 6), 0), ((4, 2, 6), 0), ((2, 4, 6), 1)):
        for chunks in (1, 2, 4):
            if shape[dim] % chunks:
                continue
            gen = torch.Generator().manual_seed(len(rows))
            full = torch.randn(*shape[:dim], shape[dim] * P, *shape[dim + 1:], generator=gen)
            W = torch.randn(10, 6, generator=gen)
            dy = torch.randn(*full.shape[:-1], 10, generator=gen)
            # all-gather side: the unfused version on the same shard
            mine = full.chunk(P, dim)[r]
            a, wa = mine.clone().requires_grad_(), W.clone().requires_grad_()
            ref = F.linear(comm.all_gather(a, dim, g), wa)
            ref.backward(dy)
            b, wb = mine.clone().requires_grad_(), W.clone().requires_grad_()
            out = overlap.allgather_matmul(b, wb, g, chunks, dim)
            out.backward(dy)
            errs = [_diff(out, ref), _diff(b.grad, a.grad), _diff(wb.grad, wa.grad)]
            # reduce-scatter side: every rank its own full-length x
            x = torch.randn(*full.shape, generator=torch.Generator().manual_seed(100 + r))
            dys = torch.randn(*mine.shape[:-1], 10, generator=gen)
            c, wc = x.clone().requires_grad_(), W.clone().requires_grad_()
            ref2 = comm.reduce_scatter(F.linear(c, wc), dim, g)
            ref2.backward(dys)
            e, we = x.clone().requires_grad_(), W.clone().requires_grad_()
            out2 = overlap.matmul_reduce_scatter(e, we, g, chunks, dim)
            out2.backward(dys)
            errs += [_diff(out2, ref2), _diff(e.grad, c.grad), _diff(we.grad, wc.grad)]
            rows.append(dict(shape=list(mine.shape), dim=dim, chunks=chunks, errs=errs))
    return rows


def _diff(got, want) -> float:
    torch.testing.assert_close(got, want)                    # float32: rtol 1.3e-6, atol 1e-5
    return float((got - want).abs().max())


def best(fn, repeats):
    """Run ``fn`` ``repeats`` times (ranks in step), return the fastest wall time and its result."""
    times, results = [], []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        results.append(fn())
        times.append(time.perf_counter() - t0)
    i = min(range(repeats), key=times.__getitem__)
    return times[i], results[i]


def timings(d, tokens, hidden, repeats) -> dict:
    P, g = d.world_size, d.group
    out = {}
    # Part 2: a TP+SP block, step time and the time inside collectives
    torch.manual_seed(0)
    s, b = tokens // 8, 2
    block = ParallelBlock.from_dense(Block(hidden, 8), g, sequence_parallel=True)
    x = torch.randn(s // P, b, hidden, requires_grad=True)

    def step():
        with comm.accounting() as acc:
            y = block(x)
            y.sum().backward()
        return sum(rec.seconds for rec in acc.records)

    total, in_comm = best(step, repeats)
    out["block"] = dict(s=s, b=b, h=hidden, step=total, comm=in_comm)
    # Part 3: timelines, sequential (1 chunk) and overlapped (4 chunks)
    x_shard = torch.randn(tokens // P, hidden)
    W = torch.randn(4 * hidden // P, hidden)
    x_full = torch.randn(tokens, 4 * hidden // P)
    W2 = torch.randn(hidden, 4 * hidden // P)
    out["timelines"] = {}
    with torch.no_grad():
        for name, fn in (("all-gather matmul", lambda c: overlap.allgather_matmul(x_shard, W, g, c)),
                         ("matmul reduce-scatter", lambda c: overlap.matmul_reduce_scatter(x_full, W2, g, c))):
            for chunks in (1, 4):
                def run():
                    with overlap.timeline() as ev:
                        fn(chunks)
                    return ev
                secs, events = best(run, repeats)
                out["timelines"][f"{name}, {chunks} chunk{'s' if chunks > 1 else ''}"] = dict(seconds=secs, events=events)
        # Part 4: two micro-batches of a tensor-parallel MLP
        fc1, fc2 = torch.randn(4 * hidden // P, hidden), torch.randn(hidden, 4 * hidden // P)
        xm = torch.randn(tokens, hidden)
        for ov in (False, True):
            def run():
                with overlap.timeline() as ev:
                    overlap.mlp_microbatches(xm, fc1, fc2, g, overlap=ov)
                return ev
            secs, events = best(run, repeats)
            out["timelines"][f"MLP, 2 micro-batches, {'overlapped' if ov else 'sequential'}"] = dict(seconds=secs,
                                                                                                    events=events)
        # Part 5: chunk sweep
        sweep = {}
        for chunks in (1, 2, 4, 8, 16, 32):
            if (tokens // P) % chunks == 0:
                sweep[chunks] = best(lambda: overlap.allgather_matmul(x_shard, W, g, chunks), repeats)[0]
        out["sweep"] = sweep
    out["sizes"] = dict(tokens=tokens, hidden=hidden, P=P)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time", action="store_true", help="also measure (parts 2-5)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", help="write rank 0's measurements to this JSON file")
    a = ap.parse_args(argv)
    with distributed.setup() as d:
        rows = correctness(d)
        every = [None] * d.world_size
        dist.all_gather_object(every, rows)
        measured = timings(d, a.tokens, a.hidden, a.repeats) if a.time else None
        if measured is not None:
            gathered = [None] * d.world_size
            dist.all_gather_object(gathered, measured)
        if d.is_main:
            print(f"P = {d.world_size} ranks ({d.backend}, {d.device.type}); collective matmuls vs unfused, "
                  "largest difference over all ranks")
            print(f"{'shard shape':13} {'dim':>3} {'chunks':>6}   all-gather matmul: out   dX    dW"
                  f"   matmul reduce-scatter: out   dX    dW")
            for i, row in enumerate(every[0]):
                worst = [max(rank[i]["errs"][j] for rank in every) for j in range(6)]
                print(f"{str(tuple(row['shape'])):13} {row['dim']:3d} {row['chunks']:6d}   "
                      + "".join(f"{error_label(w):>7}" for w in worst[:3]) + "      "
                      + "".join(f"{error_label(w):>7}" for w in worst[3:]))
            print("all checks passed on every rank")
            if a.out and measured is not None:
                with open(a.out, "w") as f:
                    json.dump(dict(ranks=gathered), f)


if __name__ == "__main__":
    main()
