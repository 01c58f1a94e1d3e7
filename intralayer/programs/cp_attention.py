"""Chapter 04: ring attention (every layout) and DeepSpeed-Ulysses on real ranks, checked and measured.

Part 1. Every rank builds the same q, k, v for the whole sequence, computes
``scaled_dot_product_attention`` on it (the reference), then runs each context-parallel
method on its own shard and checks its output shard and the gradients of its q, k and v
shards against the reference (``torch.testing.assert_close``, float32 defaults), for
several shapes, causal and not.

Part 2. With causal attention, each rank counts the attention scores it computed
(``context_parallel.counting``), for each layout of ``context_parallel.LAYOUTS``, and checks
the count against ``context_parallel.work_per_rank``.

Part 3. Each rank's bytes sent, recorded by ``comm.accounting``, checked against
``context_parallel.cp_costs``.

Part 4. Time, not counts: with causal attention at one larger size (``--time-seq-len``),
each rank runs the ring's forward pass ``--repeats`` times for each layout and records the
thread CPU time it spent in the block computations (``context_parallel.counting``'s clock,
``time.thread_time``: one thread per rank, so the compute itself and not the waits nor the
other processes on the cores). Rank 0 prints each rank's least time over the runs (the run
least disturbed by page faults and the cache other processes share), its median and maximum,
and the busiest rank's least time over the mean next to the same ratio of the schedule's counts.
On a GPU the clock synchronises first.

Part 5 (``--tp t``). The grid of ``intralayer.programs.cp_tp``: tensor parallelism over t
ranks times context parallelism over the rest, one attention layer with grouped-query
attention, ring and Ulysses, against the dense layer.

Rank 0 prints the tables; ``--out`` writes them as JSON (``--no-time-table`` keeps part 4's
table, whose times vary from run to run, out of the printed output).

Laptop (gloo, CPU)::

    torchrun --standalone --nproc-per-node 4 -m intralayer.programs.cp_attention

One GPU node (NCCL), a longer sequence::

    torchrun --standalone --nproc-per-node 8 -m intralayer.programs.cp_attention --seq-len 4096 --heads 16 --head-dim 64

(The short spellings ``--s`` and ``--d`` work when the program is run without torchrun, but
torchrun's own argument parser rejects them as ambiguous abbreviations of its options, such as
``--standalone`` and ``--duplicate-stdout-filters``.)
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
import torch.nn.functional as F

from intralayer import comm, distributed
from intralayer import context_parallel as cp
from intralayer.programs import cp_tp
from intralayer.programs.common import error_label

METHODS = tuple(f"ring, {layout}" for layout in cp.LAYOUTS) + ("Ulysses",)


def layout_of(method: str) -> str:
    """The layout of a method's shards: the ring's own; Ulysses takes contiguous ones."""
    return method.removeprefix("ring, ") if method.startswith("ring, ") else "contiguous"


def run_method(method, q, k, v, group, causal):
    if method == "Ulysses":
        return cp.ulysses_attention(q, k, v, group, causal)
    return cp.ring_attention(q, k, v, group, causal, layout=layout_of(method))


def check(d, b, heads, s, dh, causal, seed) -> dict:
    """Each method against SDPA on the whole sequence: largest differences, scores, bytes."""
    g, dev = d.group, d.device
    torch.manual_seed(seed)
    q, k, v = (torch.randn(b, heads, s, dh, device=dev, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, heads, s, dh, device=dev)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)             # (b, heads, s, d)
    ref.backward(dout)
    results = {}
    for method in METHODS:
        if method == "Ulysses" and heads % d.world_size:
            continue
        lay = layout_of(method)
        mine = [cp.shard_sequence(t.detach(), 2, g, lay).requires_grad_() for t in (q, k, v)]
        with comm.accounting() as acc, cp.counting() as work:
            out = run_method(method, *mine, g, causal)                          # (b, heads, s/P, d)
            out.backward(cp.shard_sequence(dout, 2, g, lay))
        errs = {"out": out, "dq": mine[0].grad, "dk": mine[1].grad, "dv": mine[2].grad}
        want = {"out": ref, "dq": q.grad, "dk": k.grad, "dv": v.grad}
        diffs = {}
        for key, got in errs.items():
            expect = cp.shard_sequence(want[key].detach(), 2, g, lay)
            torch.testing.assert_close(got, expect)              # float32: rtol 1.3e-6, atol 1e-5
            diffs[key] = float((got.detach() - expect).abs().max())
        whole = cp.unshard_sequence(out.detach(), 2, g, lay)
        torch.testing.assert_close(whole, ref.detach())
        results[method] = dict(diffs=diffs, scores=work.scores, steps=work.steps,
                               forward=acc.sent(phase="forward"), backward=acc.sent(phase="backward"))
    return results


def clock_for(device):
    """This rank's compute clock: thread CPU time on a CPU; on a GPU, wall time after a synchronise."""
    if device.type == "cuda":
        return lambda: (torch.cuda.synchronize(device), time.perf_counter())[1]
    return time.thread_time


def time_layouts(d, s, b, heads, dh, repeats, seed=99) -> dict:
    """Per layout: this rank's compute seconds in each causal ring forward, after one warm-up run.

    The layouts take turns within each repeat, so a spell of contention from other work on
    the machine falls on all three alike rather than on one.
    """
    torch.manual_seed(seed)
    q, k, v = (torch.randn(b, heads, s, dh, device=d.device) for _ in range(3))
    mine = {layout: [cp.shard_sequence(t, 2, d.group, layout) for t in (q, k, v)] for layout in cp.LAYOUTS}
    out = {layout: [] for layout in cp.LAYOUTS}
    for i in range(repeats + 1):
        for layout in cp.LAYOUTS:
            dist.barrier(d.group)                                     # every rank starts the ring together
            with torch.no_grad(), cp.counting(clock_for(d.device)) as work:
                cp.ring_attention(*mine[layout], d.group, causal=True, layout=layout)
            if i:
                out[layout].append(work.seconds)
    return out


def least_times(every) -> dict:
    """Per layout, each rank's least compute time over its runs: the run least disturbed by the
    machine's other work (page faults, a shared cache), the estimate of what the work itself costs."""
    return {layout: [min(rank[layout]) for rank in every] for layout in cp.LAYOUTS}


def report_times(every, s, P) -> None:
    print(f"\nCausal ring forward, s = {s:,} on P = {P}: compute time per rank (thread CPU time, ms), "
          f"least of {len(every[0]['contiguous'])} runs [median, max]")
    for layout, least in least_times(every).items():
        spread = " ".join(f"{1e3 * m:5.1f} [{1e3 * statistics.median(rank[layout]):.1f}, {1e3 * max(rank[layout]):.1f}]"
                          for m, rank in zip(least, every))
        counts = cp.work_per_rank(s, P, layout, causal=True)
        print(f"{layout:10} {spread}   busiest / mean: measured {max(least) / statistics.mean(least):.2f}, "
              f"schedule's count {max(counts) / statistics.mean(counts):.2f}")


@record
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Long names: torchrun would take --s or --d for abbreviations of its own options.
    ap.add_argument("--seq-len", "--s", dest="s", type=int, default=32,
                    help="sequence length (divisible by 2 × ranks)")
    ap.add_argument("--batch", "--b", dest="b", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", "--d", dest="d", type=int, default=8, help="head dimension")
    ap.add_argument("--time-seq-len", dest="time_s", type=int, default=4096,
                    help="sequence length of part 4's timed causal rings (0: no timing)")
    ap.add_argument("--repeats", type=int, default=15, help="timed runs of each layout (after one warm-up)")
    ap.add_argument("--no-time-table", dest="time_table", action="store_false",
                    help="leave part 4's table out of the printed output (it is still in --out's JSON)")
    ap.add_argument("--tp", type=int, default=0, help="part 5: the TP × CP grid with this tensor-parallel degree")
    ap.add_argument("--out", help="write rank 0's tables to this JSON file")
    a = ap.parse_args(argv)
    with distributed.setup() as d:
        P = d.world_size
        cp.check_sequence(a.s, P, "zigzag")
        if a.time_s:
            cp.check_sequence(a.time_s, P, "zigzag")
        shapes = [(a.b, a.heads, a.s, a.d), (1, 2 * a.heads, a.s // 2, a.d // 2 or 1)]
        table = []
        for i, (b, heads, s, dh) in enumerate(shapes):
            for causal in (False, True):
                res = check(d, b, heads, s, dh, causal, seed=10 * i + causal)
                for method, r in res.items():
                    costs = cp.cp_costs(s, b, heads, dh, P, "ring" if "ring" in method else "ulysses", causal,
                                        layout_of(method), itemsize=4)
                    if (r["forward"], r["backward"]) != (costs["forward"], costs["backward"]):
                        raise AssertionError(f"{method}: sent {r['forward']}/{r['backward']} bytes, "
                                             f"cp_costs says {costs['forward']}/{costs['backward']}")
                    if "ring" in method:
                        want = cp.work_per_rank(s, P, layout_of(method), causal)[d.rank] * b * heads
                        if r["scores"] != want:
                            raise AssertionError(f"{method}: computed {r['scores']} scores, expected {want}")
                    table.append(dict(shape=[b, heads, s, dh], causal=causal, method=method, **r))
        times = time_layouts(d, a.time_s, 1, 2, 32, a.repeats) if a.time_s else None
        grid = cp_tp.run_grid(d, a.tp, cp_tp.SHAPE) if a.tp else None
        every, every_time = [None] * P, [None] * P
        dist.all_gather_object(every, table)
        dist.all_gather_object(every_time, times)
        if d.is_main:
            report(d, every)
            if a.time_s and a.time_table:
                report_times(every_time, a.time_s, P)
            if grid:
                print(f"\nComposed with tensor parallelism (intralayer.programs.cp_tp), {P // a.tp} × {a.tp} grid:")
                cp_tp.report(grid, a.tp, P // a.tp, **cp_tp.SHAPE)
            print("\nall checks passed on every rank")
            if a.out:
                with open(a.out, "w") as f:
                    json.dump(dict(P=P, ranks=every, time_s=a.time_s, times=every_time), f, indent=1)


def report(d, every) -> None:
    P = d.world_size
    print(f"P = {P} ranks ({d.backend}, {d.device.type}), float32; largest difference from SDPA over all ranks")
    print(f"{'(b, heads, s, d)':17} {'causal':6} {'method':17} {'output':>7} {'dq':>7} {'dk':>7} {'dv':>7}"
          f" {'sent fwd':>9} {'sent bwd':>9}   (bytes, rank 0)")
    for i, row in enumerate(every[0]):
        worst = {k: max(rank[i]["diffs"][k] for rank in every) for k in ("out", "dq", "dk", "dv")}
        print(f"{str(tuple(row['shape'])):17} {str(row['causal']):6} {row['method']:17} "
              + " ".join(f"{error_label(worst[k]):>7}" for k in ("out", "dq", "dk", "dv"))
              + f" {row['forward']:9.0f} {row['backward']:9.0f}")
    print("\nCausal attention: scores each rank counted as it computed them (first shape), "
          "= context_parallel.work_per_rank")
    first = [i for i, row in enumerate(every[0]) if row["causal"] and row["shape"] == every[0][0]["shape"]]
    for i in first:
        row = every[0][i]
        if "ring" not in row["method"]:
            continue
        counts = [rank[i]["scores"] for rank in every]
        print(f"{row['method']:17} " + " ".join(f"{c:7d}" for c in counts)
              + f"   busiest / least busy = {max(counts) / min(counts):.2f}")


if __name__ == "__main__":
    main()
