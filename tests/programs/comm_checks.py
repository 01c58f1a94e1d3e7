"""Check every intralayer.comm function, forward and backward, on real ranks.

Every rank builds every rank's inputs (small, whole-numbered, different per rank), so it
can compute locally what each collective and each gradient must be. Any mismatch raises
(so the rank, and the launch, fail); when every check passed on every rank, rank 0 prints
``MARKER`` followed by the number of ranks.

``--empty-2d`` runs only one extra case: an all-to-all of 2-D rows in which the last rank
sends no rows at all (its input has shape (0, C)).
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.testing import assert_close

from intralayer import comm, distributed
from intralayer.collectives import ring_all_reduce

MARKER = "COMM CHECKS PASSED on ranks:"
EMPTY_MARKER = "EMPTY 2-D SENDER PASSED on ranks:"
F32 = 4  # bytes per float32 element


def exact(got, want, what):
    assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


def expect(cond, what):
    if not cond:
        raise AssertionError(what)


def data(k: int, shape) -> torch.Tensor:
    """Rank k's input: whole numbers, different on every rank."""
    numel = 1
    for s in shape:
        numel *= s
    return (torch.arange(numel, dtype=torch.float32) + 100 * k + 1).reshape(shape)


def weight(k: int, shape) -> torch.Tensor:
    """Rank k's loss weights: loss_k = (output_k * weight_k).sum()."""
    numel = 1
    for s in shape:
        numel *= s
    return (torch.arange(numel, dtype=torch.float32) % 7 + 10 * k - 3).reshape(shape)


def one_record(acc, op, phase, *, n, elements, sent, label=None, peers=None):
    recs = acc.select(op, phase)
    expect(len(recs) == 1, f"expected one {phase} {op} record, got {acc.records}")
    rec = recs[0]
    expect(rec.group_size == n, f"{op} {phase}: group_size {rec.group_size} != {n}")
    expect(rec.elements == elements, f"{op} {phase}: elements {rec.elements} != {elements}")
    expect(rec.itemsize == F32, f"{op} {phase}: itemsize {rec.itemsize} != {F32}")
    expect(abs(rec.sent - sent) < 1e-9, f"{op} {phase}: sent {rec.sent} != {sent}")
    expect(rec.seconds >= 0, f"{op} {phase}: negative time {rec.seconds}")
    if label is not None:
        expect(rec.label == label, f"{op} {phase}: label {rec.label!r} != {label!r}")
    if peers is not None:
        expect(rec.peers == tuple(peers), f"{op} {phase}: peers {rec.peers} != {tuple(peers)}")
    return rec


def run_grad(fn, x, w):
    """Forward ``fn`` on a leaf copy of x inside accounting, backward of (out*w).sum()."""
    leaf = x.clone().requires_grad_()
    with comm.accounting() as acc:
        out = fn(leaf)
        (out * w).sum().backward()
    return out.detach(), leaf.grad, acc


def check_reductions(n, r):
    shape = (2, 3)
    xs = [data(k, shape) for k in range(n)]
    ws = [weight(k, shape) for k in range(n)]
    S = 6 * F32
    ar = comm.bus_factor("all_reduce", n) * S

    y, g, acc = run_grad(lambda t: comm.all_reduce(t, label="ar"), xs[r], ws[r])
    exact(y, sum(xs), "all_reduce forward")
    exact(g, sum(ws), "all_reduce backward")
    one_record(acc, "all_reduce", "forward", n=n, elements=6, sent=ar, label="ar")
    one_record(acc, "all_reduce", "backward", n=n, elements=6, sent=ar, label="ar")
    expect(len(acc.records) == 2, f"all_reduce: {len(acc.records)} records")

    y, g, acc = run_grad(comm.copy_to_group, xs[r], ws[r])
    exact(y, xs[r], "copy_to_group forward")
    exact(g, sum(ws), "copy_to_group backward")
    expect(acc.count(phase="forward") == 0, "copy_to_group forward must not communicate")
    one_record(acc, "all_reduce", "backward", n=n, elements=6, sent=ar)

    y, g, acc = run_grad(comm.reduce_from_group, xs[r], ws[r])
    exact(y, sum(xs), "reduce_from_group forward")
    exact(g, ws[r], "reduce_from_group backward")
    one_record(acc, "all_reduce", "forward", n=n, elements=6, sent=ar)
    expect(acc.count(phase="backward") == 0, "reduce_from_group backward must not communicate")


def check_gather_scatter(n, r):
    xs = [data(k, (2, 3)) for k in range(n)]
    for dim in (0, 1, -1):
        cat_dim = dim % 2
        out_shape = (2 * n, 3) if cat_dim == 0 else (2, 3 * n)
        ws = [weight(k, out_shape) for k in range(n)]
        y, g, acc = run_grad(lambda t: comm.all_gather(t, dim=dim), xs[r], ws[r])
        exact(y, torch.cat(xs, cat_dim), f"all_gather dim {dim} forward")
        exact(g, sum(ws).chunk(n, cat_dim)[r], f"all_gather dim {dim} backward")
        S = 6 * n
        one_record(acc, "all_gather", "forward", n=n, elements=S, sent=(n - 1) * 6 * F32)
        one_record(acc, "reduce_scatter", "backward", n=n, elements=S,
                   sent=comm.bus_factor("reduce_scatter", n) * S * F32)
        expect(len(acc.records) == 2, f"all_gather dim {dim}: {len(acc.records)} records")

    for dim in (0, 1):
        in_shape = (2 * n, 3) if dim == 0 else (2, 3 * n)
        xs2 = [data(k, in_shape) for k in range(n)]
        out_shape = (2, 3)
        ws = [weight(k, out_shape) for k in range(n)]
        y, g, acc = run_grad(lambda t: comm.reduce_scatter(t, dim=dim), xs2[r], ws[r])
        exact(y, sum(xs2).chunk(n, dim)[r], f"reduce_scatter dim {dim} forward")
        exact(g, torch.cat(ws, dim), f"reduce_scatter dim {dim} backward")
        S = 6 * n
        one_record(acc, "reduce_scatter", "forward", n=n, elements=S,
                   sent=comm.bus_factor("reduce_scatter", n) * S * F32)
        one_record(acc, "all_gather", "backward", n=n, elements=S, sent=(n - 1) * 6 * F32)

    # split: x is replicated; rank r keeps chunk r and its loss uses only that chunk, so
    # the gradient of the shared x is every rank's chunk gradient, concatenated.
    shared = data(7, (2, 3 * n))
    ws = [weight(k, (2, 3)) for k in range(n)]
    y, g, acc = run_grad(lambda t: comm.split(t, dim=1), shared, ws[r])
    exact(y, shared.chunk(n, 1)[r], "split forward")
    exact(g, torch.cat(ws, 1), "split backward")
    expect(acc.count(phase="forward") == 0, "split forward must not communicate")
    one_record(acc, "all_gather", "backward", n=n, elements=6 * n, sent=(n - 1) * 6 * F32)

    for bad in (lambda: comm.reduce_scatter(data(r, (2 * n + 1, 3))),
                lambda: comm.split(data(r, (2 * n + 1, 3))),
                lambda: comm.all_gather(data(r, (2, 3)), dim=2)):
        try:
            bad()
        except ValueError:
            pass
        else:
            raise AssertionError("an invalid shape or dim did not raise ValueError")


def a2a_expect(xs, counts, ws, r, n):
    """What rank r receives, and the gradient of its input given every rank's weights."""
    sends = [list(xs[k].split(counts[k])) for k in range(n)]
    got = torch.cat([sends[k][r] for k in range(n)])
    pieces = []
    for j in range(n):                      # rows r sent to j come back weighted by ws[j]
        off = sum(counts[k][j] for k in range(r))
        pieces.append(ws[j][off: off + counts[r][j]])
    return got, torch.cat(pieces)


def check_a2a_case(n, r, counts, cols, what, explicit_out=False):
    row_elems = 1 if cols is None else cols
    row = row_elems * F32

    def shaped(k, rows):
        return data(k, (rows,) if cols is None else (rows, cols))

    xs = [shaped(k, sum(counts[k])) for k in range(n)]
    recv = [sum(counts[k][j] for k in range(n)) for j in range(n)]
    ws = [weight(j, (recv[j],) if cols is None else (recv[j], cols)) for j in range(n)]
    want_y, want_g = a2a_expect(xs, counts, ws, r, n)
    out_splits = [counts[k][r] for k in range(n)]
    y, g, acc = run_grad(lambda t: comm.all_to_all(
        t, in_splits=counts[r], out_splits=out_splits if explicit_out else None, label="a2a"),
        xs[r], ws[r])
    exact(y, want_y, f"{what} forward")
    exact(g, want_g, f"{what} backward")
    fwd = [rec for rec in acc.select("all_to_all", "forward") if rec.label == "a2a"]
    expect(len(fwd) == 1, f"{what}: {len(fwd)} forward a2a records")
    peers = [0 if j == r else counts[r][j] * row for j in range(n)]
    expect(fwd[0].peers == tuple(peers), f"{what} forward peers {fwd[0].peers} != {peers}")
    expect(fwd[0].sent == sum(peers), f"{what} forward sent {fwd[0].sent} != {sum(peers)}")
    expect(fwd[0].elements == sum(counts[r]) * row_elems, f"{what} forward elements")
    back_peers = [0 if j == r else out_splits[j] * row for j in range(n)]
    one_record(acc, "all_to_all", "backward", n=n, elements=recv[r] * row_elems,
               sent=sum(back_peers), peers=back_peers, label="a2a")
    counted = [rec for rec in acc.select("all_to_all", "forward") if rec.label == "counts"]
    expect(len(counted) == (0 if explicit_out else 1), f"{what}: {len(counted)} count exchanges")
    if counted:
        expect(counted[0].itemsize == 8 and counted[0].elements == n, f"{what}: count exchange record")


def check_all_to_all(n, r):
    # Uneven, with a zero count: rank k sends nothing to rank (k+1) mod n; every rank
    # sends and receives some rows (2-D rows of 3 columns).
    counts = [[0 if j == (k + 1) % n else (k + 2 * j) % 3 + 1 for j in range(n)] for k in range(n)]
    check_a2a_case(n, r, counts, 3, "all_to_all uneven 2-D")
    check_a2a_case(n, r, counts, 3, "all_to_all uneven 2-D explicit out_splits", explicit_out=True)
    # 1-D, and the last rank sends nothing at all.
    counts = [[0] * n if k == n - 1 else [(k + j) % 2 + 1 for j in range(n)] for k in range(n)]
    check_a2a_case(n, r, counts, None, "all_to_all 1-D, last rank sends nothing")
    # Even split when no splits are given.
    xs = [data(k, (2 * n, 2)) for k in range(n)]
    y = comm.all_to_all(xs[r])
    exact(y, torch.cat([xs[k].chunk(n)[r] for k in range(n)]), "all_to_all even")


def check_empty_2d(n, r):
    counts = [[0] * n if k == n - 1 else [1] * n for k in range(n)]
    check_a2a_case(n, r, counts, 3, "all_to_all 2-D, last rank sends nothing")


def check_p2p(n, r):
    xs = [data(k, (2, 3)) for k in range(n)]
    ws = [weight(k, (2, 3)) for k in range(n)]
    for shift in (1, -1):
        y, g, acc = run_grad(lambda t: comm.ring_shift(t, shift), xs[r], ws[r])
        exact(y, xs[(r - shift) % n], f"ring_shift {shift} forward")
        exact(g, ws[(r + shift) % n], f"ring_shift {shift} backward")
        fwd = one_record(acc, "send", "forward", n=n, elements=6, sent=6 * F32)
        expect(fwd.peers == tuple(6 * F32 if j == (r + shift) % n else 0 for j in range(n)),
               f"ring_shift {shift} forward peers {fwd.peers}")
        back = one_record(acc, "send", "backward", n=n, elements=6, sent=6 * F32)
        expect(back.peers == tuple(6 * F32 if j == (r - shift) % n else 0 for j in range(n)),
               f"ring_shift {shift} backward peers {back.peers}")

    # sendrecv of a different shape on every rank: rank k sends (k+1, 2) to k+1.
    mine = data(r, (r + 1, 2))
    prev = (r - 1) % n
    with comm.accounting() as acc:
        got = comm.sendrecv(mine, (r + 1) % n, prev, recv_shape=(prev + 1, 2), label="sr")
    exact(got, data(prev, (prev + 1, 2)), "sendrecv")
    rec = one_record(acc, "send", "forward", n=n, elements=2 * (r + 1), sent=2 * (r + 1) * F32, label="sr")
    expect(rec.peers == tuple(2 * (r + 1) * F32 if j == (r + 1) % n else 0 for j in range(n)),
           f"sendrecv peers {rec.peers}")
    # The asynchronous starts: a ring exchange of two tensors is one send record of both (7 elements).
    a, b = data(r, (3,)), data(r + n, (2, 2))
    with comm.accounting() as acc:
        got_a, got_b = comm.ring_exchange_start([a, b], 1, label="ring").wait()
        gathered, = comm.all_gather_start(data(r, (2, 3)), 0, label="ag").wait()
        summed, = comm.all_reduce_start(data(r, (5,)), label="ar").wait()
    exact(got_a, data(prev, (3,)), "ring_exchange_start")
    exact(got_b, data(prev + n, (2, 2)), "ring_exchange_start (second tensor)")
    exact(gathered, torch.cat([data(k, (2, 3)) for k in range(n)]), "all_gather_start")
    exact(summed, sum(data(k, (5,)) for k in range(n)), "all_reduce_start")
    rec = one_record(acc, "send", "forward", n=n, elements=7, sent=7 * F32, label="ring")
    expect(rec.peers == tuple(7 * F32 if j == (r + 1) % n else 0 for j in range(n)), f"ring_exchange peers {rec.peers}")
    one_record(acc, "all_gather", "forward", n=n, elements=6 * n, sent=(n - 1) * 6 * F32, label="ag")
    one_record(acc, "all_reduce", "forward", n=n, elements=5, sent=2 * (n - 1) / n * 5 * F32, label="ar")
    try:
        comm.sendrecv(mine, n, 0)
    except ValueError:
        pass
    else:
        raise AssertionError("sendrecv to a rank outside the group did not raise ValueError")


def check_ring_all_reduce(n, r):
    for shape in ((7,), (3, 5), (2 * n, 3)):
        xs = [data(k, shape) for k in range(n)]
        with comm.accounting() as acc:
            got = ring_all_reduce(xs[r])
        exact(got, sum(xs), f"ring_all_reduce {shape}")
        exact(xs[r], data(r, shape), f"ring_all_reduce {shape} modified its input")
        N = xs[r].numel()
        sizes = [len(c) for c in torch.arange(N).tensor_split(n)]
        expect(acc.count() == 2 * (n - 1) and acc.count("send") == 2 * (n - 1),
               f"ring_all_reduce {shape}: {acc.count()} records, want {2 * (n - 1)} sends")
        # Reduce-scatter sends every chunk but r, all-gather every chunk but r+1.
        want = (2 * N - sizes[r] - sizes[(r + 1) % n]) * F32
        expect(acc.sent() == want, f"ring_all_reduce {shape}: sent {acc.sent()} != {want}")
        total = torch.tensor([acc.sent()], dtype=torch.float64)
        dist.all_reduce(total)
        mean = total.item() / n
        bus = comm.bus_factor("all_reduce", n) * N * F32
        expect(abs(mean - bus) < 1e-9, f"ring_all_reduce {shape}: mean sent {mean} != bus {bus}")


@record
def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--empty-2d", action="store_true")
    a = p.parse_args(argv)
    with distributed.setup() as d:
        n, r = d.world_size, d.rank
        if a.empty_2d:
            check_empty_2d(n, r)
            marker = EMPTY_MARKER
        else:
            check_reductions(n, r)
            check_gather_scatter(n, r)
            check_all_to_all(n, r)
            check_p2p(n, r)
            check_ring_all_reduce(n, r)
            marker = MARKER
        dist.barrier()
        if d.is_main:
            print(f"{marker} {n}")


if __name__ == "__main__":
    main()
