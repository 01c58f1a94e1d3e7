"""The NumPy ring simulations, the α–β cost model and its fit, the bus factors, and
chapter 00's smallest program and bandwidth probe on real ranks."""
from __future__ import annotations

import json

import numpy as np
import pytest

from intralayer import collectives as C
from intralayer import comm

NS = range(1, 7)
LENGTHS = (1, 5, 7, 12, 13)   # several not divisible by most n, and 1 < n for n ≥ 2


def arrays_for(n: int, length: int, seed: int = 0, dtype=np.int64) -> list[np.ndarray]:
    rng = np.random.default_rng(seed + 31 * n + length)
    return [rng.integers(-50, 50, size=length).astype(dtype) for _ in range(n)]


# ------------------------------------------------------------------ reduce-scatter

@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("length", LENGTHS)
def test_reduce_scatter_gives_each_device_its_chunk_of_the_sum(n, length):
    arrays = arrays_for(n, length)
    originals = [a.copy() for a in arrays]
    run = C.ring_reduce_scatter_np(arrays)
    want = np.array_split(sum(arrays), n)
    assert len(run.result) == n
    for i in range(n):
        np.testing.assert_array_equal(run.result[i], want[i])
    for a, o in zip(arrays, originals):           # the inputs are left alone
        np.testing.assert_array_equal(a, o)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("length", LENGTHS)
def test_reduce_scatter_bytes_sent(n, length):
    arrays = arrays_for(n, length)
    S = arrays[0].nbytes
    run = C.ring_reduce_scatter_np(arrays)
    chunk_bytes = [c.nbytes for c in np.array_split(arrays[0], n)]
    # Device i sends every chunk's partial sum once, except its own chunk i.
    assert run.sent_bytes == [S - chunk_bytes[i] for i in range(n)]
    assert np.mean(run.sent_bytes) == pytest.approx(comm.bus_factor("reduce_scatter", n) * S, rel=1e-12, abs=0)


@pytest.mark.parametrize("n", NS)
def test_reduce_scatter_steps_and_states(n):
    arrays = arrays_for(n, 2 * n + 1)
    run = C.ring_reduce_scatter_np(arrays)
    assert len(run.steps) == n - 1
    assert len(run.states) == n                    # before the first step and after each
    for s, step in enumerate(run.steps):
        assert sorted(i for i, _, _ in step) == list(range(n))      # everyone sends once
        assert all(j == (i + 1) % n for i, j, _ in step)            # to its right neighbour
        assert [c for _, _, c in step] == [(i - s - 1) % n for i in range(n)]
    for i in range(n):                             # the last state holds the result
        np.testing.assert_array_equal(run.states[-1][i][i], run.result[i])
    for i in range(n):                             # the first state holds the inputs
        np.testing.assert_array_equal(np.concatenate(run.states[0][i]), arrays[i])


def test_reduce_scatter_of_2d_arrays_splits_the_flattened_sum():
    arrays = [np.arange(10.0).reshape(2, 5) * (k + 1) for k in range(3)]
    run = C.ring_reduce_scatter_np(arrays)
    total = (np.arange(10.0) * 6)
    np.testing.assert_array_equal(np.concatenate(run.result), total)
    assert [len(r) for r in run.result] == [4, 3, 3]


def test_reduce_scatter_rejects_bad_devices():
    with pytest.raises(ValueError, match="at least one"):
        C.ring_reduce_scatter_np([])
    with pytest.raises(ValueError, match="same shape"):
        C.ring_reduce_scatter_np([np.zeros(4), np.zeros(5)])


# ------------------------------------------------------------------ all-gather

@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("length", LENGTHS)
def test_all_gather_gives_every_device_all_chunks_in_order(n, length):
    full = arrays_for(1, length)[0]
    chunks = np.array_split(full, n)               # uneven chunks when n does not divide
    run = C.ring_all_gather_np(chunks)
    assert len(run.result) == n
    for r in run.result:
        np.testing.assert_array_equal(r, full)
    S = full.nbytes
    # Device i forwards every chunk once except chunk i+1 (the last it receives).
    assert run.sent_bytes == [S - chunks[(i + 1) % n].nbytes for i in range(n)]
    assert np.mean(run.sent_bytes) == pytest.approx(comm.bus_factor("all_gather", n) * S, rel=1e-12, abs=0)


@pytest.mark.parametrize("n", NS)
def test_all_gather_states_fill_up(n):
    chunks = [np.full(2, float(i)) for i in range(n)]
    run = C.ring_all_gather_np(chunks)
    assert len(run.steps) == n - 1 and len(run.states) == n
    for i in range(n):
        held = [c for c in range(n) if run.states[0][i][c] is not None]
        assert held == [i]                          # each starts with its own chunk only
    for s, state in enumerate(run.states):
        for device in state:                        # after s steps, s+1 chunks are held
            assert sum(c is not None for c in device) == s + 1
    assert all(c is not None for device in run.states[-1] for c in device)


def test_all_gather_rejects_no_devices():
    with pytest.raises(ValueError, match="at least one"):
        C.ring_all_gather_np([])


# ------------------------------------------------------------------ all-reduce

@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("length", LENGTHS)
def test_all_reduce_gives_every_device_the_sum(n, length):
    arrays = arrays_for(n, length)
    run = C.ring_all_reduce_np(arrays)
    total = sum(arrays)
    assert len(run.result) == n
    for r in run.result:
        np.testing.assert_array_equal(r, total)
    S = arrays[0].nbytes
    assert np.mean(run.sent_bytes) == pytest.approx(comm.bus_factor("all_reduce", n) * S, rel=1e-12, abs=0)
    assert len(run.steps) == C.steps("all_reduce", n)
    assert len(run.states) == C.steps("all_reduce", n) + 1


@pytest.mark.parametrize("n", (2, 3, 5))
def test_all_reduce_keeps_the_shape_and_dtype(n):
    arrays = [np.arange(12, dtype=np.float32).reshape(3, 4) + k for k in range(n)]
    run = C.ring_all_reduce_np(arrays)
    for r in run.result:
        assert r.shape == (3, 4) and r.dtype == np.float32
        np.testing.assert_array_equal(r, sum(arrays))
    assert np.mean(run.sent_bytes) == pytest.approx(2 * (n - 1) / n * 48, rel=1e-12)


@pytest.mark.parametrize("n", range(2, 7))
def test_all_reduce_step_j_sends_chunk_i_minus_j_in_both_phases(n):
    """Chapter 00's rule, steps numbered 1 … 2(n−1) as its printout numbers them."""
    run = C.ring_all_reduce_np(arrays_for(n, 2 * n))
    assert len(run.steps) == 2 * (n - 1)
    for j, step in enumerate(run.steps, start=1):
        assert step == [(i, (i + 1) % n, (i - j) % n) for i in range(n)], j


@pytest.mark.parametrize("n", range(2, 7))
def test_all_gather_step_j_forwards_chunk_i_minus_j_plus_1(n):
    run = C.ring_all_gather_np([np.full(2, float(i)) for i in range(n)])
    for j, step in enumerate(run.steps, start=1):
        assert step == [(i, (i + 1) % n, (i - j + 1) % n) for i in range(n)], j


def test_all_reduce_rejects_unequal_shapes():
    with pytest.raises(ValueError, match="same shape"):
        C.ring_all_reduce_np([np.zeros((2, 2)), np.zeros(4)])


# ------------------------------------------------------------------ all-to-all

@pytest.mark.parametrize("n", NS)
def test_all_to_all_transposes_the_grid(n):
    rng = np.random.default_rng(n)
    # Uneven block sizes, some of them empty.
    blocks = [[rng.integers(0, 9, size=(i + 2 * j) % 4).astype(np.float64) for j in range(n)] for i in range(n)]
    run = C.all_to_all_np(blocks)
    for j in range(n):
        assert len(run.result[j]) == n
        for i in range(n):
            np.testing.assert_array_equal(run.result[j][i], blocks[i][j])
    assert run.sent_bytes == [sum(blocks[i][j].nbytes for j in range(n) if j != i) for i in range(n)]
    assert sorted(run.steps[0]) == sorted((i, j, j) for i in range(n) for j in range(n) if i != j)


@pytest.mark.parametrize("n", NS)
def test_all_to_all_even_blocks_send_the_bus_factor(n):
    b = 3
    blocks = [[np.full(b, 10.0 * i + j) for j in range(n)] for i in range(n)]
    S = n * b * 8                                    # each device's buffer: n blocks
    run = C.all_to_all_np(blocks)
    assert np.mean(run.sent_bytes) == pytest.approx(comm.bus_factor("all_to_all", n) * S, rel=1e-12, abs=0)
    # The concatenation on device j is column j of the grid.
    for j in range(n):
        np.testing.assert_array_equal(np.concatenate(run.result[j]), np.concatenate([blocks[i][j] for i in range(n)]))


def test_all_to_all_rejects_a_grid_that_is_not_square():
    with pytest.raises(ValueError, match="n×n grid"):
        C.all_to_all_np([[np.zeros(1), np.zeros(1)], [np.zeros(1)]])
    with pytest.raises(ValueError, match="n×n grid"):
        C.all_to_all_np([])


# ------------------------------------------------------------------ bus factors, steps, time

@pytest.mark.parametrize("n", (2, 3, 4, 8))
def test_bus_factor_values(n):
    assert comm.bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert comm.bus_factor(op, n) == pytest.approx((n - 1) / n)
    assert comm.bus_factor("broadcast", n) == 1.0
    assert comm.bus_factor("reduce", n) == 1.0


def test_bus_factor_examples_and_one_rank():
    assert comm.bus_factor("all_reduce", 2) == 1.0
    assert comm.bus_factor("all_reduce", 4) == 1.5
    assert comm.bus_factor("all_gather", 8) == 0.875
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce"):
        assert comm.bus_factor(op, 1) == 0.0        # one rank sends nothing


@pytest.mark.parametrize("n", (0, -2, 2.0, "4", None))
def test_bus_factor_rejects_a_bad_rank_count(n):
    with pytest.raises(ValueError, match="whole number ≥ 1"):
        comm.bus_factor("all_reduce", n)


def test_bus_factor_rejects_an_unknown_collective():
    with pytest.raises(ValueError, match="unknown collective 'allreduce'.*all_reduce"):
        comm.bus_factor("allreduce", 4)


def test_bus_factor_accepts_numpy_integers():
    assert comm.bus_factor("all_reduce", np.int64(4)) == 1.5


@pytest.mark.parametrize("n", range(1, 9))
def test_steps(n):
    assert C.steps("all_reduce", n) == 2 * (n - 1)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert C.steps(op, n) == n - 1


def test_steps_validates_its_arguments():
    with pytest.raises(ValueError, match="unknown collective"):
        C.steps("gather", 4)
    with pytest.raises(ValueError, match="whole number"):
        C.steps("all_reduce", 0)


def test_collective_time_examples():
    # all-reduce on 4 ranks: 6 steps of α plus 1.5·S/B.
    assert C.collective_time("all_reduce", 4, 1e6, 1e9, 1e-5) == pytest.approx(6e-5 + 1.5e-3)
    # all-gather on 8 ranks: 7 steps plus 0.875·S/B.
    assert C.collective_time("all_gather", 8, 8e6, 2e9, 2e-6) == pytest.approx(14e-6 + 3.5e-3)
    assert C.collective_time("all_to_all", 2, 0, 1e9, 3e-6) == pytest.approx(3e-6)   # latency only
    assert C.collective_time("all_reduce", 1, 1e9, 1e9, 1e-3) == 0.0               # one rank: nothing to do


def test_collective_time_grows_linearly_in_size():
    t = [C.collective_time("reduce_scatter", 4, S, 5e9, 1e-6) for S in (0, 1e6, 2e6)]
    assert t[2] - t[1] == pytest.approx(t[1] - t[0])
    assert t[1] - t[0] == pytest.approx(0.75 * 1e6 / 5e9)


@pytest.mark.parametrize("kwargs, rule", [
    (dict(size_bytes=-1), "must be ≥ 0"),
    (dict(bandwidth=0), "bandwidth .* must be > 0"),
    (dict(bandwidth=-1e9), "bandwidth .* must be > 0"),
    (dict(alpha=-1e-6), "latency .* must be ≥ 0"),
    (dict(op="bcast"), "unknown collective"),
    (dict(n=0), "whole number ≥ 1"),
])
def test_collective_time_rejects_bad_inputs(kwargs, rule):
    args = dict(op="all_reduce", n=4, size_bytes=1e6, bandwidth=1e9, alpha=1e-6) | kwargs
    with pytest.raises(ValueError, match=rule):
        C.collective_time(**args)


def test_links_are_positive_and_sourced():
    assert C.LINKS
    for name, link in C.LINKS.items():
        assert link.bandwidth > 0 and link.source, name


# ------------------------------------------------------------------ fitting α and β

@pytest.mark.parametrize("op", C.OPS)
@pytest.mark.parametrize("n", (2, 4, 8))
def test_fit_recovers_known_alpha_and_bandwidth(op, n):
    alpha, bw = 7.5e-6, 3.2e9
    sizes = [256 * 4 ** k for k in range(9)]
    times = [C.collective_time(op, n, S, bw, alpha) for S in sizes]
    fit = C.fit_alpha_beta(op, n, sizes, times)
    assert (fit.op, fit.n) == (op, n)
    assert fit.alpha == pytest.approx(alpha, rel=1e-9)
    assert fit.bandwidth == pytest.approx(bw, rel=1e-9)
    assert fit.max_rel_error < 1e-9
    np.testing.assert_allclose(fit.predict(sizes), times, rtol=1e-9)


def test_fit_from_two_points_and_its_error_measure():
    fit = C.fit_alpha_beta("all_gather", 2, [1e3, 1e6], [1e-5 + 0.5e3 / 1e9, 1e-5 + 0.5e6 / 1e9])
    assert fit.alpha == pytest.approx(1e-5, rel=1e-9)
    assert fit.bandwidth == pytest.approx(1e9, rel=1e-9)
    # Noisy data: the reported error is the largest relative miss of the fitted line.
    sizes = np.array([1e3, 1e4, 1e5, 1e6])
    times = np.array([C.collective_time("all_gather", 2, S, 1e9, 1e-5) for S in sizes]) * [1.1, 0.9, 1.0, 1.05]
    noisy = C.fit_alpha_beta("all_gather", 2, sizes, times)
    assert noisy.max_rel_error == pytest.approx(np.max(np.abs(noisy.predict(sizes) - times) / times))
    assert 0.01 < noisy.max_rel_error < 0.2


@pytest.mark.parametrize("sizes, times, rule", [
    ([1e3, 1e6], [1e-5], "at least two"),
    ([1e3], [1e-5], "at least two"),
    ([], [], "at least two"),
    ([1e3, 1e6], [1e-5, 0.0], "must be positive"),
    ([1e3, 1e6], [-1e-5, 1e-3], "must be positive"),
    ([1e3, 1e6], [1e-3, 1e-5], "does not grow with message size"),
])
def test_fit_rejects_bad_data(sizes, times, rule):
    with pytest.raises(ValueError, match=rule):
        C.fit_alpha_beta("all_reduce", 4, sizes, times)


def test_fit_rejects_an_unknown_collective():
    with pytest.raises(ValueError, match="unknown collective"):
        C.fit_alpha_beta("gather", 4, [1e3, 1e6], [1e-5, 1e-3])


# ------------------------------------------------------------------ real ranks: chapter 00's programs

@pytest.mark.parametrize("nproc", [2, 4])
def test_hello_allreduce_sums_the_rank_numbers(pool, nproc):
    result = pool("intralayer.programs.hello_allreduce", nproc, timeout=60)
    total = nproc * (nproc - 1) // 2
    assert result.output.strip() == (f"{nproc} ranks, gloo: the all-reduce of the rank numbers 0 … {nproc - 1} "
                                     f"left {total} on every rank: correct")
    assert all(result.stdout[r] == "" for r in range(1, nproc))   # only rank 0 prints


def test_bandwidth_records_what_gloo_ran(pool, tmp_path):
    """gloo runs a reduce-scatter as an all-reduce of a copy (chapter 00, section 5)."""
    out = tmp_path / "bw.json"
    pool("intralayer.programs.bandwidth", 2, args=["--max-bytes", "1024", "--repeats", "1", "--out", out], timeout=60)
    measured = json.loads(out.read_text())
    assert measured["backend"] == "gloo" and measured["sizes"] == [256, 1024]
    assert measured["backend_calls"] == {"all_reduce": ["gloo:all_reduce"], "all_gather": ["gloo:all_gather"],
                                         "reduce_scatter": ["aten::clone", "gloo:all_reduce"],
                                         "all_to_all": ["gloo:all_to_all"]}
    assert all(len(t) == 2 and min(t) > 0 for t in measured["times"].values())
