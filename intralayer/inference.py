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

And the arithmetic of serving: :func:`decode_all_reduces` and :func:`allreduce_time` (ring, one-shot and
two-shot all-reduces in the α–β model, :func:`one_shot_crossover` between the last two);
:func:`ring_pass_bytes` and :func:`pass_q_threshold` for the two context-parallel rings over a KV cache;
:func:`serve_plan`, one tensor-parallel replica's memory and decode step on chapter 08's clusters, and
:func:`serve_search`, the best batch per t within a time per token. Context-parallel prefill and decode and
MoE serving with data-parallel attention are :mod:`intralayer.serving`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import comm, rules
from .collectives import NCCL_BASE_US
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


def attn_head_dim(attn: nn.Module) -> int:
    """The head dimension d of an attention module (dense or tensor-parallel)."""
    if not hasattr(attn, "qkv") or not hasattr(attn, "heads"):
        raise ValueError(f"attn_head_dim needs an attention module with qkv and heads, got {type(attn).__name__}")
    return getattr(attn, "head_dim", None) or attn.proj.in_features // attn.heads


def project_qkv(attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This module's queries (n, b, heads·d) and keys and values (n, b, kv·d) for the new tokens."""
    rules.check_tensor(x, "x", "project_qkv", dims=3, layout="(n, b, h)")
    if isinstance(attn.qkv, QKVParallelLinear):
        return attn.query_key_value(attn.qkv(x))                   # chapter 02's per-group layout
    d = attn_head_dim(attn)
    return attn.qkv(x).split([attn.heads * d, attn.kv_heads * d, attn.kv_heads * d], dim=-1)


def new_caches(model: nn.Module, b: int, s_max: int) -> list[KVCache]:
    """One empty cache per block, sized for this rank's key/value heads."""
    caches = []
    for block in model.blocks:
        attn = block.attn
        caches.append(KVCache.empty(b, attn.kv_heads, s_max, attn_head_dim(attn), attn.qkv.weight.dtype,
                                    attn.qkv.weight.device))
    return caches


def attend_cached(attn: nn.Module, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Causal attention of the n new tokens over every cached position, then the output projection."""
    n, b = x.shape[:2]
    d, heads, kv = attn_head_dim(attn), attn.heads, attn.kv_heads
    q, k, v = (part.reshape(n, b, -1, d).permute(1, 2, 0, 3) for part in project_qkv(attn, x))   # (b, ·, n, d)
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
        x = x + attend_cached(block.attn, block.ln1(x), cache)
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


# ---------------------------------------------------------------------------- decode's collectives, by formula

def decode_all_reduces(layers: int) -> int:
    """All-reduces one tensor-parallel forward issues (prefill or a decode step): the vocabulary-parallel
    embedding's one, then the attention output projection's and the MLP's in each of the L blocks."""
    _whole(layers, "layers L", "decode_all_reduces")
    return 1 + 2 * layers


def _whole(value, what: str, who: str, least: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{who}: {what} must be a whole number ≥ {least}, got {value!r}")


def _positive(value, what: str, who: str, zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (value >= 0 if zero else value > 0)
    if not ok or value != value or value == float("inf"):
        raise ValueError(f"{who}: {what} must be a finite number {'≥' if zero else '>'} 0, got {value!r}")


#: The all-reduce algorithms :func:`allreduce_time` models; "auto" takes the fastest of the three.
ALLREDUCE_ALGORITHMS = ("ring", "one-shot", "two-shot", "auto")


def allreduce_time(algorithm: str, n: int, size_bytes: float, bandwidth: float, alpha: float) -> float:
    """Seconds of one all-reduce of S = ``size_bytes`` on n ranks, in chapter 00's α–β model.

    - ``ring``: ``2(n−1)·α + 2(n−1)/n · S/B`` (:func:`intralayer.collectives.collective_time`): bandwidth-optimal,
      2(n−1) latency-bound steps.
    - ``one-shot``: every rank sends its whole S to each of the n−1 others and each adds the n copies itself:
      ``α + (n−1) · S/B`` — one step, n−1 times the bytes.
    - ``two-shot``: a reduce-scatter then an all-gather, each one direct step to every peer:
      ``2α + 2(n−1)/n · S/B`` — the ring's bytes in two steps.

    One α per step for all three is the model's assumption (a step is a round of sends that must land before
    the next begins), and B is each GPU's one-way link bandwidth, as on an NVSwitch node where every GPU reaches
    every other at full speed.
    """
    from .collectives import collective_time
    if algorithm not in ALLREDUCE_ALGORITHMS:
        raise ValueError(f"allreduce_time: algorithm must be one of {ALLREDUCE_ALGORITHMS}, got {algorithm!r}")
    _whole(n, "ranks n", "allreduce_time")
    _positive(size_bytes, "size S (bytes)", "allreduce_time", zero=True)
    _positive(bandwidth, "bandwidth B (bytes/s)", "allreduce_time")
    _positive(alpha, "latency α (s)", "allreduce_time", zero=True)
    if n == 1:
        return 0.0
    if algorithm == "auto":
        return min(allreduce_time(a, n, size_bytes, bandwidth, alpha) for a in ALLREDUCE_ALGORITHMS[:3])
    if algorithm == "ring":
        return collective_time("all_reduce", n, size_bytes, bandwidth, alpha)
    if algorithm == "one-shot":
        return alpha + (n - 1) * size_bytes / bandwidth
    return 2 * alpha + 2 * (n - 1) / n * size_bytes / bandwidth


def one_shot_crossover(n: int, bandwidth: float, alpha: float) -> float:
    """The size S* (bytes) above which two-shot beats one-shot: ``α + (n−1)S/B = 2α + 2(n−1)S/(nB)`` gives
    ``S* = α·B·n / ((n−1)(n−2))``. On two ranks the bandwidth terms are equal and one-shot always wins (inf)."""
    _whole(n, "ranks n", "one_shot_crossover", least=2)
    _positive(bandwidth, "bandwidth B (bytes/s)", "one_shot_crossover")
    _positive(alpha, "latency α (s)", "one_shot_crossover", zero=True)
    if n == 2:
        return float("inf")
    return alpha * bandwidth * n / ((n - 1) * (n - 2))


# ---------------------------------------------------------------------------- prefill under context parallelism

def ring_pass_bytes(variant: str, new: int, cached: int, heads: int, kv_heads: int, head_dim: int, P: int,
                    itemsize: int = 2, lse: bool = False, partial_itemsize: int | None = None) -> int:
    """Bytes one rank sends, per layer and sequence, in a context-parallel ring over P ranks that attends
    ``new`` tokens (split over the ranks) against ``cached + new`` keys and values (the cached ones already
    spread over them); the mean over the ranks when their shares differ.

    - ``pass-KV``: every rank's keys and values travel round the ring, P−1 hops of its share:
      ``(P−1)/P · 2·(cached + new)·a_kv·d·e``.
    - ``pass-Q``: the queries travel instead, and each rank's partial outputs must come back to the query's
      owner: ``(P−1)/P · 2·new·a·d·e``. With ``lse`` the partial outputs' log-sum-exps are counted too (one
      number per query and head), and ``partial_itemsize`` is the bytes of a partial output's number when it
      travels wider than the queries (:mod:`intralayer.serving` sends float32):
      ``(P−1)/P · new·a·(d·e + (d + 1)·e_p)``.

    The course's count of the two rings' bytes (chapter 04's ring, GQA's a_kv ≤ a).
    """
    if variant not in ("pass-KV", "pass-Q"):
        raise ValueError(f"ring_pass_bytes: variant must be 'pass-KV' or 'pass-Q', got {variant!r}")
    for value, what in ((heads, "heads a"), (kv_heads, "key/value heads a_kv"), (head_dim, "head dim d"),
                        (P, "ranks P"), (itemsize, "itemsize e")):
        _whole(value, what, "ring_pass_bytes")
    _whole(new, "new tokens", "ring_pass_bytes")
    _whole(cached, "cached tokens", "ring_pass_bytes", least=0)
    if heads % kv_heads:
        raise ValueError(f"ring_pass_bytes: a = {heads} query heads must be a multiple of a_kv = {kv_heads}")
    if new % P or cached % P:
        raise ValueError(f"ring_pass_bytes: {new} new and {cached} cached tokens must split evenly over P = {P}")
    partial = itemsize if partial_itemsize is None else partial_itemsize
    _whole(partial, "partial_itemsize e_p", "ring_pass_bytes")
    if variant == "pass-KV":
        return (P - 1) * 2 * (cached + new) // P * kv_heads * head_dim * itemsize
    per_query = head_dim * itemsize + (head_dim + (1 if lse else 0)) * partial
    return (P - 1) * new // P * heads * per_query


def pass_q_threshold(heads: int, kv_heads: int, head_dim: int | None = None, itemsize: int = 2,
                     lse: bool = False, partial_itemsize: int | None = None) -> float:
    """The share of new tokens, new / (new + cached), below which pass-Q sends fewer bytes than pass-KV.

    With the queries and partial outputs as wide as the keys and values (no ``head_dim``):
    ``new·a < (cached + new)·a_kv`` ⇔ ``new / (new + cached) < a_kv / a``. With ``head_dim`` the count of
    :func:`ring_pass_bytes` with the same ``lse`` and ``partial_itemsize``:
    ``2·a_kv·d·e / (a·(d·e + (d + [lse])·e_p))``.
    """
    _whole(heads, "heads a", "pass_q_threshold")
    _whole(kv_heads, "key/value heads a_kv", "pass_q_threshold")
    if head_dim is None:
        return kv_heads / heads
    _whole(head_dim, "head dim d", "pass_q_threshold")
    _whole(itemsize, "itemsize e", "pass_q_threshold")
    partial = itemsize if partial_itemsize is None else partial_itemsize
    _whole(partial, "partial_itemsize e_p", "pass_q_threshold")
    return 2 * kv_heads * head_dim * itemsize / (heads * (head_dim * itemsize + (head_dim + bool(lse)) * partial))


# ---------------------------------------------------------------------------- a small serving planner

#: H100 SXM's HBM3 bandwidth, bytes/s (NVIDIA H100 datasheet: 3.35 TB/s).
H100_HBM_BANDWIDTH = 3.35e12
#: H200 SXM: 141 GB of HBM3e at 4.8 TB/s, with the H100's Hopper compute and 900 GB/s NVLink (NVIDIA H200
#: product page). Chapter 08's planner has no H200 cluster; chapter 09 builds one from its H100 node and these.
H200_MEMORY = 141e9
H200_HBM_BANDWIDTH = 4.8e12


#: The latency NCCL's tuning model charges every call of a ring collective once, on top of its steps, by protocol
#: (src/graph/tuning.cc, ``baseLatencies``, the Ring row: LL 6.6, LL128 14.0, Simple 8.4 µs; the Simple entry is
#: :data:`intralayer.collectives.NCCL_BASE_US`). :func:`serve_plan`'s ``call_latency`` takes one of these.
NCCL_RING_BASE_US = {"LL": 6.6, "LL128": 14.0, "Simple": NCCL_BASE_US}


@dataclass(frozen=True)
class ServePlan:
    """One tensor-parallel replica serving ``batch`` sequences of ``context`` tokens: memory and time per GPU."""

    model: str
    t: int
    batch: int
    context: int
    weights: float          # bytes per GPU
    kv: float               # bytes per GPU: the batch's whole cache at ``context`` tokens
    memory: float           # bytes per GPU available
    kv_per_token: float     # bytes per GPU per cached token
    step_memory: float      # s: reading the weights and the cache from HBM once
    step_compute: float     # s: the step's FLOPs at the kernel efficiency
    step_comm: float        # s: 1 + 2L all-reduces of b·h·e and the logits' all-gather
    prefill: float          # s: one prompt of ``prompt`` tokens, batch 1
    prefill_comm: float     # s: its all-reduces of s·h·e

    @property
    def fits(self) -> bool:
        return self.weights + self.kv <= self.memory

    @property
    def max_tokens(self) -> int:
        """Cached tokens that fit beside the weights (0 when the weights alone do not fit)."""
        return max(int((self.memory - self.weights) // self.kv_per_token), 0)

    @property
    def step(self) -> float:
        """Seconds per decode step: the slower of memory and compute, then the all-reduces (on the critical path)."""
        return max(self.step_memory, self.step_compute) + self.step_comm

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.batch / self.step / self.t


def weight_bytes_per_gpu(m, t: int, itemsize: int = 2) -> float:
    """A dense model's weights on one of t tensor-parallel ranks: q and o, the MLP, the vocabulary-parallel
    embedding and head split t ways; the k and v projections split only while t ≤ a_kv (chapter 02's rule);
    the norms whole."""
    if m.is_moe:
        raise ValueError(f"weight_bytes_per_gpu covers dense models; {m.name} is a mixture of experts")
    _whole(t, "t", "weight_bytes_per_gpu")
    kv_bytes(m, t)                                                   # the a_kv / t rule
    d = m.hidden // m.heads
    per_layer = (2 * m.hidden * m.heads * d / t + 2 * m.hidden * max(m.kv_heads // t, 1) * d
                 + m.mlp_matrices * m.hidden * m.ffn / t + 2 * m.hidden)
    return itemsize * (m.layers * per_layer + 2 * m.vocab * m.hidden / t + m.hidden)


def kv_bytes(m, t: int, tokens: int = 1, itemsize: int = 2) -> int:
    """:func:`kv_cache_bytes` for a planner :class:`~intralayer.planner.Model`."""
    return kv_cache_bytes(m.layers, m.kv_heads, m.hidden // m.heads, tokens, t, itemsize)


def serve_plan(m, cluster, t: int, batch: int, context: int, prompt: int | None = None, itemsize: int = 2,
               algorithm: str = "ring", alpha: float | None = None, hbm: float = H100_HBM_BANDWIDTH,
               weight_itemsize: int | None = None, call_latency: float = 0.0) -> ServePlan:
    """A tensor-parallel replica of ``m`` on t GPUs of one NVLink node of ``cluster`` (chapter 08's
    :class:`~intralayer.planner.Cluster`, its kernel-efficiency curve and link bandwidth).

    - memory: :func:`weight_bytes_per_gpu` + the batch's cache at ``context`` tokens (:func:`kv_bytes`);
    - a decode step reads every weight and the whole cache once (HBM bandwidth ``hbm``), computes
      ``2·(active parameters) + 4·context·a·d·L`` FLOPs per sequence at chapter 08's kernel efficiency, and issues
      :func:`decode_all_reduces` all-reduces of b·h·e (:func:`allreduce_time`, α defaults to chapter 00's
      1.9 µs, NCCL's LL128 ring step over NVLink) and an all-gather of the b·v logits;
    - a prefill of ``prompt`` tokens (default ``context``) at batch 1: ``2·(active)·s + 2·s²·a·d·L`` FLOPs
      (causal), the same all-reduces of s·h·e.

    ``itemsize`` is the bytes of a cached number and of an activation; ``weight_itemsize`` (default the same)
    those of a weight, stored narrower than the activations, say 1 for 8-bit weights (the FLOPs are still
    counted at the bf16 peak). ``call_latency`` (seconds, default 0) is added once to every collective call, the
    decode step's and the prefill's: NCCL's per-call base latency (:data:`NCCL_RING_BASE_US`), which the α–β
    model's per-step α leaves out.

    So the step is ``max((weights + cache)/hbm, FLOPs/(peak·η)) + (1 + 2L)·(T_all-reduce + call_latency) +
    T_all-gather + call_latency``: reads and compute overlap each other, the collectives overlap nothing. Memory
    counts the weights and the cache only: no activations, CUDA graphs, communication buffers or allocator slack.
    """
    from .collectives import NCCL_RING_NVLINK_STEP_US, collective_time
    from .planner import gemm_size, kernel_efficiency, params
    for value, what in ((t, "t"), (batch, "batch b"), (context, "context")):
        _whole(value, what, "serve_plan")
    if t > cluster.gpus_per_node:
        raise ValueError(f"serve_plan: t = {t} exceeds the {cluster.gpus_per_node} GPUs of one NVLink node of "
                         f"{cluster.name}; keep tensor parallelism inside a node")
    if m.heads % t:
        raise ValueError(f"serve_plan: {m.heads} heads do not split over t = {t}")
    prompt = context if prompt is None else prompt
    _whole(prompt, "prompt", "serve_plan")
    alpha = NCCL_RING_NVLINK_STEP_US["LL128"] * 1e-6 if alpha is None else alpha
    weight_itemsize = itemsize if weight_itemsize is None else weight_itemsize
    _whole(weight_itemsize, "weight_itemsize", "serve_plan")
    _positive(call_latency, "call_latency (s)", "serve_plan", zero=True)
    weights = weight_bytes_per_gpu(m, t, weight_itemsize)
    per_token = kv_bytes(m, t, 1, itemsize)
    kv = per_token * batch * context
    d = m.hidden // m.heads
    active = params(m)["active"]
    eta = kernel_efficiency(cluster, gemm_size(m, t))
    flops_step = batch * (2 * active + 4 * context * m.heads * d * m.layers) / t
    B = cluster.intra
    ar = decode_all_reduces(m.layers)
    comm = 0.0 if t == 1 else (ar * allreduce_time(algorithm, t, batch * m.hidden * itemsize, B, alpha)
                               + collective_time("all_gather", t, batch * m.vocab * itemsize, B, alpha)
                               + (ar + 1) * call_latency)
    flops_prefill = (2 * active * prompt + 2 * prompt ** 2 * m.heads * d * m.layers) / t
    prefill_comm = 0.0 if t == 1 else ar * (allreduce_time(algorithm, t, prompt * m.hidden * itemsize, B, alpha)
                                            + call_latency)
    prefill = max(flops_prefill / (cluster.peak * eta), weights / hbm) + prefill_comm
    return ServePlan(m.name, t, batch, context, weights, kv, cluster.memory, per_token, (weights + kv) / hbm,
                     flops_step / (cluster.peak * eta), comm, prefill, prefill_comm)


#: The batch sizes :func:`serve_search` tries.
SERVE_BATCHES = tuple(2 ** i for i in range(11))


def serve_search(m, cluster, context: int, latency: float, ts=(1, 2, 4, 8), batches=SERVE_BATCHES,
                 **kw) -> dict[int, ServePlan | None]:
    """For each tensor-parallel degree t of ``ts``, the :func:`serve_plan` with the most tokens/s per GPU
    among the ``batches`` whose cache fits beside the weights at ``context`` tokens and whose decode step takes
    at most ``latency`` seconds; None where no batch does. ``kw`` goes to :func:`serve_plan`."""
    _whole(context, "context", "serve_search")
    _positive(latency, "latency (s)", "serve_search")
    if not ts or not batches:
        raise ValueError("serve_search needs at least one t and one batch size")
    best: dict[int, ServePlan | None] = {}
    for t in ts:
        ok = [p for p in (serve_plan(m, cluster, t, b, context, **kw) for b in batches)
              if p.fits and p.step <= latency]
        best[t] = max(ok, key=lambda p: p.tokens_per_s_per_gpu, default=None)
    return best
