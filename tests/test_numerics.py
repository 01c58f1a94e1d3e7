"""Numerics of ring attention and its online softmax (intralayer.context_parallel).

One process, no launches: :func:`~intralayer.context_parallel.block_attention` and
:func:`~intralayer.context_parallel.merge_partials` directly, ``ring_attention`` on a
one-rank gloo group (forward and backward), and the forward of every rank of a P-rank
ring simulated in this process (the k/v exchange replaced by handing each rank the block
it would receive). Four themes:

(a) fully masked blocks and rows: the running state starts at (0, −∞); a block nothing
    of which is visible leaves it unchanged; nothing turns into NaN, forward or backward;
(b) very long rows: four queries against 2^18 keys in 256 blocks, merged in a row (as the
    ring does) and as a tree, against float64, within a derived error bound;
(c) large logits: scores offset by 1e4, of order ±1e30 and up to 0.83 × float32's
    largest number, and a score that overflows;
(d) the log-sum-exp carried: finite where a key is visible, −∞ (never NaN) where none is.

Tolerances
----------
Every comparison is against a float64 reference computed from the *same* inputs (bf16
inputs are exact in float32 and float64, so their rounding is no error of the code under
test). The library computes in float32 (``_work_dtype``) and rounds the results once to
the input's dtype. Unit roundoff u (``tests/programs/checks.py``, ``UNIT_ROUNDOFF``):

==========  ===============  =============================================================
dtype       u                role here and its tolerance
==========  ===============  =============================================================
float64     2^-53 ≈ 1.1e-16  the reference; its own error is ignored (2^29 below float32's)
float32     2^-24 ≈ 6.0e-8   the work dtype: |err| ≤ γ_n·mag, γ_n = n·u/(1 − n·u), with
                             n counted below and mag the float64 magnitude of the terms
bfloat16    2^-8  ≈ 3.9e-3   inputs and the returned output/gradients: one final rounding
                             adds u·|want| (relative); nothing else is done in bfloat16
==========  ===============  =============================================================

Roundings counted (first order, in units of u; σ = max scale·Σ_i |q_i k_i| the score
magnitude, Λ the largest |log-sum-exp| of a block or the running state, B keys per block,
d head dim). Shifting the scores by δ_j moves the softmax, and so the output relative to
mag = p·|v|, by at most the spread max δ − min δ:

- a score q·k·scale: d + 1 roundings relative to σ, so |δs| ≤ γ_{d+1}·σ: 2(d + 1)σ;
- one block (``block_attention``): exp(s − m), m the row max, with the argument rounded
  (|s − m| ≤ 2σ) and exp itself (2), a shift of each score by up to 2σ + 2: 4σ + 4; then
  e·v and Σe, B terms each, and a division: 2B + 1. In all 2(d + 1)σ + 4σ + 2B + 5. Its
  ℓ = m + log Σe is off the log of the sum the output was divided by only through the log
  (2 ln B) and the addition (Λ);
- each ``merge_partials``: its weights sigmoid(ℓ_a − ℓ_b) are exact for the two sides'
  scores shifted by their ℓs' errors (≤ Λ + 2 ln B + 3 each: a block's, as above, or a
  merged one's, logaddexp rounded, Λ + 3) and by the rounding of the difference (≤ 2Λ);
  sigmoid itself (3), two products and a sum (3): 4Λ + 4 ln B + 12. K blocks merged in a
  row make a chain of K − 1 such merges (the first, onto (0, −∞), is exact), whose shifts
  add up; merged as a tree, a chain of ⌈log2 K⌉;
- the ring (``_merge_parts``) hands merge_partials each side's ℓ relative to the larger
  row max M, (m − M) + λ, λ = log Σ e^(s − m) ≤ ln(keys): two more roundings per side
  (2σ + (2σ + ln keys)), but no Λ: a side's own error is its λ's (≤ 2 ln keys + 3: a
  block's log, or a merge's logaddexp) and the difference is at most 2σ + ln keys:
  2(4σ + 3 ln keys + 3) + (2σ + ln keys) + 6 = 10σ + 7 ln(keys) + 12 per merge;
- a log-sum-exp (absolute): the scores' (d + 1)σ, the exp arguments' 2σ + 2, Σe's B, the
  log's 2 ln B and the addition's Λ; each merge its logaddexp's Λ + 3 (the inputs'
  errors pass through as a convex combination, not a sum);
- backward: p = exp((s − m) − λ) recomputed with the forward's m and λ: the scores'
  2(d + 1)σ, the two subtractions' 2σ + (2σ + ln keys), exp's 2, and λ's own error (the
  forward's 2σ + 2 + B + 2 ln B and one ring merge's count per merge); then dO·v and
  rowsum(dO ⊙ O) (2d), one subtraction, and the sums over queries or keys for dq, dk, dv
  (2s): 2d + 2s + 6 more, relative to the float64 magnitudes |dS|·|k|, |dS|ᵀ·|q|, pᵀ·|dO|
  (:func:`reference`).

These are worst-case bounds: the errors measured are far smaller (they say so when they
fail). They still catch what matters: a running state held in bfloat16 breaks the
long-row bound by a factor of ~9, a dropped block or a NaN at once.

Four tests here (six cases) began as strict xfails for bugs they found, three from
normalising with exp(s − ℓ), ℓ already rounded to float32, whose rounding u·|ℓ| became a
relative error of the output: an output outside the convex hull of v when scores tie at
a huge value (forward, and the backward's recomputed p) and float32 accuracy lost at
scores near 1e4; and a score that overflows float32 turning its row silently into zeros
(a test for ℓ = −∞ that caught +∞ too). The library is fixed (row max and row sum; ℓ
kept as m + λ in the ring; sigmoid merge weights; ~isneginf) and they are plain tests
now, with one more: ties across the ring's merges.
"""
from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from intralayer import context_parallel as cp

from tests.programs.checks import UNIT_ROUNDOFF, gamma

U32 = UNIT_ROUNDOFF[torch.float32]
NEG_INF = float("-inf")


def _bf16_unsupported() -> str:
    """'' when this torch build runs the bfloat16 ops the library uses on CPU, else why not."""
    try:
        x = torch.ones(2, 2, dtype=torch.bfloat16)
        x @ x, torch.logsumexp(x, -1), torch.logaddexp(x, x), torch.exp(x), x.float().bfloat16()
    except (RuntimeError, TypeError, NotImplementedError) as e:      # pragma: no cover
        return f"bfloat16 ops unsupported on this CPU build: {e}"
    return ""


BF16 = pytest.param(torch.bfloat16, id="bfloat16",
                    marks=pytest.mark.skipif(bool(_bf16_unsupported()), reason=_bf16_unsupported() or "-"))
DTYPES = [pytest.param(torch.float32, id="float32"), BF16]


# ---------------------------------------------------------------------------- helpers

def rand(*shape, seed, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def within(got, want, mag, n, what, rel=None):
    """``|got − want| ≤ γ_n(float32)·mag + u(got.dtype)·|want|`` elementwise, and got finite.

    ``want`` and ``mag`` are float64; the second term is the final rounding to a dtype
    narrower than float32 (bfloat16). ``rel`` overrides that final-rounding term.
    """
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{what}: not finite: {got}"
    if rel is None:
        rel = UNIT_ROUNDOFF[got.dtype] if UNIT_ROUNDOFF[got.dtype] > U32 else 0.0
    g = gamma(n)
    bound = (1 + rel) * g * mag + rel * want.abs()
    err = (got.double() - want).abs()
    worst = float((err / bound.clamp_min(1e-300)).max())
    assert (err <= bound).all(), (f"{what}: error {float(err.max()):.3g} over the bound (γ_{n:.0f} = {g:.3g} "
                                  f"× mag{'' if not rel else f' + {rel:.3g}·|want|'}); worst error/bound {worst:.3g}")
    return worst


def scores64(q, k, scale, causal):
    s = (q.double() @ k.double().transpose(-2, -1)) * scale
    if causal:
        m, n = s.shape[-2:]
        s = s.masked_fill(torch.ones(m, n, dtype=torch.bool).triu(n - m + 1), NEG_INF)
    return s


def reference(q, k, v, scale, causal=False, dout=None):
    """Float64 attention of q to k, v: output, log-sum-exp, the magnitudes the bounds scale
    with, σ, and with ``dout`` the gradients and their magnitudes (formulas in the module
    docstring)."""
    s = scores64(q, k, scale, causal)
    p = torch.softmax(s, -1)
    v64 = v.double()
    out = p @ v64
    r = dict(s=s, p=p, out=out, lse=torch.logsumexp(s, -1), mag_out=p @ v64.abs())
    visible = torch.isfinite(s)
    absprod = (q.double().abs() @ k.double().abs().transpose(-2, -1)) * scale
    r["sigma"] = float(torch.where(visible, absprod, torch.zeros_like(absprod)).max())
    if dout is not None:
        do = dout.double()
        dp = do @ v64.transpose(-2, -1)
        delta = (do * out).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        mag_ds = p * (do.abs() @ v64.abs().transpose(-2, -1) + (do.abs() * out.abs()).sum(-1, keepdim=True))
        r.update(dq=ds @ k.double() * scale, dk=ds.transpose(-2, -1) @ q.double() * scale,
                 dv=p.transpose(-2, -1) @ do,
                 mag_dq=mag_ds @ k.double().abs() * scale, mag_dk=mag_ds.transpose(-2, -1) @ q.double().abs() * scale,
                 mag_dv=p.transpose(-2, -1) @ do.abs())
    return r


def lam_of(r, keys):
    """Λ ≥ the largest |ℓ| of a block, the running state or the final state: each ℓ is at
    least one visible score (≥ −σ) and at most the final ℓ (≤ σ + log(keys))."""
    return max(float(r["lse"].abs().max()), r["sigma"] + math.log(keys))


def n_block(d, sigma, keys):
    """Roundings of one block's output (module docstring): 2(d + 1)σ + 4σ + 2B + 5."""
    return 2 * (d + 1) * sigma + 4 * sigma + 2 * keys + 5


def n_merge(lam, keys):
    """Roundings one merge_partials adds (module docstring): 4Λ + 4 ln B + 12."""
    return 4 * lam + 4 * math.log(keys) + 12


def n_ring_merge(sigma, keys):
    """Roundings one merge of the ring's (out, m, λ) state adds (module docstring):
    10σ + 7 ln(keys) + 12, with no Λ."""
    return 10 * sigma + 7 * math.log(keys) + 12


def n_lse(d, sigma, lam, keys, chain):
    """Roundings (absolute, in units of u) of a log-sum-exp (module docstring): one block's
    (d + 1)σ + 2σ + 2 + B + 2 ln B + Λ, and Λ + 3 per merge."""
    return (d + 1) * sigma + 2 * sigma + 2 + keys + 2 * math.log(keys) + lam + chain * (lam + 3)


def n_probs(d, sigma, keys, chain):
    """Roundings of the backward's p = exp((s − m) − λ), relative (module docstring):
    2(d + 1)σ + 4σ + ln(keys) + 2, and λ's 2σ + 2 + B + 2 ln B plus a ring merge per merge."""
    return 2 * (d + 1) * sigma + 6 * sigma + 3 * math.log(keys) + keys + 4 + chain * n_ring_merge(sigma, keys)


def n_backward(n_p, d, s):
    """Roundings of a gradient: p's (n_p), then 2d + 2s + 6 (module docstring)."""
    return n_p + 2 * d + 2 * s + 6


@pytest.fixture(autouse=True)
def one_thread():
    """These are hundreds of tiny ops: on a busy 2-core machine (two test workers) the
    intra-op thread pool's barriers cost 10–30× the arithmetic. The bounds hold for any
    summation order, so the thread count does not matter to them."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def solo_group(tmp_path, monkeypatch):
    """A one-rank gloo group in this process (as in tests/test_launch.py)."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def ring_1rank(q, k, v, dout, group, causal, layout):
    """ring_attention on one rank, forward and backward: output and input gradients."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = cp.ring_attention(*leaves, group, causal, layout)
    out.backward(dout)
    return out.detach(), *(t.grad for t in leaves)


def check_ring_against(r, got, d, s, what):
    """Output and gradients of ring_attention (one rank, one block per piece) within their bounds."""
    out, dq, dk, dv = got
    keys = s                       # zigzag pieces are shorter: s is an upper bound
    n_out = n_block(d, r["sigma"], keys) + n_ring_merge(r["sigma"], keys)   # a second piece: one merge
    within(out, r["out"], r["mag_out"], n_out, f"{what} output")
    n_g = n_backward(max(n_out, n_probs(d, r["sigma"], keys, 1)), d, s)
    for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert t.dtype == out.dtype, f"{what} {name}: dtype {t.dtype}"
        within(t, r[name], r["mag_" + name], n_g, f"{what} {name}")


# ---------------------------------------------------------------------------- (a) fully masked

@pytest.mark.parametrize("dtype", DTYPES)
def test_merging_a_block_with_no_visible_key_changes_nothing(dtype):
    """The running state starts at (out = 0, ℓ = −∞): "no key seen yet".

    merge_partials must treat a side with ℓ = −∞ as the identity: logaddexp(−∞, ℓ) = ℓ
    exactly, the weights are sigmoid(−∞) = 0 and sigmoid(+∞) = 1 exactly, so the other
    side comes through bit for bit (tolerance 0, in either order and in either dtype). Both
    sides −∞ (a row masked so far): their difference −∞ − (−∞) is NaN, which the
    ``torch.where`` on ~isneginf(new) must keep out: the result is (0, −∞), no NaN.
    """
    o = rand(2, 3, 5, 4, seed=1, dtype=dtype)
    lse = rand(2, 3, 5, seed=2, dtype=dtype, scale=3.0)
    lse[0, 0, :2] = NEG_INF                                        # two rows that saw no key either
    o[0, 0, :2] = 0
    zero, none = torch.zeros_like(o), torch.full_like(lse, NEG_INF)
    for a, b in (((zero, none), (o, lse)), ((o, lse), (zero, none))):
        out, new = cp.merge_partials(*a, *b)
        assert out.dtype == new.dtype == dtype
        assert torch.equal(out, o) and torch.equal(new, lse)       # exact: tolerance 0
    out, new = cp.merge_partials(zero, none, zero, none)
    assert not torch.isnan(out).any() and not torch.isnan(new).any()
    assert torch.equal(out, zero) and bool((new == NEG_INF).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_block_whose_every_score_is_minus_inf(dtype):
    """A key block entirely masked (an additive −∞ mask: every score of every row is −∞).

    Built from k = −∞ and q > 0, so q·k = −∞ exactly. The row max is −∞, and s − max would
    be −∞ − (−∞) = NaN: block_attention must subtract 0 instead, so every exp is 0, the row
    sum 0, and the row neither divided by it nor NaN: the block's result is exactly
    (0, −∞), and merging it into a visible block's result returns that result bit for bit
    (tolerance 0).
    """
    q = rand(1, 2, 3, 4, seed=3).abs().add(0.1).to(dtype)          # every entry > 0
    k = torch.full((1, 2, 5, 4), NEG_INF, dtype=dtype)
    v = rand(1, 2, 5, 4, seed=4, dtype=dtype)
    bo, bl = cp.block_attention(q, k, v, 0.5, diagonal=False)
    assert torch.equal(bo, torch.zeros(1, 2, 3, 4)) and bool((bl == NEG_INF).all())
    assert not torch.isnan(bo).any() and not torch.isnan(bl).any()
    seen_o, seen_l = cp.block_attention(q, rand(1, 2, 5, 4, seed=5, dtype=dtype), v, 0.5, diagonal=True)
    assert torch.isfinite(seen_o).all() and torch.isfinite(seen_l).all()
    for a, b in (((bo, bl), (seen_o, seen_l)), ((seen_o, seen_l), (bo, bl))):
        out, new = cp.merge_partials(*a, *b)
        assert torch.equal(out, seen_o) and torch.equal(new, seen_l)


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_ring_on_one_rank_with_masked_blocks_and_one_key_rows(solo_group, dtype, layout):
    """Causal ring attention on one rank, forward and backward, against float64.

    The first query sees exactly one key (its softmax is 1, its max starts from −∞); under
    zigzag the rank holds chunks 0 and 1, and query chunk 0 against key chunk 1 is a fully
    masked block that the schedule must skip, not compute into NaN. Everything finite and
    within the bounds of the module docstring: output 2(d + 1)σ + 4σ + 2s + 5 plus one ring
    merge (10σ + 7 ln s + 12), gradients 2d + 2s + 6 more on top of that or of p's error;
    bfloat16 output and gradients also carry their one final rounding, u = 2^-8 relative.
    """
    b, h, s, d = 1, 2, 16, 8
    q, k, v, dout = (rand(b, h, s, d, seed=10 + i, dtype=dtype) for i in range(4))
    scale = d ** -0.5
    r = reference(q, k, v, scale, causal=True, dout=dout)
    got = ring_1rank(q, k, v, dout, solo_group, True, layout)
    assert got[0].dtype == dtype
    check_ring_against(r, got, d, s, f"{dtype} causal {layout}")
    torch.testing.assert_close(got[0][..., 0, :].double(), v[..., 0, :].double(), rtol=0, atol=0)  # one key: exact


def simulated_ring_forward(monkeypatch, q, k, v, P, layout, causal):
    """Every rank's output of a P-rank ring, run one rank after another in this process.

    The process group is a stand-in that reports (P, r), and ``comm.ring_exchange_start``
    hands rank r, at step i, the k/v block of rank r − i − 1, which is what the real ring
    delivers. Forward only: the backward's travelling dk/dv need all ranks at once.
    """
    shards = {}
    for r in range(P):
        monkeypatch.setattr(cp, "dist", SimpleNamespace(get_world_size=lambda g: P, get_rank=lambda g, r=r: r))
        shards[r] = [cp.shard_sequence(t, 2, None, layout) for t in (q, k, v)]
    outs = []
    for r in range(P):
        step = [0]

        def exchange(tensors, shift=1, group=None, label="", phase="forward", r=r, step=step):
            step[0] += 1
            j = (r - step[0]) % P
            return SimpleNamespace(wait=lambda: [shards[j][1], shards[j][2]])

        monkeypatch.setattr(cp, "dist", SimpleNamespace(get_world_size=lambda g: P, get_rank=lambda g, r=r: r))
        monkeypatch.setattr(cp.comm, "ring_exchange_start", exchange)
        with torch.no_grad(), cp.counting() as work:
            outs.append(cp.ring_attention(*shards[r], None, causal, layout))
        want_blocks = sum(len(pairs) for pairs in cp.schedule(r, P, layout, causal))
        assert work.blocks == want_blocks, f"rank {r} computed {work.blocks} blocks, the schedule {want_blocks}"
    return outs


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_ring_forward_on_every_rank_of_four(monkeypatch, dtype, layout):
    """A four-rank causal ring, every rank's forward, against float64 attention.

    Contiguous: rank 0's queries come before every other rank's keys, so its steps 1–3 are
    fully masked and skipped, and its state after step 0 must come out untouched; rank 3
    merges four blocks. Zigzag: every rank skips some (query chunk, key chunk) pairs.
    Bound: one block (2(d + 1)σ + 4σ + 2B + 5, B = s/P keys) plus 2P − 1 ring merges at most
    (10σ + 7 ln s + 12 each); bfloat16 output adds its final rounding.
    """
    P, b, h, s, d = 4, 1, 2, 16, 4
    q, k, v = (rand(b, h, s, d, seed=20 + i, dtype=dtype) for i in range(3))
    scale = d ** -0.5
    r = reference(q, k, v, scale, causal=True)
    outs = simulated_ring_forward(monkeypatch, q, k, v, P, layout, True)
    n = n_block(d, r["sigma"], s // P) + (2 * P - 1) * n_ring_merge(r["sigma"], s)
    for rank, out in enumerate(outs):
        assert out.dtype == dtype
        monkeypatch.setattr(cp, "dist", SimpleNamespace(get_world_size=lambda g: P, get_rank=lambda g, x=rank: x))
        want, mag = (cp.shard_sequence(t, 2, None, layout) for t in (r["out"], r["mag_out"]))
        within(out, want, mag, n, f"{dtype} {layout} rank {rank}")


# ---------------------------------------------------------------------------- (b) long rows

@functools.lru_cache(maxsize=2)
def long_row(dtype, n_keys=2 ** 18, block=2 ** 10, seed=30):
    """4 queries (1, 1, 4, 32) against n_keys keys: inputs, float64 reference, Λ (from the
    float64 log-sum-exp of every block and of the row), d. Cached: both merge orders use it."""
    d = 32
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 1, n, d, generator=g).to(dtype) for n in (4, n_keys, n_keys))
    scale = d ** -0.5
    r = reference(q, k, v, scale)
    block_lse = torch.logsumexp(r["s"].unflatten(-1, (n_keys // block, block)), -1)
    lam = max(float(r["lse"].abs().max()), float(block_lse.abs().max()))   # running ℓ lies between them
    blocks = [(k[..., i:i + block, :], v[..., i:i + block, :]) for i in range(0, n_keys, block)]
    return q, blocks, scale, r, lam, d


def merge_in_a_row(parts, state_dtype=torch.float32):
    out = torch.zeros_like(parts[0][0], dtype=state_dtype)
    lse = torch.full_like(parts[0][1], NEG_INF, dtype=state_dtype)
    for bo, bl in parts:
        out, lse = cp.merge_partials(out, lse, bo.to(state_dtype), bl.to(state_dtype))
    return out, lse


def merge_as_a_tree(parts):
    while len(parts) > 1:
        parts = [cp.merge_partials(*parts[i], *parts[i + 1]) if i + 1 < len(parts) else parts[i]
                 for i in range(0, len(parts), 2)]
    return parts[0]


@pytest.mark.parametrize("order", ["in a row", "as a tree"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_of_2_18_keys_in_256_blocks(dtype, order):
    """Online softmax over rows of 2^18 keys, 256 blocks of 1024, against float64.

    Error model (module docstring): each block costs n_block = 2(d + 1)σ + 4σ + 2B + 5
    roundings relative to mag = p·|v| (elementwise), and each merge_partials
    4Λ + 4 ln B + 12. A merge multiplies the error already in the state by its weight
    sigmoid(ℓ_a − ℓ_b) ≤ 1 and adds its own, so merging in a row (the ring's order, the
    recursive summation of the numerators Σ e^(s_j)·v_j) has a worst case *linear* in the
    chain, K − 1 = 255 merges; a pairwise tree has a chain of ⌈log2 K⌉ = 8 (as pairwise
    summation's γ_{log2 n}). The log-sum-exp (absolute): (d + 1)σ + 2σ + 2 + B + 2 ln B
    + Λ + chain·(Λ + 3) units of u. With d = 32, σ ≈ 8, Λ ≈ 13 that is γ ≈ 1.6e-3 in a row
    and 2.0e-4 as a tree; the errors measured are ~3e-8 and ~1e-8 of mag (the bounds are
    worst cases). bfloat16 inputs: the same (the state stays float32, as in the ring), plus
    one rounding of the output to bfloat16. A state kept in bfloat16 instead is ~1.5e-2
    off, ~9 times the in-a-row bound (checked on the float32 case).
    """
    q, blocks, scale, r, lam, d = long_row(dtype)
    B, K = blocks[0][0].shape[2], len(blocks)
    parts = [cp.block_attention(q, kb, vb, scale, diagonal=False) for kb, vb in blocks]
    out, lse = merge_in_a_row(parts) if order == "in a row" else merge_as_a_tree(parts)
    chain = K - 1 if order == "in a row" else math.ceil(math.log2(K))
    n_out = n_block(d, r["sigma"], B) + chain * n_merge(lam, B)
    within(out.to(dtype), r["out"], r["mag_out"], n_out, f"{dtype} {order}: output")
    within(lse, r["lse"], torch.ones_like(r["lse"]), n_lse(d, r["sigma"], lam, B, chain), f"{dtype} {order}: lse")
    if dtype == torch.float32 and order == "in a row":             # the bound has teeth
        narrow, _ = merge_in_a_row(parts, state_dtype=torch.bfloat16)
        with pytest.raises(AssertionError, match="over the bound"):
            within(narrow, r["out"], r["mag_out"], n_out, "state in bfloat16", rel=0.0)


# ---------------------------------------------------------------------------- (c) large logits

def saturated(seed, dtype, m=6, n=8, d=4, big=2.0 ** 50):
    """q, k whose scores are c_i·t_j·big²·scale, c_i ∈ {±1, ±2, ±3}, t_j distinct in
    {−3.5, …, 3.5}: one key per row wins by a gap of at least big²·scale (the order-1
    random parts of q, k's other d − 1 entries are lost in rounding, in float64 too), so
    the float64 softmax is exactly one-hot. All of c_i·big, t_j·big are exact in bfloat16."""
    g = torch.Generator().manual_seed(seed)
    c = torch.tensor([3.0, -2.0, 1.0, -3.0, 2.0, -1.0]).repeat(2)[:m]
    t = torch.randperm(n, generator=g).double() - n / 2 + 0.5
    q = rand(1, 1, m, d, seed=seed + 1)
    k = rand(1, 1, n, d, seed=seed + 2)
    q[..., 0] = c * big
    k[..., 0] = t * big
    return q.to(dtype), k.to(dtype), rand(1, 1, n, d, seed=seed + 3, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scores_offset_by_1e4(solo_group, dtype):
    """Every score near 1e4, spread of order 1: exp(s) overflows float32 beyond s ≈ 88.7,
    so this works only because every exponent is max-subtracted.

    The bounds of the module docstring with σ ≈ Λ ≈ 1e4: a float32 score of 1e4 carries
    an absolute rounding of order 1e4·u ≈ 6e-4 (and (d + 1) of them through the dot
    product), which moves the softmax weights by as much: γ ≈ 1.5e-2 here. Blocks merged
    one by one (4 of 4 keys) and the one-rank ring, forward and backward.
    """
    b, h, s, d = 1, 2, 16, 4
    q, k, v, dout = (rand(b, h, s, d, seed=40 + i) for i in range(4))
    q[..., 0] = k[..., 0] = (2 * 1e4) ** 0.5                      # q0·k0·scale = 1e4
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    scale = d ** -0.5
    r = reference(q, k, v, scale, dout=dout)
    assert 9e3 < float(r["s"].min()) and float(r["s"].max()) < 1.1e4
    lam = lam_of(r, s)
    parts = [cp.block_attention(q, k[..., i:i + 4, :], v[..., i:i + 4, :], scale, False) for i in range(0, s, 4)]
    out, lse = merge_in_a_row(parts)
    within(out.to(dtype), r["out"], r["mag_out"], n_block(d, r["sigma"], 4) + 3 * n_merge(lam, 4), "blocks")
    within(lse, r["lse"], torch.ones_like(lse, dtype=torch.float64), n_lse(d, r["sigma"], lam, 4, 3), "lse")
    got = ring_1rank(q, k, v, dout, solo_group, False, "contiguous")
    check_ring_against(r, got, d, s, f"{dtype} scores ~1e4")


@pytest.mark.parametrize("big, d, what", [pytest.param(2.0 ** 50, 4, "±1e30", id="1e30"),
                                           pytest.param(1.125 * 2.0 ** 62, 1, "±2.8e38, near float32's max",
                                                        id="2.8e38")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_saturated_scores_of_1e30_and_near_float32_max(solo_group, dtype, big, d, what):
    """Scores up to ±10.5·2^99 ≈ ±6.7e30 (d = 4, scale 1/2), or ±10.5·1.27·2^124 ≈ ±2.8e38,
    0.83 of float32's largest number 3.40e38 (bfloat16's is 3.39e38; d = 1 and scale 1, as
    q·k itself must not overflow before the scale), distinct by gaps of at least 2^99 or
    2^124.

    Every exp(s − m), m the row max (the winning score), is exp(0) = 1 for the winner and
    exp(−huge) = 0 (or exp(−inf): s − m overflows to −inf for s ≈ −m ≈ −2.8e38, harmless)
    for the rest, so p is exactly one-hot, as is the float64 softmax, and λ = log 1 = 0.
    Hence the tolerances: the output is v of the winner, exactly (tolerance 0); ℓ is the
    winning score, d + 1 roundings relative; dv = pᵀ·dO sums at most s terms (n = s),
    plus the bfloat16 rounding; dq, dk are zero in exact arithmetic, and their computed
    values are rounding noise of the two d-term dot products dO·v and rowsum(dO ⊙ O) times
    |k|·scale or |q|·scale: n = 2d + s + 4 relative to those magnitudes. A merge of two
    blocks and the one-rank ring; all finite.
    """
    q, k, v = saturated(50, dtype, d=d, big=big)
    s = k.shape[2]
    scale = d ** -0.5
    r = reference(q, k, v, scale)
    assert float(r["s"].abs().max()) == pytest.approx(10.5 * big ** 2 * scale, rel=1e-12)   # as stated
    assert bool(((r["p"] == 0) | (r["p"] == 1)).all()), "the float64 reference is not one-hot"
    for parts in ([cp.block_attention(q, k, v, scale, False)],
                  [cp.block_attention(q, k[..., :4, :], v[..., :4, :], scale, False),
                   cp.block_attention(q, k[..., 4:, :], v[..., 4:, :], scale, False)]):
        out, lse = merge_in_a_row(parts)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all(), f"{what}: {out}, {lse}"
        torch.testing.assert_close(out.double(), r["out"], rtol=0, atol=0)
        within(lse, r["lse"], r["lse"].abs(), d + 1, f"{what} lse")
    # the one-rank ring on a square problem (q, k, v the same length), forward and backward
    qs, _, _ = saturated(50, dtype, m=s, d=d, big=big)
    dout = rand(1, 1, s, d, seed=51, dtype=dtype)
    r = reference(qs, k, v, scale, dout=dout)
    assert bool(((r["p"] == 0) | (r["p"] == 1)).all())
    out, dq, dk, dv = ring_1rank(qs, k, v, dout, solo_group, False, "contiguous")
    for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(t).all(), f"{what} {name} not finite"
    torch.testing.assert_close(out.double(), r["out"], rtol=0, atol=0)
    within(dv, r["dv"], r["mag_dv"], s, f"{what} dv")
    within(dq, r["dq"], r["mag_dq"], 2 * d + s + 4, f"{what} dq")
    within(dk, r["dk"], r["mag_dk"], 2 * d + s + 4, f"{what} dk")


# ---------------------------------------------------------------------------- (d) the log-sum-exp

@pytest.mark.parametrize("dtype", DTYPES)
def test_lse_is_finite_where_a_key_is_visible_and_minus_inf_where_none_is(dtype):
    """block_attention's ℓ: finite on every row of a diagonal (causal) block, where row i
    sees keys 0..i; −∞, not NaN, on a block whose every score is −∞. Very negative but
    finite scores (−12·2^100 ± 5.25·2^100, one-hot as in the saturated test) are not
    masked: ℓ is finite (the winning score, d + 1 roundings relative) and the output is v
    of the winner, exactly. Merging keeps the rule: finite ∨ −∞ = the finite side, exactly;
    −∞ ∨ −∞ = −∞.
    """
    q, k, v = (rand(1, 2, 5, 4, seed=60 + i, dtype=dtype) for i in range(3))
    o_diag, l_diag = cp.block_attention(q, k, v, 0.5, diagonal=True)
    assert torch.isfinite(l_diag).all() and torch.isfinite(o_diag).all()
    qp = q.abs().add(0.1)
    o_none, l_none = cp.block_attention(qp, torch.full_like(k, NEG_INF), v, 0.5, diagonal=False)
    assert bool((l_none == NEG_INF).all()) and torch.equal(o_none, torch.zeros_like(o_none))
    # very negative, finite: scores s = −12·2^100 + (distinct multiples of 2^99)
    qs, ks, vs = saturated(61, dtype)
    qs = torch.cat([qs, torch.zeros_like(qs[..., :1])], -1)
    ks = torch.cat([ks, torch.zeros_like(ks[..., :1])], -1)
    qs[..., -1] = 2.0 ** 50
    ks[..., -1] = -24.0 * 2.0 ** 50                                 # adds −12·2^100 to every score at scale 1/2
    vs = torch.cat([vs, torch.zeros_like(vs[..., :1])], -1)
    r = reference(qs, ks, vs, 0.5)
    assert float(r["s"].max()) < -2.0 ** 100 and bool(((r["p"] == 0) | (r["p"] == 1)).all())
    o_neg, l_neg = cp.block_attention(qs, ks, vs, 0.5, diagonal=False)
    assert torch.isfinite(l_neg).all()
    within(l_neg, r["lse"], r["lse"].abs(), qs.shape[-1] + 1, "very negative lse")
    torch.testing.assert_close(o_neg.double(), r["out"], rtol=0, atol=0)
    out, lse = cp.merge_partials(o_diag, l_diag, o_none, l_none)
    assert torch.equal(out, o_diag) and torch.equal(lse, l_diag)
    out, lse = cp.merge_partials(o_none, l_none, o_none, l_none)
    assert bool((lse == NEG_INF).all()) and not torch.isnan(out).any()


# ---------------------------------------------------------------------------- bugs found (once strict xfails)

def tied(dtype, keys=4, big=2.0 ** 50, d=4):
    """One query, ``keys`` keys, every score exactly big²·2·scale = 2^100 (products of powers
    of two): a tie, so the float64 softmax is exactly uniform and the output mean(v)."""
    q = torch.zeros(1, 1, 1, d, dtype=dtype)
    k = torch.zeros(1, 1, keys, d, dtype=dtype)
    q[..., 0] = big
    k[..., 0] = 2 * big
    return q, k, rand(1, 1, keys, d, seed=70, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tied_huge_scores_average_v(solo_group, dtype):
    """Four keys tied at the score 2^100 (exactly representable): attention must return
    mean(v), inside v's convex hull. (Ties at 1e4 come out 2^-11 off; at 2^24 ≈ 1.7e7, 46 %;
    from ~1e8 on, Σv.)

    The scores are exact, exp(s − max) = exp(0) = 1 exactly, so an exact-in-the-scores
    float32 softmax rounds only in the sum p·v (4 terms) and one division: n = 4 + 2 in
    units of u relative to mag = p·|v|, plus bfloat16's final rounding. Two such blocks
    merged: weights 1/2 and 1/2 exactly, two products and a sum more: n = 6 + 3. The ring
    on one rank (one block) likewise. F.scaled_dot_product_attention in float32 meets the
    one-block bound (checked first: the bound is reachable).
    """
    q, k, v = tied(dtype)
    r = reference(q, k, v, 0.5)
    assert torch.equal(r["p"], torch.full_like(r["p"], 0.25))
    sdpa = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=0.5)
    within(sdpa.to(dtype), r["out"], r["mag_out"], 6, "SDPA float32")
    out, lse = cp.block_attention(q, k, v, 0.5, diagonal=False)
    within(out.to(dtype), r["out"], r["mag_out"], 6, "one block of four tied keys")
    q8, k8, v8 = tied(dtype, keys=8)
    r8 = reference(q8, k8, v8, 0.5)
    parts = [cp.block_attention(q8, k8[..., :4, :], v8[..., :4, :], 0.5, False),
             cp.block_attention(q8, k8[..., 4:, :], v8[..., 4:, :], 0.5, False)]
    out, _ = merge_in_a_row(parts)
    within(out.to(dtype), r8["out"], r8["mag_out"], 9, "two merged blocks of four tied keys")
    qs = q.expand(1, 1, 4, 4).contiguous()                        # the ring's scale 1/√d = 1/2, as above
    r = reference(qs, k, v, 0.5)
    within(cp.ring_attention(qs, k, v, solo_group), r["out"], r["mag_out"], 6, "ring on one rank")


@pytest.mark.parametrize("dtype", DTYPES)
def test_tied_huge_scores_gradients(solo_group, dtype):
    """Gradients of the one-rank ring at four keys tied at 2^100 (see the forward test).

    The float64 p is 1/4 exactly. The ring recomputes p = exp((s − m) − λ) = exp(−λ), λ =
    log 4 to within one ulp (2 ln 4 < 3 in units of u, absolute) and exp's own rounding
    (2): p within 5u of 1/4; dv = pᵀ·dO sums 4 terms (4): n = 9 relative to mag = pᵀ·|dO|;
    bfloat16 adds its final rounding. (dq and dk are rounding noise times 2^50-sized k, q,
    as in the saturated test; only dv is checked.) Autograd through softmax(q·kᵀ·scale)·v
    written out in float32 meets the tighter n = 6 (checked first: softmax's backward uses
    its output p, exactly 1/4 here: exp(0) = 1 over an exact sum of 4). Torch's CPU
    F.scaled_dot_product_attention does not: its backward recomputes p from the rounded
    log-sum-exp, and gives Σ dO (as this ring once did).
    """
    q, k, v = tied(dtype)
    qs = q.expand(1, 1, 4, 4).contiguous()
    dout = rand(1, 1, 4, 4, seed=71, dtype=dtype)
    r = reference(qs, k, v, 0.5, dout=dout)
    leaves = [t.detach().float().requires_grad_() for t in (qs, k, v)]
    (torch.softmax(leaves[0] @ leaves[1].transpose(-2, -1) * 0.5, -1) @ leaves[2]).backward(dout.float())
    within(leaves[2].grad.to(dtype), r["dv"], r["mag_dv"], 6, "softmax written out, float32: dv")
    _, _, _, dv = ring_1rank(qs, k, v, dout, solo_group, False, "contiguous")
    within(dv, r["dv"], r["mag_dv"], 9, "dv at tied huge scores")


def tied_causal(dtype, s, d=4, big=2.0 ** 50):
    """s queries and s keys, every score exactly 2^100 at scale 1/√d = 1/2 (as in :func:`tied`)."""
    q = torch.zeros(1, 1, s, d, dtype=dtype)
    k = torch.zeros(1, 1, s, d, dtype=dtype)
    q[..., 0] = big
    k[..., 0] = 2 * big
    return q, k, rand(1, 1, s, d, seed=72, dtype=dtype), rand(1, 1, s, d, seed=73, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tied_huge_scores_across_the_rings_merges(monkeypatch, solo_group, dtype):
    """Causal attention with every score tied at 2^100: query i sees keys 0..i, so its output
    is the mean of v_0..v_i, and the blocks the ring merges hold different numbers of
    visible keys. Their log-sum-exps 2^100 + ln(count) all round to 2^100 in float32, so
    only a state that keeps ℓ as m + λ weighs them right (merge_partials on the rounded ℓs
    would give each side 1/2). A four-rank ring's forward, every rank, both layouts, and
    the one-rank zigzag ring (two pieces: one merge) forward and backward.

    Bounds: the module docstring's with σ = 0, as every score and every difference of row
    maxima is exact here (products of powers of two; 2^100 − 2^100 = 0): one block
    2B + 5, each ring merge 7 ln(s) + 12, p in the backward 3 ln(s) + s + 4 plus a merge;
    dv then 2d + 2s + 6 more. (dq and dk are rounding noise times 2^50, as above.)
    """
    P, s, d = 4, 16, 4
    q, k, v, _ = tied_causal(dtype, s)
    r = reference(q, k, v, 0.5, causal=True)
    assert torch.equal(r["p"][0, 0, 5, :6], torch.full((6,), 1 / 6, dtype=torch.float64))
    for layout in cp.LAYOUTS:
        outs = simulated_ring_forward(monkeypatch, q, k, v, P, layout, True)
        n = n_block(d, 0, s // P) + (2 * P - 1) * n_ring_merge(0, s)
        for rank, out in enumerate(outs):
            monkeypatch.setattr(cp, "dist", SimpleNamespace(get_world_size=lambda g: P, get_rank=lambda g, x=rank: x))
            want, mag = (cp.shard_sequence(t, 2, None, layout) for t in (r["out"], r["mag_out"]))
            within(out, want, mag, n, f"{dtype} {layout} rank {rank} of {P}, tied scores")
    monkeypatch.undo()                                              # the real process group again
    s = 8
    q, k, v, dout = tied_causal(dtype, s)
    r = reference(q, k, v, 0.5, causal=True, dout=dout)
    out, _, _, dv = ring_1rank(q, k, v, dout, solo_group, True, "zigzag")
    n_out = n_block(d, 0, s) + n_ring_merge(0, s)
    within(out, r["out"], r["mag_out"], n_out, f"{dtype} one-rank zigzag ring, tied scores: output")
    n_g = n_backward(max(n_out, n_probs(d, 0, s, 1)), d, s)
    within(dv, r["dv"], r["mag_dv"], n_g, f"{dtype} one-rank zigzag ring, tied scores: dv")


def test_exact_scores_near_1e4_keep_float32_accuracy(solo_group):
    """Scores 1e4 + 0.390625·j, j = 0..3 (d = 1, q = 100, k_j = 100 + j/256: exact products),
    so the float64 reference is exact and nothing but the softmax's own arithmetic can err.

    s − max is exact (Sterbenz), so exp(s − max) rounds once (2u, exp being within one ulp),
    their sum of 4 terms (4), p·v (4), one division (1): n = 2 + 4 + 4 + 1 = 11 relative
    to mag = p·|v|. The one-rank ring (one block, merged onto (0, −∞) exactly) must do as
    well. F.scaled_dot_product_attention in float32 does: checked first, so the bound is
    shown to be reachable. (block_attention was ~2000 u off here when it normalised with
    exp(s − ℓ): ℓ ≈ 10001 is stored to within ulp/2 = 2^-11 ≈ 4.9e-4, and exp(s − ℓ) turned
    that into a relative error.)
    """
    q = torch.full((1, 1, 4, 1), 100.0)
    k = (100.0 + torch.arange(4.0) / 256).view(1, 1, 4, 1)
    v = rand(1, 1, 4, 1, seed=80)
    r = reference(q, k, v, 1.0)
    within(F.scaled_dot_product_attention(q, k, v, scale=1.0), r["out"], r["mag_out"], 11, "SDPA float32")
    out, _ = cp.block_attention(q, k, v, 1.0, diagonal=False)
    within(out, r["out"], r["mag_out"], 11, "block_attention")
    within(cp.ring_attention(q, k, v, solo_group), r["out"], r["mag_out"], 11, "ring on one rank")   # scale 1/√1


def test_an_overflowing_score_is_not_a_silent_zero():
    """q·k = 2^128 overflows float32 to +inf on the first row; the second row's scores are
    1 and 2^-65, ordinary.

    There is no right finite answer in float32, but a row must not come back as a finite
    wrong one: either non-finite (NaN, as F.scaled_dot_product_attention gives) or the
    float64 answer v₀. The ordinary row must be unaffected (n = 2(d + 1)σ + 4σ + 2B + 5).
    """
    q = torch.tensor([[[[2.0 ** 64], [2.0 ** -64]]]])
    k = torch.tensor([[[[2.0 ** 64], [0.5]]]])
    v = torch.tensor([[[[5.0], [7.0]]]])
    r = reference(q[..., 1:, :], k, v, 1.0)
    out, lse = cp.block_attention(q, k, v, 1.0, diagonal=False)
    within(out[..., 1:, :], r["out"], r["mag_out"], n_block(1, r["sigma"], 2), "row 1")
    row0 = out[0, 0, 0]
    assert not torch.isfinite(row0).all() or torch.equal(row0, v[0, 0, 0]), f"row 0 is {row0}, finite and wrong"


# ---------------------------------------------------------------------------- the tolerance table

def test_the_unit_roundoff_table_and_rounding_tol():
    """UNIT_ROUNDOFF is half of torch.finfo(dtype).eps (eps is the gap above 1, u half of
    it), and rounding_tol adds a narrow dtype's one final rounding to γ_n of the work dtype."""
    from tests.programs.checks import rounding_tol
    for dtype, u in UNIT_ROUNDOFF.items():
        assert u == torch.finfo(dtype).eps / 2, dtype
    assert gamma(10) == pytest.approx(10 * U32, rel=1e-6)
    assert rounding_tol(torch.float32, 10) == dict(rtol=gamma(10), atol=gamma(10))
    assert rounding_tol(torch.bfloat16, 10, mag=2.0) == dict(rtol=gamma(10) + 2.0 ** -8, atol=2 * gamma(10))
    assert rounding_tol(torch.float64, 10)["rtol"] == pytest.approx(10 * 2.0 ** -53, rel=1e-12)
    with pytest.raises(ValueError, match="n·u must be below 1"):
        gamma(2 ** 24)
