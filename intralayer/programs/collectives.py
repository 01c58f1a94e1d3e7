"""Chapter 00: every collective on real ranks, checked, with the bytes each rank sends.

Each rank builds the same small deterministic tensors, runs all-reduce, all-gather,
reduce-scatter, all-to-all (uneven splits, one of them empty) and a ring all-reduce
written with send/recv only; it checks every result against what it computes locally
from all ranks' inputs. Then the backward passes: of an all-gather whose output each
rank uses differently (a reduce-scatter), of a gather whose output every rank uses
identically (each keeps its own slice: a split), and of a reduce-scatter (an all-gather).
Rank 0 gathers every rank's verdict and prints one table.

Laptop (gloo, CPU)::

    torchrun --standalone --nproc-per-node 4 -m intralayer.programs.collectives

One GPU node (NCCL)::

    torchrun --standalone --nproc-per-node 8 -m intralayer.programs.collectives

A cluster (run on every node; the rendezvous host is one of them)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint $HEAD_NODE:29500 -m intralayer.programs.collectives
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from intralayer import comm, distributed
from intralayer.collectives import ring_all_reduce

ROWS_PER_RANK = 2
COLS = 3


def data(rank: int, n: int, device) -> torch.Tensor:
    """Rank ``rank``'s input: (2n, 3) whole numbers, different on every rank."""
    base = torch.arange(2 * n * COLS, dtype=torch.float32, device=device).reshape(2 * n, COLS)  # (2n, 3)
    return base + 100 * rank


def a2a_counts(rank: int, n: int) -> list[int]:
    """Rows rank ``rank`` sends to each rank: uneven, and zero to rank (rank+1) mod n."""
    return [0 if j == (rank + 1) % n else (rank + j) % 3 + 1 for j in range(n)]


def run_checks(d: distributed.Dist) -> tuple[list[tuple[str, bool, comm.Record | None, float]], bool]:
    n, r, dev = d.world_size, d.rank, d.device
    xs = [data(j, n, dev) for j in range(n)]        # every rank's input, to build expectations
    x = xs[r]
    total = sum(xs)
    rows: list[tuple[str, bool, comm.Record | None, float]] = []

    def check(name, got, want, acc, sent_want=None):
        """The values on this rank; where the bytes are counted send by send, the count as well."""
        rec = acc.records[-1] if acc.records else None
        counted_right = sent_want is None or acc.sent() == sent_want
        rows.append((name, bool(torch.equal(got, want)) and counted_right, rec, acc.sent()))

    with comm.accounting() as acc:
        got = comm.all_reduce(x)
    check("all_reduce", got, total, acc)
    with comm.accounting() as acc:
        got = comm.all_gather(x, dim=0)
    check("all_gather", got, torch.cat(xs, 0), acc)
    with comm.accounting() as acc:
        got = comm.reduce_scatter(x, dim=0)
    check("reduce_scatter", got, total.chunk(n, 0)[r], acc)

    counts = [a2a_counts(j, n) for j in range(n)]
    sends = [list(xs[j][: sum(counts[j])].split(counts[j])) for j in range(n)]
    with comm.accounting() as acc:
        got = comm.all_to_all(x[: sum(counts[r])], in_splits=counts[r])
    acc.records[:] = [rec for rec in acc.records if rec.label != "counts"]
    to_others = sum(c for j, c in enumerate(counts[r]) if j != r) * COLS * x.element_size()   # its own rows stay
    check("all_to_all", got, torch.cat([sends[j][r] for j in range(n)]), acc, sent_want=to_others)

    with comm.accounting() as acc:
        got = ring_all_reduce(x)
    check("ring all-reduce (send/recv)", got, total, acc, sent_want=2 * (n - 1) / n * x.nbytes)   # 2(n−1)/n·S

    # Backward of an all-gather whose output each rank uses differently: rank j's loss
    # weighs the gathered tensor by its own w_j, so d(sum_j loss_j)/dx_r is the r-th chunk
    # of the sum of the w_j — a reduce-scatter.
    ws = [torch.full((2 * n * n, COLS), float(j + 1), device=dev) + torch.arange(2 * n * n, device=dev)[:, None]
          for j in range(n)]                                            # (2n·n, 3) each
    leaf = x.clone().requires_grad_()
    (comm.all_gather(leaf, dim=0) * ws[r]).sum().backward()
    rows.append(("backward of all_gather", bool(torch.equal(leaf.grad, sum(ws).chunk(n, 0)[r])), None, 0.0))
    # Backward of a gather whose output every rank uses identically (one loss, w_0 on every
    # rank): every rank already holds the whole gradient w_0; each keeps its chunk — a split.
    leaf = x.clone().requires_grad_()
    (comm.gather_from_group(leaf, dim=0) * ws[0]).sum().backward()
    rows.append(("backward of gather, same use", bool(torch.equal(leaf.grad, ws[0].chunk(n, 0)[r])), None, 0.0))
    vs = [torch.full((ROWS_PER_RANK, COLS), float(j + 1), device=dev) for j in range(n)]  # (2, 3) each
    leaf = x.clone().requires_grad_()
    (comm.reduce_scatter(leaf, dim=0) * vs[r]).sum().backward()
    rows.append(("backward of reduce_scatter", bool(torch.equal(leaf.grad, torch.cat(vs, 0))), None, 0.0))

    ok = torch.tensor([all(row[1] for row in rows)], dtype=torch.int32, device=dev)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)          # every rank's verdict
    return rows, bool(ok.item())


#: How the "sent" column is known: gloo and NCCL do not report their traffic, so for the
#: library collectives it is the bandwidth-optimal ring's (nccl-tests' bus factor); the
#: all-to-all's and the hand-written ring's bytes are counted send by send.
HOW = {"all_reduce": "ring model", "all_gather": "ring model", "reduce_scatter": "ring model",
       "all_to_all": "counted", "ring all-reduce (send/recv)": "counted"}
#: What each backward check found the gradient to be.
BACKWARD = {"backward of all_gather": "reduce-scatter (each rank used the output differently)",
            "backward of gather, same use": "split (every rank used the output identically)",
            "backward of reduce_scatter": "all-gather"}
FACTOR = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
          "all_to_all": "all_to_all", "ring all-reduce (send/recv)": "all_reduce"}


def report(d: distributed.Dist, rows, all_ok: bool) -> None:
    n = d.world_size
    print(f"{n} ranks, {d.backend} on {d.device.type}; every rank's results checked: "
          f"{'all correct' if all_ok else 'MISMATCH'}")
    print(f"{'collective':28} {'rank 0':>6} {'S bytes':>8} {'sent':>6} {'sent/S':>7} {'bus factor':>10}  sent is")
    for name, ok, rec, sent in rows:
        if rec is None:
            print(f"{name:28} {'ok' if ok else 'WRONG':>6}  = {BACKWARD[name]}")
            continue
        size = ROWS_PER_RANK * n * COLS * 4 if name.startswith("ring") else rec.bytes
        print(f"{name:28} {'ok' if ok else 'WRONG':>6} {size:8d} {sent:6.0f} {sent / size:7.3f} "
              f"{comm.bus_factor(FACTOR[name], n):10.3f}  {HOW[name]}")


@record
def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    with distributed.setup() as d:
        rows, all_ok = run_checks(d)
        if d.is_main:
            report(d, rows, all_ok)
        if not all_ok:
            raise SystemExit(f"rank {d.rank}: a collective gave a wrong result")


if __name__ == "__main__":
    main()
