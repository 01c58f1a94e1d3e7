"""The dense twins: a GPT block as every chapter's parallel version must reproduce it.

Activations are laid out ``(s, b, h)`` — sequence first, as in Megatron-LM — so that
splitting along the sequence (chapters 03–04) is a split of dimension 0. The block is
pre-LayerNorm: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``, with causal self-attention
and a GeLU MLP of width ``ffn`` (4h unless given).

Options for chapter 03's memory measurements, off by default (with dropout on, a parallel
run equals the dense one only when both draw the same masks: see ``generator`` below):

- ``dropout``: the probability, applied to the attention probabilities and after the
  attention and MLP outputs, as in GPT and in Korthikanti et al. 2022. It saves a 1-byte
  (bool) mask, as ``torch.native_dropout`` does on CPU and GPU; ``F.dropout`` on a CPU
  saves its mask in the activations' own dtype instead (torch 2.13: 2 bytes for bf16).
  By default the masks come from torch's global generator. Chapter 02 draws them from
  given generators instead (``Block.generator`` for the two dropouts on the residual
  stream, ``Attention.generators`` for the attention probabilities, one generator per
  group of heads), so that a tensor-parallel block and its dense twin draw the same masks.
- ``fused``: attention through ``scaled_dot_product_attention`` (a FlashAttention-style
  kernel that keeps no s×s matrix) or, when False, written out — scores, softmax,
  dropout, weighted sum — so that every tensor the paper counts is really kept.
- ``recompute``: ``"selective"`` recomputes the attention core in the backward pass,
  ``"full"`` the whole block (:func:`checkpoint`).

``kv_heads`` (default: ``heads``) gives grouped-query attention (Ainslie et al. 2023): the
``heads`` query heads form ``kv_heads`` groups of consecutive heads, and every head of group
g attends with key/value head g; ``kv_heads = 1`` is multi-query attention. The fused
projection stays laid out ``[q | k | v]``, ``heads·d + 2·kv_heads·d`` wide, as a checkpoint
that keeps three matrices stacks them (chapter 02 permutes it into Megatron-LM's layout).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .rules import check_like, check_shape

RECOMPUTE = ("none", "selective", "full")


def dropout_mask(shape: tuple[int, ...], p: float, generator: torch.Generator) -> torch.Tensor:
    """The keep-mask dropout draws from ``generator``: True with probability 1 − p.

    One float32 uniform number per element on the generator's device, whatever the
    activations' dtype, so a float32 and a float64 run draw the same mask.
    """
    _check_p(p)
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"dropout needs a torch.Generator, got {type(generator).__name__}")
    return torch.rand(shape, generator=generator, device=generator.device) >= p


class _GeneratorDropout(torch.autograd.Function):
    """``x · mask / (1 − p)`` with the mask drawn from a given generator; keeps the 1-byte mask."""

    @staticmethod
    def forward(ctx, x, p, generator):
        keep = dropout_mask(x.shape, p, generator)                  # bool, like native_dropout's mask
        ctx.save_for_backward(keep)
        ctx.scale = 1 / (1 - p)
        return x * keep * ctx.scale

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return grad * keep * ctx.scale, None, None


def dropout(x: torch.Tensor, p: float, training: bool = True,
            generator: torch.Generator | None = None) -> torch.Tensor:
    """Dropout that saves a 1-byte mask for backward.

    Without ``generator`` it is ``torch.native_dropout`` on torch's global generator;
    with one, the mask is :func:`dropout_mask` drawn from it.
    """
    if not training or p == 0:
        return x
    if generator is None:
        return torch.native_dropout(x, p, True)[0]
    if generator.device != x.device:
        raise ValueError(f"dropout: the generator is on {generator.device} but the activations are on {x.device}")
    return _GeneratorDropout.apply(x, p, generator)


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, p: float = 0.0,
                   fused: bool = True, generators: list[torch.Generator] | None = None) -> torch.Tensor:
    """softmax(q kᵀ/√d + mask) v for ``(b, heads, s, d)`` tensors, fused or written out.

    With ``generators`` the heads form ``len(generators)`` equal consecutive groups, and
    group g's dropout mask is drawn from ``generators[g]``.
    """
    if generators is not None and (not generators or q.shape[1] % len(generators)):
        raise ValueError(f"{q.shape[1]} heads do not split into {len(generators or [])} equal groups, "
                         "one per dropout generator")
    if fused and p == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)        # (b, heads, s, d)
    s = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * (1 / math.sqrt(q.shape[-1]))          # (b, heads, s, s)
    if causal:                                                                  # an added −∞ mask saves nothing
        scores = scores + torch.full((s, s), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
    probs = torch.softmax(scores, dim=-1)                                       # (b, heads, s, s)
    if generators is None:
        probs = dropout(probs, p)
    else:                                                                       # G × (b, heads/G, s, s)
        probs = torch.cat([dropout(group, p, generator=g)
                           for group, g in zip(probs.chunk(len(generators), dim=1), generators)], dim=1)
    return probs @ v                                                            # (b, heads, s, d)


def check_kv_heads(heads: int, kv_heads: int | None) -> int:
    """The number of key/value heads (``heads`` when None); ``ValueError`` unless it divides ``heads``."""
    if kv_heads is None:
        return heads
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1:
        raise ValueError(f"the number of key/value heads must be a whole number ≥ 1, got {kv_heads!r}")
    if heads % kv_heads:
        raise ValueError(f"the number of heads {heads} is not divisible by the number of key/value heads "
                         f"{kv_heads}: each key/value head serves an equal group of query heads")
    return kv_heads


def attend(qkv: torch.Tensor, heads: int, causal: bool = True, p: float = 0.0, fused: bool = True,
           recompute: bool = False, generators: list[torch.Generator] | None = None,
           kv_heads: int | None = None) -> torch.Tensor:
    """Multi-head attention on a fused projection ``[q | k | v]`` of ``heads`` heads.

    ``qkv`` is ``(s, b, (heads + 2·kv_heads)·d)`` (``kv_heads`` defaults to ``heads``:
    ``3·heads·d``); the result is ``(s, b, heads·d)``. Heads never interact, which is
    what lets tensor parallelism give each rank a subset of them. With ``recompute`` the
    core (scores, softmax, dropout, weighted sum) keeps nothing for backward but q, k and
    v, and is run again in the backward pass. ``generators``: see :func:`attention_core`.
    """
    if qkv.dim() != 3:
        raise ValueError(f"attention expects activations laid out (s, b, h), got shape {tuple(qkv.shape)}")
    kv_heads = check_kv_heads(heads, kv_heads)
    width = qkv.shape[-1]
    if width % (heads + 2 * kv_heads):
        raise ValueError(f"a fused q|k|v width {width} is not divisible by {heads} + 2 × {kv_heads} heads"
                         if kv_heads != heads else f"a fused q|k|v width {width} is not divisible by 3 × {heads} heads")
    d = width // (heads + 2 * kv_heads)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)   # (s, b, heads·d), 2 × (s, b, kv·d)
    return attend_heads(q, k, v, heads, kv_heads, causal, p, fused, recompute, generators)


def attend_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, kv_heads: int | None = None,
                 causal: bool = True, p: float = 0.0, fused: bool = True, recompute: bool = False,
                 generators: list[torch.Generator] | None = None) -> torch.Tensor:
    """Attention of ``heads`` query heads ``q`` (s, b, heads·d) over ``kv_heads`` heads ``k``, ``v`` (s, b, kv·d).

    Query head j attends with key/value head ``j // (heads/kv_heads)``: the key/value heads
    are repeated inside the core, so that recomputation keeps only the unrepeated k and v.
    """
    kv_heads = check_kv_heads(heads, kv_heads)
    s, b = q.shape[:2]

    def by_head(t, n):
        return t.reshape(s, b, n, -1).permute(1, 2, 0, 3)           # (b, n, s, d)

    def core(q_, k_, v_):
        if kv_heads != heads:                                       # (b, kv, s, d) → (b, heads, s, d)
            k_, v_ = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k_, v_))
        return attention_core(q_, k_, v_, causal, p, fused, generators)

    args = (by_head(q, heads), by_head(k, kv_heads), by_head(v, kv_heads))
    o = checkpoint(core, *args, generators=generators or ()) if recompute else core(*args)   # (b, heads, s, d)
    return o.permute(2, 0, 1, 3).reshape(s, b, -1)                   # (s, b, heads·d)


class _Checkpoint(torch.autograd.Function):
    """Run ``fn`` without keeping its intermediates; run it again, with grad, in backward."""

    @staticmethod
    def forward(ctx, fn, generators, *inputs):
        ctx.fn, ctx.generators = fn, generators
        ctx.rng = torch.get_rng_state()               # dropout must draw the same masks again
        ctx.cuda_rng = [torch.cuda.get_rng_state(t.device) for t in inputs[:1] if t.is_cuda]
        ctx.gen_states = [g.get_state() for g in generators]          # and so must given generators
        ctx.save_for_backward(*inputs)                # the only tensors kept: the inputs
        with torch.no_grad():
            return fn(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        devices = [t.device for t in inputs[:1] if t.is_cuda]
        now = [g.get_state() for g in ctx.generators]
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(ctx.rng)
            for dev, state in zip(devices, ctx.cuda_rng):
                torch.cuda.set_rng_state(state, dev)
            for g, state in zip(ctx.generators, ctx.gen_states):
                g.set_state(state)
            try:
                with torch.enable_grad():
                    out = ctx.fn(*inputs)
            finally:                                  # leave the generators where forward left them
                for g, state in zip(ctx.generators, now):
                    g.set_state(state)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, grads)          # parameters' gradients accumulate here
        return (None, None, *(t.grad if t.requires_grad else None for t in inputs))


def checkpoint(fn, *inputs: torch.Tensor, generators: tuple | list = ()):
    """Activation recomputation: keep only ``inputs`` for backward, recompute ``fn`` there.

    The same idea as ``torch.utils.checkpoint`` (its reentrant form), written out so
    that the course can count exactly what it keeps (Chen et al. 2016; Korthikanti et al.
    2022 recompute only the attention core, "selective" recomputation). The recomputation
    draws the same dropout masks: torch's global generator and each of ``generators`` are
    rewound to their state before ``fn`` ran, then left where the forward pass left them.
    """
    return _Checkpoint.apply(fn, tuple(generators), *inputs)


class MLP(nn.Module):
    """``fc2(GeLU(fc1(x)))``: h → ffn → h."""

    def __init__(self, h: int, ffn: int | None = None, bias: bool = True):
        super().__init__()
        ffn = 4 * h if ffn is None else ffn
        self.fc1 = nn.Linear(h, ffn, bias=bias)
        self.fc2 = nn.Linear(ffn, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))                         # (s, b, ffn) → (s, b, h)


class Attention(nn.Module):
    """Causal self-attention with a fused q|k|v projection and an output projection.

    ``kv_heads`` (default ``heads``): grouped-query attention, ``[q | k | v]`` of widths
    ``h``, ``kv_heads·d`` and ``kv_heads·d``. ``generators`` (None: torch's global
    generator) draws the attention-dropout masks, one generator per equal group of
    consecutive query heads (:func:`attention_core`).
    """

    generators: list[torch.Generator] | None = None

    def __init__(self, h: int, heads: int, bias: bool = True, causal: bool = True, dropout: float = 0.0,
                 fused: bool = True, recompute: bool = False, kv_heads: int | None = None):
        super().__init__()
        if heads < 1 or h % heads:
            raise ValueError(f"hidden size {h} is not divisible by the number of heads {heads}")
        _check_p(dropout)
        self.heads, self.causal, self.p, self.fused, self.recompute = heads, causal, dropout, fused, recompute
        self.kv_heads = check_kv_heads(heads, kv_heads)
        self.qkv = nn.Linear(h, h + 2 * self.kv_heads * (h // heads), bias=bias)    # [q | k | v]
        self.proj = nn.Linear(h, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o = attend(self.qkv(x), self.heads, self.causal, self.p if self.training else 0.0, self.fused,
                   self.recompute, self.generators, self.kv_heads)  # (s, b, heads·d)
        return self.proj(o)                                          # (s, b, h)


class Block(nn.Module):
    """A pre-LayerNorm GPT block: ``x + drop(attn(ln1(x)))``, then ``x + drop(mlp(ln2(x)))``.

    ``generator`` (None: torch's global generator) draws the masks of the two dropouts on
    the residual stream; the attention's own dropout uses ``attn.generators``.
    """

    generator: torch.Generator | None = None

    def __init__(self, h: int, heads: int, ffn: int | None = None, causal: bool = True, dropout: float = 0.0,
                 fused: bool = True, recompute: str = "none", kv_heads: int | None = None):
        super().__init__()
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
        _check_p(dropout)
        self.h, self.p, self.recompute = h, dropout, recompute
        self.ln1 = nn.LayerNorm(h)
        self.attn = Attention(h, heads, causal=causal, dropout=dropout, fused=fused,
                              recompute=recompute == "selective", kv_heads=kv_heads)
        self.ln2 = nn.LayerNorm(h)
        self.mlp = MLP(h, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_shape(x, self.h, type(self).__name__)
        check_like(x, "the input", self.ln1.weight, "ln1.weight", type(self).__name__)
        if self.recompute != "full":
            return self.layer(x)
        generators = [g for g in (self.generator, *(self.attn.generators or ())) if g is not None]
        return checkpoint(self.layer, x, generators=generators)

    def layer(self, x: torch.Tensor) -> torch.Tensor:
        """The block's computation (parallel blocks reuse it with sharded parts)."""
        p = self.p if self.training else 0.0
        x = x + dropout(self.attn(self.ln1(x)), p, generator=self.generator)    # (s, b, h)
        return x + dropout(self.mlp(self.ln2(x)), p, generator=self.generator)  # (s, b, h)


def _check_p(p: float) -> None:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
        raise ValueError(f"dropout probability {p} must lie in [0, 1)")


class TinyGPT(nn.Module):
    """Embedding, ``layers`` blocks, a final LayerNorm and an untied LM head: logits (s, b, v)."""

    def __init__(self, vocab: int, h: int, heads: int, layers: int = 1, ffn: int | None = None,
                 kv_heads: int | None = None):
        super().__init__()
        self.embed = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList(Block(h, heads, ffn, kv_heads=kv_heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)
        self.head = nn.Linear(h, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)                                          # (s, b) → (s, b, h)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))                               # (s, b, v)

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(ids)                                           # (s, b, v)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
