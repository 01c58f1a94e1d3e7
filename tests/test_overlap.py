"""Tests of intralayer.overlap (chapter 07).

(a) On 2 and 4 ranks (tests/programs/overlap_checks.py): every schedule of
    allgather_matmul and matmul_reduce_scatter against the unfused collectives and against
    sums written out from every rank's tensors, forward and backward, float32 and float64,
    2-D to 4-D inputs, every chunk count; the messages each schedule sends; the schedule
    read back from torch.profiler traces; mlp_microbatches forward and backward against
    the dense MLP; bad input.
(b) The ring's plan (ring_reach, ring_order): every shard reaches every rank exactly once.
(c) The same ops on a one-rank group in this process; trace_timeline and merge_traces on
    a real profiler trace and on hand-made ones.
(d) model_times against its formulas written out here, the closed form of what the ring
    saves, and its errors.
(e) Validation that must run before any communication, without a process group.
"""
from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function
from torch.testing import assert_close

from intralayer import comm, overlap
from intralayer.collectives import LINKS, collective_time

ROOT = Path(__file__).resolve().parents[1]
from tests.programs import overlap_checks
from tests.programs.checks import rounding_tol
ENV = {"PYTHONPATH": str(ROOT)}


# ------------------------------------------------------------------ (a) on real ranks

@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.parametrize("check", overlap_checks.CHECKS, ids=lambda c: c.__name__)
def test_collective_matmuls_match_unfused_on_real_ranks(on_ranks, nproc, check):
    on_ranks(overlap_checks, check, nproc, env=ENV, timeout=300)


# ------------------------------------------------------------------ (b) the ring's plan

@pytest.mark.parametrize("t", range(1, 10))
@pytest.mark.parametrize("bidirectional", [False, True])
def test_every_rank_multiplies_every_shard_once(t, bidirectional):
    forward, backward = overlap.ring_reach(t, bidirectional)
    assert forward + backward == t - 1 and forward >= backward >= 0
    for r in range(t):
        order = overlap.ring_order(t, r, bidirectional)
        assert len(order) == forward + 1 and order[0] == [r]
        assert sorted(sum(order, [])) == list(range(t))
        for s, shards in enumerate(order[1:], start=1):
            assert shards[0] == (r - s) % t                      # from r−1: rank r−s's shard
            assert shards[1:] == ([(r + s) % t] if s <= backward else [])


@pytest.mark.parametrize("t, steps", [(2, 1), (3, 1), (4, 2), (5, 2), (8, 4), (9, 4)])
def test_both_ways_the_ring_takes_half_the_steps(t, steps):
    assert overlap.ring_reach(t, True)[0] == steps == t // 2
    assert overlap.ring_reach(t, False) == (t - 1, 0)


def test_ring_order_is_the_chapters_example():
    assert overlap.ring_order(4, 0) == [[0], [3], [2], [1]]
    assert overlap.ring_order(4, 1, bidirectional=True) == [[1], [0, 2], [3]]


@pytest.mark.parametrize("args, words", [((0, False), "t ≥ 1, got 0"), ((2.0, True), "got 2.0"),
                                         ((True, False), "got True")])
def test_ring_reach_rejects_bad_sizes(args, words):
    with pytest.raises(ValueError, match=words):
        overlap.ring_reach(*args)


@pytest.mark.parametrize("r", [-1, 4, 1.0])
def test_ring_order_rejects_a_rank_outside_the_ring(r):
    with pytest.raises(ValueError, match=r"rank r=.* must be one of 0\.\.3"):
        overlap.ring_order(4, r)


# ------------------------------------------------------------------ (c) one rank, this process

@pytest.fixture
def solo_group(tmp_path, monkeypatch):
    """A one-rank gloo group in this process (no launch needed)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield None
    finally:
        dist.destroy_process_group()


def randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("schedule", overlap.SCHEDULES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape, dim", [((6, 5), 0), ((3, 2, 5), 0), ((2, 3, 5), 1), ((2, 2, 3, 5), -2)])
def test_one_rank_is_a_plain_linear(solo_group, shape, dim, dtype, schedule):
    """With t = 1 every schedule is F.linear, in pieces or not, forward and backward; nothing is sent."""
    W = randn(7, 5, seed=1, dtype=dtype)
    up = randn(*shape[:-1], 7, seed=2, dtype=dtype)
    rows = shape[dim]
    x0 = randn(*shape, seed=0, dtype=dtype).requires_grad_()
    w0 = W.clone().requires_grad_()
    F.linear(x0, w0).backward(up)
    # float64: γ_n of float64 with n = 36 ≥ twice (both sides round) the longest chain, dW's
    # ≤ 12 rows summed plus ≤ 6 pieces' partial sums added, and atol for the largest Σ|terms|
    # (|x|·|W|ᵀ, |up|·|W|, |up|ᵀ·|x|); its defaults (1e-7) would pass float32 arithmetic too.
    # float32: assert_close's defaults (tests/programs/checks.FLOAT32_REORDERED; ≤ 18 terms).
    X, U = x0.detach().abs().reshape(-1, 5), up.abs().reshape(-1, 7)
    tol_y, tol_dx, tol_dw = ((rounding_tol(torch.float64, 36, float(mag.max())) if dtype == torch.float64 else {})
                             for mag in (X @ W.abs().T, U @ W.abs(), U.T @ X))
    for fn in (overlap.allgather_matmul, overlap.matmul_reduce_scatter):
        for chunks in (c for c in range(1, rows + 1) if rows % c == 0):
            x = x0.detach().clone().requires_grad_()
            w = W.clone().requires_grad_()
            with comm.accounting() as acc:
                y = fn(x, w, None, chunks, dim, schedule)
                y.backward(up)
            assert y.dtype == dtype and y.shape == (*shape[:-1], 7)
            assert_close(y.detach(), F.linear(x0, w0).detach(), **tol_y)
            assert_close(x.grad, x0.grad, **tol_dx)
            assert_close(w.grad, w0.grad, **tol_dw)
            assert acc.sent() == 0.0
            if schedule in ("ring", "bidirectional"):      # a ring of one: nothing to pass on
                assert acc.records == []
            else:                                          # one collective of one per chunk, each way
                assert len(acc.records) == 2 * chunks and all("chunk" in r.label for r in acc.records)


def test_mlp_microbatches_on_one_rank_is_the_dense_mlp(solo_group):
    x0, fc1, fc2, up = randn(8, 6, seed=0), randn(16, 6, seed=1), randn(6, 16, seed=2), randn(8, 6, seed=3)
    leaves = [t.clone().requires_grad_() for t in (x0, fc1, fc2)]
    F.linear(F.gelu(F.linear(leaves[0], leaves[1])), leaves[2]).backward(up)
    for ov in (False, True):
        for micro in (1, 2, 4, 8):
            mine = [t.clone().requires_grad_() for t in (x0, fc1, fc2)]
            with comm.accounting() as acc:
                y = overlap.mlp_microbatches(*mine, None, ov, micro)
                y.backward(up)
            assert_close(y.detach(), F.linear(F.gelu(F.linear(x0, fc1)), fc2))
            for got, want in zip(mine, leaves):
                assert_close(got.grad, want.grad)
            assert [(r.op, r.phase) for r in acc.records] == [("all_reduce", "forward")] * micro + \
                [("all_reduce", "backward")] * micro


def _profiled_run(fn, name="run: test"):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function(name):
            fn()
    return prof


def test_a_real_trace_reads_back_as_the_schedule(solo_group, tmp_path):
    x, W = randn(4, 3, seed=3), randn(5, 3, seed=4)
    prof = _profiled_run(lambda: overlap.allgather_matmul(x, W, None, 2, 0, "chunked"))
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    tl = overlap.trace_timeline(path, "run: test")
    names = [(k, n) for k, n, _, _ in tl if k in ("compute", "wait")]
    assert names == [("wait", "wait: ag-matmul chunk 0"), ("compute", "compute: ag-matmul chunk 0"),
                     ("wait", "wait: ag-matmul chunk 1"), ("compute", "compute: ag-matmul chunk 1")]
    assert sum(k == "post" for k, *_ in tl) == 2 and sum(k == "comm" for k, *_ in tl) == 2   # gloo's own
    for kind, name, start, end in tl:
        assert 0 <= start <= end
    merged = overlap.merge_traces([path])
    assert merged["traceEvents"][0]["args"]["name"] == "rank 0"
    assert {e["pid"] for e in merged["traceEvents"]} == {0}
    ranges_ = [e for e in merged["traceEvents"] if e["ph"] == "X"]
    assert all(e["name"].startswith(overlap.KEPT_PREFIXES) for e in ranges_)
    assert min(e["ts"] for e in ranges_) == 0
    again = overlap.trace_timeline(merged, "run: test", pid=0)
    assert [e[:2] for e in again] == [e[:2] for e in tl]
    assert all(math.isclose(a[3] - a[2], b[3] - b[2], abs_tol=2e-9) for a, b in zip(again, tl))
    assert len(json.dumps(merged)) < len(path.read_text())


def _event(name, ts, dur, pid=7, tid=1):
    return dict(ph="X", name=name, ts=ts, dur=dur, pid=pid, tid=tid, cat="user_annotation", args={"big": "x" * 50})


def test_merge_traces_puts_each_rank_under_its_number_and_shifts_time():
    rank0 = dict(traceEvents=[_event("run: a", 1000, 50), _event("compute: m", 1010, 20), _event("aten::mm", 1011, 5),
                              _event("gloo:send", 1005, 30), dict(ph="M", name="thread_name", pid=7, tid=1)])
    rank1 = dict(traceEvents=[_event("run: a", 990, 70, pid=9), _event("wait: w", 1000, 3, pid=9)])
    merged = overlap.merge_traces([rank0, rank1])
    meta, events = merged["traceEvents"][:3], merged["traceEvents"][3:]
    assert [m["args"]["name"] for m in meta] == ["rank 0", "rank 1", "gloo:send (posted → waited for)"]
    assert [e["tid"] for e in events if e["name"] == "gloo:send"] == [meta[2]["tid"]] != [1]   # a track of its own
    assert sorted((e["pid"], e["name"], e["ts"], e["dur"]) for e in events) == [
        (0, "compute: m", 20, 20), (0, "gloo:send", 15, 30), (0, "run: a", 10, 50),
        (1, "run: a", 0, 70), (1, "wait: w", 10, 3)]
    assert all("args" not in e for e in events)
    tl = overlap.trace_timeline(merged, "run: a", pid=0)
    assert tl == [("comm", "gloo:send", 5e-6, 35e-6), ("compute", "compute: m", 10e-6, 30e-6)]


def test_trace_timeline_keeps_only_what_starts_inside_the_run():
    gemm = dict(_event("sm90_gemm", 104, 3), cat="kernel")
    trace = dict(traceEvents=[_event("run: a", 100, 10), _event("compute: in", 105, 20),
                              _event("compute: before", 90, 5), _event("wait: after", 111, 1),
                              dict(_event("ncclDevKernel_SendRecv", 101, 2), cat="kernel"),
                              _event("c10d::send", 102, 1), _event("aten::mm", 103, 1), gemm])
    assert overlap.trace_timeline(trace, "run: a") == [
        ("comm", "ncclDevKernel_SendRecv", 1e-6, 3e-6), ("post", "c10d::send", 2e-6, 3e-6),
        ("kernel", "sm90_gemm", 4e-6, 7e-6), ("compute", "compute: in", 5e-6, 25e-6)]
    merged = overlap.merge_traces([trace])
    assert sorted(e["name"] for e in merged["traceEvents"] if e["ph"] == "X") == [
        "c10d::send", "compute: before", "compute: in", "ncclDevKernel_SendRecv", "run: a", "sm90_gemm", "wait: after"]


def test_merge_traces_keeps_only_the_runs_asked_for():
    """Several traced runs of each schedule; the chapter keeps one of each (its median run)."""
    rank0 = dict(traceEvents=[_event("run: a #0", 100, 10), _event("compute: x", 102, 3), _event("run: a #1", 200, 10),
                              _event("wait: y", 203, 2), _event("gloo:send", 204, 1, tid=2)])
    rank1 = dict(traceEvents=[_event("run: a #0", 100, 12, pid=3), _event("compute: x", 101, 3, pid=3),
                              _event("run: a #1", 205, 10, pid=3), _event("compute: z", 206, 1, pid=3)])
    merged = overlap.merge_traces([rank0, rank1], runs={"run: a #1"})
    kept = sorted((e["pid"], e["name"]) for e in merged["traceEvents"] if e["ph"] == "X")
    assert kept == [(0, "gloo:send"), (0, "run: a #1"), (0, "wait: y"), (1, "compute: z"), (1, "run: a #1")]
    assert min(e["ts"] for e in merged["traceEvents"] if e["ph"] == "X") == 0.0
    assert overlap.trace_timeline(merged, "run: a #1", pid=0)[0][:2] == ("wait", "wait: y")
    assert len([e for e in overlap.merge_traces([rank0, rank1])["traceEvents"] if e["ph"] == "X"]) == 9


def test_trace_timeline_and_merge_name_what_is_missing():
    one = dict(traceEvents=[_event("run: a", 0, 1), _event("run: a", 5, 1)])
    with pytest.raises(ValueError, match="2 ranges named 'run: a'; expected exactly one"):
        overlap.trace_timeline(one, "run: a")
    with pytest.raises(ValueError, match="0 ranges named 'run: b' in process 3"):
        overlap.trace_timeline(one, "run: b", pid=3)
    with pytest.raises(ValueError, match="at least one trace"):
        overlap.merge_traces([])
    with pytest.raises(ValueError, match="none of the traces"):
        overlap.merge_traces([dict(traceEvents=[_event("aten::mm", 0, 1)])])


# ------------------------------------------------------------------ (d) the cost model

def written_out(t, h, tokens, chunks, B, flops, alpha=overlap.ALPHA, overhead=5e-6, itemsize=2, phi=0.0, separate=False):
    """model_times' docstring, term by term (α: NCCL's Simple ring step over NVLink, 3.4 µs)."""
    S = tokens * h * itemsize
    matmul = 2 * tokens * h * (4 * h / t) / flops
    gather = (t - 1) * alpha + (t - 1) / t * S / B                       # chapter 00's ring all-gather
    step = lambda send, mul: max(send, mul + phi * send)                   # noqa: E731
    piece_send = (t - 1) * alpha + (t - 1) / t * S / chunks / B
    piece_mul = matmul / chunks + overhead
    chunked = piece_send + sum(step(piece_send, piece_mul) for _ in range(chunks - 1)) + piece_mul
    hop, shard = alpha + S / t / B, matmul / t + overhead
    ring = sum(step(hop, shard) for _ in range(t - 1)) + shard
    fwd, bwd = (t // 2, (t - 1) // 2)
    bi = 0.0
    for s in range(fwd + 1):
        work = shard if s == 0 else (2 if s <= bwd else 1) * shard
        sent = (2 if s < bwd and not separate else 1) * S / t / B
        bi += step(alpha + sent, work) if s < fwd else work
    return dict(sequential=gather + matmul + overhead, sequential_chunked=chunks * (piece_send + piece_mul),
                chunked=chunked, ring=ring, bidirectional=bi, compute=matmul + overhead, comm=gather)


GRID = [
    (8, 12288, 2048, 8, 450e9, 494.5e12),             # GPT-3 fc1 over NVLink: compute-bound shards
    (8, 12288, 2048, 8, 50e9, 494.5e12),              # over a slow link: communication-bound
    (2, 64, 128, 4, 1e9, 1e9, 0.0, 0.0, 4),            # no latency, no overhead, float32
    (4, 1024, 4096, 16, 25e9, 1e14, 1e-5, 2e-6, 2),
    (16, 4096, 2048, 64, 900e9, 1e15),
    (3, 7, 3 * 5 * 2, 5, 1e6, 1e6, 1e-3, 1e-3, 8),      # odd sizes
    (5, 4096, 2000, 4, 50e9, 5e14),                    # odd t: both ways go equally far
    (8, 12288, 2048, 1, 450e9, 494.5e12),             # one chunk
    (1, 4096, 2048, 4, 450e9, 494.5e12),              # one rank: nothing to send
]


@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize("phi", [0.0, 20 / 132, 0.5])
@pytest.mark.parametrize("args", GRID)
def test_model_times_is_its_formula(args, phi, separate):
    want = written_out(*args, phi=phi, separate=separate)
    got = overlap.model_times(*args, sm_fraction=phi, separate_directions=separate)
    assert set(got) == set(want)
    for key in want:
        assert math.isclose(got[key], want[key], rel_tol=1e-12, abs_tol=1e-18), key
    t, h, tokens, chunks, B, flops, *rest = args
    alpha, overhead, itemsize = (rest + [overlap.ALPHA, 5e-6, 2][len(rest):])[:3]
    assert got["comm"] == collective_time("all_gather", t, tokens * h * itemsize, B, alpha)   # chapter 00's model


@pytest.mark.parametrize("phi", [0.0, 20 / 132, 0.9])
@pytest.mark.parametrize("args", GRID)
def test_what_the_ring_saves_is_its_closed_form(args, phi):
    """sequential − ring = (t−1)·(min(τ_mul, (1−φ)·τ_send) − τ_launch), the chapter's rule for when overlap pays."""
    t, h, tokens, chunks, B, flops, *rest = args
    alpha, overhead, itemsize = (rest + [overlap.ALPHA, 5e-6, 2][len(rest):])[:3]
    times = overlap.model_times(*args, sm_fraction=phi)
    hop = alpha + tokens * h * itemsize / t / B
    shard = 2 * tokens * h * (4 * h / t) / flops / t + overhead
    saved = overlap.ring_saving(t, hop, shard, overhead, phi)
    assert math.isclose(times["sequential"] - times["ring"], saved, rel_tol=1e-9, abs_tol=1e-15)


def test_the_ring_exposes_no_transfer_when_each_shard_covers_one():
    """Compute-bound shards, no contention: the ring is the compute plus t−1 extra kernel
    launches, nothing of the communication; the chunked all-gather still exposes its first piece."""
    times = overlap.model_times(8, 12288, 2048, 4, 450e9, 494.5e12, sm_fraction=0.0)
    assert math.isclose(times["ring"], times["compute"] + 7 * 5e-6, rel_tol=1e-12)
    first = collective_time("all_gather", 8, 2048 * 12288 * 2 / 4, 450e9, overlap.ALPHA)
    assert math.isclose(times["chunked"], first + 4 * (times["compute"] - 5e-6) / 4 + 4 * 5e-6, rel_tol=1e-12)
    assert times["ring"] < times["chunked"] < times["sequential"] < times["sequential_chunked"]


def test_the_default_latency_is_nccls_simple_ring_step_over_nvlink():
    """α defaults to NCCL's own figure (tuning.cc at 5067397c, kept in intralayer.collectives), not a round guess."""
    from intralayer.collectives import NCCL_RING_NVLINK_STEP_US
    assert overlap.ALPHA == NCCL_RING_NVLINK_STEP_US["Simple"] * 1e-6 == pytest.approx(3.4e-6)
    assert inspect.signature(overlap.model_times).parameters["alpha"].default == overlap.ALPHA


def test_contention_costs_a_share_of_every_hidden_transfer():
    base = dict(t=8, h=12288, tokens=2048, chunks=4, bandwidth=450e9, flops=494.5e12)
    free, taken = overlap.model_times(**base), overlap.model_times(**base, sm_fraction=0.25)
    hop = overlap.ALPHA + 2048 * 12288 * 2 / 8 / 450e9
    assert math.isclose(taken["ring"] - free["ring"], 7 * 0.25 * hop, rel_tol=1e-9)
    assert taken["sequential"] == free["sequential"]        # nothing runs beside a lone collective


def test_both_ways_the_ring_saves_latency_not_bandwidth():
    """Through one GPU's bandwidth the bidirectional ring moves the same bytes: with α = 0 and
    communication-bound steps it takes as long as the ring (up to the last multiply); it saves
    (t−1) − ⌊t/2⌋ latencies."""
    slow = dict(t=8, h=12288, tokens=2048, chunks=1, bandwidth=5e9, flops=494.5e12, overhead=0.0)
    no_alpha = overlap.model_times(**slow, alpha=0.0)
    shard = no_alpha["compute"] / 8
    assert math.isclose(no_alpha["bidirectional"] - shard, no_alpha["ring"] - shard, rel_tol=1e-9)
    lat = overlap.model_times(**slow, alpha=1e-3)
    assert math.isclose(lat["ring"] - lat["bidirectional"], (7 - 4) * 1e-3, rel_tol=1e-9)


def test_with_a_link_each_way_the_bidirectional_ring_halves_the_bytes_waited_for():
    """Wang et al.'s setting (a TPU torus: a link to each neighbour): communication-bound, α = 0,
    t = 8 both ways waits for 4 shard transfers (the last step sends one) instead of 7."""
    slow = dict(t=8, h=12288, tokens=2048, chunks=1, bandwidth=5e9, flops=494.5e12, overhead=0.0, alpha=0.0)
    shared, own = overlap.model_times(**slow), overlap.model_times(**slow, separate_directions=True)
    hop, shard = 2048 * 12288 * 2 / 8 / 5e9, shared["compute"] / 8
    assert math.isclose(shared["bidirectional"] - shard, 7 * hop, rel_tol=1e-9)
    assert math.isclose(own["bidirectional"] - shard, 4 * hop, rel_tol=1e-9)
    assert own["ring"] == shared["ring"] and own["sequential"] == shared["sequential"]   # one way: nothing changes


@pytest.mark.parametrize("t, hop, shard, o, phi, words", [
    (0, 1, 1, 0, 0, "t ≥ 1"), (2, -1, 1, 0, 0, "times ≥ 0"), (2, 1, 1, 0, 1.0, "sm_fraction < 1")])
def test_ring_saving_rejects_bad_arguments(t, hop, shard, o, phi, words):
    with pytest.raises(ValueError, match=words):
        overlap.ring_saving(t, hop, shard, o, phi)


def test_model_times_reproduces_the_chapter():
    """The numbers chapter 07 prints for GPT-3's fc1 (t = 8, 2048 tokens, 4 chunks, 989 TFLOP/s at 50 %),
    with NCCL's Simple ring step: 3.4 µs over NVLink, 14 µs over the network."""
    nv = overlap.model_times(8, 12288, 2048, 4, LINKS["NVLink 4 (H100 SXM)"].bandwidth, 989e12 * 0.5)
    ib = overlap.model_times(8, 12288, 2048, 4, LINKS["InfiniBand NDR (1 NIC)"].bandwidth, 989e12 * 0.5, alpha=14e-6)
    assert nv["sequential"] == pytest.approx(752e-6, abs=0.6e-6) and nv["ring"] == pytest.approx(665e-6, abs=0.6e-6)
    assert ib["sequential"] == pytest.approx(1609e-6, abs=0.6e-6) and ib["ring"] == pytest.approx(1062e-6, abs=0.6e-6)


@pytest.mark.parametrize("kwargs, words", [
    (dict(t=0), "t must be a whole number ≥ 1, got 0"),
    (dict(t=2.0), "t must be a whole number ≥ 1, got 2.0"),
    (dict(t=True), "t must be a whole number ≥ 1, got True"),
    (dict(h=64.5), "h must be a whole number ≥ 1"),
    (dict(tokens="128"), "tokens must be a whole number ≥ 1, got '128'"),
    (dict(chunks=0), "chunks must be a whole number ≥ 1, got 0"),
    (dict(chunks=None), "chunks must be a whole number ≥ 1, got None"),
    (dict(chunks=3), "128 tokens do not split into t=4 ranks × 3 chunks"),
    (dict(t=3), "128 tokens do not split into t=3 ranks × 2 chunks"),
    (dict(bandwidth=0), "bandwidth and FLOP rate must be > 0"),
    (dict(bandwidth=float("nan")), "bandwidth and FLOP rate must be > 0"),
    (dict(flops=-1e12), "bandwidth and FLOP rate must be > 0"),
    (dict(alpha=-1e-3), "latency α=-0.001 and per-kernel overhead"),
    (dict(overhead=float("nan")), "per-kernel overhead nan must be ≥ 0"),
    (dict(itemsize=0), "itemsize must be a whole number of bytes ≥ 1, got 0"),
    (dict(itemsize=True), "itemsize must be a whole number of bytes ≥ 1, got True"),
    (dict(sm_fraction=1.0), "sm_fraction=1.0 must be in [0, 1)"),
    (dict(sm_fraction=-0.1), "sm_fraction=-0.1 must be in [0, 1)"),
    (dict(sm_fraction=float("nan")), "sm_fraction=nan must be in [0, 1)"),
])
def test_model_times_rejects_bad_arguments(kwargs, words):
    args = dict(t=4, h=64, tokens=128, chunks=2, bandwidth=1e9, flops=1e12) | kwargs
    with pytest.raises(ValueError) as info:
        overlap.model_times(**args)
    assert words in str(info.value)


# ------------------------------------------------------------------ (e) validation, no process group

@pytest.mark.parametrize("fn", [overlap.allgather_matmul, overlap.matmul_reduce_scatter])
def test_bad_input_is_rejected_before_the_group_is_used(fn):
    """These all fail in the checks, before any collective (run with no process group: a
    collective would fail with another error)."""
    x, W = randn(4, 6, seed=0), randn(10, 6, seed=1)
    for args, words in (((x, W, None, 0), "chunks must be a whole number ≥ 1, got 0"),
                        ((x, W, None, 2, 1), "dim=1 is the feature dimension"),
                        ((x, W, None, 2, 2), "dim=2 is out of range for a tensor with 2 dimensions"),
                        ((x, W[:, :5], None, 2), "does not match the weight's in_features 5"),
                        ((x.double(), W, None, 2), "torch.float64"),
                        ((x.int(), W, None, 2), "floating-point"),
                        ((x, W[None], None, 2), "(out_features, in_features) matrix"),
                        ((x, W, None, 2, 0, "pipeline"), "schedule='pipeline' is not one of ring, bidirectional")):
        with pytest.raises(ValueError) as info:
            fn(*args)
        assert words in str(info.value)
        assert fn.__name__ in str(info.value)


@pytest.mark.parametrize("weight", [torch.ones(6), torch.tensor(1.0), [[1.0] * 6] * 10], ids=["1-D", "0-D", "list"])
@pytest.mark.parametrize("fn", [overlap.allgather_matmul, overlap.matmul_reduce_scatter])
def test_weight_that_is_not_a_matrix_is_a_value_error(fn, weight):
    with pytest.raises(ValueError, match=r"\(out_features, in_features\) matrix"):
        fn(randn(4, 6, seed=0), weight, None, 1)


def test_mlp_microbatches_rows_must_split():
    x, fc1, fc2 = randn(6, 4, seed=0), randn(8, 4, seed=1), randn(4, 8, seed=2)
    with pytest.raises(ValueError, match="6 rows do not split into 4 micro-batches"):
        overlap.mlp_microbatches(x, fc1, fc2, None, overlap=True, micro_batches=4)


@pytest.mark.parametrize("micro", [0, -1, 2.0, True])
def test_mlp_microbatches_rejects_bad_micro_batch_counts(micro):
    x, fc1, fc2 = randn(8, 4, seed=0), randn(8, 4, seed=1), randn(4, 8, seed=2)
    with pytest.raises(ValueError, match="micro"):
        overlap.mlp_microbatches(x, fc1, fc2, None, overlap=True, micro_batches=micro)


def test_accounting_is_made_by_the_one_recorder_and_only_around_the_collective(solo_group):
    """comm.accounting's records come from intralayer.record's dispatch mode (what the c10d operators
    carried), and that mode is active only during comm's own call: a product between two collectives
    inside an accounting does not pass through Python dispatch (chapter 07 times such products)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    from intralayer import record

    x = torch.ones(6, 4)
    with record.Recorder() as seen:                          # a raw call of torch.distributed, seen
        dist.all_reduce(x.clone())
    assert [(c.op, c.elements, c.itemsize, c.reduce) for c in seen.calls] == [("all_reduce", 24, 4, "SUM")]
    modes = []
    with comm.accounting() as acc:
        comm.raw_all_reduce(x, None, "forward", "a")
        modes.append(_get_current_dispatch_mode())
        comm.ring_exchange_start([x, x[:2]], 1, None, "ring").wait()
    assert modes == [None], "a dispatch mode stayed active between comm's calls"
    assert [(r.op, r.elements, r.label) for r in acc.records] == [("all_reduce", 24, "a")]   # one rank: no ring
    with record.Recorder() as outer:                         # nested: the outer recorder sees comm's call too
        with comm.accounting() as acc:
            comm.raw_all_gather(x, 0, None, "forward", "g")
    assert [c.op for c in outer.calls] == ["all_gather"] and acc.records[0].elements == 24
