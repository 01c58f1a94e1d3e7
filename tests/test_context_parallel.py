"""Tests of intralayer.context_parallel.

(a) Ring attention (every layout: contiguous, zigzag, striped) and Ulysses against SDPA on
    the whole sequence, forward and backward, float32 / float64 / bfloat16, shard/unshard,
    counted scores and bytes sent, bad input: on 2 and 4 ranks (tests/programs/cp_checks.py).
(b) merge_partials and block_attention on one process, against attention written out.
(c) The ring's schedule: who computes what, under which mask (against the token
    positions each layout's definition gives), and how much (work_per_rank).
(d) Layout helpers: the registry, n_chunks, chunk_ids, positions, check_sequence, and
    shard_sequence with a stand-in for the process group.
(e) cp_costs against the formulas of its docstring, and its errors.

Three tests here began as strict xfails for bugs they found (ring attention in float32
whatever the input dtype, an out-of-range dim wrapping round, P = 0 in cp_costs); the
library is fixed and they are plain tests now.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from intralayer import context_parallel as cp

ROOT = Path(__file__).resolve().parents[1]
from tests.programs import cp_checks
from tests.programs.checks import rounding_tol
ENV = {"PYTHONPATH": str(ROOT)}


# ------------------------------------------------------------------ (a) on real ranks

@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.parametrize("check", cp_checks.CHECKS, ids=lambda c: c.__name__)
def test_ring_and_ulysses_match_sdpa_on_real_ranks(on_ranks, nproc, check):
    on_ranks(cp_checks, check, nproc, env=ENV, timeout=120)


def test_ring_attention_keeps_float64_precision(pool):
    result = pool("tests.programs.cp_checks", 2, args=["float64-ring"], env=ENV, timeout=60)
    assert f"{cp_checks.FLOAT64_RING_MARKER} 2" in result.output


# ------------------------------------------------------------------ (b) blocks, one process
#
# Tolerances: float64 merges at float64's rounding (merge_tol); exact cases at 0; float32
# results at assert_close's float32 defaults (checks.FLOAT32_REORDERED): blocks of ≤ 12
# keys, d ≤ 8, scores of order one, whose rounding errors grow like √n·u.

def attention_with_lse(scores: np.ndarray, v: np.ndarray):
    """Softmax attention written out in float64 from the scores: (output, log-sum-exp) per row.

    Rows with no finite score give output 0 and log-sum-exp −∞.
    """
    scores = scores.astype(np.float64)
    m = scores.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(scores - m)
    total = e.sum(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(total > 0, (e @ v.astype(np.float64)) / np.where(total > 0, total, 1), 0.0)
        lse = np.where(total[..., 0] > 0, np.log(total[..., 0]) + m[..., 0], -np.inf)
    return out, lse


def partial(scores: np.ndarray, v: np.ndarray, dtype=torch.float64):
    out, lse = attention_with_lse(scores, v)
    return torch.tensor(out, dtype=dtype), torch.tensor(lse, dtype=dtype)


def split_keys(seed, b=2, h=3, m=5, n=7, d=4, scale=1.0):
    rng = np.random.default_rng(seed)
    scores = rng.standard_normal((b, h, m, n)) * scale
    v = rng.standard_normal((b, h, n, d))
    return scores, v


def merge_tol(dtype, scores, v, merges):
    """Tolerance of merged partials against attention over all keys, both from the same
    scores in ``dtype`` (float64 here): tests/test_numerics.py's counts with the scores
    given (no q·k), σ = max |score| and B ≤ the number of keys: each block — a partial and
    the reference — 4σ + 2B + 5 roundings relative to mag = max |v|, and each merge
    4Λ + 4 ln B + 12 with Λ = σ + ln B; the log-sum-exp's absolute error, (2σ + 2 + B + 2 ln B
    + Λ) per block and Λ + 3 per merge, is below that count, with mag ≥ 1.
    (assert_close's float64 defaults, 1e-7, would pass float32 arithmetic too.)"""
    finite = scores[np.isfinite(scores)]
    sigma, keys = float(np.abs(finite).max()), scores.shape[-1]
    lam = sigma + math.log(keys)
    n = 2 * (4 * sigma + 2 * keys + 5) + merges * (4 * lam + 4 * math.log(keys) + 12)
    return rounding_tol(dtype, n, mag=max(1.0, float(np.abs(v).max())))


@pytest.mark.parametrize("cut", [1, 3, 6])
def test_merge_partials_equals_attention_over_the_union_of_keys(cut):
    scores, v = split_keys(cut)
    o1, l1 = partial(scores[..., :cut], v[..., :cut, :])
    o2, l2 = partial(scores[..., cut:], v[..., cut:, :])
    want_o, want_l = attention_with_lse(scores, v)
    tol = merge_tol(torch.float64, scores, v, merges=1)
    for a, b in (((o1, l1), (o2, l2)), ((o2, l2), (o1, l1))):     # in either order
        out, lse = cp.merge_partials(*a, *b)
        torch.testing.assert_close(out, torch.tensor(want_o), **tol)
        torch.testing.assert_close(lse, torch.tensor(want_l), **tol)


def test_merge_partials_one_block_at_a_time_from_nothing():
    """Starting from (0, −∞) and merging the key blocks one by one, as the ring does."""
    scores, v = split_keys(7, n=12)
    out = torch.zeros(2, 3, 5, 4, dtype=torch.float64)
    lse = torch.full((2, 3, 5), float("-inf"), dtype=torch.float64)
    for cols in np.array_split(np.arange(12), 4):
        out, lse = cp.merge_partials(out, lse, *partial(scores[..., cols], v[..., cols, :]))
    want_o, want_l = attention_with_lse(scores, v)
    tol = merge_tol(torch.float64, scores, v, merges=3)            # 4 blocks: the first merge is exact
    torch.testing.assert_close(out, torch.tensor(want_o), **tol)
    torch.testing.assert_close(lse, torch.tensor(want_l), **tol)


def test_merge_partials_rows_with_no_key_in_a_block():
    scores, v = split_keys(2, b=1, h=1, m=4, n=6)
    scores[0, 0, 0, :3] = -np.inf          # row 0: no key in block 1
    scores[0, 0, 1, 3:] = -np.inf          # row 1: no key in block 2
    scores[0, 0, 2, :] = -np.inf           # row 2: no key in either
    o1, l1 = partial(scores[..., :3], v[..., :3, :])
    o2, l2 = partial(scores[..., 3:], v[..., 3:, :])
    assert l1[0, 0, 0] == -math.inf and l2[0, 0, 1] == -math.inf
    for a, b in (((o1, l1), (o2, l2)), ((o2, l2), (o1, l1))):
        out, lse = cp.merge_partials(*a, *b)
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        # the other side unchanged, bit for bit: its weight is sigmoid(+∞) = 1, the other's 0
        torch.testing.assert_close(out[0, 0, 0], o2[0, 0, 0], rtol=0, atol=0)
        torch.testing.assert_close(out[0, 0, 1], o1[0, 0, 1], rtol=0, atol=0)
        torch.testing.assert_close(out[0, 0, 2], torch.zeros(4, dtype=torch.float64), rtol=0, atol=0)
        assert lse[0, 0, 2] == -math.inf
        want_o, want_l = attention_with_lse(scores, v)
        tol = merge_tol(torch.float64, scores, v, merges=1)
        torch.testing.assert_close(out, torch.tensor(want_o), **tol)
        torch.testing.assert_close(lse, torch.tensor(want_l), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_merge_partials_with_scores_of_order_1e4(dtype):
    """No overflow, however large the scores: every exponent is ≤ 0."""
    scores, v = split_keys(3, scale=1.0)
    scores = scores + 1e4                                           # all scores near 1e4, none saturating
    o1, l1 = partial(scores[..., :3], v[..., :3, :], dtype)
    o2, l2 = partial(scores[..., 3:], v[..., 3:, :], dtype)
    out, lse = cp.merge_partials(o1, l1, o2, l2)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    want_o, want_l = attention_with_lse(scores, v)
    # float32: each log-sum-exp near 1e4 is stored to within 2^-11 ≈ 4.9e-4, so the weights
    # sigmoid(ℓ_1 − ℓ_2) move by up to both errors, 9.8e-4, relative; twice that, 2e-3, for
    # outputs and v of order one (the rest of the arithmetic is ~100u);
    # float64: merge_tol (float64's rounding; its defaults would pass float32 arithmetic).
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == torch.float32 else merge_tol(dtype, scores, v, merges=1)
    torch.testing.assert_close(out, torch.tensor(want_o, dtype=dtype), **tol)
    torch.testing.assert_close(lse, torch.tensor(want_l, dtype=dtype), **tol)
    # and with scores of order ±1e4 (rows dominated by one key)
    big, v = split_keys(4, scale=1e4)
    o1, l1 = partial(big[..., :3], v[..., :3, :], dtype)
    o2, l2 = partial(big[..., 3:], v[..., 3:, :], dtype)
    out, lse = cp.merge_partials(o1, l1, o2, l2)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    want_o, want_l = attention_with_lse(big, v)
    # float32: one key dominates every row (gaps of order 1e4), so the weights are 0 or 1 and
    # ℓ is the winning score: assert_close's float32 defaults; float64: merge_tol.
    tol = {} if dtype == torch.float32 else merge_tol(dtype, big, v, merges=1)
    torch.testing.assert_close(out, torch.tensor(want_o, dtype=dtype), **tol)
    torch.testing.assert_close(lse, torch.tensor(want_l, dtype=dtype), **tol)


def masked_attention(q, k, v, scale, diagonal):
    s = (q.double() @ k.double().transpose(-2, -1)) * scale
    if diagonal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v.double(), torch.logsumexp(s, -1)


@pytest.mark.parametrize("diagonal", [True, False])
@pytest.mark.parametrize("m", [1, 2, 5])
def test_block_attention_equals_masked_softmax(diagonal, m):
    g = torch.Generator().manual_seed(m)
    q, k, v = (torch.randn(2, 3, m, 4, generator=g) for _ in range(3))
    out, lse = cp.block_attention(q, k, v, 0.5, diagonal)
    assert out.dtype == lse.dtype == torch.float32
    assert out.shape == (2, 3, m, 4) and lse.shape == (2, 3, m)
    want_o, want_l = masked_attention(q, k, v, 0.5, diagonal)
    torch.testing.assert_close(out, want_o.float())
    torch.testing.assert_close(lse, want_l.float())
    if diagonal:   # the first query sees only the first key: exp(0)·v / 1, exact
        torch.testing.assert_close(out[..., 0, :], v[..., 0, :], rtol=0, atol=0)


def test_block_attention_computes_in_float32_for_bfloat16_input():
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g).bfloat16() for _ in range(3))
    out, lse = cp.block_attention(q, k, v, 8 ** -0.5, True)
    assert out.dtype == lse.dtype == torch.float32
    want_o, want_l = masked_attention(q, k, v, 8 ** -0.5, True)
    torch.testing.assert_close(out, want_o.float())
    torch.testing.assert_close(lse, want_l.float())


def test_block_attention_then_merge_over_blocks_equals_causal_attention():
    """Causal attention over 3 blocks of 4 tokens, block by block as one ring rank would."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, 12, 4, generator=g) for _ in range(3))
    scale = 0.5
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    for qb in range(3):
        qs = q[..., 4 * qb:4 * qb + 4, :]
        out = torch.zeros(1, 2, 4, 4)
        lse = torch.full((1, 2, 4), float("-inf"))
        for kb in range(qb + 1):
            bo, bl = cp.block_attention(qs, k[..., 4 * kb:4 * kb + 4, :], v[..., 4 * kb:4 * kb + 4, :], scale,
                                        diagonal=kb == qb)
            out, lse = cp.merge_partials(out, lse, bo, bl)
        torch.testing.assert_close(out, ref[..., 4 * qb:4 * qb + 4, :])


# ------------------------------------------------------------------ (c) the schedule

@pytest.mark.parametrize("P", range(1, 9))
def test_contiguous_causal_work_grows_as_1_to_P(P):
    s = 4 * P
    work = cp.work_per_rank(s, P, "contiguous", True)
    assert work == [(s // P) ** 2 * (r + 1) for r in range(P)]
    assert [w / work[0] for w in work] == list(range(1, P + 1))


@pytest.mark.parametrize("P", range(1, 9))
def test_zigzag_causal_work_is_equal(P):
    s = 6 * P
    work = cp.work_per_rank(s, P, "zigzag", True)
    piece = s // (2 * P)
    assert work == [piece * piece * (2 * P + 1)] * P          # 2P full pieces' worth + the diagonal pair
    assert sum(work) == piece * piece * (2 * P) * (2 * P + 1) // 2   # the lower triangle of 2P × 2P pieces


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("P", range(1, 9))
def test_non_causal_work_is_equal_and_covers_the_matrix(P, layout):
    s = 2 * P * 3
    work = cp.work_per_rank(s, P, layout, False)
    assert work == [s * s // P] * P


def brute_force_unmasked(s, P, layout):
    """Causal (query, key) pairs with key ≤ query whose query a rank holds, by enumeration."""
    return [sum(q + 1 for q in cp_checks.TOKENS[layout](r, P, s)) for r in range(P)]     # query q sees keys 0..q


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("s, P", [(8, 1), (8, 2), (24, 3), (32, 4), (64, 8)])
def test_unmasked_work_counts_the_visible_scores(s, P, layout):
    unmasked = cp.work_per_rank(s, P, layout, True, count="unmasked")
    assert unmasked == brute_force_unmasked(s, P, layout)
    assert sum(unmasked) == s * (s + 1) // 2                  # the causal triangle, diagonal included
    computed = cp.work_per_rank(s, P, layout, True)
    piece = s // cp.n_chunks(P, layout)
    masked = {"full": 0, "diagonal": piece * (piece - 1) // 2, "shifted": piece * (piece + 1) // 2}
    want = [sum(masked[kind] for step in cp.schedule(r, P, layout, True) for _, _, kind in step) for r in range(P)]
    assert [c - u for c, u in zip(computed, unmasked)] == want


@pytest.mark.parametrize("P", range(1, 9))
def test_contiguous_unmasked_work_tends_to_2P_minus_1(P):
    s = 1024 * P
    work = cp.work_per_rank(s, P, "contiguous", True, count="unmasked")
    c = s // P
    assert work == [r * c * c + c * (c + 1) // 2 for r in range(P)]
    assert work[-1] / work[0] == pytest.approx(2 * P - 1, rel=2 / c)
    assert cp.work_per_rank(s, P, "zigzag", True, count="unmasked") == [2 * P * (c // 2) ** 2 + c // 2] * P


@pytest.mark.parametrize("P", range(1, 9))
def test_striped_causal_work_is_one_triangle_per_block(P):
    """Striped: every block computed whole (s²/P per rank); unmasked, rank r's r + 1 blocks
    from ranks 0..r keep their diagonal and its P − 1 − r others lose it, so at each step the
    ranks differ by at most s/P scores, one block's diagonal (Brandon et al. 2023)."""
    s = 4 * P
    c = s // P
    assert cp.work_per_rank(s, P, "striped", True) == [s * s // P] * P
    unmasked = cp.work_per_rank(s, P, "striped", True, count="unmasked")
    assert unmasked == [(r + 1) * c * (c + 1) // 2 + (P - 1 - r) * c * (c - 1) // 2 for r in range(P)]
    steps = cp.work_per_step(s, P, "striped", True, count="unmasked")
    spreads = [max(col) - min(col) for col in zip(*steps)]
    assert spreads == [0] + [c] * (P - 1)       # step 0: every rank's own stripe, diagonal kept


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_work_per_step_sums_to_work_per_rank_and_is_half_a_block_under_zigzag(layout, causal):
    s, P = 64, 4
    for count in cp.COUNTS:
        steps = cp.work_per_step(s, P, layout, causal, count)
        assert [sum(row) for row in steps] == cp.work_per_rank(s, P, layout, causal, count)
        assert all(len(row) == P for row in steps)
    if causal and layout == "zigzag":             # after step 0, two full pieces: half of a (s/P)² block
        assert all(w == (s // P) ** 2 // 2 for row in cp.work_per_step(s, P, layout, True) for w in row[1:])


def test_work_count_must_be_known():
    with pytest.raises(ValueError, match="count must be one of"):
        cp.work_per_step(16, 2, "zigzag", True, count="masked")
    with pytest.raises(ValueError, match="count must be one of"):
        cp.work_per_rank(16, 2, "zigzag", True, count="")


def global_pairs(P, layout, causal):
    """(query chunk, key chunk, kind, rank, step) for everything the ring computes."""
    out = []
    for r in range(P):
        mine = cp.chunk_ids(r, P, layout)
        plan = cp.schedule(r, P, layout, causal)
        assert len(plan) == P
        for i, pairs in enumerate(plan):
            theirs = cp.chunk_ids((r - i) % P, P, layout)        # step i: the block of rank r − i
            for qi, kj, kind in pairs:
                out.append((mine[qi], theirs[kj], kind, r, i))
    return out


def chunk_tokens(P, layout, s):
    """Each chunk's token positions: the ranks' tokens (cp_checks.TOKENS) cut into their chunks."""
    out = {}
    for r in range(P):
        ids, tokens = cp.chunk_ids(r, P, layout), cp_checks.TOKENS[layout](r, P, s)
        size = len(tokens) // len(ids)
        out.update({c: tokens[j * size:(j + 1) * size] for j, c in enumerate(ids)})
    return out


def mask_from_positions(q_tokens, k_tokens):
    """The causal mask of a (query chunk, key chunk) pair from its token positions — query i
    sees key j when k_tokens[j] ≤ q_tokens[i] — named as the schedule names it."""
    seen = torch.tensor(k_tokens)[None, :] <= torch.tensor(q_tokens)[:, None]       # (queries, keys)
    ones = torch.ones_like(seen)
    for kind, want in (("full", ones), ("diagonal", ones.tril()), ("shifted", ones.tril(-1))):
        if torch.equal(seen, want):
            return kind
    assert not seen.any(), f"a mask the ring cannot compute:\n{seen.int()}"
    return None


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("P", range(1, 9))
def test_causal_schedule_computes_each_needed_pair_exactly_once(P, layout):
    """The pairs with a visible key, each once, under the mask the token positions give (chunks
    of 3 tokens, so that "full", "diagonal" and "shifted" all differ); queries stay home."""
    n = cp.n_chunks(P, layout)
    tokens = chunk_tokens(P, layout, 3 * n)
    pairs = global_pairs(P, layout, True)
    seen = [(qc, kc) for qc, kc, *_ in pairs]
    needed = [(qc, kc) for qc in range(n) for kc in range(n) if mask_from_positions(tokens[qc], tokens[kc])]
    assert sorted(seen) == sorted(needed) and len(seen) == len(set(seen))
    for qc, kc, kind, r, _ in pairs:
        assert kind == mask_from_positions(tokens[qc], tokens[kc]), f"rank {r}: chunks {qc}, {kc}"
        assert qc in cp.chunk_ids(r, P, layout)                  # queries stay home


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("P", range(1, 9))
def test_non_causal_schedule_computes_every_pair_exactly_once(P, layout):
    n = cp.n_chunks(P, layout)
    pairs = global_pairs(P, layout, False)
    seen = [(qc, kc) for qc, kc, *_ in pairs]
    assert sorted(seen) == sorted((qc, kc) for qc in range(n) for kc in range(n))
    assert len(set(seen)) == n * n
    assert {kind for _, _, kind, *_ in pairs} == {"full"}


def test_schedule_for_four_ranks_by_hand():
    assert cp.schedule(0, 4, "contiguous", True) == [[(0, 0, "diagonal")], [], [], []]
    assert cp.schedule(3, 4, "contiguous", True) == [[(0, 0, "diagonal")], [(0, 0, "full")],
                                                     [(0, 0, "full")], [(0, 0, "full")]]
    # zigzag rank 0 holds chunks [0, 7]; at step 1 it holds rank 3's chunks [3, 4]
    assert cp.schedule(0, 4, "zigzag", True)[0] == [(0, 0, "diagonal"), (1, 0, "full"), (1, 1, "diagonal")]
    assert cp.schedule(0, 4, "zigzag", True)[1] == [(1, 0, "full"), (1, 1, "full")]
    # striped rank 1: its own stripe and rank 0's (earlier tokens) keep the diagonal, ranks 3 and 2 lose it
    assert cp.schedule(1, 4, "striped", True) == [[(0, 0, "diagonal")], [(0, 0, "diagonal")],
                                                  [(0, 0, "shifted")], [(0, 0, "shifted")]]


# ------------------------------------------------------------------ (d) layout helpers

@pytest.mark.parametrize("P", range(1, 9))
def test_chunk_ids_give_every_chunk_to_exactly_one_rank(P):
    for layout in cp.LAYOUTS:
        ids = [c for r in range(P) for c in cp.chunk_ids(r, P, layout)]
        assert sorted(ids) == list(range(cp.n_chunks(P, layout)))
    assert cp.n_chunks(P, "contiguous") == cp.n_chunks(P, "striped") == P and cp.n_chunks(P, "zigzag") == 2 * P
    assert [cp.chunk_ids(r, P, "zigzag") for r in range(P)] == [[r, 2 * P - 1 - r] for r in range(P)]
    assert [cp.chunk_ids(r, P, "contiguous") for r in range(P)] == [[r] for r in range(P)]
    assert [cp.chunk_ids(r, P, "striped") for r in range(P)] == [[r] for r in range(P)]


@pytest.mark.parametrize("P", range(1, 6))
def test_every_layout_deals_the_tokens_its_definition_says(P):
    """The registry against the layouts written out in cp_checks.TOKENS (every layout has one):
    each rank's positions, and every token on exactly one rank."""
    assert set(cp.LAYOUTS) == set(cp_checks.TOKENS)
    for layout in cp.LAYOUTS:
        s = 3 * cp.n_chunks(P, layout)
        held = [cp.positions(r, P, s, layout) for r in range(P)]
        assert held == [cp_checks.TOKENS[layout](r, P, s) for r in range(P)]
        assert sorted(sum(held, [])) == list(range(s))
    assert cp.positions(1, 4, 16, "striped") == [1, 5, 9, 13]          # token i on rank i mod P
    assert cp.get_layout("striped") is cp.LAYOUTS["striped"]


@pytest.mark.parametrize("P", [0, -1, 2.5, True, "2", None])
def test_n_chunks_rejects_a_bad_degree(P):
    with pytest.raises(ValueError, match="the context-parallel degree P must be a whole number ≥ 1"):
        cp.n_chunks(P, "zigzag")


@pytest.mark.parametrize("call", [lambda: cp.n_chunks(2, "stripes"), lambda: cp.chunk_ids(0, 2, "Zigzag"),
                                  lambda: cp.check_sequence(8, 2, "ring"),
                                  lambda: cp.work_per_rank(8, 2, "", True),
                                  lambda: cp.schedule(0, 2, "contiguous ", True),
                                  lambda: cp.positions(0, 2, 8, ["zigzag"]),
                                  lambda: cp.get_layout(None)])
def test_unknown_layouts_are_rejected(call):
    with pytest.raises(ValueError, match=re.escape("layout must be one of ('contiguous', 'zigzag', 'striped')")):
        call()


@pytest.mark.parametrize("rank, P", [(2, 2), (-1, 2), (4, 4), (1, 1)])
def test_chunk_ids_rejects_a_rank_outside_the_group(rank, P):
    with pytest.raises(ValueError, match=re.escape(f"rank {rank} is not one of the P={P} ranks")):
        cp.chunk_ids(rank, P, "zigzag")


@pytest.mark.parametrize("s, P, layout", [(8, 1, "zigzag"), (8, 4, "zigzag"), (8, 8, "contiguous"),
                                          (6, 3, "zigzag"), (7, 7, "contiguous"), (2, 1, "zigzag"),
                                          (12, 4, "striped"), (5, 5, "striped")])
def test_check_sequence_accepts(s, P, layout):
    assert cp.check_sequence(s, P, layout) is None


@pytest.mark.parametrize("s, P, layout, message", [
    (12, 4, "zigzag", "sequence length 12 is not divisible by 2P = 8 (the zigzag layout cuts it into 8 equal chunks)"),
    (6, 4, "contiguous", "sequence length 6 is not divisible by P = 4"),
    (3, 1, "zigzag", "sequence length 3 is not divisible by 2P = 2"),
    (10, 2, "zigzag", "sequence length 10 is not divisible by 2P = 4"),
    (6, 4, "striped", "sequence length 6 is not divisible by P = 4 (the striped layout cuts it into 4 equal chunks)"),
])
def test_check_sequence_names_the_rule(s, P, layout, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        cp.check_sequence(s, P, layout)
    with pytest.raises(ValueError, match=re.escape(message)):
        cp.work_per_rank(s, P, layout, True)


def fake_group(monkeypatch, P, rank):
    """shard_sequence only asks the group for its size and this rank: no process group needed."""
    monkeypatch.setattr(cp, "dist", SimpleNamespace(get_world_size=lambda group: P, get_rank=lambda group: rank))


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_shard_sequence_takes_this_ranks_chunks(monkeypatch, layout, dim):
    P = 3
    x = torch.arange(6 * 12 * 6).reshape(6, 12, 6)
    parts = []
    for r in range(P):
        fake_group(monkeypatch, P, r)
        parts.append(cp.shard_sequence(x, dim, None, layout))
    for r, part in enumerate(parts):
        assert torch.equal(part, x.index_select(dim, torch.tensor(cp_checks.TOKENS[layout](r, P, x.shape[dim]))))
    assert torch.equal(torch.cat(parts, dim).sort(dim).values, x.sort(dim).values)   # nothing lost


@pytest.mark.parametrize("dim", [3, -4])
def test_shard_sequence_rejects_a_dim_out_of_range(monkeypatch, dim):
    fake_group(monkeypatch, 2, 0)
    x = torch.zeros(4, 4, 4)
    with pytest.raises((ValueError, IndexError)):
        cp.shard_sequence(x, dim, None, "contiguous")


# ------------------------------------------------------------------ (e) cp_costs

@pytest.mark.parametrize("P", [1, 2, 4, 8])
@pytest.mark.parametrize("itemsize", [2, 4])
def test_cp_costs_ring_bytes(P, itemsize):
    s, b, heads, d = 64, 2, 8, 16
    block = b * (s // P) * heads * d * itemsize
    for layout in cp.LAYOUTS:
        for causal in (True, False):
            c = cp.cp_costs(s, b, heads, d, P, "ring", causal, layout, itemsize)
            assert c["forward"] == 2 * (P - 1) * block
            # k, v again, and P moves of dk, dv in float32
            assert c["backward"] == 2 * (P - 1) * block + (2 * P * block * 4 // itemsize if P > 1 else 0)
            assert c["sent"] == c["forward"] + c["backward"]
            assert c["scores"] == max(cp.work_per_rank(s, P, layout, causal)) * b * heads
            assert c["flops"] == 4 * d * c["scores"]
            assert c["memory"] == 6 * block


@pytest.mark.parametrize("P", [1, 2, 4, 8])
def test_cp_costs_ulysses_bytes(P):
    s, b, heads, d, itemsize = 64, 2, 8, 16, 2
    block = b * (s // P) * heads * d * itemsize
    for causal in (True, False):
        c = cp.cp_costs(s, b, heads, d, P, "ulysses", causal, itemsize=itemsize)
        assert c["forward"] == pytest.approx(4 * (P - 1) / P * block)
        assert c["backward"] == c["forward"]
        assert c["sent"] == pytest.approx(8 * (P - 1) / P * block)
        assert c["scores"] == b * (heads // P) * (s * (s + 1) // 2 if causal else s * s)
        assert c["memory"] == 8 * block


def test_cp_costs_zigzag_balances_the_causal_ring():
    s, b, heads, d, P = 1024, 1, 8, 64, 8
    contiguous = cp.cp_costs(s, b, heads, d, P, "ring", True, "contiguous")
    zigzag = cp.cp_costs(s, b, heads, d, P, "ring", True, "zigzag")
    assert contiguous["forward"] == zigzag["forward"]
    # the busiest rank: all P blocks against (2P + 1)/4 of them
    assert contiguous["scores"] / zigzag["scores"] == pytest.approx(P / ((2 * P + 1) / 4))


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="flash"), "method must be 'ring' or 'ulysses', got 'flash'"),
    (dict(method="Ring"), "method must be 'ring' or 'ulysses', got 'Ring'"),
    (dict(method="ulysses", heads=6, P=4),
     "6 heads are not divisible by the context-parallel degree P=4"),
    (dict(method="ulysses", heads=2, P=4), "(P > heads)"),
    (dict(method="ulysses", s=30, P=4), "sequence length 30 is not divisible by P = 4"),
    (dict(method="ring", s=36, P=4), "sequence length 36 is not divisible by 2P = 8"),
    (dict(method="ring", layout="stripes"), "layout must be one of"),
    (dict(s=0), "sequence length must be a whole number ≥ 1, got 0"),
    (dict(b=1.5), "batch must be a whole number ≥ 1, got 1.5"),
    (dict(heads=True), "heads must be a whole number ≥ 1, got True"),
    (dict(d=-8), "head dimension must be a whole number ≥ 1, got -8"),
    (dict(itemsize=0), "itemsize must be a whole number ≥ 1, got 0"),
    (dict(P=2.5), "the context-parallel degree P must be a whole number ≥ 1, got 2.5"),
])
def test_cp_costs_errors_name_the_rule(kwargs, message):
    args = dict(s=64, b=1, heads=8, d=16, P=4, method="ring", causal=True, layout="zigzag", itemsize=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        cp.cp_costs(**args)


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_cp_costs_rejects_zero_ranks(method):
    with pytest.raises(ValueError, match="P must be a whole number"):
        cp.cp_costs(64, 1, 8, 16, 0, method)


def test_nothing_here_starts_a_process_group():
    assert not dist.is_initialized()


# ------------------------------------------------------------------ (f) grouped-query attention and the backward's costs

@pytest.mark.parametrize("P", [1, 2, 4])
def test_cp_costs_with_grouped_query_attention(P):
    """The ring moves only the kv heads; Ulysses' q and output all-to-alls keep all heads."""
    s, b, heads, kv, d, e = 64, 2, 8, 2, 16, 2
    q_block, kv_block = b * (s // P) * heads * d * e, b * (s // P) * kv * d * e
    ring = cp.cp_costs(s, b, heads, d, P, "ring", True, "zigzag", e, kv_heads=kv)
    assert ring["forward"] == 2 * (P - 1) * kv_block
    assert ring["backward"] == 2 * (P - 1) * kv_block + (2 * P * kv_block * 4 // e if P > 1 else 0)
    assert ring["memory"] == 2 * q_block + 4 * kv_block
    full = cp.cp_costs(s, b, heads, d, P, "ring", True, "zigzag", e)
    assert ring["forward"] * heads == full["forward"] * kv and ring["scores"] == full["scores"]
    uly = cp.cp_costs(s, b, heads, d, P, "ulysses", True, itemsize=e, kv_heads=kv) if kv % P == 0 else None
    if uly is not None:
        assert uly["forward"] == pytest.approx((P - 1) / P * (2 * q_block + 2 * kv_block))
    for c in (ring, full):
        assert c["backward_flops"] == 10 * d * c["scores"] == 2.5 * c["flops"]


def test_cp_costs_rejects_kv_heads_that_do_not_divide_the_heads():
    with pytest.raises(ValueError, match=re.escape("the number of heads 8 is not divisible by the number of "
                                                   "key/value heads 3")):
        cp.cp_costs(64, 1, 8, 16, 2, "ring", kv_heads=3)
    with pytest.raises(ValueError, match="kv_heads/P whole key/value heads: 2 key/value heads"):
        cp.cp_costs(64, 1, 8, 16, 4, "ulysses", kv_heads=2)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("P", [2, 4, 8])
def test_ring_step_sums_to_cp_costs(P, causal):
    """Steps 1..P−1 of the ring: forward bytes (P−1)·step; backward P−1 k, v moves and P gradient
    moves; FLOPs: a whole block per step, or zigzag's half block under a causal mask."""
    s, heads, kv, d, e = 32 * P, 4, 2, 8, 2
    c = s // P
    step = cp.ring_step(c, heads, d, kv, e, causal)
    costs = cp.cp_costs(s, 1, heads, d, P, "ring", causal, "zigzag", e, kv_heads=kv)
    assert (P - 1) * step["forward_bytes"] == costs["forward"]
    grads = step["backward_bytes"] - step["forward_bytes"]
    assert (P - 1) * step["forward_bytes"] + P * grads == costs["backward"]
    assert grads == step["forward_bytes"] * 4 // e                     # float32 dk, dv beside bf16 k, v
    steps = cp.work_per_step(s, P, "zigzag", causal)
    assert all(4 * d * w * heads == step["forward_flops"] for w in steps[0][1:])
    assert step["backward_flops"] == 2.5 * step["forward_flops"]
    assert cp.ring_step(c, heads, d, kv, e, causal, grad_itemsize=e)["backward_bytes"] == 2 * step["forward_bytes"]


def test_overlap_tokens_is_liu_et_als_condition_and_the_backward_needs_more():
    F, B, e = 5e14, 5e10, 2                    # F: an achieved rate ηF here (half an H100-like peak)
    assert cp.overlap_tokens(F, B, 8, 128, itemsize=e) == pytest.approx(e * F / (2 * B))
    assert cp.overlap_tokens(F, B, 8, 128, itemsize=e, causal=True) == pytest.approx(e * F / B)
    assert cp.overlap_tokens(F, B, 128, 128, 8, e, True) == pytest.approx(e * F / B * 8 / 128)
    fwd = cp.overlap_tokens(F, B, 8, 128, itemsize=e, causal=True)
    assert cp.overlap_tokens(F, B, 8, 128, itemsize=e, causal=True, phase="backward") == pytest.approx(1.2 * fwd)
    assert cp.overlap_tokens(F, B, 8, 128, itemsize=e, causal=True, phase="backward",
                             grad_itemsize=e) == pytest.approx(0.8 * fwd)
    # float32 inputs: float32 gradients too, twice the bytes, 0.8 of the forward's threshold
    assert cp.overlap_tokens(F, B, 8, 128, itemsize=4, phase="backward") == pytest.approx(
        0.8 * cp.overlap_tokens(F, B, 8, 128, itemsize=4))


@pytest.mark.parametrize("kwargs, message", [
    (dict(phase="both"), "phase must be 'forward' or 'backward', got 'both'"),
    (dict(flops_per_s=0), "flops_per_s must be a positive, finite number, got 0"),
    (dict(bytes_per_s=float("inf")), "bytes_per_s must be a positive, finite number, got inf"),
    (dict(kv_heads=3), "the number of heads 8 is not divisible by the number of key/value heads 3"),
    (dict(grad_itemsize=0), "grad_itemsize must be a whole number ≥ 1, got 0"),
])
def test_overlap_tokens_errors_name_the_rule(kwargs, message):
    args = dict(flops_per_s=5e14, bytes_per_s=5e10, heads=8, d=128)
    args.update(kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        cp.overlap_tokens(**args)


@pytest.mark.parametrize("heads, P, kv_heads", [(8, 2, 4), (8, 4, 4), (16, 2, 2), (4, 1, 1)])
def test_check_ulysses_accepts_kv_heads_divisible_by_P(heads, P, kv_heads):
    assert cp.check_ulysses(heads, P, kv_heads=kv_heads) is None


@pytest.mark.parametrize("heads, P, kv_heads, message", [
    (8, 4, 2, "2 key/value heads are not divisible by the context-parallel degree P=4 (P > kv_heads)"),
    (12, 2, 3, "3 key/value heads are not divisible by the context-parallel degree P=2"),
    (8, 2, 3, "the number of heads 8 is not divisible by the number of key/value heads 3"),
    (8, 2, 0, "the number of key/value heads must be a whole number ≥ 1, got 0"),
])
def test_check_ulysses_names_the_kv_rule(heads, P, kv_heads, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        cp.check_ulysses(heads, P, kv_heads=kv_heads)
