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

Everything runs on CPU with gloo and on GPUs with NCCL, causal or not, forward and
backward; :func:`counting` records how many attention scores each rank computed.
"""
from __future__ import annotations

import math
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
# absolute error on to every probability as a relative one. So nothing below subtracts a
# rounded lse:
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
    mine, mask = chunk_ids(rank, P, layout), LAYOUTS[layout].mask
    steps = []
    for i in range(P):
        theirs = chunk_ids((rank - i) % P, P, layout)
        steps.append([(qi, kj, kind) for qi, qc in enumerate(mine) for kj, kc in enumerate(theirs)
                      if (kind := mask(qc, kc) if causal else "full") is not None])
    return steps


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
    """Scores computed by this rank inside ``with counting():`` (forward passes only)."""

    scores: int = 0            # entries of q kᵀ computed (masked ones included)
    blocks: int = 0            # (query piece, key piece) products computed
    steps: list[int] = field(default_factory=list)   # scores per ring step, last call


_counters: list[WorkCount] = []


@contextmanager
def counting():
    """Count the attention scores this rank computes in :func:`ring_attention`."""
    w = WorkCount()
    _counters.append(w)
    try:
        yield w
    finally:
        _counters.remove(w)


# ---------------------------------------------------------------------------- ring attention

def _pieces(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    return list(x.chunk(n, dim=2))              # along the sequence: (b, h, s_local, d) or (b, h, s_local)


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
        kv = [k, v]                               # the key/value block held now: our own at step 0
        per_step = []
        for i, pairs in enumerate(plan):
            # Send the held block to rank r+1 and receive the next from r−1, while computing below.
            pending = comm.ring_exchange_start(kv, shift=1, group=group, label="ring k,v") if i < P - 1 else None
            k_p, v_p = _pieces(kv[0], n), _pieces(kv[1], n)
            done = 0
            for qi, kj, kind in pairs:
                bo, bm, bl = _block_parts(q_p[qi], k_p[kj], v_p[kj], scale, kind)        # out, m, λ
                merged, new_m, new_lam = _merge_parts(out_p[qi], m_p[qi], lam_p[qi], bo, bm, bl)  # lse = m + λ
                out_p[qi].copy_(merged)
                m_p[qi].copy_(new_m)
                lam_p[qi].copy_(new_lam)
                done += q_p[qi].shape[2] * k_p[kj].shape[2]
            per_step.append(done)
            if pending is not None:
                kv = pending.wait()
        for w in _counters:
            w.scores += sum(per_step) * b * h
            w.blocks += sum(len(pairs) for pairs in plan)
            w.steps = [x * b * h for x in per_step]
        ctx.save_for_backward(q, k, v, out, m, lam)
        ctx.group, ctx.plan, ctx.n, ctx.scale = group, plan, n, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, m, lam = ctx.saved_tensors
        group, plan, n, scale = ctx.group, ctx.plan, ctx.n, ctx.scale
        P = dist.get_world_size(group)
        w = out.dtype
        dout = dout.to(w)
        delta = (dout * out).sum(-1)                                             # D = rowsum(dO ⊙ O), (b, h, sl)
        dq = torch.zeros_like(out)
        q_p, do_p, m_p, lam_p, dl_p, dq_p = (_pieces(q.to(w), n), _pieces(dout, n), _pieces(m, n),
                                             _pieces(lam, n), _pieces(delta, n), _pieces(dq, n))
        kv = [k, v]
        acc = [torch.zeros_like(k, dtype=w), torch.zeros_like(v, dtype=w)]      # dk, dv, travelling
        for i, pairs in enumerate(plan):
            pending = comm.ring_exchange_start(kv, 1, group, "ring k,v", "backward") if i < P - 1 else None
            k_p, v_p = _pieces(kv[0].to(w), n), _pieces(kv[1].to(w), n)
            dk_p, dv_p = _pieces(acc[0], n), _pieces(acc[1], n)
            for qi, kj, kind in pairs:
                s = _scores(q_p[qi], k_p[kj], scale, kind)
                p = _probs(s, m_p[qi], lam_p[qi])                                       # (b, h, m, n)
                dv_p[kj] += p.transpose(-2, -1) @ do_p[qi]
                ds = p * (do_p[qi] @ v_p[kj].transpose(-2, -1) - dl_p[qi].unsqueeze(-1))
                dq_p[qi] += (ds @ k_p[kj]) * scale
                dk_p[kj] += (ds.transpose(-2, -1) @ q_p[qi]) * scale
            # The gradients of the block travel with it; after P moves they are home.
            acc = comm.ring_exchange_start(acc, 1, group, "ring dk,dv", "backward").wait()
            if pending is not None:
                kv = pending.wait()
        return dq.to(q.dtype), acc[0].to(k.dtype), acc[1].to(v.dtype), None, None, None


def _check_qkv(q, k, v, who: str, group=None) -> None:
    """Shapes, dtypes and devices of this rank's shards, before any rank communicates."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != 4:
            got = f"dtype {t.dtype}, shape {t.shape}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{who}: {name} must be a floating-point tensor laid out (b, heads, s_local, d), "
                             f"got {got}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"{who}: q, k and v must have the same shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype and q.device == k.device == v.device):
        raise ValueError(f"{who}: q, k and v must share dtype and device, got q {q.dtype} on {q.device}, "
                         f"k {k.dtype} on {k.device}, v {v.dtype} on {v.device}")
    _check_group_device(q, "q", who, group)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, causal: bool = False,
                   layout: str = "contiguous") -> torch.Tensor:
    """Softmax attention over the whole sequence, from this rank's shards ``(b, heads, s_local, d)``.

    The shards are those of :func:`shard_sequence` with the same ``layout``; the result is
    this rank's shard of the output. Differentiable.
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


def check_ulysses(heads: int, P: int, s: int | None = None) -> None:
    """``ValueError`` unless Ulysses can give each of P ranks whole heads: P must divide the heads.

    With ``s``, the sequence must also cut into P equal contiguous shards.
    """
    n_chunks(P, "contiguous")                                                   # P a whole number ≥ 1
    if _whole(heads, "the number of heads") % P:
        raise ValueError(f"Ulysses gives each rank heads/P whole heads: {heads} heads are not divisible by "
                         f"the context-parallel degree P={P}" + (" (P > heads)" if P > heads else ""))
    if s is not None:
        check_sequence(s, P, "contiguous")


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, causal: bool = False) -> torch.Tensor:
    """DeepSpeed-Ulysses: all-to-all to a head split, full attention on heads/P heads, all-to-all back.

    q, k, v are this rank's contiguous shards ``(b, heads, s_local, d)``; P must divide
    the number of heads (each rank attends with whole heads), so P ≤ heads.
    """
    _check_qkv(q, k, v, "ulysses_attention", group)
    P = dist.get_world_size(group)
    check_ulysses(q.shape[1], P)
    qh, kh, vh = (_seq_to_heads(t, group, f"ulysses {n}") for n, t in (("q", q), ("k", k), ("v", v)))
    o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)              # (b, H/P, s, d)
    return _heads_to_seq(o, group, "ulysses out")


# ---------------------------------------------------------------------------- costs

def cp_costs(s: int, b: int, heads: int, d: int, P: int, method: str, causal: bool = True,
             layout: str = "zigzag", itemsize: int = 2) -> dict:
    """Per rank and attention layer: bytes sent (forward + backward), scores, memory.

    - Ring (this module's implementation): forward, P−1 moves of this rank's k and v
      blocks (``block`` = b·s/P·heads·d numbers each); backward, P−1 moves of k and v and
      P moves of their gradients, which travel in float32 (float64 for float64 inputs).
    - Ulysses: four all-to-alls forward (q, k, v, output) and four backward, each sending
      (P−1)/P of a (b, heads, s/P, d) tensor — 4Nh/P per rank and pass for N = b·s tokens
      and h = heads·d (Jacobs et al. 2023).
    - scores: attention scores the busiest rank computes, forward (the ring's schedule,
      diagonal blocks computed whole; Ulysses' heads/P heads over s·(s+1)/2 causal pairs or
      s² pairs); flops = 4·d·scores (q kᵀ and the weighted sum).
    - memory: the attention tensors a rank holds at once, in blocks: ring — q, k, v, the
      output and the k, v block arriving; Ulysses — q, k, v and the output in both layouts.
    """
    if method not in ("ring", "ulysses"):
        raise ValueError(f"method must be 'ring' or 'ulysses', got {method!r}")
    for value, what in ((s, "sequence length"), (b, "batch"), (heads, "heads"), (d, "head dimension"),
                        (itemsize, "itemsize")):
        _whole(value, what)
    n_chunks(P, "contiguous")                                                   # P a whole number ≥ 1
    block = b * (s // P) * heads * d * itemsize                                  # one of q, k, v on a rank
    if method == "ring":
        check_sequence(s, P, layout)
        forward = (P - 1) * 2 * block
        backward = (P - 1) * 2 * block + (P * 2 * block * max(4, itemsize) // itemsize if P > 1 else 0)
        scores = max(work_per_rank(s, P, layout, causal)) * b * heads
        memory = 6 * block
    else:
        check_sequence(s, P, "contiguous")
        check_ulysses(heads, P)
        forward = backward = 4 * (P - 1) * block / P
        scores = b * (heads // P) * (s * (s + 1) // 2 if causal else s * s)
        memory = 8 * block
    return dict(forward=forward, backward=backward, sent=forward + backward, scores=scores,
                flops=4 * d * scores, memory=memory)
