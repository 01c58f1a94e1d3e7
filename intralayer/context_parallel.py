"""Context parallelism: attention over a sequence split across ranks (chapter 04).

Each of P ranks holds ``s/P`` tokens of q, k and v, laid out ``(b, heads, s_local, d)``.

- :func:`ring_attention` keeps its queries and passes the key/value blocks around a ring
  of send/recv (Liu et al. 2023, Ring Attention): at each of P steps it attends to the
  block it holds while the next block is already on its way, and merges the partial
  results with the log-sum-exp rule (:func:`merge_partials`). The backward pass sends the
  blocks round again, with their gradients travelling alongside.
- Which tokens a rank holds is its layout, one :class:`Layout` in :data:`LAYOUTS`. Causal
  attention makes the ring unfair with ``"contiguous"``: rank r computes r+1 blocks, so the
  last rank computes P times the blocks of the first (and about 2P−1 times its unmasked
  scores, as the first's one block is half masked). ``"zigzag"`` cuts the sequence into 2P
  chunks and gives rank r chunks r and 2P−1−r, an early and a late one, so every rank does
  the same work (Megatron-LM's ``get_batch_on_this_cp_rank``). ``"striped"`` gives token i
  to rank i mod P (Brandon et al. 2023, Striped Attention): every block is then a triangle,
  with or without its diagonal, so at each step the ranks' unmasked scores differ by at
  most s/P, one block's diagonal.
- :func:`ulysses_attention` (Jacobs et al. 2023, DeepSpeed-Ulysses) trades the sequence
  split for a head split with an all-to-all, runs ordinary attention on ``heads/P`` heads
  over the whole sequence, and trades back.

Both take grouped-query attention: k and v may hold fewer heads than q (``kv_heads``
dividing ``heads``; query head j attends with key/value head ``j // (heads/kv_heads)``), and
the ring then moves only those. Under tensor parallelism each rank passes its own
``heads/t`` query heads and ``kv_heads/t`` key/value heads, and the context-parallel group
is one column of the rank grid (``intralayer/programs/cp_tp.py``).

Everything runs on CPU with gloo and on GPUs with NCCL, causal or not, forward and
backward; :func:`counting` records how many attention scores each rank computed, and the
thread CPU time it spent computing them. :func:`cp_costs` and :func:`ring_step` are the
arithmetic: bytes, FLOPs, memory, and when a ring step's transfer hides
(:func:`overlap_tokens`).
"""
from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import comm, rules
from .rules import check_group_device as _check_group_device, check_tensor as _check_tensor, whole as _whole


# ---------------------------------------------------------------------------- layouts
#
# A causal query sees the keys at or before its position. Between a chunk of queries and a
# chunk of keys of L tokens each, with query i and key j their i-th and j-th tokens, that
# leaves one of four masks: "full" (every key), "diagonal" (j ≤ i), "shifted" (j < i: the
# triangle without its diagonal) or none at all (the pair is skipped).

def _runs(chunk: int, n: int, s: int) -> range:
    """Chunk ``chunk`` of n as a run of s/n consecutive tokens."""
    size = s // n
    return range(chunk * size, (chunk + 1) * size)


def _runs_mask(qc: int, kc: int) -> str | None:
    """Runs: a query sees every key of an earlier chunk, the triangle of its own, none of a later one."""
    return "full" if kc < qc else "diagonal" if kc == qc else None


def _stripes(chunk: int, n: int, s: int) -> range:
    """Chunk ``chunk`` of n as every n-th token from ``chunk`` on: chunk, chunk + n, chunk + 2n, …"""
    return range(chunk, s, n)


def _stripes_mask(qc: int, kc: int) -> str:
    """Stripes of n chunks: query i sits at qc + n·i, key j at kc + n·j, and as |qc − kc| < n,
    kc + n·j ≤ qc + n·i holds for j ≤ i when kc ≤ qc and for j < i when kc > qc."""
    return "diagonal" if kc <= qc else "shifted"


@dataclass(frozen=True)
class Layout:
    """How a sequence of s tokens is cut into ``per_rank · P`` equal chunks and dealt to P ranks."""

    name: str
    per_rank: int                                  # chunks each rank holds
    deal: Callable[[int, int], list[int]]          # (rank, P) → the chunks it holds, in order
    tokens: Callable[[int, int, int], range]       # (chunk, n chunks, s) → the chunk's token positions
    mask: Callable[[int, int], str | None]         # (query chunk, key chunk) → causal mask, None: no key


#: Every context-parallel layout, by name: the one place a layout is defined.
LAYOUTS = {lay.name: lay for lay in (
    Layout("contiguous", 1, lambda r, P: [r], _runs, _runs_mask),
    Layout("zigzag", 2, lambda r, P: [r, 2 * P - 1 - r], _runs, _runs_mask),
    Layout("striped", 1, lambda r, P: [r], _stripes, _stripes_mask),
)}


def get_layout(layout: str) -> Layout:
    """The registered :class:`Layout` called ``layout``, or a ``ValueError`` listing the names."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {tuple(LAYOUTS)}, got {layout!r}")
    return LAYOUTS[layout]


def n_chunks(P: int, layout: str) -> int:
    """How many equal chunks the sequence is cut into: P (contiguous, striped) or 2P (zigzag)."""
    lay = get_layout(layout)
    return lay.per_rank * _whole(P, "the context-parallel degree P")


def chunk_ids(rank: int, P: int, layout: str) -> list[int]:
    """The chunks rank ``rank`` holds, in order: ``[r]``, or ``[r, 2P−1−r]`` under zigzag."""
    n_chunks(P, layout)
    return LAYOUTS[layout].deal(rules.index(rank, "rank ", P, f"the P={P} ranks"), P)


def positions(rank: int, P: int, s: int, layout: str) -> list[int]:
    """The token positions rank ``rank`` holds, in the order of its shard."""
    check_sequence(s, P, layout)
    n = n_chunks(P, layout)
    return [t for c in chunk_ids(rank, P, layout) for t in LAYOUTS[layout].tokens(c, n, s)]


def check_sequence(s: int, P: int, layout: str) -> None:
    """``ValueError`` unless a sequence of ``s`` tokens cuts evenly for ``layout`` on P ranks."""
    n = n_chunks(P, layout)
    if _whole(s, "sequence length") % n:
        rule = f"{n // P}P" if n > P else "P"
        raise ValueError(f"sequence length {s} is not divisible by {rule} = {n} "
                         f"(the {layout} layout cuts it into {n} equal chunks)")


def shard_sequence(x: torch.Tensor, dim: int, group, layout: str = "contiguous") -> torch.Tensor:
    """This rank's tokens of a sequence that every rank holds whole."""
    _check_tensor(x, "x", "shard_sequence", floating=False)
    P, r = dist.get_world_size(group), dist.get_rank(group)
    dim = rules.check_dim(x, dim)
    mine = positions(r, P, x.shape[dim], layout)
    return x.index_select(dim, torch.tensor(mine, device=x.device))


def unshard_sequence(x_local: torch.Tensor, dim: int, group, layout: str = "contiguous") -> torch.Tensor:
    """The whole sequence, in order, on every rank (an all-gather; backward keeps this rank's part)."""
    _check_tensor(x_local, "x_local", "unshard_sequence", floating=False)
    _check_group_device(x_local, "x_local", "unshard_sequence", group)
    P = dist.get_world_size(group)
    dim = rules.check_dim(x_local, dim)
    per_rank = n_chunks(P, layout) // P
    if x_local.shape[dim] % per_rank:
        raise ValueError(f"a {layout} shard holds {per_rank} equal chunks; {x_local.shape[dim]} tokens "
                         f"do not split into {per_rank}")
    gathered = comm.gather_from_group(x_local, dim, group, "unshard")           # rank after rank
    order = [t for j in range(P) for t in positions(j, P, gathered.shape[dim], layout)]   # gathered[i]: token order[i]
    return gathered.index_select(dim, torch.argsort(torch.tensor(order, device=x_local.device)))


# ---------------------------------------------------------------------------- blocks
#
# Numerics. A row's log-sum-exp lse = log Σ_j exp(z_j) of its scores z is about as large as
# its largest score, and float32 holds it only to within u·|lse| (u = 2^-24): 6e-4 at
# lse ≈ 1e4, more than log 4 at lse ≈ 2^100. Normalising with exp(z − lse) would pass that
# absolute error on to every probability as a relative one. FlashAttention and the rings
# built on it keep one float32 lse, and at the scores models produce (|lse| of tens) that
# error is ~1e-6, far below bfloat16's 2^-8; this module still never subtracts a rounded lse
# (belt and braces, for scores of order 1e4 and beyond):
# - a block subtracts its row max m (one of the scores, so exact) and divides by the row
#   sum of exp(z − m);
# - merge_partials' weights depend only on the difference of the two lses;
# - the ring keeps lse in two parts, m and λ = log Σ_j exp(z_j − m), a number between 0 and
#   log(keys) whose rounding is tiny, and the backward recomputes p = exp((z − m) − λ).
# A score that overflows to +∞ makes its row NaN (as SDPA does), never a finite answer.

def merge_partials(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Combine two softmax-attention results over disjoint key sets.

    ``out`` is normalised over its keys and ``lse`` their log-sum-exp of scores; the
    result is what attention over both key sets gives:
    ``new = log(e^lse + e^block_lse)``, ``out·e^(lse−new) + block_out·e^(block_lse−new)``.
    Rows that have seen no key yet (lse = −∞) take the other side unchanged.
    """
    new = torch.logaddexp(lse, block_lse)                                        # (b, h, m)
    # e^(lse−new) = 1/(1 + e^(block_lse−lse)) = sigmoid(lse − block_lse): computed from the
    # difference, the weights do not inherit new's rounding (u·|new|). sigmoid(±∞) is exactly
    # 1 or 0, so a side with lse = −∞ passes the other through unchanged; where both are −∞
    # the difference is NaN, and the row stays (0, −∞). (+∞ or NaN, an overflow, stays NaN.)
    seen = ~torch.isneginf(new)
    w_old = torch.where(seen, torch.sigmoid(lse - block_lse), 0.0)
    w_new = torch.where(seen, torch.sigmoid(block_lse - lse), 0.0)
    return w_old.unsqueeze(-1) * out + w_new.unsqueeze(-1) * block_out, new


def _merge_parts(out, m, lam, block_out, block_m, block_lam):
    """:func:`merge_partials` on log-sum-exps kept in two parts, lse = m + λ: (out, m, λ).

    Both sides' lse are written relative to the larger row max M, as (m − M) + λ: the side
    holding M passes just its λ, and merge_partials sees small numbers, never |lse|. The
    result's λ is relative to M, its new row max.
    """
    new_m = torch.maximum(m, block_m)
    ref = torch.where(torch.isneginf(new_m), 0.0, new_m)       # no key on either side: −∞ − (−∞) is NaN
    merged, new_lam = merge_partials(out, (m - ref) + lam, block_out, (block_m - ref) + block_lam)
    return merged, new_m, new_lam


#: The first masked diagonal (``triu``'s offset) of each kind of masked block: keys j > i, or j ≥ i.
_MASKED_FROM = {"diagonal": 1, "shifted": 0}


def _scores(q, k, scale, kind):
    s = (q @ k.transpose(-2, -1)) * scale                                        # (b, h, m, n), fp32
    if kind in _MASKED_FROM:
        m, n = s.shape[-2:]
        hidden = torch.ones(m, n, dtype=torch.bool, device=s.device).triu(_MASKED_FROM[kind])
        s = s.masked_fill(hidden, float("-inf"))
    return s


def _block_parts(q, k, v, scale, kind):
    """One block's (output, row max m, λ = log Σ_j e^(s_j − m)), in the work dtype.

    Its log-sum-exp is m + λ; a row with no visible key has m = λ = −∞ and output 0.
    """
    w = _work_dtype(q.dtype)
    s = _scores(q.to(w), k.to(w), scale, kind)
    m = s.amax(-1)                                                               # row max, (b, h, queries)
    shift = torch.where(torch.isneginf(m), 0.0, m)                               # −∞ − (−∞) would be NaN
    e = torch.exp(s - shift.unsqueeze(-1))              # ≤ 1 (no overflow), exactly 1 at the max
    total = e.sum(-1)                                   # ≥ 1; 0 where no key is visible
    out = (e @ v.to(w)) / torch.where(total > 0, total, 1.0).unsqueeze(-1)
    return out, m, torch.log(total)


def _probs(s, m, lam):
    """The softmax probabilities exp((s − m) − λ) of scores ``s``, from the row max m and
    λ = log Σ e^(s − m) of the forward pass; zero in rows that saw no key (m = −∞)."""
    p = torch.exp((s - m.unsqueeze(-1)) - lam.unsqueeze(-1))
    return torch.where(torch.isneginf(m).unsqueeze(-1), 0.0, p)


def block_attention(q, k, v, scale: float, diagonal: bool):
    """Attention of a query block to one key/value block: (output, log-sum-exp), float32.

    ``diagonal`` masks keys after queries within the block (the block on the diagonal of
    a causal attention matrix).
    """
    out, m, lam = _block_parts(q, k, v, scale, "diagonal" if diagonal else "full")
    return out, m + lam


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate in float32, or in the input's own type when it is wider (float64)."""
    return torch.promote_types(dtype, torch.float32)


def schedule(rank: int, P: int, layout: str, causal: bool) -> list[list[tuple[int, int, str]]]:
    """For each ring step, the (local query piece, key piece, kind) pairs rank ``rank`` computes.

    At step ``i`` the rank holds the key/value block of rank (r − i) mod P. A piece is one
    of the rank's chunks (one, or two under zigzag); kind is the pair's causal mask, "full",
    "diagonal" or "shifted" (see the layouts), and pairs with no visible key are left out.
    """
    chunk_ids(rank, P, layout)                    # the arguments' rules, before they are a cache's key
    return [list(step) for step in _schedule(int(rank), int(P), layout, bool(causal))]


@functools.lru_cache(maxsize=4096)
def _schedule(rank: int, P: int, layout: str, causal: bool) -> tuple:
    """:func:`schedule` as tuples, kept: it does not depend on the sequence length, and the book's
    explorer asks for the same few schedules thousands of times."""
    mine, mask = chunk_ids(rank, P, layout), LAYOUTS[layout].mask
    steps = []
    for i in range(P):
        theirs = chunk_ids((rank - i) % P, P, layout)
        steps.append(tuple((qi, kj, kind) for qi, qc in enumerate(mine) for kj, kc in enumerate(theirs)
                           if (kind := mask(qc, kc) if causal else "full") is not None))
    return tuple(steps)


COUNTS = ("computed", "unmasked")


def _pair_scores(piece: int, kind: str, count: str) -> int:
    """Scores of one (query piece, key piece) pair: a piece × piece block, which this
    implementation computes whole, though under a "diagonal" mask its queries see only
    piece·(piece + 1)/2 of its keys and under a "shifted" one piece·(piece − 1)/2."""
    if count == "unmasked" and kind in _MASKED_FROM:
        return piece * (piece + 1) // 2 if kind == "diagonal" else piece * (piece - 1) // 2
    return piece * piece



def work_per_step(s: int, P: int, layout: str, causal: bool, count: str = "computed") -> list[list[int]]:
    """Attention scores each rank computes at each ring step (per batch element and head).

    ``work_per_step(...)[r][i]`` is rank r's work at step i. ``count="computed"``: every
    score of every block the schedule visits, masked blocks whole (what :func:`ring_attention`
    computes and :func:`counting` records). ``count="unmasked"``: only the scores a query may
    see, what a kernel that skips masked entries computes.
    """
    check_sequence(s, P, layout)
    if count not in COUNTS:
        raise ValueError(f"count must be one of {COUNTS}, got {count!r}")
    piece = s // n_chunks(P, layout)
    return [[sum(_pair_scores(piece, kind, count) for _, _, kind in step)
             for step in schedule(r, P, layout, causal)] for r in range(P)]


def work_per_rank(s: int, P: int, layout: str, causal: bool, count: str = "computed") -> list[int]:
    """Attention scores each rank computes over the whole ring (per batch element and head);
    ``count`` as in :func:`work_per_step`."""
    return [sum(steps) for steps in work_per_step(s, P, layout, causal, count)]


# ---------------------------------------------------------------------------- counting

@dataclass
class WorkCount:
    """Scores computed by this rank inside ``with counting():`` (forward passes only), and the
    time it spent computing them, by the clock :func:`counting` was given."""

    scores: int = 0            # entries of q kᵀ computed (masked ones included)
    blocks: int = 0            # (query piece, key piece) products computed
    steps: list[int] = field(default_factory=list)   # scores per ring step, last call
    seconds: float = 0.0       # clock time inside the block computations and merges, every call
    step_seconds: list[float] = field(default_factory=list)   # per ring step, last call
    clock: Callable[[], float] = time.thread_time


_counters: list[WorkCount] = []


@contextmanager
def counting(clock: Callable[[], float] = time.thread_time):
    """Count the attention scores this rank computes in :func:`ring_attention`, and time them.

    The default clock, ``time.thread_time``, is this thread's CPU time: on a CPU (one
    thread per rank, as ``distributed.setup`` sets) it measures the compute itself and not
    the waits, nor the other processes sharing the cores. On a GPU kernels run
    asynchronously: pass a clock that synchronises first.
    """
    w = WorkCount(clock=clock)
    _counters.append(w)
    try:
        yield w
    finally:
        _counters.remove(w)


# ---------------------------------------------------------------------------- ring attention

def _pieces(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    return list(x.chunk(n, dim=2))              # along the sequence: (b, h, s_local, d) or (b, h, s_local)


def _repeat_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """Grouped-query attention: (b, kv, n, d) → (b, kv·group, n, d), key/value head j serving
    query heads j·group … j·group + group − 1."""
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _sum_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """The gradient of :func:`_repeat_kv`: (b, kv·group, n, d) → (b, kv, n, d), each group summed."""
    b, h, n, d = x.shape
    return x if group == 1 else x.reshape(b, h // group, group, n, d).sum(2)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout):
        P, r = dist.get_world_size(group), dist.get_rank(group)
        plan = schedule(r, P, layout, causal)     # per step: the (query piece, key piece, kind) pairs to compute
        n = len(chunk_ids(r, P, layout))          # pieces per rank: 1, or 2 under zigzag
        scale = 1.0 / math.sqrt(q.shape[-1])
        b, h, sl, d = q.shape
        w = _work_dtype(q.dtype)
        out = torch.zeros(b, h, sl, d, dtype=w, device=q.device)
        # Each query row's log-sum-exp so far, lse = m + λ: m its largest score (−∞: no key
        # yet), λ = log Σ exp(z − m). Kept apart, as lse itself is too coarse in float32.
        m = torch.full((b, h, sl), float("-inf"), dtype=w, device=q.device)
        lam = torch.full_like(m, float("-inf"))
        # The same tensors seen piece by piece (views: writing a piece writes the whole).
        out_p, m_p, lam_p, q_p = _pieces(out, n), _pieces(m, n), _pieces(lam, n), _pieces(q, n)
        g = h // k.shape[1]                       # query heads per key/value head (grouped-query attention)
        kv = [k, v]                               # the key/value block held now, (b, kv, sl, d): our own at step 0
        per_step, seconds = [], []
        clocks = [c.clock for c in _counters]
        for i, pairs in enumerate(plan):
            # Send the held block to rank r+1 and receive the next from r−1, while computing below.
            pending = comm.ring_exchange_start(kv, shift=1, group=group, label="ring k,v") if i < P - 1 else None
            t0 = [clock() for clock in clocks]
            k_p, v_p = _pieces(_repeat_kv(kv[0], g), n), _pieces(_repeat_kv(kv[1], g), n)   # (b, h, sl/n, d)
            done = 0
            for qi, kj, kind in pairs:
                bo, bm, bl = _block_parts(q_p[qi], k_p[kj], v_p[kj], scale, kind)        # out, m, λ
                merged, new_m, new_lam = _merge_parts(out_p[qi], m_p[qi], lam_p[qi], bo, bm, bl)  # lse = m + λ
                out_p[qi].copy_(merged)
                m_p[qi].copy_(new_m)
                lam_p[qi].copy_(new_lam)
                done += q_p[qi].shape[2] * k_p[kj].shape[2]
            seconds.append([clock() - t for clock, t in zip(clocks, t0)])
            per_step.append(done)
            if pending is not None:
                kv = pending.wait()
        for j, w in enumerate(_counters):
            w.scores += sum(per_step) * b * h
            w.blocks += sum(len(pairs) for pairs in plan)
            w.steps = [x * b * h for x in per_step]
            w.step_seconds = [step[j] for step in seconds]
            w.seconds += sum(w.step_seconds)
        ctx.save_for_backward(q, k, v, out, m, lam)
        ctx.group, ctx.plan, ctx.n, ctx.scale, ctx.g = group, plan, n, scale, g
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, m, lam = ctx.saved_tensors
        group, plan, n, scale, g = ctx.group, ctx.plan, ctx.n, ctx.scale, ctx.g
        P = dist.get_world_size(group)
        w = out.dtype
        dout = dout.to(w)
        delta = (dout * out).sum(-1)                                             # D = rowsum(dO ⊙ O), (b, h, sl)
        dq = torch.zeros_like(out)
        q_p, do_p, m_p, lam_p, dl_p, dq_p = (_pieces(q.to(w), n), _pieces(dout, n), _pieces(m, n),
                                             _pieces(lam, n), _pieces(delta, n), _pieces(dq, n))
        kv = [k, v]
        arriving = None           # the held block's dk, dv so far, on their way from rank r−1 (none at step 0)
        for i, pairs in enumerate(plan):
            pending = comm.ring_exchange_start(kv, 1, group, "ring k,v", "backward") if i < P - 1 else None
            k_p, v_p = _pieces(_repeat_kv(kv[0].to(w), g), n), _pieces(_repeat_kv(kv[1].to(w), g), n)
            mine = [kv[0].new_zeros(kv[0].shape, dtype=w) for _ in range(2)]             # dk, dv: (b, kv, sl, d)
            dk_p, dv_p = _pieces(mine[0], n), _pieces(mine[1], n)
            for qi, kj, kind in pairs:
                s = _scores(q_p[qi], k_p[kj], scale, kind)
                p = _probs(s, m_p[qi], lam_p[qi])                                       # (b, h, m, n)
                dv_p[kj] += _sum_groups(p.transpose(-2, -1) @ do_p[qi], g)              # (b, kv, n, d)
                ds = p * (do_p[qi] @ v_p[kj].transpose(-2, -1) - dl_p[qi].unsqueeze(-1))
                dq_p[qi] += (ds @ k_p[kj]) * scale
                dk_p[kj] += _sum_groups(ds.transpose(-2, -1) @ q_p[qi], g) * scale
            # The gradients of the block travel with it, P moves in all, the last one home. This
            # step's move starts now and is waited for after the next step's compute, so it
            # overlaps that compute; the last has nothing left to hide behind.
            if arriving is not None:
                for mine_t, got in zip(mine, arriving.wait()):
                    mine_t += got
            arriving = comm.ring_exchange_start(mine, 1, group, "ring dk,dv", "backward")
            if pending is not None:
                kv = pending.wait()
        dk, dv = arriving.wait()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _check_qkv(q, k, v, who: str, group=None) -> None:
    """Shapes, dtypes and devices of this rank's shards, before any rank communicates."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != 4:
            got = f"dtype {t.dtype}, shape {t.shape}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{who}: {name} must be a floating-point tensor laid out (b, heads, s_local, d), "
                             f"got {got}")
    b, heads, sl, d = q.shape
    kv_heads = k.shape[1]
    if not (k.shape == v.shape and (b, sl, d) == (k.shape[0], k.shape[2], k.shape[3]) and heads % kv_heads == 0):
        raise ValueError(f"{who}: q, k and v must have the same shape, or k and v the same shape with a number of "
                         f"heads that divides q's (grouped-query attention), got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype and q.device == k.device == v.device):
        raise ValueError(f"{who}: q, k and v must share dtype and device, got q {q.dtype} on {q.device}, "
                         f"k {k.dtype} on {k.device}, v {v.dtype} on {v.device}")
    _check_group_device(q, "q", who, group)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, causal: bool = False,
                   layout: str = "contiguous") -> torch.Tensor:
    """Softmax attention over the whole sequence, from this rank's shards ``(b, heads, s_local, d)``.

    The shards are those of :func:`shard_sequence` with the same ``layout``; the result is
    this rank's shard of the output. k and v may hold ``kv_heads`` heads, a divisor of q's
    (grouped-query attention): the ring moves those, and repeats them for each group of query
    heads only inside the block computation. Differentiable.
    """
    _check_qkv(q, k, v, "ring_attention", group)
    P = dist.get_world_size(group)
    check_sequence(q.shape[2] * P, P, layout)
    return _RingAttention.apply(q, k, v, group, bool(causal), layout)


# ---------------------------------------------------------------------------- Ulysses

def _seq_to_heads(x: torch.Tensor, group, label: str) -> torch.Tensor:
    """(b, H, s/P, d) → (b, H/P, s, d): send head group j to rank j, receive every rank's tokens."""
    P = dist.get_world_size(group)
    b, H, sl, d = x.shape
    x = x.reshape(b, P, H // P, sl, d).movedim(1, 0).contiguous()                # (P, b, H/P, s/P, d)
    y = comm.all_to_all(x, [1] * P, [1] * P, group, label)                       # row j: rank j's tokens
    return y.movedim(0, 2).reshape(b, H // P, P * sl, d)                         # (b, H/P, s, d)


def _heads_to_seq(y: torch.Tensor, group, label: str) -> torch.Tensor:
    """(b, H/P, s, d) → (b, H, s/P, d): the inverse all-to-all."""
    P = dist.get_world_size(group)
    b, hp, s, d = y.shape
    y = y.reshape(b, hp, P, s // P, d).movedim(2, 0).contiguous()                # (P, b, H/P, s/P, d)
    x = comm.all_to_all(y, [1] * P, [1] * P, group, label)                       # row j: head group j
    return x.movedim(0, 1).reshape(b, P * hp, s // P, d)                         # (b, H, s/P, d)


def check_ulysses(heads: int, P: int, s: int | None = None, kv_heads: int | None = None) -> None:
    """``ValueError`` unless Ulysses can give each of P ranks whole heads: P must divide the heads,
    and, with grouped-query attention, the ``kv_heads`` key/value heads too.

    Under tensor parallelism over t ranks, pass this rank's heads/t and kv_heads/t: both must
    be divisible by P. With ``s``, the sequence must also cut into P equal contiguous shards.
    """
    n_chunks(P, "contiguous")                                                   # P a whole number ≥ 1
    if _whole(heads, "the number of heads") % P:
        raise ValueError(f"Ulysses gives each rank heads/P whole heads: {heads} heads are not divisible by "
                         f"the context-parallel degree P={P}" + (" (P > heads)" if P > heads else ""))
    if kv_heads is not None:
        if heads % _whole(kv_heads, "the number of key/value heads"):
            raise ValueError(f"the number of heads {heads} is not divisible by the number of key/value heads "
                             f"{kv_heads}: each key/value head serves an equal group of query heads")
        if kv_heads % P:
            raise ValueError(f"Ulysses gives each rank kv_heads/P whole key/value heads: {kv_heads} key/value "
                             f"heads are not divisible by the context-parallel degree P={P}"
                             + (" (P > kv_heads)" if P > kv_heads else ""))
    if s is not None:
        check_sequence(s, P, "contiguous")


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, causal: bool = False) -> torch.Tensor:
    """DeepSpeed-Ulysses: all-to-all to a head split, full attention on heads/P heads, all-to-all back.

    q, k, v are this rank's contiguous shards ``(b, heads, s_local, d)``; P must divide
    the number of heads (each rank attends with whole heads), so P ≤ heads. With
    grouped-query attention (k, v of ``kv_heads`` heads) P must divide ``kv_heads`` too:
    rank j receives query heads j·heads/P … and exactly the key/value heads they use.
    """
    _check_qkv(q, k, v, "ulysses_attention", group)
    P = dist.get_world_size(group)
    check_ulysses(q.shape[1], P, kv_heads=k.shape[1])
    qh, kh, vh = (_seq_to_heads(t, group, f"ulysses {n}") for n, t in (("q", q), ("k", k), ("v", v)))
    g = q.shape[1] // k.shape[1]
    o = F.scaled_dot_product_attention(qh, _repeat_kv(kh, g), _repeat_kv(vh, g), is_causal=causal)  # (b, H/P, s, d)
    return _heads_to_seq(o, group, "ulysses out")


# ---------------------------------------------------------------------------- costs

def _kv_heads(heads: int, kv_heads: int | None) -> int:
    """The key/value heads (``heads`` when None); ``ValueError`` unless a whole number dividing ``heads``."""
    if kv_heads is None:
        return heads
    if heads % _whole(kv_heads, "the number of key/value heads"):
        raise ValueError(f"the number of heads {heads} is not divisible by the number of key/value heads "
                         f"{kv_heads}: each key/value head serves an equal group of query heads")
    return kv_heads


def cp_costs(s: int, b: int, heads: int, d: int, P: int, method: str, causal: bool = True,
             layout: str = "zigzag", itemsize: int = 2, kv_heads: int | None = None) -> dict:
    """Per rank and attention layer: bytes sent (forward + backward), scores, FLOPs, memory.

    ``heads`` query heads and ``kv_heads`` key/value heads (grouped-query attention; default
    ``heads``) — under tensor parallelism, one rank's heads/t and kv_heads/t.

    - Ring (this module's implementation): forward, P−1 moves of this rank's k and v
      blocks (``block_kv`` = b·s/P·kv_heads·d numbers each); backward, P−1 moves of k and v
      and P moves of their gradients, which travel in float32 (float64 for float64 inputs).
    - Ulysses: four all-to-alls forward (q, k, v, output) and four backward, each sending
      (P−1)/P of its (b, heads or kv_heads, s/P, d) tensor — 4Nh/P per rank and pass for
      N = b·s tokens and h = heads·d without GQA (Jacobs et al. 2023).
    - scores: attention scores the busiest rank computes, forward (the ring's schedule,
      diagonal blocks computed whole; Ulysses' heads/P heads over s·(s+1)/2 causal pairs or
      s² pairs); flops = 4·d·scores (q kᵀ and the weighted sum); backward_flops =
      10·d·scores, 2.5 times as many: the backward recomputes q kᵀ and computes dV, dP, dQ and
      dK, five products against the forward's two (Dao et al. 2022).
    - memory: the attention tensors a rank holds at once: ring — q and the output, k, v and
      the k, v block arriving; Ulysses — q, k, v and the output in both layouts.
    """
    if method not in ("ring", "ulysses"):
        raise ValueError(f"method must be 'ring' or 'ulysses', got {method!r}")
    for value, what in ((s, "sequence length"), (b, "batch"), (heads, "heads"), (d, "head dimension"),
                        (itemsize, "itemsize")):
        _whole(value, what)
    kv = _kv_heads(heads, kv_heads)
    n_chunks(P, "contiguous")                                                   # P a whole number ≥ 1
    block_q = b * (s // P) * heads * d * itemsize                                # q (or the output) on a rank
    block_kv = b * (s // P) * kv * d * itemsize                                  # k (or v) on a rank
    if method == "ring":
        check_sequence(s, P, layout)
        forward = (P - 1) * 2 * block_kv
        backward = (P - 1) * 2 * block_kv + (P * 2 * block_kv * max(4, itemsize) // itemsize if P > 1 else 0)
        scores = max(work_per_rank(s, P, layout, causal)) * b * heads
        memory = 2 * block_q + 4 * block_kv
    else:
        check_sequence(s, P, "contiguous")
        check_ulysses(heads, P, kv_heads=kv)
        forward = backward = (P - 1) * (2 * block_q + 2 * block_kv) / P
        scores = b * (heads // P) * (s * (s + 1) // 2 if causal else s * s)
        memory = 4 * block_q + 4 * block_kv
    return dict(forward=forward, backward=backward, sent=forward + backward, scores=scores,
                flops=4 * d * scores, backward_flops=10 * d * scores, memory=memory)


def ring_step(c: int, heads: int, d: int, kv_heads: int | None = None, itemsize: int = 2, causal: bool = False,
              grad_itemsize: int | None = None) -> dict:
    """One ring step after the first, per sequence of the batch, on a rank holding ``c`` tokens.

    FLOPs it computes and bytes it moves, forward and backward, with a balanced layout: a
    whole c × c block per step without a mask, half of one under a causal mask (zigzag's two
    of its four pieces, section 4 of chapter 04). Forward: 4·d FLOPs per score, k and v moved.
    Backward: 10·d FLOPs per score (:func:`cp_costs`), k and v moved and the gradients of the
    block before, in ``grad_itemsize`` bytes per number — this implementation's float32
    (``max(4, itemsize)``) by default; Transformer Engine's ring sends them in the inputs'
    own type (pass ``itemsize``).
    """
    for value, what in ((c, "tokens per rank c"), (heads, "heads"), (d, "head dimension"), (itemsize, "itemsize")):
        _whole(value, what)
    kv = _kv_heads(heads, kv_heads)
    grad = max(4, itemsize) if grad_itemsize is None else _whole(grad_itemsize, "grad_itemsize")
    scores = c * c * heads / (2 if causal else 1)
    kv_bytes = 2 * c * kv * d * itemsize
    return dict(forward_flops=4 * d * scores, backward_flops=10 * d * scores, forward_bytes=kv_bytes,
                backward_bytes=kv_bytes + 2 * c * kv * d * grad)


def overlap_tokens(flops_per_s: float, bytes_per_s: float, heads: int = 1, d: int = 128,
                   kv_heads: int | None = None, itemsize: int = 2, causal: bool = False, phase: str = "forward",
                   grad_itemsize: int | None = None) -> float:
    """Tokens per rank above which a ring step's transfer hides behind its attention.

    ``flops_per_s`` is the rate attention reaches, ηF (η the fraction of the device's peak F;
    the course assumes it), ``bytes_per_s`` the link's B. A step computes ∝ c² and moves ∝ c
    (:func:`ring_step`): the two take equally long at c = bytes(1)·ηF / (FLOPs(1)·B). Forward,
    without a mask and grouped-query attention, that is e·ηF/(2B), Liu et al.'s condition; a
    causal mask doubles it, GQA scales it by kv_heads/heads. The backward computes 2.5 times
    the FLOPs and, with float32 gradients beside bfloat16 k and v, moves 3 times the bytes:
    its threshold is 3/2.5 = 1.2 times the forward's.
    """
    if phase not in ("forward", "backward"):
        raise ValueError(f"phase must be 'forward' or 'backward', got {phase!r}")
    for value, what in ((flops_per_s, "flops_per_s"), (bytes_per_s, "bytes_per_s")):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{what} must be a positive, finite number, got {value!r}")
    one = ring_step(1, heads, d, kv_heads, itemsize, causal, grad_itemsize)
    return one[f"{phase}_bytes"] * flops_per_s / (one[f"{phase}_flops"] * bytes_per_s)
