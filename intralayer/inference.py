"""Inference inside the layer: greedy decoding with a KV cache, on one device and under tensor parallelism.

The pieces of chapter 09 (issue 29), built on chapters 02 and 04's modules:

- :class:`KVCache` holds one layer's keys and values, ``(b, kv, s_max, d)`` each, of which
  the first ``length`` positions are filled; :func:`kv_cache_bytes` is its size by formula,
  ``2·L·a_kv·d·e`` bytes per token, divided by t only while t ≤ a_kv (a rank that shares a
  key/value head holds it whole, chapter 02's rule).
- :func:`forward_cached` runs n new tokens through a :class:`~intralayer.model.TinyGPT` or a
  :class:`~intralayer.tensor_parallel.ParallelGPT`, appending their keys and values to the
  caches: n = the prompt's length is the *prefill*, n = 1 a *decode step*. Under tensor
  parallelism the module's own collectives run: the embedding's all-reduce, and in each
  block the attention output projection's and the MLP's all-reduce, each of n·b·h numbers.
- :func:`greedy_decode` prefills, then decodes one token at a time, taking the most likely
  token; under tensor parallelism the logits are split by vocabulary, and it all-gathers
  them (b·v numbers per step) before the argmax, so that every rank picks the same token.
- :func:`greedy_reference` decodes without a cache, re-running the whole sequence each
  step: the model's own ``forward``, the twin every cached decode is checked against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import comm
from .model import TinyGPT
from .tensor_parallel import ParallelGPT, QKVParallelLinear


@dataclass
class KVCache:
    """One layer's cached keys and values, ``(b, kv, s_max, d)`` each; positions ``[0, length)`` filled."""

    k: torch.Tensor
    v: torch.Tensor
    length: int = 0

    @classmethod
    def empty(cls, b: int, kv_heads: int, s_max: int, d: int, dtype=torch.float32, device=None) -> "KVCache":
        for value, what in ((b, "batch b"), (kv_heads, "key/value heads"), (s_max, "s_max"), (d, "head dim d")):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KVCache: {what} must be a whole number ≥ 1, got {value!r}")
        shape = (b, kv_heads, s_max, d)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds (allocated for ``s_max`` positions, filled or not)."""
        return self.k.nbytes + self.v.nbytes

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store n new positions' keys and values ``(b, kv, n, d)``; return every filled position's."""
        n = k.shape[2]
        if k.shape != v.shape or k.shape[:2] != self.k.shape[:2] or k.shape[3] != self.k.shape[3]:
            raise ValueError(f"KVCache.append: keys {tuple(k.shape)} and values {tuple(v.shape)} must both be "
                             f"(b, kv, n, d) = ({self.k.shape[0]}, {self.k.shape[1]}, n, {self.k.shape[3]})")
        if self.length + n > self.capacity:
            raise ValueError(f"KVCache.append: {self.length} cached + {n} new positions exceed s_max = "
                             f"{self.capacity}; allocate the cache for the prompt plus every token to decode")
        self.k[:, :, self.length:self.length + n] = k
        self.v[:, :, self.length:self.length + n] = v
        self.length += n
        return self.k[:, :, :self.length], self.v[:, :, :self.length]


def kv_cache_bytes(layers: int, kv_heads: int, head_dim: int, tokens: int = 1, t: int = 1,
                   itemsize: int = 2) -> int:
    """Bytes of keys and values one rank caches for ``tokens`` tokens: ``2·L·(a_kv/t)·d·e`` each,
    with a_kv/t taken as 1 when t > a_kv (the shared head is held whole by every rank sharing it)."""
    for value, what in ((layers, "layers L"), (kv_heads, "key/value heads a_kv"), (head_dim, "head dim d"),
                        (tokens, "tokens"), (t, "t"), (itemsize, "itemsize e")):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if what == "tokens" else 1):
            raise ValueError(f"kv_cache_bytes: {what} must be a whole number, got {value!r}")
    if kv_heads % t and t % kv_heads:
        raise ValueError(f"kv_cache_bytes: a_kv = {kv_heads} must be a multiple or a divisor of t = {t} "
                         f"(Megatron-Core's rule, chapter 02)")
    return 2 * layers * max(kv_heads // t, 1) * head_dim * itemsize * tokens


def _head_dim(attn: nn.Module) -> int:
    return getattr(attn, "head_dim", None) or attn.proj.in_features // attn.heads


def _project(attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This module's queries (n, b, heads·d) and keys and values (n, b, kv·d) for the new tokens."""
    if isinstance(attn.qkv, QKVParallelLinear):
        return attn.query_key_value(attn.qkv(x))                   # chapter 02's per-group layout
    d = _head_dim(attn)
    return attn.qkv(x).split([attn.heads * d, attn.kv_heads * d, attn.kv_heads * d], dim=-1)


def new_caches(model: nn.Module, b: int, s_max: int) -> list[KVCache]:
    """One empty cache per block, sized for this rank's key/value heads."""
    caches = []
    for block in model.blocks:
        attn = block.attn
        caches.append(KVCache.empty(b, attn.kv_heads, s_max, _head_dim(attn), attn.qkv.weight.dtype,
                                    attn.qkv.weight.device))
    return caches


def _attend(attn: nn.Module, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Causal attention of the n new tokens over every cached position, then the output projection."""
    n, b = x.shape[:2]
    d, heads, kv = _head_dim(attn), attn.heads, attn.kv_heads
    q, k, v = (part.reshape(n, b, -1, d).permute(1, 2, 0, 3) for part in _project(attn, x))   # (b, ·, n, d)
    start = cache.length
    keys, values = cache.append(k, v)                                # (b, kv, start + n, d)
    keys, values = (c.repeat_interleave(heads // kv, dim=1) for c in (keys, values))
    # New token i sits at position start + i and sees positions 0 … start + i.
    visible = torch.arange(start + n, device=x.device) <= (start + torch.arange(n, device=x.device))[:, None]
    o = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)         # (b, heads, n, d)
    return attn.proj(o.permute(2, 0, 1, 3).reshape(n, b, heads * d))   # (n, b, h): row-parallel all-reduce


@torch.no_grad()
def forward_cached(model: nn.Module, ids: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
    """Logits of n new tokens ``ids`` (n, b), every block attending over its cache, which grows by n.

    A :class:`~intralayer.model.TinyGPT` returns (n, b, v); a
    :class:`~intralayer.tensor_parallel.ParallelGPT` returns this rank's vocabulary slice (n, b, v/t).
    """
    if not isinstance(model, (TinyGPT, ParallelGPT)):
        raise ValueError(f"forward_cached runs a TinyGPT or a ParallelGPT, got {type(model).__name__}")
    if len(caches) != len(model.blocks):
        raise ValueError(f"forward_cached: {len(caches)} caches for {len(model.blocks)} blocks (one per block)")
    x = model.embed(ids)                                             # (n, b, h); TP: the embedding's all-reduce
    for block, cache in zip(model.blocks, caches):
        x = x + _attend(block.attn, block.ln1(x), cache)
        x = x + block.mlp(block.ln2(x))                              # TP: fc2's all-reduce
    return model.head(model.ln_f(x))


def _full_logits(model: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """The whole vocabulary's logits: under TP, every rank's slice all-gathered (b·v numbers a step)."""
    if isinstance(model, ParallelGPT):
        return comm.all_gather(logits, -1, model.group, "logits gather")
    return logits


@torch.no_grad()
def greedy_decode(model: nn.Module, prompt: torch.Tensor, steps: int, s_max: int | None = None
                  ) -> tuple[torch.Tensor, list[KVCache]]:
    """Prefill ``prompt`` (s0, b), then decode ``steps`` tokens greedily with the cache: tokens (steps, b)."""
    if prompt.dim() != 2 or prompt.shape[0] < 1:
        raise ValueError(f"greedy_decode: the prompt must be token ids (s0, b) with s0 ≥ 1, got {tuple(prompt.shape)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"greedy_decode: steps must be a whole number ≥ 1, got {steps!r}")
    s0, b = prompt.shape
    caches = new_caches(model, b, s_max or s0 + steps)
    logits = _full_logits(model, forward_cached(model, prompt, caches))[-1]      # prefill: (b, v) of the last
    out = []
    for step in range(steps):
        token = logits.argmax(-1)                                    # (b,)
        out.append(token)
        if step + 1 < steps:                                         # decode: one token per sequence
            logits = _full_logits(model, forward_cached(model, token[None], caches))[-1]
    return torch.stack(out), caches


@torch.no_grad()
def greedy_reference(model: TinyGPT, prompt: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy decoding without a cache: the whole sequence through ``model`` at every step.
    Returns the tokens (steps, b) and each step's last-position logits (b, v)."""
    ids, out, every = prompt, [], []
    for _ in range(steps):
        logits = model(ids)[-1]                                      # (b, v)
        every.append(logits)
        token = logits.argmax(-1)
        out.append(token)
        ids = torch.cat([ids, token[None]])
    return torch.stack(out), every
