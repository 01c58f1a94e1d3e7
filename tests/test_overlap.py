"""Tests of intralayer.overlap (chapter 07).

(a) allgather_matmul and matmul_reduce_scatter against the unfused collectives and
    against sums written out from every rank's tensors, forward and backward, float32
    and float64, 2-D to 4-D inputs, every chunk count; the collectives they issue; the
    timeline's events; mlp_microbatches; bad input: on 2 and 4 ranks
    (tests/programs/overlap_checks.py).
(b) The same ops on a one-rank group in this process, and timeline(): nothing recorded
    outside an op or outside a block, nested blocks.
(c) model_times against its formulas written out here, the chapter's printed numbers,
    and its errors.
(d) Validation that must run before any communication, without a process group.

Four groups of tests began as strict xfails for bugs they found, since fixed: nested
timelines measured from the innermost block's start; a 1-D, 0-D or non-tensor weight
failed with IndexError/AttributeError instead of the ValueError that names the rule;
mlp_microbatches did not validate micro_batches; model_times accepted a negative
latency, overhead or item size.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

from intralayer import comm, launch, overlap
from intralayer.collectives import LINKS

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the programs' package, whatever directory pytest runs from
    sys.path.insert(0, str(ROOT))
from tests.programs import overlap_checks  # noqa: E402
from tests.programs.checks import rounding_tol  # noqa: E402
ENV = {"PYTHONPATH": str(ROOT)}


# ------------------------------------------------------------------ (a) on real ranks

@pytest.mark.parametrize("nproc", [2, 4])
def test_collective_matmuls_match_unfused_on_real_ranks(nproc):
    result = launch.run("tests.programs.overlap_checks", nproc, env=ENV, timeout=120, show=False)
    assert f"{overlap_checks.MARKER} {nproc}" in result.output
    assert all("Traceback" not in text for text in result.stderr.values())


# ------------------------------------------------------------------ (b) one rank, this process

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape, dim", [((6, 5), 0), ((3, 2, 5), 0), ((2, 3, 5), 1), ((2, 2, 3, 5), -2)])
def test_one_rank_is_a_plain_linear(solo_group, shape, dim, dtype):
    """With P = 1 both ops are F.linear, chunked or not, forward and backward; nothing is sent."""
    W = randn(7, 5, seed=1, dtype=dtype)
    up = randn(*shape[:-1], 7, seed=2, dtype=dtype)
    rows = shape[dim]
    x0 = randn(*shape, seed=0, dtype=dtype).requires_grad_()
    w0 = W.clone().requires_grad_()
    F.linear(x0, w0).backward(up)
    # float64: γ_n of float64 with n = 36 ≥ twice (both sides round) the longest chain, dW's
    # ≤ 12 rows summed plus ≤ 6 chunks' partial sums added, and atol for the largest Σ|terms|
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
                y = fn(x, w, None, chunks, dim)
                y.backward(up)
            assert y.dtype == dtype and y.shape == (*shape[:-1], 7)
            assert_close(y.detach(), F.linear(x0, w0).detach(), **tol_y)
            assert_close(x.grad, x0.grad, **tol_dx)
            assert_close(w.grad, w0.grad, **tol_dw)
            assert len(acc.records) == 2 * chunks and acc.sent() == 0.0
            assert all("chunk" in r.label and r.group_size == 1 for r in acc.records)


def _small_op():
    x, W = randn(4, 3, seed=3), randn(5, 3, seed=4)
    return overlap.allgather_matmul(x, W, None, 2)


def test_timeline_with_no_op_records_nothing():
    with overlap.timeline() as ev:
        pass
    assert ev == []
    with overlap.timeline() as outer:
        with overlap.timeline() as inner:
            pass
    assert outer == [] and inner == []


def test_ops_outside_a_timeline_record_nothing(solo_group):
    _small_op()                                     # no block open: no error, nothing kept
    with overlap.timeline() as ev:
        pass
    assert ev == []
    _small_op()                                     # after the block: the list is not touched
    assert ev == []
    with overlap.timeline() as ev:
        _small_op()
    assert len(ev) == 4
    _small_op()
    assert len(ev) == 4


def test_timeline_stops_recording_when_its_block_raises(solo_group):
    with pytest.raises(KeyError):
        with overlap.timeline() as ev:
            _small_op()
            raise KeyError("boom")
    assert len(ev) == 4
    _small_op()
    assert len(ev) == 4


def test_timeline_nests(solo_group):
    """Events inside an inner block go to both lists; the inner one stops when it closes."""
    with overlap.timeline() as outer:
        _small_op()
        with overlap.timeline() as inner:
            _small_op()
        _small_op()
    assert len(inner) == 4 and len(outer) == 12
    assert [e[:2] for e in outer[4:8]] == [e[:2] for e in inner]
    assert sorted(e[:2] for e in inner) == sorted(
        [("comm", "all-gather 0"), ("comm", "all-gather 1"), ("compute", "matmul 0"), ("compute", "matmul 1")])
    for e in outer + inner:
        assert 0 <= e[2] <= e[3]


def test_nested_timeline_times_are_from_each_blocks_own_start(solo_group):
    pause = 0.05
    with overlap.timeline() as outer:
        _small_op()
        time.sleep(pause)
        with overlap.timeline() as inner:
            _small_op()
        _small_op()
    # the inner block opened at least `pause` after the outer one: its events, as the outer
    # block sees them, are shifted by that much
    for o, i in zip(outer[4:8], inner):
        assert o[:2] == i[:2]
        assert o[2] - i[2] >= pause and math.isclose(o[2] - i[2], o[3] - i[3], rel_tol=1e-6, abs_tol=1e-9)
    assert all(e[2] >= pause for e in outer[4:])
    ends = [e[3] for e in outer]
    assert ends == sorted(ends)                      # appended as they finish


# ------------------------------------------------------------------ (c) the cost model

def written_out(t, h, tokens, chunks, bandwidth, flops, alpha=5e-6, overhead=5e-6, itemsize=2):
    """model_times' docstring, term by term."""
    comm_c = alpha + (t - 1) / t * tokens * h * itemsize / chunks / bandwidth if t > 1 else 0.0
    comp_c = 2 * tokens * h * (4 * h / t) / flops / chunks + overhead
    sequential = chunks * (comm_c + comp_c)
    if chunks == 1:
        overlapped = comm_c + comp_c
    else:                                              # first transfer, then pairs, then last compute
        overlapped = comm_c + sum(max(comm_c, comp_c) for _ in range(chunks - 1)) + comp_c
    return comm_c, comp_c, sequential, overlapped


GRID = [
    (8, 12288, 2048, 8, 450e9, 494.5e12),             # GPT-3 fc1 over NVLink: compute-bound chunks
    (8, 12288, 2048, 8, 50e9, 494.5e12),              # over a slow link: communication-bound
    (2, 64, 128, 4, 1e9, 1e9, 0.0, 0.0, 4),            # no latency, no overhead, float32
    (4, 1024, 4096, 16, 25e9, 1e14, 1e-5, 2e-6, 2),
    (16, 4096, 2048, 64, 900e9, 1e15),
    (3, 7, 3 * 5 * 2, 5, 1e6, 1e6, 1e-3, 1e-3, 8),      # odd sizes
    (8, 12288, 2048, 1, 450e9, 494.5e12),             # one chunk
]


@pytest.mark.parametrize("args", GRID)
def test_model_times_is_its_formula(args):
    comm_c, comp_c, sequential, overlapped = written_out(*args)
    m = overlap.model_times(*args)
    chunks = args[3]
    assert set(m) == {"sequential", "overlapped", "compute", "comm", "hidden"}
    assert math.isclose(m["sequential"], sequential, rel_tol=1e-12)
    assert math.isclose(m["overlapped"], overlapped, rel_tol=1e-12)
    assert math.isclose(m["compute"], chunks * comp_c, rel_tol=1e-12)
    assert math.isclose(m["comm"], chunks * comm_c, rel_tol=1e-12)
    assert m["overlapped"] <= m["sequential"] * (1 + 1e-12)
    assert 0.0 <= m["hidden"] <= 1.0
    hidden = 1 - (overlapped - chunks * comp_c) / (chunks * comm_c)
    assert math.isclose(m["hidden"], hidden, rel_tol=1e-9, abs_tol=1e-12)
    # closed forms: compute-bound chunks hide all but the first transfer; otherwise the
    # compute of all but the first chunk is what hides
    if chunks > 1 and comp_c >= comm_c:
        assert math.isclose(m["hidden"], 1 - 1 / chunks, rel_tol=1e-9)
        assert math.isclose(m["overlapped"], comm_c + chunks * comp_c, rel_tol=1e-12)
    elif chunks > 1:
        assert math.isclose(m["hidden"], (chunks - 1) * comp_c / (chunks * comm_c), rel_tol=1e-9)
        assert math.isclose(m["overlapped"], chunks * comm_c + comp_c, rel_tol=1e-12)


def test_model_times_defaults():
    base = (8, 4096, 2048, 4, 100e9, 1e14)
    assert overlap.model_times(*base) == overlap.model_times(*base, alpha=5e-6, overhead=5e-6, itemsize=2)
    c2, *_ = written_out(*base, itemsize=2)
    c4, *_ = written_out(*base, itemsize=4)
    assert math.isclose(overlap.model_times(*base, itemsize=4)["comm"], 4 * c4, rel_tol=1e-12)
    assert c4 - 5e-6 == pytest.approx(2 * (c2 - 5e-6), rel=1e-12)     # bytes on the wire double


@pytest.mark.parametrize("t, h, tokens", [(8, 12288, 2048), (2, 64, 128), (4, 1024, 4096)])
@pytest.mark.parametrize("bandwidth", [1e9, 50e9, 900e9])
def test_model_times_one_chunk_hides_nothing_and_more_never_hurt_overlap(t, h, tokens, bandwidth):
    """The chapter: "with one chunk nothing is hidden"; overlapped ≤ sequential always."""
    one = overlap.model_times(t, h, tokens, 1, bandwidth, 5e14)
    # 0 up to rounding: hidden = 1 − ((comm + comp) − comp)/comm, which can come out as ~1e-16
    assert one["hidden"] == pytest.approx(0.0, abs=1e-12)
    assert math.isclose(one["overlapped"], one["sequential"], rel_tol=1e-12)
    chunks = 2
    while tokens % (t * chunks) == 0 and chunks <= 256:
        m = overlap.model_times(t, h, tokens, chunks, bandwidth, 5e14)
        assert m["overlapped"] <= m["sequential"]
        assert 0.0 <= m["hidden"] <= 1.0
        assert m["overlapped"] >= max(m["compute"], m["comm"])       # neither can be hidden by itself
        chunks *= 2


@pytest.mark.parametrize("chunks", [1, 2, 8])
def test_model_times_one_rank_sends_nothing(chunks):
    m = overlap.model_times(1, 4096, 2048, chunks, 100e9, 1e14)
    assert m["comm"] == 0.0 and m["hidden"] == 0.0
    assert m["sequential"] == pytest.approx(m["compute"], rel=1e-12)
    assert m["overlapped"] == pytest.approx(m["compute"], rel=1e-12)
    assert m["compute"] == pytest.approx(2 * 2048 * 4096 * 4 * 4096 / 1e14 + chunks * 5e-6, rel=1e-12)


@pytest.mark.parametrize("link, sequential, overlapped, hidden", [
    ("NVLink 4 (H100 SXM)", 803.2e-6, 682.6e-6, 0.88),
    ("InfiniBand NDR (1 NIC)", 1586.2e-6, 1004.0e-6, 0.63),
])
def test_model_times_reproduces_the_chapter(link, sequential, overlapped, hidden):
    """The numbers chapter 07 prints for GPT-3's fc1 (t = 8, 2048 tokens, 8 chunks, 989 TFLOP/s at 50 %)."""
    m = overlap.model_times(8, 12288, 2048, 8, LINKS[link].bandwidth, 989e12 * 0.5)
    assert m["sequential"] == pytest.approx(sequential, abs=0.06e-6)
    assert m["overlapped"] == pytest.approx(overlapped, abs=0.06e-6)
    assert m["hidden"] == pytest.approx(hidden, abs=0.005)


@pytest.mark.parametrize("kwargs, words", [
    (dict(t=0), "t must be a whole number ≥ 1, got 0"),
    (dict(t=-2), "t must be a whole number ≥ 1, got -2"),
    (dict(t=2.0), "t must be a whole number ≥ 1, got 2.0"),
    (dict(t=True), "t must be a whole number ≥ 1, got True"),
    (dict(h=0), "h must be a whole number ≥ 1, got 0"),
    (dict(h=64.5), "h must be a whole number ≥ 1"),
    (dict(tokens=0), "tokens must be a whole number ≥ 1, got 0"),
    (dict(tokens="128"), "tokens must be a whole number ≥ 1, got '128'"),
    (dict(chunks=0), "chunks must be a whole number ≥ 1, got 0"),
    (dict(chunks=-1), "chunks must be a whole number ≥ 1, got -1"),
    (dict(chunks=1.5), "chunks must be a whole number ≥ 1, got 1.5"),
    (dict(chunks=None), "chunks must be a whole number ≥ 1, got None"),
    (dict(chunks=3), "128 tokens do not split into t=4 ranks × 3 chunks"),
    (dict(chunks=64), "128 tokens do not split into t=4 ranks × 64 chunks"),
    (dict(t=3), "128 tokens do not split into t=3 ranks × 2 chunks"),
    (dict(bandwidth=0), "bandwidth and FLOP rate must be > 0"),
    (dict(bandwidth=-1e9), "bandwidth and FLOP rate must be > 0"),
    (dict(bandwidth=float("nan")), "bandwidth and FLOP rate must be > 0"),
    (dict(flops=0.0), "bandwidth and FLOP rate must be > 0"),
    (dict(flops=-1e12), "bandwidth and FLOP rate must be > 0"),
    (dict(flops=float("nan")), "bandwidth and FLOP rate must be > 0"),
])
def test_model_times_rejects_bad_arguments(kwargs, words):
    args = dict(t=4, h=64, tokens=128, chunks=2, bandwidth=1e9, flops=1e12) | kwargs
    with pytest.raises(ValueError) as info:
        overlap.model_times(**args)
    assert words in str(info.value)


@pytest.mark.parametrize("kwargs", [dict(alpha=-1e-3), dict(overhead=-1e-3), dict(itemsize=0), dict(itemsize=-2)])
def test_model_times_rejects_negative_latency_overhead_or_itemsize(kwargs):
    with pytest.raises(ValueError):
        overlap.model_times(4, 64, 128, 2, 1e9, 1e12, **kwargs)


# ------------------------------------------------------------------ (d) validation, no process group

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
                        ((x, W[None], None, 2), "(out_features, in_features) matrix")):
        with pytest.raises(ValueError) as info:
            fn(*args)
        assert words in str(info.value)
        if "out of range" not in words:            # that one is comm's message, shared by every op
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


@pytest.mark.parametrize("micro", [0, -1, 2.0])
def test_mlp_microbatches_rejects_bad_micro_batch_counts(micro):
    x, fc1, fc2 = randn(8, 4, seed=0), randn(8, 4, seed=1), randn(4, 8, seed=2)
    with pytest.raises(ValueError, match="micro"):
        overlap.mlp_microbatches(x, fc1, fc2, None, overlap=True, micro_batches=micro)
