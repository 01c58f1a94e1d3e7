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

The model's edges, as Megatron-Core places them (:class:`SequenceParallelGPT`):

- :class:`SequenceParallelEmbedding` enters the region: each rank's vocabulary-parallel
  lookup is a partial sum over the vocabulary, and a **reduce-scatter** along the
  sequence (backward: an all-gather) gives each rank the sum for its ``s/t`` tokens —
  Megatron-Core's ``reduce_scatter_embeddings``, in place of tensor parallelism's
  all-reduce;
- the LM head leaves it: a :class:`SequenceParallelColumnLinear` gathers the final
  LayerNorm's output (backward: a reduce-scatter), and the ``(s, b, v/t)`` logits go to
  the vocabulary-parallel cross-entropy.

Dropout under sequence parallelism: every rank holds different tokens, so every dropout —
after the embedding, on the attention probabilities, on the residual stream — draws from
the rank's own tensor-parallel generator (``seed + 2718 + rank``;
:func:`seed_sequence_parallel_dropout`). A seed shared by the ranks would give every
rank's chunk of the sequence the same mask. :func:`seed_dense_sequence_dropout` makes the
dense twin draw the same masks, chunk by chunk (:func:`sequence_dropout`).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import comm
from .model import Block, TinyGPT, _check_p, dropout
from .rules import check_like, check_shape, whole as _whole
from .tensor_parallel import (ColumnParallelLinear, ParallelAttention, ParallelBlock as TensorParallelBlock,
                              ParallelMLP, RNGTracker, RowParallelLinear, VocabParallelEmbedding, check_degrees,
                              degree, model_parallel_seed, vocab_parallel_cross_entropy)


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
        if self.sequence_parallel:
            sum_grads(self.replicated_parameters(), self.group)


def sum_grads(params: list[nn.Parameter], group) -> None:
    """Sum the gradients of ``params`` over ``group``: one all-reduce of all of them flattened together.

    Under sequence parallelism each rank's gradient of a replicated parameter covers only
    its own tokens (Megatron-Core's ``_allreduce_non_tensor_model_parallel_grads`` sums the
    parameters marked ``sequence_parallel`` the same way, once per step).
    """
    params = [p for p in params if p.grad is not None]
    if not params:
        raise ValueError("sync_grads: no gradients yet — run backward first")
    flat = comm.raw_all_reduce(torch.cat([p.grad.flatten() for p in params]), group, "backward",
                               "replicated grads")
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p.grad))


# ---------------------------------------------------------------------------- the model's edges

class SequenceParallelEmbedding(VocabParallelEmbedding):
    """The vocabulary-parallel embedding, leaving each rank its ``(s/t, b, h)`` slice of the sequence.

    Each rank looks up the ids in its ``v/t`` rows (zeros for the others): a partial sum
    over the vocabulary of the whole ``(s, b, h)`` embedding. A reduce-scatter along the
    sequence sums the partials and keeps this rank's ``s/t`` tokens — half the bytes of
    tensor parallelism's all-reduce, and nothing gathered that the next layer would only
    split. Backward: an all-gather, since every rank's rows may serve any token.
    """

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(ids, torch.Tensor) and ids.dim() != 2:
            raise ValueError(f"{type(self).__name__} expects token ids laid out (s, b), got shape {tuple(ids.shape)}")
        partial = self.lookup(ids)                                            # (s, b, h), partial sums
        check_sequence(ids.shape[0], self.t)
        return comm.reduce_scatter(partial, 0, self.group, "embed reduce-scatter")   # (s/t, b, h)


class SequenceParallelGPT(nn.Module):
    """:class:`~intralayer.model.TinyGPT` with tensor and sequence parallelism, end to end.

    ``(s, b)`` token ids on every rank → embedding, reduce-scattered: ``(s/t, b, h)`` →
    dropout → blocks, each ``(s/t, b, h)`` in and out → final LayerNorm on ``s/t`` tokens →
    the LM head's all-gather and column-parallel product: ``(s, b, v/t)`` logits → the
    vocabulary-parallel cross-entropy of every token, the same loss on every rank.
    ``dropout`` is the probability of every dropout (embedding, attention, residual);
    :func:`seed_sequence_parallel_dropout` gives them their generator.
    """

    generator: torch.Generator | None = None

    def __init__(self, embed: SequenceParallelEmbedding, blocks: list[ParallelBlock], ln_f: nn.LayerNorm,
                 head: SequenceParallelColumnLinear, group, p: float):
        super().__init__()
        self.embed, self.blocks, self.ln_f, self.head = embed, nn.ModuleList(blocks), ln_f, head
        self.group, self.p = group, p

    @classmethod
    def from_dense(cls, model: TinyGPT, group, dropout: float = 0.0) -> "SequenceParallelGPT":
        if not isinstance(model, TinyGPT):
            raise ValueError(f"SequenceParallelGPT.from_dense expects a dense TinyGPT, got {type(model).__name__}")
        _check_p(dropout)
        t, _ = degree(group)
        check_degrees(t, vocab=model.embed.num_embeddings)
        blocks = [ParallelBlock.from_dense(b, group, sequence_parallel=True) for b in model.blocks]
        for block in blocks:
            block.p = block.attn.p = dropout
        return cls(SequenceParallelEmbedding.from_dense(model.embed, group), blocks, copy.deepcopy(model.ln_f),
                   SequenceParallelColumnLinear.from_dense(model.head, group, label="head"), group, dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)                                                   # (s/t, b, h)
        x = dropout(x, self.p, self.training, self.generator)                 # this rank's tokens' mask
        for block in self.blocks:
            x = block(x)                                                      # (s/t, b, h)
        return self.head(self.ln_f(x))                                        # (s, b, v/t): all tokens

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(self(ids), targets, self.group).mean()

    def replicated_parameters(self) -> list[nn.Parameter]:
        """Every block's LayerNorms and row biases, and the final LayerNorm: whole on every rank."""
        return [p for block in self.blocks for p in block.replicated_parameters()] + list(self.ln_f.parameters())

    def sync_grads(self) -> None:
        """After backward, sum the replicated parameters' gradients over the group (one all-reduce)."""
        sum_grads(self.replicated_parameters(), self.group)


# ---------------------------------------------------------------------------- dropout randomness

def seed_sequence_parallel_dropout(model: SequenceParallelGPT, tracker: RNGTracker) -> None:
    """Draw every dropout mask of a sequence-parallel GPT from this rank's tensor-parallel generator.

    Megatron-Core runs the embedding's dropout and the whole transformer block under
    ``get_cuda_rng_tracker().fork()`` when sequence parallelism is on: the activations
    there are this rank's tokens (or, in the attention, its heads), so each rank draws its
    own mask from ``seed + 2718 + rank``.
    """
    if not isinstance(model, SequenceParallelGPT):
        raise ValueError(f"seed_sequence_parallel_dropout expects a SequenceParallelGPT, got {type(model).__name__}")
    if not isinstance(tracker, RNGTracker):
        raise ValueError(f"seed_sequence_parallel_dropout expects an RNGTracker, got {type(tracker).__name__}")
    g = tracker["tensor-parallel"]
    model.generator = g
    for block in model.blocks:
        block.generator, block.attn.generators = g, [g]


def sequence_dropout(x: torch.Tensor, p: float, generators: list[torch.Generator],
                     training: bool = True) -> torch.Tensor:
    """Dropout on ``(s, b, h)`` whose mask's i-th chunk of the sequence is drawn from ``generators[i]``.

    The dense view of what t sequence-parallel ranks draw, rank i on its ``s/t`` tokens.
    """
    if not generators or x.shape[0] % len(generators):
        raise ValueError(f"a sequence of {x.shape[0]} tokens does not split into {len(generators or [])} "
                         "equal chunks, one per dropout generator")
    chunks = x.chunk(len(generators), dim=0)                                  # t × (s/t, b, h)
    return torch.cat([dropout(c, p, training, g) for c, g in zip(chunks, generators)], dim=0)


class _SequenceDropoutHook:
    """A forward hook: :func:`sequence_dropout` on a module's ``(s, b, h)`` output."""

    def __init__(self, p: float, generators: list[torch.Generator]):
        self.p, self.generators = p, generators

    def __call__(self, module, args, output):
        return sequence_dropout(output, self.p, self.generators, module.training)


def seed_dense_sequence_dropout(model: TinyGPT, seed: int, t: int, p: float) -> None:
    """Make a dense TinyGPT drop out as t sequence-parallel ranks seeded with ``seed`` do.

    Rank r draws every mask from its tensor-parallel generator ``seed + 2718 + r``: the
    masks of its ``s/t`` tokens after the embedding and on the residual stream, and of its
    ``a/t`` heads in the attention. The dense twin holds the t generators: the attention's
    head groups use them as in :func:`~intralayer.tensor_parallel.seed_dense_dropout`, and
    the embedding's, attention's and MLP's outputs get forward hooks that drop out chunk r of
    the sequence with generator r (the block's own residual dropout is switched off, the
    hooks stand in its place). Each generator then sees rank r's draws in rank r's order.
    """
    if not isinstance(model, TinyGPT):
        raise ValueError(f"seed_dense_sequence_dropout expects a dense TinyGPT, got {type(model).__name__}")
    _check_p(p)
    first = model.blocks[0].attn if len(model.blocks) else None
    check_degrees(t, h=model.embed.embedding_dim, heads=first.heads if first else None)
    if any(isinstance(h, _SequenceDropoutHook) for h in model.embed._forward_hooks.values()):
        raise ValueError("seed_dense_sequence_dropout: this model's dropout is seeded already")
    device = model.embed.weight.device
    generators = [model_parallel_seed(seed, r, device)["tensor-parallel"] for r in range(t)]
    model.embed.register_forward_hook(_SequenceDropoutHook(p, generators))
    for block in model.blocks:
        block.p, block.attn.p, block.attn.generators = 0.0, p, generators
        block.attn.register_forward_hook(_SequenceDropoutHook(p, generators))
        block.mlp.register_forward_hook(_SequenceDropoutHook(p, generators))
