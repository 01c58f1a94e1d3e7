"""Check intralayer.overlap's collective matmuls on real ranks.

``allgather_matmul(x_shard, W, group, chunks, dim)`` must equal
``F.linear(comm.all_gather(x_shard, dim), W)`` and ``matmul_reduce_scatter(x, W, group,
chunks, dim)`` must equal ``comm.reduce_scatter(F.linear(x, W), dim)``: outputs, input
gradients and weight gradients (this rank's own, no reduction across the group), for a
2-D (tokens, h) input, (s, b, h) with dim 0, (b, s, h) with dim 1, a 4-D input with
dim 2 and negative dims; every chunk count that divides the rows per rank (the largest
included); out_features ≠ in_features both ways; float32 at its default tolerances and
float64 at float64's rounding (``FLOAT64``). Each rank has its own input, weight and upstream gradient (seeded by
rank), so the result is also held against the sum over ranks written out here from
every rank's tensors, not only against the unfused collectives.

Also: gradients of a loss that is not linear in the output (with one row per chunk,
the most chunks); the collectives each op
issues (``comm.accounting``: ``chunks`` records of the right kind each way, labelled
"chunk", with the unfused version's bytes in total); the events ``overlap.timeline()``
records (well formed, ``chunks`` of each kind, in the order the data dependencies and
the overlap require); ``mlp_microbatches`` against the unfused and the dense MLP; and
that bad input raises a ``ValueError`` that names the rule before any rank communicates.

Any mismatch raises, so the rank, and the launch, fail; when every check passed on
every rank, rank 0 prints ``MARKER`` followed by the number of ranks.
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

from intralayer import comm, distributed, overlap
from tests.programs.checks import expect, raises, rounding_tol

MARKER = "OVERLAP CHECKS PASSED on ranks:"
DTYPES = (torch.float32, torch.float64)

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


def divisors(n):
    return [c for c in range(1, n + 1) if n % c == 0]


def linear_grads(out, loss_kind, seed, dtype):
    """The loss to backpropagate from ``out``: linear (upstream gradient) or non-linear."""
    up = randn(*out.shape, seed=seed, dtype=dtype)
    if loss_kind == "linear":
        return (out * up).sum()
    return (torch.tanh(out) * up).sum() + (out ** 2).mean()       # not linear in the output


# ---------------------------------------------------------------------------- all-gather side

def check_allgather_matmul(P, r, group):
    for k, (shape, dim, h_in, h_out) in enumerate(cases()):
        d = dim % len(shape)
        n = shape[d]
        for dtype in DTYPES:
            # every rank's shard, weight and upstream seed: rank j's are known to every rank
            shards = [randn(*shape, seed=1000 * k + j, dtype=dtype) for j in range(P)]
            weights = [randn(h_out, h_in, seed=1000 * k + 100 + j, dtype=dtype) for j in range(P)]
            full = torch.cat(shards, dim=d)
            for chunks in divisors(n):
                what = f"allgather_matmul {dtype} shard {shape} dim={dim} chunks={chunks} W {h_out}x{h_in}"
                for loss_kind in ("linear", "non-linear") if chunks == n else ("linear",):
                    wh = f"{what} ({loss_kind} loss)"
                    useed = 50_000 + 1000 * k + 10 * r                   # upstream differs by rank

                    # the unfused reference
                    a, wa = shards[r].clone().requires_grad_(), weights[r].clone().requires_grad_()
                    with comm.accounting() as ref_acc:
                        ref = F.linear(comm.all_gather(a, d, group), wa)
                        linear_grads(ref, loss_kind, useed, dtype).backward()
                    # the collective matmul
                    b, wb = shards[r].clone().requires_grad_(), weights[r].clone().requires_grad_()
                    before = b.detach().clone()
                    with comm.accounting() as acc:
                        out = overlap.allgather_matmul(b, wb, group, chunks, dim)
                        n_fwd = len(acc.records)
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

                    # accounting: chunks all-gathers forward, chunks reduce-scatters backward
                    fwd, bwd = acc.records[:n_fwd], acc.records[n_fwd:]
                    expect([x.op for x in fwd] == ["all_gather"] * chunks and all(x.phase == "forward" for x in fwd),
                           f"{wh}: forward records {[(x.op, x.phase) for x in fwd]}")
                    expect([x.op for x in bwd] == ["reduce_scatter"] * chunks
                           and all(x.phase == "backward" for x in bwd),
                           f"{wh}: backward records {[(x.op, x.phase) for x in bwd]}")
                    check_records(acc, ref_acc, P, chunks, dtype, wh)


def check_records(acc, ref_acc, P, chunks, dtype, what):
    """Labels name the chunk, every chunk is the same size, totals equal the unfused version's."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    for phase in ("forward", "backward"):
        mine, ref = acc.select(phase=phase), ref_acc.select(phase=phase)
        expect(len(ref) == 1, f"{what}: unfused {phase} records {len(ref)}")
        expect(all("chunk" in x.label for x in mine), f"{what}: {phase} labels {[x.label for x in mine]}")
        expect(sorted(int(x.label.rsplit(" ", 1)[1]) for x in mine) == list(range(chunks)),
               f"{what}: {phase} labels do not number chunks 0..{chunks - 1}: {[x.label for x in mine]}")
        expect(all(x.group_size == P and x.itemsize == itemsize for x in mine), f"{what}: {phase} group/itemsize")
        expect(len({x.elements for x in mine}) == 1, f"{what}: {phase} chunks of unequal size "
                                                      f"{[x.elements for x in mine]}")
        expect(sum(x.bytes for x in mine) == ref[0].bytes,
               f"{what}: {phase} S {sum(x.bytes for x in mine)} bytes, unfused {ref[0].bytes}")
        expect(mine[0].op == ref[0].op, f"{what}: {phase} op {mine[0].op}, unfused {ref[0].op}")
        expect(math.isclose(acc.sent(phase=phase), ref_acc.sent(phase=phase), rel_tol=1e-12),
               f"{what}: {phase} sent {acc.sent(phase=phase)} bytes, unfused {ref_acc.sent(phase=phase)}")


# ---------------------------------------------------------------------------- reduce-scatter side

def check_matmul_reduce_scatter(P, r, group):
    for k, (shape, dim, h_in, h_out) in enumerate(cases()):
        d = dim % len(shape)
        n = shape[d]                                       # rows per rank of the output
        xshape = with_rows(shape, d, P * n)                # every rank's own full-length input
        for dtype in DTYPES:
            xs = [randn(*xshape, seed=2000 * (k + 1) + j, dtype=dtype) for j in range(P)]
            weights = [randn(h_out, h_in, seed=2000 * (k + 1) + 100 + j, dtype=dtype) for j in range(P)]
            for chunks in divisors(n):
                what = f"matmul_reduce_scatter {dtype} x {xshape} dim={dim} chunks={chunks} W {h_out}x{h_in}"
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
                        out = overlap.matmul_reduce_scatter(e, we, group, chunks, dim)
                        n_fwd = len(acc.records)
                        linear_grads(out, loss_kind, useed, dtype).backward()

                    expect(out.dtype == dtype and out.requires_grad, f"{wh}: output {out.dtype}")
                    expect(tuple(out.shape) == shape[:-1] + (h_out,), f"{wh}: output shape {tuple(out.shape)}")
                    expect(torch.equal(e.detach(), before), f"{wh}: the input was modified")
                    close(out.detach(), ref.detach(), f"{wh}: output vs unfused")
                    close(e.grad, c.grad, f"{wh}: dX vs unfused")
                    close(we.grad, wc.grad, f"{wh}: dW vs unfused")
                    if loss_kind == "linear":
                        # written out: out_r = rows of rank r of Σ_j x_j @ W_j.T;
                        # dX_r = cat_j(up_j) @ W_r; dW_r = cat_j(up_j).T @ x_r
                        total = sum(F.linear(xs[j], weights[j]) for j in range(P))
                        close(out.detach(), total.chunk(P, d)[r], f"{wh}: output vs Σ_j x_j @ W_j.T")
                        ups = torch.cat([randn(*out.shape, seed=70_000 + 1000 * k + 10 * j, dtype=dtype)
                                         for j in range(P)], dim=d)
                        close(e.grad, F.linear(ups, weights[r].T), f"{wh}: dX vs gathered up @ W")
                        dw = ups.reshape(-1, h_out).T @ xs[r].reshape(-1, h_in)
                        close(we.grad, dw, f"{wh}: dW vs gathered up.T @ x (no sum over ranks)")

                    fwd, bwd = acc.records[:n_fwd], acc.records[n_fwd:]
                    expect([x.op for x in fwd] == ["reduce_scatter"] * chunks
                           and all(x.phase == "forward" for x in fwd),
                           f"{wh}: forward records {[(x.op, x.phase) for x in fwd]}")
                    expect([x.op for x in bwd] == ["all_gather"] * chunks and all(x.phase == "backward" for x in bwd),
                           f"{wh}: backward records {[(x.op, x.phase) for x in bwd]}")
                    check_records(acc, ref_acc, P, chunks, dtype, wh)


def check_partial_grads(P, r, group):
    """Only the weight, or only the input, requires a gradient."""
    x, W = randn(4, 6, seed=3000 + r), randn(10, 6, seed=3100 + r)
    xf = randn(4 * P, 6, seed=3200 + r)
    for fn, inp in ((overlap.allgather_matmul, x), (overlap.matmul_reduce_scatter, xf)):
        ref_fn = ((lambda t, w: F.linear(comm.all_gather(t, 0, group), w)) if fn is overlap.allgather_matmul
                  else (lambda t, w: comm.reduce_scatter(F.linear(t, w), 0, group)))
        w1, w2 = W.clone().requires_grad_(), W.clone().requires_grad_()
        fn(inp, w1, group, 2).square().sum().backward()
        ref_fn(inp, w2).square().sum().backward()
        close(w1.grad, w2.grad, f"{fn.__name__}: dW with x not requiring grad")
        x1, x2 = inp.clone().requires_grad_(), inp.clone().requires_grad_()
        fn(x1, W, group, 2).square().sum().backward()
        ref_fn(x2, W).square().sum().backward()
        close(x1.grad, x2.grad, f"{fn.__name__}: dX with W not requiring grad")
        with torch.no_grad():
            y = fn(inp, W, group, 2)
        expect(not y.requires_grad, f"{fn.__name__}: output under no_grad requires grad")
        close(y, ref_fn(inp, W).detach(), f"{fn.__name__}: under no_grad")
    # a numpy integer is a whole number too
    close(overlap.allgather_matmul(x, W, group, np.int64(2)), F.linear(comm.all_gather(x, 0, group), W),
          "allgather_matmul chunks=np.int64(2)")


# ---------------------------------------------------------------------------- timeline

def events_of(ev, kind):
    return [e for e in ev if e[0] == kind]


def by_label(ev):
    out = {}
    for kind, label, start, end in ev:
        expect(label not in out, f"label {label!r} recorded twice: {ev}")
        out[label] = (kind, start, end)
    return out


def well_formed(ev, elapsed, what):
    for e in ev:
        expect(len(e) == 4 and e[0] in ("compute", "comm") and isinstance(e[1], str), f"{what}: event {e}")
        expect(0 <= e[2] <= e[3] <= elapsed, f"{what}: event {e} not within 0..{elapsed}")


def check_timeline(P, r, group):
    x, W = randn(8, 6, seed=4000 + r), randn(10, 6, seed=4100 + r)
    xf = randn(8 * P, 6, seed=4200 + r)
    overlap.allgather_matmul(x, W, group, 2)                      # outside any timeline: nothing to see
    for chunks in (1, 2, 4, 8):
        what = f"timeline allgather_matmul chunks={chunks}"
        leaf = x.clone().requires_grad_()
        t0 = time.perf_counter()
        with overlap.timeline() as ev:
            out = overlap.allgather_matmul(leaf, W, group, chunks)
            n_fwd = len(ev)
        elapsed = time.perf_counter() - t0
        well_formed(ev, elapsed, what)
        fwd = by_label(ev)
        expect(n_fwd == 2 * chunks and len(events_of(ev, "comm")) == chunks
               and len(events_of(ev, "compute")) == chunks, f"{what}: events {ev}")
        expect(set(fwd) == {f"all-gather {i}" for i in range(chunks)} | {f"matmul {i}" for i in range(chunks)},
               f"{what}: labels {sorted(fwd)}")
        for i in range(chunks):
            kind_c, c_start, c_end = fwd[f"all-gather {i}"]
            kind_m, m_start, m_end = fwd[f"matmul {i}"]
            expect(kind_c == "comm" and kind_m == "compute", f"{what}: kinds {kind_c}, {kind_m}")
            expect(c_end <= m_start, f"{what}: matmul {i} started before its all-gather ended")
            if i + 1 < chunks:                                   # the overlap: next transfer already out
                expect(fwd[f"all-gather {i + 1}"][1] <= m_start,
                       f"{what}: all-gather {i + 1} did not start before matmul {i}")
        out.sum().backward()                                      # outside the block: not recorded
        expect(len(ev) == n_fwd, f"{what}: events recorded after the block closed")

        # backward inside a timeline: the reduce-scatter side's events
        leaf = x.clone().requires_grad_()
        out = overlap.allgather_matmul(leaf, W, group, chunks)
        t0 = time.perf_counter()
        with overlap.timeline() as ev:
            out.sum().backward()
        check_scatter_events(ev, chunks, time.perf_counter() - t0, f"{what}, backward")

        what = f"timeline matmul_reduce_scatter chunks={chunks}"
        t0 = time.perf_counter()
        with overlap.timeline() as ev:
            overlap.matmul_reduce_scatter(xf, W, group, chunks)
        check_scatter_events(ev, chunks, time.perf_counter() - t0, what)


def check_scatter_events(ev, chunks, elapsed, what):
    well_formed(ev, elapsed, what)
    got = by_label(ev)
    expect(len(events_of(ev, "comm")) == chunks and len(events_of(ev, "compute")) == chunks, f"{what}: events {ev}")
    expect(set(got) == {f"reduce-scatter {i}" for i in range(chunks)} | {f"matmul {i}" for i in range(chunks)},
           f"{what}: labels {sorted(got)}")
    for i in range(chunks):
        kind_m, m_start, m_end = got[f"matmul {i}"]
        kind_c, c_start, c_end = got[f"reduce-scatter {i}"]
        expect(kind_c == "comm" and kind_m == "compute", f"{what}: kinds {kind_c}, {kind_m}")
        expect(m_end <= c_start, f"{what}: reduce-scatter {i} started before matmul {i} ended")
        if i + 1 < chunks:                                       # the overlap: still in flight meanwhile
            expect(got[f"matmul {i + 1}"][2] <= c_end, f"{what}: reduce-scatter {i} ended before matmul {i + 1}")


# ---------------------------------------------------------------------------- two micro-batches

def check_mlp_microbatches(P, r, group):
    h, ffn = 6, 4 * P                                          # ffn/P = 4 columns per rank
    for k, (xshape, dtype) in enumerate((((8, h), torch.float32), ((8, h), torch.float64),
                                         ((4, 3, h), torch.float32))):
        x = randn(*xshape, seed=5000 + k, dtype=dtype)                  # replicated input
        FC1, FC2 = randn(ffn, h, seed=5100 + k, dtype=dtype), randn(h, ffn, seed=5200 + k, dtype=dtype)
        fc1, fc2 = FC1.chunk(P, 0)[r], FC2.chunk(P, 1)[r]
        with comm.accounting() as ref_acc:
            unfused = comm.all_reduce(F.linear(F.gelu(F.linear(x, fc1)), fc2), group)
        dense = F.linear(F.gelu(F.linear(x, FC1)), FC2)
        for micro in divisors(xshape[0]):
            for ov in (False, True):
                what = f"mlp_microbatches {dtype} x {xshape} micro_batches={micro} overlap={ov}"
                leaf = x.clone().requires_grad_()
                t0 = time.perf_counter()
                with comm.accounting() as acc, overlap.timeline() as ev:
                    out = overlap.mlp_microbatches(leaf, fc1, fc2, group, overlap=ov, micro_batches=micro)
                elapsed = time.perf_counter() - t0
                expect(not out.requires_grad, f"{what}: output requires grad (the function is forward only)")
                close(out, unfused, f"{what}: vs the unfused TP MLP")
                close(out, dense, f"{what}: vs the dense MLP")
                expect([x_.op for x_ in acc.records] == ["all_reduce"] * micro, f"{what}: records {acc.table()}")
                expect(sum(x_.bytes for x_ in acc.records) == ref_acc.records[0].bytes, f"{what}: bytes")
                expect(math.isclose(acc.sent(), ref_acc.sent(), rel_tol=1e-12), f"{what}: sent")
                well_formed(ev, elapsed, what)
                got = by_label(ev)
                expect(set(got) == {f"MLP {i}" for i in range(micro)} | {f"all-reduce {i}" for i in range(micro)}
                       and all(got[f"MLP {i}"][0] == "compute" and got[f"all-reduce {i}"][0] == "comm"
                               for i in range(micro)), f"{what}: events {ev}")
                for i in range(micro):
                    expect(got[f"MLP {i}"][2] <= got[f"all-reduce {i}"][1], f"{what}: all-reduce {i} before MLP {i}")
                    if i + 1 < micro:
                        nxt = got[f"MLP {i + 1}"][1]
                        if ov:        # in flight while the next micro-batch multiplies
                            expect(got[f"all-reduce {i}"][2] >= got[f"MLP {i + 1}"][2],
                                   f"{what}: all-reduce {i} finished before MLP {i + 1}")
                        else:         # one after the other
                            expect(got[f"all-reduce {i}"][2] <= nxt, f"{what}: MLP {i + 1} overlapped")
    raises(lambda: overlap.mlp_microbatches(randn(6, h, seed=1), fc1.float(), fc2.float(), group, True, 4),
           "6 rows do not split into 4 micro-batches", what="mlp_microbatches, 6 rows in 4")


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
        # (a 1-D or 0-D weight, or one that is not a tensor, is tested in tests/test_overlap.py: it
        # fails on weight.shape[1] before the check that would name the rule)
        raises(lambda: fn(inp, W[None], group, 1), name, "(out_features, in_features) matrix", what=f"{name}: 3-D W")
    # chunks that do not divide the rows per rank
    for chunks in (3, 8, 5):
        raises(lambda: overlap.allgather_matmul(x, W, group, chunks), "allgather_matmul", "4 rows per rank",
               f"into {chunks} chunks", what=f"allgather_matmul: 4 rows in {chunks} chunks")
    raises(lambda: overlap.allgather_matmul(x3, W, group, 3, 1), "allgather_matmul", "along dim 1",
           "into 3 chunks", what="allgather_matmul: (b, s, h) with s = 4 in 3 chunks")
    # matmul_reduce_scatter: rows along dim must split into P ranks × chunks
    for rows, chunks in ((4 * P, 3), (4 * P, 8), (P + 1, 1), (4 * P + 2, 2)):
        raises(lambda: overlap.matmul_reduce_scatter(randn(rows, 6, seed=7), W, group, chunks),
               "matmul_reduce_scatter", f"{rows} rows along dim 0", f"{P} ranks × {chunks} chunks",
               what=f"matmul_reduce_scatter: {rows} rows, {chunks} chunks")
    raises(lambda: overlap.matmul_reduce_scatter(randn(2, 3 * P, 6, seed=8), W, group, 2, 1),
           "matmul_reduce_scatter", f"{3 * P} rows along dim 1", f"{P} ranks × 2 chunks",
           what="matmul_reduce_scatter: (b, s, h) with s = 3P in 2 chunks")


def main() -> None:
    with distributed.setup() as d:
        P, r, group = d.world_size, d.rank, d.group
        check_bad_input(P, r, group)        # first: each must raise before any rank communicates
        check_allgather_matmul(P, r, group)
        check_matmul_reduce_scatter(P, r, group)
        check_partial_grads(P, r, group)
        check_timeline(P, r, group)
        check_mlp_microbatches(P, r, group)
        dist.barrier()
        if d.is_main:
            print(f"{MARKER} {P}")


if __name__ == "__main__":
    main()
