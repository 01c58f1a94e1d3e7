"""Check intralayer.overlap's collective matmuls on real ranks.

For every schedule (ring, bidirectional, chunked, sequential):
``allgather_matmul(x_shard, W, group, chunks, dim, schedule)`` must equal
``F.linear(comm.all_gather(x_shard, dim), W)`` and ``matmul_reduce_scatter(x, W, group,
chunks, dim, schedule)`` must equal ``comm.reduce_scatter(F.linear(x, W), dim)``: outputs,
input gradients and weight gradients (this rank's own, no reduction across the group),
for a 2-D (tokens, h) input, (s, b, h) with dim 0, (b, s, h) with dim 1, a 4-D input with
dim 2 and negative dims; every chunk count that divides the rows per rank;
out_features ≠ in_features both ways; float32 at its default tolerances and float64 at
float64's rounding (``FLOAT64``). Each rank has its own input, weight and upstream
gradient (seeded by rank), so the result is also held against the sum over ranks
written out here from every rank's tensors, not only against the unfused collectives.

Also: gradients of a loss that is not linear in the output (with one row per chunk);
the messages each schedule sends (``comm.accounting``): the ring's ``(P−1)·chunks`` sends
to the right neighbours, each way as far as ``ring_reach`` says, and the chunked
schedules' ``chunks`` collectives, all with the unfused version's bytes in total; the
schedule itself, read back from a ``torch.profiler`` trace (each piece is passed on
before it is multiplied; the chunked schedule's next all-gather is in flight while a
chunk multiplies, the sequential one's is not); ``mlp_microbatches`` forward and
backward against the unfused and the dense MLP, its all-reduces, and its overlap in the
trace; and that bad input raises a ``ValueError`` that names the rule before any rank
communicates.

Any mismatch raises, so the rank, and the launch, fail; when every check passed on
every rank, rank 0 prints ``MARKER`` followed by the number of ranks.
"""
from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function
from torch.testing import assert_close

from intralayer import comm, distributed, overlap
from tests.programs.checks import expect, raises, rounding_tol

MARKER = "OVERLAP CHECKS PASSED on ranks:"
DTYPES = (torch.float32, torch.float64)
RINGS = ("ring", "bidirectional")

# Tolerances. float32: the collective matmul against the unfused ops or the sum written
# out is the same float32 terms summed in another order, at assert_close's float32
# defaults (checks.FLOAT32_REORDERED: longest reduction 96 rows of a weight gradient).
# float64: assert_close's float64 defaults (1e-7) would pass float32 arithmetic too, so
# γ_n of float64 with n = 256 ≥ twice (both sides round) the longest chain here, < 128:
# ≤ 96 rows summed for dW (P·24), ≤ 16-term products, P partial sums, the loss's few
# operations; atol for terms up to mag = 96·5·5, 96 products of randn entries, which
# :func:`randn` keeps below 5 in magnitude.
FLOAT64 = rounding_tol(torch.float64, 256, mag=96 * 5 * 5)


# ---------------------------------------------------------------------------- helpers

def close(got, want, what, **tol):
    """``assert_close`` at ``tol`` if given, else at :data:`FLOAT64` for float64 and at the
    float32 defaults for float32 (the comment above :data:`FLOAT64`)."""
    expect(got is not None, f"{what}: got None")
    expect(got.dtype == want.dtype, f"{what}: dtype {got.dtype}, want {want.dtype}")
    expect(tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}")
    if not tol and got.dtype == torch.float64:
        tol = FLOAT64
    assert_close(got, want, msg=lambda m: f"{what}: {m}", **tol)


def randn(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    """The same tensor on every rank for the same seed (drawn in float64, then cast)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g, dtype=torch.float64)
    expect(bool(t.abs().max() < 5), f"randn seed {seed}: an entry of 5 or more breaks FLOAT64's magnitude")
    return t.to(dtype)


def with_rows(shape, dim, rows):
    return (*shape[:dim], rows, *shape[dim + 1:])


def cases():
    """(shard shape, dim as passed, in_features, out_features): rows per rank along dim."""
    return [
        ((4, 6), 0, 6, 10),            # (tokens, h), out > in
        ((6, 5), 0, 5, 3),             # rows 6 (chunks 1, 2, 3, 6), out < in
        ((4, 2, 6), 0, 6, 10),         # (s, b, h), sequence first
        ((2, 4, 6), 1, 6, 4),          # (b, s, h), sequence second
        ((2, 4, 6), -2, 6, 7),         # the same with a negative dim
        ((2, 3, 4, 5), 2, 5, 9),       # 4-D, dim 2
        ((1, 2, 3), 1, 3, 2),          # two rows per rank, b = 1
    ]


def plan(schedule):
    """(dtypes, chunk counts) to try: the ring in both dtypes at every chunk count; the
    bidirectional ring (the ring's code, both ways) in float64 at every chunk count; the
    chunked schedules (one code path for both) in float64 at 1, 2 and all chunks."""
    if schedule == "ring":
        return DTYPES, None
    return (torch.float64,), (None if schedule == "bidirectional" else (1, 2, "all"))


def chunk_counts(n, which):
    divisors = [c for c in range(1, n + 1) if n % c == 0]
    if which is None:
        return divisors
    return sorted({n if c == "all" else c for c in which if c == "all" or n % c == 0})


def linear_grads(out, loss_kind, seed, dtype):
    """The loss to backpropagate from ``out``: linear (upstream gradient) or non-linear."""
    up = randn(*out.shape, seed=seed, dtype=dtype)
    if loss_kind == "linear":
        return (out * up).sum()
    return (torch.tanh(out) * up).sum() + (out ** 2).mean()       # not linear in the output


def check_records(acc, ref_acc, P, r, chunks, dtype, schedule, what):
    """The messages: the ring's point-to-point sends, or one collective per chunk; totals as unfused."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    for phase in ("forward", "backward"):
        mine, ref = acc.select(phase=phase), ref_acc.select(phase=phase)
        expect(len(ref) == 1, f"{what}: unfused {phase} records {len(ref)}")
        expect(all(x.group_size == P and x.itemsize == itemsize for x in mine), f"{what}: {phase} group/itemsize")
        expect(math.isclose(acc.sent(phase=phase), ref_acc.sent(phase=phase), rel_tol=1e-12),
               f"{what}: {phase} sent {acc.sent(phase=phase)} bytes, unfused {ref_acc.sent(phase=phase)}")
        if schedule in RINGS:
            forward, backward = overlap.ring_reach(P, schedule == "bidirectional")
            expect(len(mine) == (P - 1) * chunks and all(x.op == "send" for x in mine),
                   f"{what}: {phase} records {[(x.op, x.label) for x in mine]}, want {(P - 1) * chunks} sends")
            expect(len({x.elements for x in mine}) <= 1, f"{what}: {phase} pieces of unequal size")
            if mine:
                to = np.sum([x.peers for x in mine], axis=0)           # bytes to each rank of the group
                piece = mine[0].bytes
                want = np.zeros(P)
                want[(r + 1) % P] += forward * chunks * piece
                want[(r - 1) % P] += backward * chunks * piece
                expect(np.array_equal(to, want), f"{what}: {phase} bytes to each rank {to.tolist()}, want "
                                                 f"{want.tolist()} (forward {forward} steps, backward {backward})")
        else:
            expect(len(mine) == chunks and all(x.op == ref[0].op for x in mine),
                   f"{what}: {phase} records {[(x.op, x.label) for x in mine]}, want {chunks} × {ref[0].op}")
            expect(sorted(int(x.label.rsplit(" ", 1)[1]) for x in mine) == list(range(chunks)),
                   f"{what}: {phase} labels do not number chunks 0..{chunks - 1}: {[x.label for x in mine]}")
            expect(sum(x.bytes for x in mine) == ref[0].bytes,
                   f"{what}: {phase} S {sum(x.bytes for x in mine)} bytes, unfused {ref[0].bytes}")


# ---------------------------------------------------------------------------- all-gather side

def check_allgather_matmul(P, r, group):
    for schedule in overlap.SCHEDULES:
        dtypes, which = plan(schedule)
        for k, (shape, dim, h_in, h_out) in enumerate(cases()):
            d = dim % len(shape)
            n = shape[d]
            for dtype in dtypes:
                # every rank's shard, weight and upstream seed: rank j's are known to every rank
                shards = [randn(*shape, seed=1000 * k + j, dtype=dtype) for j in range(P)]
                weights = [randn(h_out, h_in, seed=1000 * k + 100 + j, dtype=dtype) for j in range(P)]
                full = torch.cat(shards, dim=d)
                for chunks in chunk_counts(n, which):
                    what = (f"allgather_matmul {schedule} {dtype} shard {shape} dim={dim} chunks={chunks} "
                            f"W {h_out}x{h_in}")
                    for loss_kind in ("linear", "non-linear") if chunks == n else ("linear",):
                        wh = f"{what} ({loss_kind} loss)"
                        useed = 50_000 + 1000 * k + 10 * r                   # upstream differs by rank
                        a, wa = shards[r].clone().requires_grad_(), weights[r].clone().requires_grad_()
                        with comm.accounting() as ref_acc:
                            ref = F.linear(comm.all_gather(a, d, group), wa)
                            linear_grads(ref, loss_kind, useed, dtype).backward()
                        b, wb = shards[r].clone().requires_grad_(), weights[r].clone().requires_grad_()
                        before = b.detach().clone()
                        with comm.accounting() as acc:
                            out = overlap.allgather_matmul(b, wb, group, chunks, dim, schedule)
                            linear_grads(out, loss_kind, useed, dtype).backward()

                        expect(out.dtype == dtype and out.requires_grad, f"{wh}: output {out.dtype}")
                        expect(tuple(out.shape) == with_rows(shape, d, P * n)[:-1] + (h_out,),
                               f"{wh}: output shape {tuple(out.shape)}")
                        expect(torch.equal(b.detach(), before), f"{wh}: the input shard was modified")
                        close(out.detach(), ref.detach(), f"{wh}: output vs unfused")
                        close(b.grad, a.grad, f"{wh}: dX vs unfused")
                        close(wb.grad, wa.grad, f"{wh}: dW vs unfused")
                        if loss_kind == "linear":
                            # written out: out = full @ W_r.T; dX_r = (Σ_j up_j @ W_j) rows of rank r;
                            # dW_r = up_r.T @ full (this rank's own)
                            close(out.detach(), F.linear(full, weights[r]), f"{wh}: output vs full @ W.T")
                            ups = [randn(*out.shape, seed=50_000 + 1000 * k + 10 * j, dtype=dtype) for j in range(P)]
                            dfull = sum(F.linear(ups[j], weights[j].T) for j in range(P))
                            close(b.grad, dfull.chunk(P, d)[r], f"{wh}: dX vs Σ_j up_j @ W_j")
                            dw = ups[r].reshape(-1, h_out).T @ full.reshape(-1, h_in)
                            close(wb.grad, dw, f"{wh}: dW vs up_r.T @ gathered x (no sum over ranks)")
                        check_records(acc, ref_acc, P, r, chunks, dtype, schedule, wh)


# ---------------------------------------------------------------------------- reduce-scatter side

def check_matmul_reduce_scatter(P, r, group):
    for schedule in overlap.SCHEDULES:
        dtypes, which = plan(schedule)
        for k, (shape, dim, h_in, h_out) in enumerate(cases()):
            d = dim % len(shape)
            n = shape[d]                                       # rows per rank of the output
            xshape = with_rows(shape, d, P * n)                # every rank's own full-length input
            for dtype in dtypes:
                xs = [randn(*xshape, seed=2000 * (k + 1) + j, dtype=dtype) for j in range(P)]
                weights = [randn(h_out, h_in, seed=2000 * (k + 1) + 100 + j, dtype=dtype) for j in range(P)]
                for chunks in chunk_counts(n, which):
                    what = (f"matmul_reduce_scatter {schedule} {dtype} x {xshape} dim={dim} chunks={chunks} "
                            f"W {h_out}x{h_in}")
                    for loss_kind in ("linear", "non-linear") if chunks == n else ("linear",):
                        wh = f"{what} ({loss_kind} loss)"
                        useed = 70_000 + 1000 * k + 10 * r
                        c, wc = xs[r].clone().requires_grad_(), weights[r].clone().requires_grad_()
                        with comm.accounting() as ref_acc:
                            ref = comm.reduce_scatter(F.linear(c, wc), d, group)
                            linear_grads(ref, loss_kind, useed, dtype).backward()
                        e, we = xs[r].clone().requires_grad_(), weights[r].clone().requires_grad_()
                        before = e.detach().clone()
                        with comm.accounting() as acc:
                            out = overlap.matmul_reduce_scatter(e, we, group, chunks, dim, schedule)
                            linear_grads(out, loss_kind, useed, dtype).backward()

                        expect(tuple(out.shape) == with_rows(shape, d, n)[:-1] + (h_out,),
                               f"{wh}: output shape {tuple(out.shape)}")
                        expect(torch.equal(e.detach(), before), f"{wh}: the input was modified")
                        close(out.detach(), ref.detach(), f"{wh}: output vs unfused")
                        close(e.grad, c.grad, f"{wh}: dX vs unfused")
                        close(we.grad, wc.grad, f"{wh}: dW vs unfused")
                        if loss_kind == "linear":
                            # written out: out_r = rows r of Σ_j x_j @ W_j.T; dX_r = gathered up @ W_r
                            total = sum(F.linear(xs[j], weights[j]) for j in range(P))
                            close(out.detach(), total.chunk(P, d)[r], f"{wh}: output vs Σ_j x_j @ W_j.T")
                            ups = torch.cat([randn(*out.shape, seed=70_000 + 1000 * k + 10 * j, dtype=dtype)
                                             for j in range(P)], dim=d)
                            close(e.grad, F.linear(ups, weights[r].T), f"{wh}: dX vs gathered up @ W")
                            dw = ups.reshape(-1, h_out).T @ xs[r].reshape(-1, h_in)
                            close(we.grad, dw, f"{wh}: dW vs gathered up.T @ x (no sum over ranks)")
                        check_records(acc, ref_acc, P, r, chunks, dtype, schedule, wh)


def check_partial_grads(P, r, group):
    """Only the weight, or only the input, requires a gradient; no_grad; a numpy chunk count."""
    x, W = randn(4, 6, seed=3000 + r), randn(10, 6, seed=3100 + r)
    xf = randn(4 * P, 6, seed=3200 + r)
    for schedule in overlap.SCHEDULES:
        for fn, inp in ((overlap.allgather_matmul, x), (overlap.matmul_reduce_scatter, xf)):
            ref_fn = ((lambda t, w: F.linear(comm.all_gather(t, 0, group), w)) if fn is overlap.allgather_matmul
                      else (lambda t, w: comm.reduce_scatter(F.linear(t, w), 0, group)))
            what = f"{fn.__name__} {schedule}"
            w1, w2 = W.clone().requires_grad_(), W.clone().requires_grad_()
            fn(inp, w1, group, 2, 0, schedule).square().sum().backward()
            ref_fn(inp, w2).square().sum().backward()
            close(w1.grad, w2.grad, f"{what}: dW with x not requiring grad")
            x1, x2 = inp.clone().requires_grad_(), inp.clone().requires_grad_()
            fn(x1, W, group, 2, 0, schedule).square().sum().backward()
            ref_fn(x2, W).square().sum().backward()
            close(x1.grad, x2.grad, f"{what}: dX with W not requiring grad")
            with torch.no_grad():
                y = fn(inp, W, group, 2, 0, schedule)
            expect(not y.requires_grad, f"{what}: output under no_grad requires grad")
            close(y, ref_fn(inp, W).detach(), f"{what}: under no_grad")
    close(overlap.allgather_matmul(x, W, group, np.int64(2)), F.linear(comm.all_gather(x, 0, group), W),
          "allgather_matmul chunks=np.int64(2)")


# ---------------------------------------------------------------------------- the schedule, from the profiler

def traced(fn):
    """Run ``fn`` under torch.profiler (CPU) inside a range "run: check"; its timeline (overlap.trace_timeline)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("run: check"):
            fn()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        return overlap.trace_timeline(path, "run: check")


def ranges(timeline, kind, prefix):
    found = {}
    for k, name, start, end in timeline:
        if k == kind and name.startswith(prefix):
            expect(name not in found, f"range {name!r} recorded twice")
            found[name] = (start, end)
    return found


def check_ring_trace(P, r, group):
    """What the ring does, read back from the profiler: P·chunks multiplies, (P−1)·chunks
    waits, and each piece that still has further to go passed on (its send posted) after
    it arrived and before it is multiplied; the own shard's first sends before it multiplies."""
    x, W = randn(4, 6, seed=4000 + r), randn(10, 6, seed=4100 + r)
    for schedule in RINGS:
        forward, backward = overlap.ring_reach(P, schedule == "bidirectional")
        for chunks in (1, 2):
            what = f"trace of allgather_matmul {schedule} chunks={chunks}"
            tl = traced(lambda: overlap.allgather_matmul(x, W, group, chunks, 0, schedule))
            compute, waits = ranges(tl, "compute", "compute: ag-matmul"), ranges(tl, "wait", "wait: ag-matmul")
            sends = [start for kind, name, start, _ in tl if kind == "post" and name == "c10d::send"]
            expect(len(compute) == P * chunks and len(waits) == (P - 1) * chunks,
                   f"{what}: {len(compute)} multiplies, {len(waits)} waits: {sorted(compute)} {sorted(waits)}")
            expect(len(sends) == (P - 1) * chunks, f"{what}: {len(sends)} sends posted, want {(P - 1) * chunks}")
            if P > 1:
                first = compute["compute: ag-matmul step 0 piece 0"][0]
                expect(sum(t <= first for t in sends) == 1 + (backward > 0),
                       f"{what}: {sum(t <= first for t in sends)} sends posted before the own shard multiplied")
            for name, (w0, w1) in waits.items():
                c0, _ = compute[name.replace("wait:", "compute:")]
                s = int(name.split(" step ")[1].split()[0])
                reach = forward if name.endswith("from r-1") else backward
                passed = sum(w1 <= t <= c0 for t in sends)
                expect(w1 <= c0 and passed == (s < reach),
                       f"{what}: {name}: {passed} sends posted between its arrival and its multiply, "
                       f"want {int(s < reach)}")


def check_chunked_trace(P, r, group):
    """Chunked: the next all-gather is posted before this chunk multiplies; sequential: after."""
    x, W = randn(4, 6, seed=4200 + r), randn(10, 6, seed=4300 + r)
    for schedule, overlapped in (("chunked", True), ("sequential", False)):
        what = f"trace of allgather_matmul {schedule} chunks=4"
        tl = traced(lambda: overlap.allgather_matmul(x, W, group, 4, 0, schedule))
        compute = ranges(tl, "compute", "compute: ag-matmul")
        gathers = [start for kind, name, start, _ in tl if kind == "post" and name.startswith("c10d::_allgather")]
        expect(len(compute) == 4 and len(gathers) == 4,
               f"{what}: {len(compute)} multiplies, {len(gathers)} all-gathers")
        for i in range(3):
            c0, c1 = compute[f"compute: ag-matmul chunk {i}"]
            nxt = gathers[i + 1]
            if overlapped:
                expect(nxt <= c0, f"{what}: all-gather {i + 1} posted after chunk {i}'s multiply began")
            else:
                expect(nxt >= c1, f"{what}: all-gather {i + 1} posted before chunk {i}'s multiply ended")


# ---------------------------------------------------------------------------- two micro-batches

def check_mlp_microbatches(P, r, group):
    h, ffn = 6, 4 * P                                          # ffn/P = 4 columns per rank
    for k, (xshape, dtype) in enumerate((((8, h), torch.float32), ((8, h), torch.float64),
                                         ((4, 3, h), torch.float32))):
        X = randn(*xshape, seed=5000 + k, dtype=dtype)                  # replicated input
        FC1, FC2 = randn(ffn, h, seed=5100 + k, dtype=dtype), randn(h, ffn, seed=5200 + k, dtype=dtype)
        dY = randn(*xshape, seed=5300 + k, dtype=dtype)                 # the same on every rank
        fc1, fc2 = FC1.chunk(P, 0)[r], FC2.chunk(P, 1)[r]
        xd, f1, f2 = X.clone().requires_grad_(), FC1.clone().requires_grad_(), FC2.clone().requires_grad_()
        dense = F.linear(F.gelu(F.linear(xd, f1)), f2)
        dense.backward(dY)
        xu, u1, u2 = X.clone().requires_grad_(), fc1.clone().requires_grad_(), fc2.clone().requires_grad_()
        with comm.accounting() as ref_acc:                              # Megatron's f and g, unfused
            unfused = comm.reduce_from_group(F.linear(F.gelu(F.linear(comm.copy_to_group(xu, group), u1)), u2),
                                             group)
            unfused.backward(dY)
        for micro in (m for m in range(1, xshape[0] + 1) if xshape[0] % m == 0):
            for ov in (False, True):
                what = f"mlp_microbatches {dtype} x {xshape} micro_batches={micro} overlap={ov}"
                x, a1, a2 = X.clone().requires_grad_(), fc1.clone().requires_grad_(), fc2.clone().requires_grad_()
                with comm.accounting() as acc:
                    out = overlap.mlp_microbatches(x, a1, a2, group, overlap=ov, micro_batches=micro)
                    n_fwd = len(acc.records)
                    out.backward(dY)
                close(out.detach(), unfused.detach(), f"{what}: vs the unfused TP MLP")
                close(out.detach(), dense.detach(), f"{what}: vs the dense MLP")
                close(x.grad, xd.grad, f"{what}: dX vs the dense MLP")
                close(x.grad, xu.grad, f"{what}: dX vs the unfused TP MLP")
                close(a1.grad, f1.grad.chunk(P, 0)[r], f"{what}: dfc1 vs the dense MLP's rows of this rank")
                close(a2.grad, f2.grad.chunk(P, 1)[r], f"{what}: dfc2 vs the dense MLP's columns of this rank")
                fwd, bwd = acc.records[:n_fwd], acc.records[n_fwd:]
                expect([x_.op for x_ in fwd] == ["all_reduce"] * micro and all(x_.phase == "forward" for x_ in fwd),
                       f"{what}: forward records {acc.table()}")
                expect([x_.op for x_ in bwd] == ["all_reduce"] * micro and all(x_.phase == "backward" for x_ in bwd),
                       f"{what}: backward records {acc.table()}")
                for phase in ("forward", "backward"):
                    expect(sum(x_.bytes for x_ in acc.select(phase=phase))
                           == sum(x_.bytes for x_ in ref_acc.select(phase=phase)), f"{what}: {phase} bytes")
                    expect(math.isclose(acc.sent(phase=phase), ref_acc.sent(phase=phase), rel_tol=1e-12),
                           f"{what}: {phase} sent")
        # without an input gradient: no backward all-reduce
        a1 = fc1.clone().requires_grad_()
        with comm.accounting() as acc:
            overlap.mlp_microbatches(X, a1, fc2, group, True, 2).sum().backward()
        expect(acc.count(phase="backward") == 0, f"x without grad: backward records {acc.table()}")
    # the overlap, from the profiler: a micro-batch's all-reduce is waited for after the
    # next micro-batch computed (overlapped), before it (sequential); forward and backward
    x, w1, w2 = randn(8, h, seed=5400), randn(ffn, h, seed=5401).chunk(P, 0)[r], randn(h, ffn, seed=5402).chunk(P, 1)[r]
    for ov in (False, True):
        xg = x.clone().requires_grad_()
        tl = traced(lambda: overlap.mlp_microbatches(xg, w1, w2, group, ov, 2).sum().backward())
        for part, first, second in (("forward", 0, 1), ("backward", 1, 0)):
            what = f"trace of mlp_microbatches overlap={ov}, {part}"
            compute = ranges(tl, "compute", f"compute: MLP {part}")
            waits = ranges(tl, "wait", f"wait: MLP {part}")
            expect(len(compute) == 2 and len(waits) == 2, f"{what}: {sorted(compute)} {sorted(waits)}")
            w_first = waits[f"wait: MLP {part} {first}"][0]
            c_second = compute[f"compute: MLP {part} {second}"][1]
            expect((w_first >= c_second) == ov, f"{what}: micro-batch {first}'s all-reduce waited for at {w_first}, "
                                                f"micro-batch {second} computed until {c_second}")


# ---------------------------------------------------------------------------- bad input

def check_bad_input(P, r, group):
    x, W = randn(4, 6, seed=6000), randn(10, 6, seed=6001)
    xf = randn(4 * P, 6, seed=6002)
    x3 = randn(2, 4, 6, seed=6003)
    for name, fn, inp in (("allgather_matmul", overlap.allgather_matmul, x),
                          ("matmul_reduce_scatter", overlap.matmul_reduce_scatter, xf)):
        for bad in (0, -1, 2.0, 1.5, True, "2", None):
            raises(lambda: fn(inp, W, group, bad), name, "chunks must be a whole number ≥ 1", repr(bad),
                   what=f"{name}: chunks={bad!r}")
        for bad in ("rings", "", None, "Ring"):
            raises(lambda: fn(inp, W, group, 1, 0, bad), name, f"schedule={bad!r} is not one of",
                   "ring, bidirectional, chunked, sequential", what=f"{name}: schedule={bad!r}")
        raises(lambda: fn(inp, W, group, 1, 1), name, "dim=1 is the feature dimension",
               what=f"{name}: dim 1 of a 2-D input")
        raises(lambda: fn(inp, W, group, 1, -1), name, "dim=1 is the feature dimension",
               what=f"{name}: dim -1 of a 2-D input")
        raises(lambda: fn(inp.expand(2, *inp.shape), W, group, 1, 2), name, "dim=2 is the feature dimension",
               what=f"{name}: dim 2 of a 3-D input")
        for bad_dim in (2, -3, 5):
            raises(lambda: fn(inp, W, group, 1, bad_dim), f"dim={bad_dim} is out of range",
                   "2 dimensions", what=f"{name}: dim={bad_dim}")
        raises(lambda: fn(inp, randn(10, 5, seed=1), group, 1), name, "last dimension 6",
               "does not match the weight's in_features 5", what=f"{name}: in_features 5 for h = 6")
        raises(lambda: fn(inp, W.T.contiguous(), group, 1), name, "does not match the weight's in_features 10",
               what=f"{name}: a transposed weight")
        raises(lambda: fn(inp, W.double(), group, 1), name, "torch.float32", "torch.float64",
               what=f"{name}: float32 x, float64 weight")
        raises(lambda: fn(inp.double(), W, group, 1), name, "torch.float64", "torch.float32",
               what=f"{name}: float64 x, float32 weight")
        raises(lambda: fn(inp.long(), W, group, 1), name, "floating-point", what=f"{name}: integer x")
        raises(lambda: fn(inp.long(), W.long(), group, 1), name, "floating-point", what=f"{name}: integer x and W")
        raises(lambda: fn(inp, W.long(), group, 1), name, "torch.int64", what=f"{name}: integer weight")
        raises(lambda: fn(inp.tolist(), W, group, 1), name, "floating-point", what=f"{name}: a list")
        raises(lambda: fn(torch.tensor(1.0), W, group, 1), name, "floating-point", what=f"{name}: a 0-D x")
        raises(lambda: fn(inp, W[None], group, 1), name, "(out_features, in_features) matrix", what=f"{name}: 3-D W")
    # chunks that do not divide the rows per rank, for every schedule
    for schedule in overlap.SCHEDULES:
        for chunks in (3, 8, 5):
            raises(lambda: overlap.allgather_matmul(x, W, group, chunks, 0, schedule), "allgather_matmul",
                   "4 rows per rank", f"into {chunks} chunks", what=f"allgather_matmul {schedule}: 4 rows in {chunks}")
        raises(lambda: overlap.allgather_matmul(x3, W, group, 3, 1, schedule), "allgather_matmul", "along dim 1",
               "into 3 chunks", what=f"allgather_matmul {schedule}: (b, s, h) with s = 4 in 3 chunks")
        for rows, chunks in ((4 * P, 3), (4 * P, 8), (P + 1, 1), (4 * P + 2, 2)):
            raises(lambda: overlap.matmul_reduce_scatter(randn(rows, 6, seed=7), W, group, chunks, 0, schedule),
                   "matmul_reduce_scatter", f"{rows} rows along dim 0", f"{P} ranks × {chunks} chunks",
                   what=f"matmul_reduce_scatter {schedule}: {rows} rows, {chunks} chunks")
        raises(lambda: overlap.matmul_reduce_scatter(randn(2, 3 * P, 6, seed=8), W, group, 2, 1, schedule),
               "matmul_reduce_scatter", f"{3 * P} rows along dim 1", f"{P} ranks × 2 chunks",
               what=f"matmul_reduce_scatter {schedule}: (b, s, h) with s = 3P in 2 chunks")
    raises(lambda: overlap.mlp_microbatches(randn(6, 6, seed=1), randn(4, 6, seed=2), randn(6, 4, seed=3), group,
                                            True, 4), "6 rows do not split into 4 micro-batches",
           what="mlp_microbatches, 6 rows in 4")


#: Every check, in the order main runs them; each is also a test item of its own (tests.programs.checks.run_check).
CHECKS = (check_bad_input, check_allgather_matmul, check_matmul_reduce_scatter, check_partial_grads, check_ring_trace, check_chunked_trace, check_mlp_microbatches)


@record
def main() -> None:
    with distributed.setup() as d:
        P, r, group = d.world_size, d.rank, d.group
        for check in CHECKS:
            check(P, r, group)
        dist.barrier()
        if d.is_main:
            print(f"{MARKER} {P}")


if __name__ == "__main__":
    main()
