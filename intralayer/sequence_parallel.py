"""Sequence parallelism (Korthikanti et al. 2022), built in chapter 03.

With tensor parallelism alone, the parts of a block between the tensor-parallel regions
— the LayerNorms, the dropouts, the residual additions — run on the whole ``(s, b, h)``
activation on every rank. Sequence parallelism splits those parts along the sequence:
each rank holds ``s/t`` tokens there. Each all-reduce of tensor parallelism becomes its
two halves:

- entering a column-parallel layer, an **all-gather** along the sequence (forward) whose
  backward is a reduce-scatter — Korthikanti et al.'s *g*, in place of Megatron's *f*.
  The backward is a reduce-scatter, not a split, because each rank multiplies the
  gathered input by its own weight columns: every rank's gradient has a part for every
  token, and the parts must be summed;
- leaving a row-parallel layer, a **reduce-scatter** along the sequence (forward) whose
  backward is an all-gather — their *ḡ*, in place of Megatron's *g* (their *f̄*).

An all-reduce is a reduce-scatter plus an all-gather, so the forward pass sends the same
bytes as before (chapter 00). What changes is memory: everything outside the
tensor-parallel regions is now split t ways.

Like Megatron-LM, :class:`SequenceParallelColumnLinear` keeps only this rank's ``s/t``
slice of its input for the backward pass and gathers it again there (one more
all-gather per column layer, backward: the backward pass sends 1.5 times tensor
parallelism's bytes); ``keep_gathered=True`` keeps the gathered input instead, trading
``(t−1)/t·sbh`` numbers of memory for that all-gather.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import comm
from .model import Block
from .rules import check_like, check_shape, whole as _whole
from .tensor_parallel import (ColumnParallelLinear, ParallelAttention, ParallelBlock as TensorParallelBlock,
                              ParallelMLP, RowParallelLinear, check_degrees, degree)


def check_sequence(s: int, t: int) -> None:
    """``ValueError`` naming the rule unless the tensor-parallel degree ``t`` divides the sequence length.

    Sequence parallelism gives each of the t ranks ``s/t`` consecutive tokens; callable
    before any process starts, with :func:`~intralayer.tensor_parallel.check_degrees`
    for the model's own dimensions.
    """
    _whole(t, "the tensor-parallel degree t")
    if _whole(s, "sequence length s") % t:
        raise ValueError(f"sequence length s={s} is not divisible by the tensor-parallel degree t={t} "
                         f"(sequence parallelism gives each rank s/t tokens)")


class _GatherLinear(torch.autograd.Function):
    """``F.linear(all_gather(x, dim 0), W, b)``; keeps x's slice (or the gathered x) for backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, label, keep_gathered):
        full = comm.raw_all_gather(x, 0, group, "forward", f"{label} all-gather")          # (s, b, in)
        ctx.group, ctx.label, ctx.keep, ctx.has_bias = group, label, keep_gathered, bias is not None
        ctx.save_for_backward(full if keep_gathered else x, weight)
        return F.linear(full, weight, bias)                                              # (s, b, out/t)

    @staticmethod
    def backward(ctx, dy):
        kept, weight = ctx.saved_tensors
        full = kept if ctx.keep else comm.raw_all_gather(kept, 0, ctx.group, "backward", f"{ctx.label} re-gather")
        dx_full = dy @ weight                                                            # (s, b, in)
        dx = comm.raw_reduce_scatter(dx_full, 0, ctx.group, "backward", f"{ctx.label} reduce-scatter")
        dw = dy.flatten(0, -2).T @ full.flatten(0, -2)                                   # (out/t, in)
        db = dy.flatten(0, -2).sum(0) if ctx.has_bias else None
        return dx, dw, db, None, None, None


class SequenceParallelColumnLinear(ColumnParallelLinear):
    """A column-parallel layer whose input arrives split along the sequence: ``(s/t, b, in)``.

    ``keep_gathered`` keeps the gathered input for the backward pass instead of gathering it
    again there: the bytes of one all-gather for the memory of ``(s, b, in)``.
    """

    def __init__(self, *args, keep_gathered: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.keep_gathered = keep_gathered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_shape(x, self.in_features, f"{type(self).__name__} (input (s/t, b, h))")
        check_like(x, "the input", self.weight, "the weight", type(self).__name__)
        return _GatherLinear.apply(x, self.weight, self.bias, self.group, self.label, self.keep_gathered)


class SequenceParallelRowLinear(RowParallelLinear):
    """A row-parallel layer whose output leaves split along the sequence: ``(s/t, b, out)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_shape(x, self.in_features // self.t, f"{type(self).__name__} (this rank's slice)")
        if x.device != self.weight.device or x.dtype != self.weight.dtype:
            raise ValueError(f"{type(self).__name__}: the input is {x.dtype} on {x.device} but the weights are "
                             f"{self.weight.dtype} on {self.weight.device}")
        y = comm.reduce_scatter(F.linear(x, self.weight), 0, self.group, f"{self.label} reduce-scatter")
        return y if self.bias is None else y + self.bias                                 # (s/t, b, out)


class ParallelBlock(TensorParallelBlock):
    """A GPT block with tensor parallelism, and sequence parallelism when asked.

    With ``sequence_parallel`` the input and output are this rank's ``(s/t, b, h)`` slice
    of the sequence; without it, the whole ``(s, b, h)`` on every rank (chapter 02's
    block). The LayerNorms and the row layers' biases are replicated; under sequence
    parallelism each rank's gradient for them covers only its tokens, so
    :meth:`sync_grads` adds them up over the group after backward (as Megatron-LM does).
    """

    def __init__(self, ln1, attn, ln2, mlp, dense: Block, group, sequence_parallel: bool):
        super().__init__(ln1, attn, ln2, mlp, dense)
        self.group, self.sequence_parallel = group, sequence_parallel

    @classmethod
    def from_dense(cls, block: Block, group, sequence_parallel: bool = True,
                   keep_gathered: bool = False) -> "ParallelBlock":
        t, _ = degree(group)
        check_degrees(t, h=block.h, heads=block.attn.heads, ffn=block.mlp.fc1.out_features)
        col, row = ((SequenceParallelColumnLinear, SequenceParallelRowLinear) if sequence_parallel
                    else (ColumnParallelLinear, RowParallelLinear))
        kept = dict(keep_gathered=keep_gathered) if sequence_parallel else {}    # no gather, nothing to keep
        qkv = col.from_dense(block.attn.qkv, group, parts=3, label="attn.qkv", **kept)
        fc1 = col.from_dense(block.mlp.fc1, group, label="mlp.fc1", **kept)
        attn = ParallelAttention(qkv, row.from_dense(block.attn.proj, group, label="attn.proj"),
                                 block.attn.heads // t, block.attn)
        mlp = ParallelMLP(fc1, row.from_dense(block.mlp.fc2, group, label="mlp.fc2"))
        return cls(copy.deepcopy(block.ln1), attn, copy.deepcopy(block.ln2), mlp, block, group, sequence_parallel)

    def replicated_parameters(self) -> list[nn.Parameter]:
        """The parameters every rank holds whole: LayerNorms and the row layers' biases."""
        params = [*self.ln1.parameters(), *self.ln2.parameters()]
        return params + [b for b in (self.attn.proj.bias, self.mlp.fc2.bias) if b is not None]

    def sync_grads(self) -> None:
        """Under sequence parallelism, sum the replicated parameters' gradients over the group.

        One all-reduce of all of them flattened together. Without sequence parallelism
        every rank already holds the full gradient, and nothing is sent.
        """
        if not self.sequence_parallel:
            return
        params = [p for p in self.replicated_parameters() if p.grad is not None]
        if not params:
            raise ValueError("sync_grads: no gradients yet — run backward first")
        flat = comm.raw_all_reduce(torch.cat([p.grad.flatten() for p in params]), self.group, "backward",
                                "replicated grads")
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p.grad))
