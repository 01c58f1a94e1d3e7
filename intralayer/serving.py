"""Serving across ranks: a long prompt's prefill under context parallelism, and an MoE model served with
data-parallel attention and expert parallelism (chapter 09).

Context parallelism at inference. A prompt too long for one GPU's time budget is split over the P ranks
of a group, and so is its KV cache:

- :func:`cp_prefill` gives each rank s0/P of the prompt's tokens (chapter 04's layouts) and runs every
  block's attention with chapter 04's :func:`~intralayer.context_parallel.ring_attention`, causal: the keys
  and values travel round the ring (*pass-KV*). Each rank keeps the keys and values of its own tokens, so
  the cache stays spread over the ranks (:class:`ContextParallelCache`), and the last position's logits
  reach every rank (an all-reduce of b·v numbers to which the other ranks add zeros).
- :func:`cp_decode_step` decodes one token per sequence. Every rank runs it (the weights are replicated);
  one rank stores its keys and values (the one holding the fewest positions, so the shares stay even);
  each rank attends the query to the keys it holds (:func:`partial_attention`, an output and its
  log-sum-exp), the ranks all-gather those partial results, b·a·(d + 1) numbers each per layer, and merge
  them with chapter 04's rule (:func:`~intralayer.context_parallel.merge_partials`), in rank order on every
  rank, so that all of them pick the same token.
- :func:`cp_extend` adds n more tokens to the cache (a follow-up turn of a conversation), n/P on each rank,
  with either ring: ``"pass-KV"`` (each rank's keys and values, cached and new, travel) or ``"pass-Q"``
  (the new queries travel, and the partial outputs come back to their owners by one all-to-all).
  :func:`intralayer.inference.ring_pass_bytes` counts what each sends and
  :func:`~intralayer.inference.pass_q_threshold` says when pass-Q sends less.

MoE serving. :class:`MoEGPT` is the dense twin, blocks of attention and a
:class:`~intralayer.moe.MoELayer` whose capacity factor is E/k: an expert then accepts every token of a
batch, so none is dropped and a token's output never depends on which other requests share its batch.
:func:`dp_ep_greedy_decode` serves it on a group: attention data-parallel (each rank its own requests,
their KV cache and a replica of the attention weights; no collective), the experts expert-parallel (E/P
on each rank, chapter 06's :class:`~intralayer.expert_parallel.ExpertParallelMoE`: per MoE layer and
forward three all-to-alls, the counts, the dispatch and the combine). :func:`moe_serving_memory` is the
arithmetic of that layout against attention split by tensor parallelism.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm, rules
from . import context_parallel as cp
from .expert_parallel import ExpertParallelMoE
from .inference import KVCache, attend_cached, attn_head_dim, kv_cache_bytes, new_caches, project_qkv
from .model import Attention, TinyGPT
from .moe import MoELayer

#: The two context-parallel rings of :func:`cp_extend`.
RING_VARIANTS = ("pass-KV", "pass-Q")


# ---------------------------------------------------------------------------- attention by positions

def partial_attention(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of queries ``q`` (b, a, m, d) at positions ``q_pos`` (m,) over the keys and values
    ``k``, ``v`` (b, a_kv, n, d) at positions ``k_pos`` (n,): key j is visible to query i when
    ``k_pos[j] ≤ q_pos[i]``. Returns (output (b, a, m, d), log-sum-exp of the scores (b, a, m)), in float32
    (float64 for float64 inputs); a query that sees no key gets output 0 and log-sum-exp −∞, which
    :func:`~intralayer.context_parallel.merge_partials` passes over.
    """
    who = "partial_attention"
    for name, x in (("q", q), ("k", k), ("v", v)):
        rules.check_tensor(x, name, who, dims=4, layout="(b, heads, tokens, d)")
    b, a, m, d = q.shape
    if k.shape != v.shape or (k.shape[0], k.shape[3]) != (b, d) or a % k.shape[1]:
        raise ValueError(f"{who}: k and v must be (b, a_kv, n, d) = ({b}, a_kv, n, {d}) with a_kv dividing the "
                         f"{a} query heads, got {tuple(k.shape)} and {tuple(v.shape)}")
    for name, pos, size in (("q_pos", q_pos, m), ("k_pos", k_pos, k.shape[2])):
        rules.check_tensor(pos, name, who, dims=1, floating=False)
        if pos.shape[0] != size:
            raise ValueError(f"{who}: {name} must hold one position per token, {size}, got {pos.shape[0]}")
    w = torch.promote_types(q.dtype, torch.float32)
    n = k.shape[2]
    if n == 0:                                                       # this rank holds no key yet
        return q.new_zeros(q.shape, dtype=w), torch.full((b, a, m), float("-inf"), dtype=w, device=q.device)
    g = a // k.shape[1]
    keys, values = (x.to(w).repeat_interleave(g, dim=1) for x in (k, v))        # (b, a, n, d)
    scores = (q.to(w) @ keys.transpose(-2, -1)) / math.sqrt(d)                 # (b, a, m, n)
    visible = k_pos.to(q.device)[None, :] <= q_pos.to(q.device)[:, None]       # (m, n)
    scores = scores.masked_fill(~visible, float("-inf"))
    top = scores.amax(-1)                                                        # (b, a, m); −∞: nothing visible
    shift = torch.where(torch.isneginf(top), 0.0, top)
    e = torch.exp(scores - shift.unsqueeze(-1))
    total = e.sum(-1)                                                            # 0 where nothing is visible
    out = (e @ values) / torch.where(total > 0, total, 1.0).unsqueeze(-1)        # (b, a, m, d)
    return out, shift + torch.log(total)


def merge_all(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """The attention output over all the key sets of ``outs``/``lses`` (partial results over disjoint keys),
    merged left to right with chapter 04's log-sum-exp rule."""
    if not outs or len(outs) != len(lses):
        raise ValueError(f"merge_all needs as many log-sum-exps as outputs (at least one), got {len(outs)} "
                         f"and {len(lses)}")
    out, lse = outs[0], lses[0]
    for o, l in zip(outs[1:], lses[1:]):
        out, lse = cp.merge_partials(out, lse, o, l)
    return out


# ---------------------------------------------------------------------------- the distributed KV cache

@dataclass
class ContextParallelCache:
    """This rank's share of a KV cache spread over a context-parallel group.

    ``layers`` holds one :class:`~intralayer.inference.KVCache` per block, the keys and values of this
    rank's positions; ``held[j]`` lists the positions rank j holds, in the order of its cache (the same
    list on every rank: every rank can say where any position lives).
    """

    layers: list[KVCache]
    held: list[list[int]]
    rank: int
    kv_heads: int
    head_dim: int
    itemsize: int

    @property
    def P(self) -> int:
        return len(self.held)

    @property
    def length(self) -> int:
        """Positions cached over the whole group."""
        return sum(len(h) for h in self.held)

    def positions(self, rank: int | None = None) -> torch.Tensor:
        """The positions rank ``rank`` (default: this one) holds, in its cache's order."""
        j = self.rank if rank is None else rules.index(rank, "rank ", self.P, f"the P={self.P} ranks")
        return torch.tensor(self.held[j], dtype=torch.long)

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values this rank holds (the filled positions of every layer)."""
        return sum(2 * c.k[:, :, :c.length].nbytes for c in self.layers)

    def formula_bytes(self, rank: int | None = None) -> int:
        """:func:`~intralayer.inference.kv_cache_bytes` for the positions rank ``rank`` holds, b sequences."""
        j = self.rank if rank is None else rules.index(rank, "rank ", self.P, f"the P={self.P} ranks")
        b = self.layers[0].k.shape[0]
        return kv_cache_bytes(len(self.layers), self.kv_heads, self.head_dim, len(self.held[j]) * b,
                              itemsize=self.itemsize)

    def check_room(self, adding: dict[int, int], who: str) -> None:
        """``ValueError`` on every rank alike (before any collective) unless each rank j has room for
        ``adding[j]`` more positions."""
        room = self.layers[0].capacity
        full = [j for j, n in adding.items() if len(self.held[j]) + n > room]
        if full:
            raise ValueError(f"{who}: rank {full[0]} holds {len(self.held[full[0]])} of its {room} positions and "
                             f"cannot take {adding[full[0]]} more; prefill with a larger s_max")

    def least_loaded(self) -> int:
        """The rank holding the fewest positions (the lowest such rank): where a decoded token's keys go."""
        return min(range(self.P), key=lambda j: (len(self.held[j]), j))


def _check_gpt(model, who: str) -> None:
    if not isinstance(model, TinyGPT):
        raise ValueError(f"{who} runs a dense TinyGPT (its weights replicated on every rank), got "
                         f"{type(model).__name__}")


def _check_ids(ids, who: str, what: str = "ids") -> tuple[int, int]:
    rules.check_tensor(ids, what, who, dims=2, floating=False, layout="(tokens, b)")
    if ids.shape[0] < 1 or ids.shape[1] < 1:
        raise ValueError(f"{who}: {what} must hold at least one token of at least one sequence, got shape "
                         f"{tuple(ids.shape)}")
    return ids.shape[0], ids.shape[1]


def _heads(attn: nn.Module, x: torch.Tensor):
    """q (b, a, n, d) and k, v (b, a_kv, n, d) of the tokens x (n, b, h)."""
    n, b = x.shape[:2]
    d = attn_head_dim(attn)
    return tuple(part.reshape(n, b, -1, d).permute(1, 2, 0, 3) for part in project_qkv(attn, x))


def _project_out(attn: nn.Module, o: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(b, a, n, d) → the output projection of (n, b, a·d)."""
    b, a, n, d = o.shape
    return attn.proj(o.to(dtype).permute(2, 0, 1, 3).reshape(n, b, a * d))


def _last_logits(model: TinyGPT, x: torch.Tensor, cache: ContextParallelCache, position: int, group):
    """The logits (b, v) at ``position``, on every rank: its owner computes them, the others add zeros."""
    owner = next(j for j, h in enumerate(cache.held) if position in h)
    if owner == cache.rank:
        mine = cache.held[owner]                                     # x: the last len(x) of them
        logits = model.head(model.ln_f(x[mine.index(position) - (len(mine) - len(x))]))
    else:
        logits = x.new_zeros(x.shape[1], model.head.out_features)
    return comm.all_reduce(logits, group, "last logits")


@torch.no_grad()
def cp_prefill(model: TinyGPT, prompt: torch.Tensor, group, s_max: int,
               layout: str = "zigzag") -> tuple[torch.Tensor, ContextParallelCache]:
    """Prefill ``prompt`` (s0, b), the same on every rank, split over the group's P ranks by ``layout``.

    Returns the logits of the prompt's last position (b, v), on every rank, and this rank's share of the
    cache, room for ``s_max`` positions over the group (⌈s_max/P⌉ here).
    """
    _check_gpt(model, "cp_prefill")
    s0, b = _check_ids(prompt, "cp_prefill", "prompt")
    P, r = dist.get_world_size(group), dist.get_rank(group)
    cp.check_sequence(s0, P, layout)
    if rules.whole(s_max, "s_max") < s0:
        raise ValueError(f"cp_prefill: s_max = {s_max} positions cannot hold the prompt's {s0}")
    rules.check_group_device(prompt, "prompt", "cp_prefill", group)
    attn = model.blocks[0].attn
    weight = attn.qkv.weight
    local = -(-s_max // P)
    caches = [KVCache.empty(b, blk.attn.kv_heads, local, attn_head_dim(blk.attn), weight.dtype, weight.device)
              for blk in model.blocks]
    held = [cp.positions(j, P, s0, layout) for j in range(P)]
    cache = ContextParallelCache(caches, held, r, attn.kv_heads, attn_head_dim(attn),
                                 weight.element_size())
    x = model.embed(prompt[held[r]])                                 # (s0/P, b, h): this rank's tokens
    for block, kv in zip(model.blocks, caches):
        q, k, v = _heads(block.attn, block.ln1(x))                    # (b, a, s0/P, d), 2 × (b, a_kv, s0/P, d)
        kv.append(k, v)
        o = cp.ring_attention(q, k, v, group, causal=True, layout=layout)        # pass-KV: k, v travel
        x = x + _project_out(block.attn, o, x.dtype)
        x = x + block.mlp(block.ln2(x))
    return _last_logits(model, x, cache, s0 - 1, group), cache


@torch.no_grad()
def cp_decode_step(model: TinyGPT, token: torch.Tensor, cache: ContextParallelCache, group) -> torch.Tensor:
    """Decode one token per sequence (``token``: (b,) ids, the same on every rank) against the spread
    cache; its keys and values are stored by :meth:`ContextParallelCache.least_loaded`. Returns the next
    position's logits (b, v), bit for bit the same on every rank."""
    _check_gpt(model, "cp_decode_step")
    rules.check_tensor(token, "token", "cp_decode_step", dims=1, floating=False, layout="(b,)")
    b = cache.layers[0].k.shape[0]
    if token.shape[0] != b:
        raise ValueError(f"cp_decode_step: {token.shape[0]} tokens for a cache of b = {b} sequences")
    if dist.get_world_size(group) != cache.P or dist.get_rank(group) != cache.rank:
        raise ValueError("cp_decode_step: the cache belongs to another group (or rank) than the one given")
    position, owner = cache.length, cache.least_loaded()
    cache.check_room({owner: 1}, "cp_decode_step")                    # every rank decides alike, before any send
    cache.held[owner].append(position)
    q_pos, k_pos = torch.tensor([position]), cache.positions()
    x = model.embed(token[None])                                     # (1, b, h)
    for block, kv in zip(model.blocks, cache.layers):
        q, k, v = _heads(block.attn, block.ln1(x))                    # (b, a, 1, d), 2 × (b, a_kv, 1, d)
        keys, values = kv.append(k, v) if owner == cache.rank else (kv.k[:, :, :kv.length], kv.v[:, :, :kv.length])
        out, lse = partial_attention(q, q_pos, keys, values, k_pos)
        d = out.shape[-1]
        packed = torch.cat([out, lse.unsqueeze(-1)], -1).unsqueeze(0)         # (1, b, a, 1, d + 1)
        every = comm.all_gather(packed, 0, group, "decode partials")          # (P, b, a, 1, d + 1)
        o = merge_all(list(every[..., :d]), list(every[..., d]))
        x = x + _project_out(block.attn, o, x.dtype)
        x = x + block.mlp(block.ln2(x))
    return model.head(model.ln_f(x))[-1]


def _pass_kv(q, q_pos, keys, values, cache: ContextParallelCache, group) -> torch.Tensor:
    """Each rank's keys and values (cached and new) go round the ring; this rank's queries stay."""
    P, r, d = cache.P, cache.rank, q.shape[-1]
    out, lse = partial_attention(q, q_pos, keys, values, cache.positions())
    outs, lses = [out], [lse]
    block = torch.cat([keys, values], -1)                            # (b, a_kv, n_r, 2d): one message a hop
    for i in range(1, P):
        frm = (r - i) % P                                            # whose block arrives now
        shape = (*block.shape[:2], len(cache.held[frm]), 2 * d)
        block = comm.sendrecv(block, (r + 1) % P, (r - 1) % P, shape, group, "pass-KV ring")
        out, lse = partial_attention(q, q_pos, block[..., :d], block[..., d:], cache.positions(frm))
        outs.append(out)
        lses.append(lse)
    return merge_all(outs, lses)


def _pass_q(q, new_positions: list[torch.Tensor], keys, values, cache: ContextParallelCache, group) -> torch.Tensor:
    """Each rank's new queries go round the ring; the partial outputs come home by one all-to-all."""
    P, r, d = cache.P, cache.rank, q.shape[-1]
    k_pos = cache.positions()
    partials = [None] * P
    for i in range(P):
        src = (r - i) % P                                            # whose queries this rank holds now
        if i:
            q = comm.sendrecv(q, (r + 1) % P, (r - 1) % P, None, group, "pass-Q ring")
        out, lse = partial_attention(q, new_positions[src], keys, values, k_pos)
        partials[src] = torch.cat([out, lse.unsqueeze(-1)], -1)          # (b, a, n/P, d + 1)
    home = comm.all_to_all(torch.stack(partials), [1] * P, [1] * P, group, "pass-Q partials")   # row j: rank j's
    return merge_all(list(home[..., :d]), list(home[..., d]))


@torch.no_grad()
def cp_extend(model: TinyGPT, ids: torch.Tensor, cache: ContextParallelCache, group,
              variant: str = "pass-KV") -> torch.Tensor:
    """Add n new tokens ``ids`` (n, b), the same on every rank, to the spread cache: rank r takes the r-th
    n/P of them, and their attention over every cached and new position runs as ``variant``, pass-KV or
    pass-Q. Returns the last new position's logits (b, v) on every rank."""
    _check_gpt(model, "cp_extend")
    if variant not in RING_VARIANTS:
        raise ValueError(f"cp_extend: variant must be one of {RING_VARIANTS}, got {variant!r}")
    n, b = _check_ids(ids, "cp_extend")
    P = cache.P
    if dist.get_world_size(group) != P or dist.get_rank(group) != cache.rank:
        raise ValueError("cp_extend: the cache belongs to another group (or rank) than the one given")
    if b != cache.layers[0].k.shape[0]:
        raise ValueError(f"cp_extend: {b} sequences for a cache of b = {cache.layers[0].k.shape[0]}")
    if n % P:
        raise ValueError(f"cp_extend: {n} new tokens do not split evenly over P = {P} ranks")
    start, per, r = cache.length, n // P, cache.rank
    cache.check_room({j: per for j in range(P)}, "cp_extend")
    new_positions = [torch.arange(start + j * per, start + (j + 1) * per) for j in range(P)]
    for j in range(P):
        cache.held[j].extend(new_positions[j].tolist())
    x = model.embed(ids[r * per:(r + 1) * per])                      # (n/P, b, h)
    for block, kv in zip(model.blocks, cache.layers):
        q, k, v = _heads(block.attn, block.ln1(x))                    # (b, a, n/P, d), 2 × (b, a_kv, n/P, d)
        keys, values = kv.append(k, v)                               # this rank's cached and new
        if variant == "pass-KV":
            o = _pass_kv(q, new_positions[r], keys, values, cache, group)
        else:
            o = _pass_q(q, new_positions, keys, values, cache, group)
        x = x + _project_out(block.attn, o, x.dtype)
        x = x + block.mlp(block.ln2(x))
    return _last_logits(model, x, cache, start + n - 1, group)


@torch.no_grad()
def cp_greedy_decode(model: TinyGPT, prompt: torch.Tensor, steps: int, group, s_max: int | None = None,
                     layout: str = "zigzag") -> tuple[torch.Tensor, ContextParallelCache]:
    """:func:`cp_prefill`, then ``steps`` greedy tokens (steps, b) by :func:`cp_decode_step` (the last one
    chosen, not yet fed), as :func:`intralayer.inference.greedy_decode` does on one device."""
    rules.whole(steps, "steps")
    s0 = _check_ids(prompt, "cp_greedy_decode", "prompt")[0]
    logits, cache = cp_prefill(model, prompt, group, s_max or s0 + steps, layout)
    return greedy_continue(model, logits, steps, cache, group), cache


def greedy_continue(model: TinyGPT, logits: torch.Tensor, steps: int, cache: ContextParallelCache,
                    group) -> torch.Tensor:
    """``steps`` greedy tokens (steps, b) from ``logits`` (b, v), each fed back by :func:`cp_decode_step`
    but the last."""
    rules.whole(steps, "steps")
    rules.check_tensor(logits, "logits", "greedy_continue", dims=2, layout="(b, v)")
    out = []
    for step in range(steps):
        token = logits.argmax(-1)                                    # (b,)
        out.append(token)
        if step + 1 < steps:
            logits = cp_decode_step(model, token, cache, group)
    return torch.stack(out)


# ---------------------------------------------------------------------------- MoE serving

class MoEBlock(nn.Module):
    """A pre-LayerNorm block with an MoE layer: ``x + attn(ln1(x))``, then ``x + moe(ln2(x))`` over the
    (s·b, h) tokens. The capacity factor is E/k: no token is ever dropped."""

    def __init__(self, h: int, heads: int, ffn: int, experts: int, k: int, kv_heads: int | None = None,
                 shared: bool = False):
        super().__init__()
        self.h = rules.whole(h, "hidden size h")
        self.ln1 = nn.LayerNorm(h)
        self.attn = Attention(h, heads, kv_heads=kv_heads)
        self.ln2 = nn.LayerNorm(h)
        self.moe = MoELayer(h, ffn, experts, k, capacity_factor=experts / k, shared=shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rules.check_shape(x, self.h, "MoEBlock")
        x = x + self.attn(self.ln1(x))                               # (s, b, h)
        return x + _moe(self.moe, self.ln2(x))


def _moe(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An MoE layer (dense or expert-parallel) on the tokens of x (n, b, h), as (n, b, h)."""
    n, b, h = x.shape
    y = layer(x.reshape(n * b, h))                                   # (n·b, h) tokens
    return (y[0] if isinstance(y, tuple) else y).reshape(n, b, h)


class MoEGPT(nn.Module):
    """Embedding, ``layers`` :class:`MoEBlock`s, a final LayerNorm and an untied head: logits (s, b, v)."""

    def __init__(self, vocab: int, h: int, heads: int, ffn: int, experts: int, k: int, layers: int = 1,
                 kv_heads: int | None = None, shared: bool = False):
        super().__init__()
        self.embed = nn.Embedding(rules.whole(vocab, "vocabulary v"), h)
        self.blocks = nn.ModuleList(MoEBlock(h, heads, ffn, experts, k, kv_heads, shared)
                                    for _ in range(rules.whole(layers, "layers L")))
        self.ln_f = nn.LayerNorm(h)
        self.head = nn.Linear(h, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        _check_ids(ids, "MoEGPT")
        x = self.embed(ids)                                          # (s, b) → (s, b, h)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))                               # (s, b, v)


@torch.no_grad()
def moe_forward_cached(model: MoEGPT, ids: torch.Tensor, caches: list[KVCache] | None,
                       moe_layers: list[nn.Module] | None = None) -> torch.Tensor:
    """Logits (n, b, v) of n new tokens ``ids`` (n, b), each block's attention over its cache (which grows
    by n) and its MoE layer, or ``moe_layers[i]`` instead (an expert-parallel shard: then every rank of its
    group must call this, even with b = 0 requests and ``caches`` None)."""
    if not isinstance(model, MoEGPT):
        raise ValueError(f"moe_forward_cached runs an MoEGPT, got {type(model).__name__}")
    rules.check_tensor(ids, "ids", "moe_forward_cached", dims=2, floating=False, layout="(n, b)")
    n, b = ids.shape
    L = len(model.blocks)
    if b and (caches is None or len(caches) != L):
        raise ValueError(f"moe_forward_cached: {b} sequences need one cache per block ({L})")
    if moe_layers is not None and len(moe_layers) != L:
        raise ValueError(f"moe_forward_cached: {len(moe_layers)} MoE layers for {L} blocks (one per block)")
    x = model.embed(ids)                                             # (n, b, h)
    for i, block in enumerate(model.blocks):
        if b:                                                        # data-parallel attention: no collective
            x = x + attend_cached(block.attn, block.ln1(x), caches[i])
        x = x + _moe(block.moe if moe_layers is None else moe_layers[i], block.ln2(x))
    return model.head(model.ln_f(x))


@torch.no_grad()
def dp_ep_greedy_decode(model: MoEGPT, prompt: torch.Tensor, steps: int, group
                        ) -> tuple[torch.Tensor, list[ExpertParallelMoE]]:
    """Serve this rank's requests ``prompt`` (s0, b_r; b_r may be 0, s0 the same on every rank) on a group:
    attention data-parallel, the experts spread over the ranks. Prefill, then ``steps`` greedy tokens
    (steps, b_r). Returns them and the expert-parallel layers (their ``last`` dispatch, for counting)."""
    if not isinstance(model, MoEGPT):
        raise ValueError(f"dp_ep_greedy_decode runs an MoEGPT, got {type(model).__name__}")
    rules.check_tensor(prompt, "prompt", "dp_ep_greedy_decode", dims=2, floating=False, layout="(s0, b)")
    rules.whole(steps, "steps")
    s0, b = prompt.shape
    rules.whole(s0, "prompt length s0")
    layers = [ExpertParallelMoE.from_dense(block.moe, group) for block in model.blocks]
    caches = new_caches(model, b, s0 + steps) if b else None
    logits = moe_forward_cached(model, prompt, caches, layers)[-1]   # (b, v)
    out = []
    for step in range(steps):
        token = logits.argmax(-1)                                    # (b,)
        out.append(token)
        if step + 1 < steps:
            logits = moe_forward_cached(model, token[None], caches, layers)[-1]
    return torch.stack(out), layers


# ---------------------------------------------------------------------------- the serving arithmetic

ATTENTION_LAYOUTS = ("tp", "dp")


@dataclass(frozen=True)
class MoEServing:
    """An MoE model served on P GPUs: experts spread over all P, attention split t ways inside each of
    P/t replicas (t = 1: data-parallel attention). Bytes per GPU."""

    model: str
    P: int
    t: int
    weights: float               # bytes per GPU
    experts: float               # of which the experts'
    kv_per_token: float          # bytes per GPU for one cached token of a request this GPU's replica serves
    memory: float                # bytes per GPU

    @property
    def fits(self) -> bool:
        return self.weights < self.memory

    @property
    def tokens_per_replica(self) -> int:
        """Tokens one attention replica (t GPUs) can cache beside the weights."""
        return max(int((self.memory - self.weights) // self.kv_per_token), 0)

    @property
    def tokens(self) -> int:
        """Tokens the P GPUs can cache: P/t replicas, each with its own requests."""
        return self.P // self.t * self.tokens_per_replica


def cached_numbers_per_token(m) -> tuple[int, bool]:
    """Numbers one token caches per layer, and whether tensor parallelism splits them: GQA, 2·a_kv·d split
    by heads; MLA, the latent of kv_lora_rank numbers and the shared rotary key of qk_rope_head_dim, which
    every head uses and so every tensor-parallel rank holds whole (DeepSeek-V3's configuration)."""
    from .planner import Model
    if not isinstance(m, Model):
        raise ValueError(f"cached_numbers_per_token takes a planner Model, got {type(m).__name__}")
    c = m.moe_config
    if c is not None and c.attention == "mla":
        return c.kv_lora_rank + c.qk_rope_head_dim, False
    return 2 * m.kv_heads * m.head_dims[0], True


def moe_serving_memory(m, P: int, t: int = 1, itemsize: int = 2, kv_itemsize: int = 2,
                       memory: float = 80e9) -> MoEServing:
    """Weights and KV cache per GPU of a planner :class:`~intralayer.planner.Model` of an MoE model served on
    P GPUs, its parameters counted by :func:`intralayer.moe.param_breakdown`: the routed experts split P ways;
    attention, dense and shared-expert MLPs and the vocabulary-parallel embedding and head split t ways, norms
    and routers whole (as chapter 08's planner splits them); per cached token :func:`cached_numbers_per_token`,
    divided by t where heads split it (while t ≤ a_kv)."""
    from .moe import param_breakdown
    for value, what in ((P, "GPUs P"), (t, "attention's tensor-parallel degree t"), (itemsize, "itemsize e"),
                        (kv_itemsize, "the cache's itemsize")):
        rules.whole(value, what)
    if P % t:
        raise ValueError(f"moe_serving_memory: t = {t} does not divide the P = {P} GPUs into attention replicas")
    if m.heads % t:
        raise ValueError(f"moe_serving_memory: {m.heads} heads do not split over t = {t}")
    if not m.is_moe or m.moe_config is None or m.experts % P:
        raise ValueError(f"moe_serving_memory: {m.name}'s {m.experts} experts do not split evenly over P = {P} GPUs "
                         f"(an MoE model with its configuration, experts a multiple of P)")
    parts = {k: total for k, (total, _) in param_breakdown(m.moe_config).items()}
    whole = parts["norms"] + parts["routers"]                        # on every GPU
    experts = parts["routed experts"] / P
    split = sum(parts.values()) - parts["routed experts"] - whole     # attention, dense and shared MLPs, tables
    split /= t
    numbers, by_heads = cached_numbers_per_token(m)
    kv = (kv_cache_bytes(m.layers, m.kv_heads, m.head_dims[0], 1, t, kv_itemsize) if by_heads
          else m.layers * numbers * kv_itemsize)
    return MoEServing(m.name, P, t, itemsize * (split + whole + experts), itemsize * experts, kv, memory)


def ep_decode_bytes(tokens: int, k: int, P: int, hidden: int, itemsize: int = 2) -> float:
    """Bytes one GPU sends per MoE layer and decode step, dispatch and combine, for ``tokens`` tokens of its
    own when the router spreads assignments evenly: ``2·tokens·k·(P−1)/P·h·e`` (each of the k copies of a
    token leaves the GPU unless its expert is one of the GPU's own, 1/P of them)."""
    for value, what in ((k, "k"), (P, "P"), (hidden, "hidden h"), (itemsize, "itemsize e")):
        rules.whole(value, what)
    rules.whole(tokens, "tokens", minimum=0)
    return 2 * tokens * k * (P - 1) / P * hidden * itemsize
