"""The dense twins: a GPT block as every chapter's parallel version must reproduce it.

Activations are laid out ``(s, b, h)`` — sequence first, as in Megatron-LM — so that
splitting along the sequence (chapters 03–04) is a split of dimension 0. The block is
pre-LayerNorm: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``, with causal self-attention
and a GeLU MLP of width ``ffn`` (4h unless given). No dropout: a parallel run must draw
the same random numbers as the dense one to be compared with it, and the course compares
exactly.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def check_shape(x: torch.Tensor, last: int, who: str, dims: tuple[int, ...] = (3,)) -> None:
    """Raise a ``ValueError`` naming ``who`` unless ``x`` is a floating tensor ending in ``last``."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{who} expects a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{who} expects a floating-point tensor, got dtype {x.dtype}")
    if x.dim() not in dims or x.shape[-1] != last:
        want = " or ".join(f"{d} dimensions" for d in dims)
        raise ValueError(f"{who} expects {want} with the last of size {last}, got shape {tuple(x.shape)}")


def attend(qkv: torch.Tensor, heads: int, causal: bool = True) -> torch.Tensor:
    """Multi-head attention on a fused projection ``[q | k | v]`` of ``heads`` heads.

    ``qkv`` is ``(s, b, 3·heads·d)``; the result is ``(s, b, heads·d)``. Heads never
    interact, which is what lets tensor parallelism give each rank a subset of them.
    """
    if qkv.dim() != 3:
        raise ValueError(f"attention expects activations laid out (s, b, h), got shape {tuple(qkv.shape)}")
    s, b, width = qkv.shape
    if width % (3 * heads):
        raise ValueError(f"a fused q|k|v width {width} is not divisible by 3 × {heads} heads")
    q, k, v = qkv.chunk(3, dim=-1)                                   # 3 × (s, b, heads·d)

    def by_head(t):
        return t.reshape(s, b, heads, -1).permute(1, 2, 0, 3)        # (b, heads, s, d)

    o = F.scaled_dot_product_attention(by_head(q), by_head(k), by_head(v), is_causal=causal)  # (b, heads, s, d)
    return o.permute(2, 0, 1, 3).reshape(s, b, -1)                   # (s, b, heads·d)


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
    """Causal self-attention with a fused q|k|v projection and an output projection."""

    def __init__(self, h: int, heads: int, bias: bool = True, causal: bool = True):
        super().__init__()
        if heads < 1 or h % heads:
            raise ValueError(f"hidden size {h} is not divisible by the number of heads {heads}")
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(h, 3 * h, bias=bias)
        self.proj = nn.Linear(h, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(attend(self.qkv(x), self.heads, self.causal))   # (s, b, h)


class Block(nn.Module):
    """A pre-LayerNorm GPT block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, h: int, heads: int, ffn: int | None = None, causal: bool = True):
        super().__init__()
        self.h = h
        self.ln1 = nn.LayerNorm(h)
        self.attn = Attention(h, heads, causal=causal)
        self.ln2 = nn.LayerNorm(h)
        self.mlp = MLP(h, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_shape(x, self.h, "Block")
        if x.dtype != self.ln1.weight.dtype or x.device != self.ln1.weight.device:
            raise ValueError(f"Block: the input is {x.dtype} on {x.device} but the weights are "
                             f"{self.ln1.weight.dtype} on {self.ln1.weight.device}")
        x = x + self.attn(self.ln1(x))                               # (s, b, h)
        return x + self.mlp(self.ln2(x))                             # (s, b, h)


class TinyGPT(nn.Module):
    """Embedding, ``layers`` blocks, a final LayerNorm and an untied LM head: logits (s, b, v)."""

    def __init__(self, vocab: int, h: int, heads: int, layers: int = 1, ffn: int | None = None):
        super().__init__()
        self.embed = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList(Block(h, heads, ffn) for _ in range(layers))
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
