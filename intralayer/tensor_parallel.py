"""Tensor parallelism as Megatron-LM lays it out (Shoeybi et al. 2019), built in chapters 01–02.

Each module is made from a dense twin (:mod:`intralayer.model` or ``nn.Linear``) that is
identical on every rank, with ``from_dense(..., group)``; it keeps only this rank's shard
of the weights, so its outputs and gradients can be compared with the dense module's.

- :class:`ColumnParallelLinear` — ``Y = X A`` with ``A = [A_1 … A_t]`` split by output
  columns. Input replicated through *f* (identity forward, all-reduce backward); output
  split along the last dimension, or gathered when ``gather_output``.
- :class:`RowParallelLinear` — ``A`` split by input rows, ``X`` split by columns; the
  partial products are summed by *g* (all-reduce forward, identity backward); the bias
  is added once, after the sum.
- :class:`ParallelMLP` — column then row: one all-reduce forward, one backward.
- :class:`ParallelAttention` — heads split over ranks: q|k|v column-parallel, output
  projection row-parallel. Grouped-query attention (fewer key/value heads than query
  heads) as Megatron-Core runs it: :class:`QKVParallelLinear` holds the fused projection
  in Megatron's per-query-group layout (:func:`megatron_qkv_order`); when t exceeds the
  key/value heads, the ranks sharing a group all-gather its activations, and the
  all-gather's backward (a reduce-scatter) sums their gradients.
- :class:`ParallelBlock` — a whole GPT block: 2 all-reduces forward, 2 backward.
- :class:`VocabParallelEmbedding` and :func:`vocab_parallel_cross_entropy` — the vocabulary
  split over ranks; the ``b·s·v`` logits are never gathered. :func:`padded_vocab_size` is
  Megatron-LM's padding of the vocabulary to a multiple of 128·t.
- :class:`RNGTracker`, :func:`model_parallel_seed`, :func:`seed_dropout` and
  :func:`seed_dense_dropout` — dropout randomness as Megatron-LM places it: one seed,
  the same on every rank, where activations are replicated; a seed per rank inside the
  split attention.
- :func:`block_costs`, :func:`comm_compute_ratio`, :func:`break_even_hidden` and
  :func:`layer_times` — what a layer computes and sends, and when the all-reduces
  outweigh the compute; :func:`check_link_degree` refuses NVLink groups larger than the
  servers that have them.

Weights live as ``nn.Linear`` does, ``(out_features, in_features)``, so "split by
columns of A" (with ``Y = X A``) is a split of the weight's *rows*.
"""
from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from . import comm
from .collectives import LINKS, collective_time
from .hardware import H100_BF16_PEAK, NVLINK_DOMAIN  # noqa: F401  (GPU facts live in intralayer.hardware)
from .model import Attention, Block, TinyGPT, attend_heads, check_kv_heads
from .rules import check_group_device as _check_group_device, check_like, check_shape, whole as _whole


# ---------------------------------------------------------------------------- rules

def check_divisible(value: int, t: int, what: str) -> None:
    """``ValueError`` naming the rule unless the tensor-parallel degree ``t`` divides ``value``."""
    _whole(t, "the tensor-parallel degree t")
    if _whole(value, what) % t:
        raise ValueError(f"{what} {value} is not divisible by the tensor-parallel degree t={t}")


def check_degrees(t: int, h: int | None = None, heads: int | None = None, ffn: int | None = None,
                  vocab: int | None = None, kv_heads: int | None = None) -> None:
    """Check every rule tensor parallelism puts on a model before any process starts.

    Heads are dealt out whole (each rank attends with ``heads/t`` of them), the hidden,
    MLP and vocabulary dimensions are split evenly. With ``kv_heads`` (grouped-query
    attention; it needs ``heads``), Megatron-Core's rule on the query groups: their number
    must be a multiple of t (each rank holds ``kv_heads/t`` whole groups) or a divisor of t
    (``t/kv_heads`` ranks share each group). Shared, the fused q|k|v projection, ``(heads +
    2·kv_heads)·d`` rows, is still split evenly over the t ranks, so that width must divide
    by t too.
    """
    _whole(t, "the tensor-parallel degree t")
    if h is not None and heads is not None and _whole(h, "hidden size") % _whole(heads, "number of heads"):
        raise ValueError(f"hidden size {h} is not divisible by the number of heads {heads}")
    if kv_heads is not None:
        if heads is None:
            raise ValueError("the number of key/value heads is checked against the number of heads: pass heads too")
        check_kv_heads(_whole(heads, "number of heads"), _whole(kv_heads, "number of key/value heads"))
    for value, what in ((h, "hidden size"), (heads, "number of heads"), (ffn, "MLP width"),
                        (vocab, "vocabulary size")):
        if value is not None:
            check_divisible(value, t, what)
    if kv_heads is None:
        return
    if kv_heads % t and t % kv_heads:
        raise ValueError(f"the number of key/value heads {kv_heads} is neither a multiple nor a divisor of the "
                         f"tensor-parallel degree t={t}: a rank must hold whole key/value heads (t divides "
                         f"them) or share one with other ranks ({kv_heads} divides t), as Megatron-Core requires "
                         "of its query groups")
    if t > kv_heads and h is not None:
        d = h // heads
        width = (heads + 2 * kv_heads) * d
        if width % t:
            raise ValueError(f"the fused q|k|v width (heads + 2·kv_heads)·d = ({heads} + 2·{kv_heads})·{d} = {width} "
                             f"is not divisible by the tensor-parallel degree t={t}: with fewer key/value heads "
                             "than ranks, the fused projection is still split evenly over the ranks")


#: Megatron-LM's ``--make-vocab-size-divisible-by`` default: each rank's vocabulary slice
#: stays a multiple of 128 rows, for efficient matrix-multiply kernels.
VOCAB_MULTIPLE = 128


def padded_vocab_size(vocab: int, t: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """The vocabulary padded as Megatron-LM pads it: up to a multiple of ``multiple·t``.

    Then the vocabulary divides by t, and each rank's ``v/t`` rows are a multiple of
    ``multiple``. No token id ever selects the extra rows.
    """
    _whole(vocab, "vocabulary size")
    _whole(t, "the tensor-parallel degree t")
    step = _whole(multiple, "the padding multiple") * t
    return -(-vocab // step) * step


def degree(group) -> tuple[int, int]:
    """``(t, rank)``: the size of ``group`` and this rank's place in it."""
    if not dist.is_initialized():
        raise RuntimeError("tensor-parallel modules need a process group: build them inside distributed.setup()")
    return dist.get_world_size(group), dist.get_rank(group)


def _rows(full: torch.Tensor, t: int, r: int, parts: int = 1) -> torch.Tensor:
    """Rank r's rows of ``full``, whose rows are ``parts`` stacked blocks split t ways each."""
    return torch.cat([block.chunk(t, dim=0)[r] for block in full.chunk(parts, dim=0)], dim=0)


def _same_device(x: torch.Tensor, param: torch.Tensor, who: str) -> None:
    check_like(x, "the input", param, "the weight", who)              # the name chapter 01 prints


# ---------------------------------------------------------------------------- cost arithmetic

def linear_costs(m: int, h_in: int, h_out: int, t: int, split: str, itemsize: int = 2,
                 gather_output: bool = False, input_is_parallel: bool = True) -> dict[str, float]:
    """Bytes one device holds and communicates for ``Y = X A``, X (m, h_in), A (h_in, h_out), split t ways.

    ``split`` is ``"column"`` (A by columns; Megatron's f before, optional gather after)
    or ``"row"`` (A by rows; g after, optional split before). Returns the bytes of the
    weights, input and output this device holds, and for each pass the collectives'
    size S and the bytes this device sends on a ring (``2(t−1)/t·S`` for an all-reduce,
    ``(t−1)/t·S`` for an all-gather).
    """
    for value, what in ((m, "rows m"), (h_in, "input features h_in"), (h_out, "output features h_out"),
                        (itemsize, "itemsize")):
        _whole(value, what)
    if split not in ("column", "row"):
        raise ValueError(f"split must be 'column' or 'row', got {split!r}")
    _whole(t, "the tensor-parallel degree t")
    value, what = (h_out, "h_out (columns of A)") if split == "column" else (h_in, "h_in (rows of A)")
    if value % t:
        raise ValueError(f"{what} = {value} is not divisible by the tensor-parallel degree t={t}")
    ar, ag = comm.bus_factor("all_reduce", t), comm.bus_factor("all_gather", t)
    weights = h_in * h_out // t * itemsize
    if split == "column":
        fwd_S = m * h_out * itemsize if gather_output else 0                 # all-gather of Y
        bwd_S = m * h_in * itemsize                                          # all-reduce of dX (f)
        return dict(weights=weights, input=m * h_in * itemsize,
                    output=m * h_out * itemsize if gather_output else m * h_out // t * itemsize,
                    forward_S=fwd_S, forward_sent=ag * fwd_S, backward_S=bwd_S, backward_sent=ar * bwd_S)
    fwd_S = m * h_out * itemsize                                              # all-reduce of Y (g)
    bwd_S = 0 if input_is_parallel else m * h_in * itemsize                  # all-gather of dX
    return dict(weights=weights, input=m * h_in // t * itemsize, output=m * h_out * itemsize,
                forward_S=fwd_S, forward_sent=ar * fwd_S, backward_S=bwd_S, backward_sent=ag * bwd_S)


def block_costs(s: int, b: int, h: int, heads: int, t: int, itemsize: int = 2, ffn: int | None = None,
                kv_heads: int | None = None) -> dict:
    """One GPT block with tensor parallelism t: weights, FLOPs and communication per device.

    - weights: the q|k|v projection (h·w + w, with w = h + 2·kv_heads·d: 3h² + 3h without
      grouped-query attention), the output projection (h²) and the MLP (2·h·ffn + ffn)
      split t ways, the row layers' biases and the two LayerNorms (4h) replicated —
      exactly the parameters of :class:`ParallelBlock` on one rank.
    - forward FLOPs per device: 2 per multiply-add of the four matmuls, 2·s·b·h·(w + h +
      2·ffn), plus attention's scores and weighted sum, 4·b·s²·h; all divided by t. With
      ffn = 4h and no grouping that is 24bsh² + 4bs²h (Narayanan et al. 2021). Backward
      costs twice the forward.
    - ``kv_bytes``: the keys and values one device computes for the layer, 2·s·b·d times
      its key/value heads (kv_heads/t, or 1 when t > kv_heads: a shared head is held whole
      by every rank that shares it) — per layer, what an inference KV cache stores.
    - communication: Megatron's 2 all-reduces forward and 2 backward of s·b·h
      numbers (S bytes); a ring sends 2(t−1)/t·S bytes per device for each. With t > kv_heads,
      Megatron-Core adds an all-gather of the projection's output (s·b·w numbers, S bytes)
      forward and its reduce-scatter backward, (t−1)/t·S each (``gathers``, ``gather_S``).
    """
    ffn = 4 * h if ffn is None else ffn
    kv = heads if kv_heads is None else kv_heads
    check_degrees(t, h=h, heads=heads, ffn=ffn, kv_heads=kv)
    for value, what in ((s, "sequence length s"), (b, "micro-batch b"), (itemsize, "itemsize")):
        _whole(value, what)
    d = h // heads
    w = h + 2 * kv * d                                             # the fused q|k|v width
    split = (h * w + w + h * h + 2 * h * ffn + ffn) // t           # qkv (+bias), proj, fc1 (+bias), fc2
    replicated = 2 * h + 4 * h                                     # proj and fc2 biases; 2 LayerNorms
    flops = (2 * s * b * h * (w + h + 2 * ffn) + 4 * b * s * s * h) / t
    S = s * b * h * itemsize
    sent = comm.bus_factor("all_reduce", t) * S
    gathers = 2 if t > kv else 0                                   # all-gather forward, reduce-scatter backward
    gather_S = s * b * w * itemsize if gathers else 0
    return dict(weights=split + replicated, weight_bytes=(split + replicated) * itemsize,
                forward_flops=flops, step_flops=3 * flops, allreduce_S=S,
                allreduces=4, gathers=gathers, gather_S=gather_S,
                kv_bytes=2 * s * b * max(kv // t, 1) * d * itemsize,
                sent=4 * sent + gathers * comm.bus_factor("all_gather", t) * gather_S)


def check_link_degree(t: int, link: str) -> None:
    """``ValueError`` naming the rule unless ``t`` GPUs fit in one domain of ``link``.

    The NVLink links here are those of one HGX H100 server (8 GPUs) and one GB200 NVL72
    rack (72): a larger tensor-parallel group would have to leave it. Links between servers
    (InfiniBand, PCIe) set no such limit here.
    """
    _whole(t, "the tensor-parallel degree t")
    if link not in LINKS:
        raise ValueError(f"unknown link {link!r}; the links are {sorted(LINKS)}")
    domain = NVLINK_DOMAIN.get(link)
    if domain is not None and t > domain:
        raise ValueError(f"t = {t} GPUs do not fit in one {link} domain: it joins {domain} GPUs, and a "
                         f"tensor-parallel group on NVLink must stay inside one NVLink domain (t ≤ {domain})")


def _check_rate(value: float, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise ValueError(f"{what} must be a positive number, got {value!r}")


def comm_compute_ratio(h: int, t: int, flops: float, bandwidth: float, s: int = 0, itemsize: int = 2,
                       passes: str = "forward") -> float:
    """All-reduce time over compute time for one layer under tensor parallelism t.

    Forward: compute ``(24bsh² + 4bs²h)/t`` FLOPs at ``flops`` FLOP/s (Narayanan et al.
    2021), against 2 all-reduces that each send ``2(t−1)/t·sbh·itemsize`` bytes at
    ``bandwidth`` bytes/s. b cancels, and so does s but for the attention term:

        ratio = (t−1)·itemsize·flops / (6·h·bandwidth·(1 + s/(6h)))

    ``s = 0`` drops the attention term. ``passes="forward+backward"``: the backward pass
    has the same 2 all-reduces and twice the compute, so the ratio is 2/3 of the forward's.
    """
    _whole(h, "hidden size")
    _whole(t, "the tensor-parallel degree t")
    _whole(s, "sequence length s", minimum=0)
    _whole(itemsize, "itemsize")
    _check_rate(flops, "the sustained compute rate (FLOP/s)")
    _check_rate(bandwidth, "the link bandwidth (bytes/s)")
    if passes not in ("forward", "forward+backward"):
        raise ValueError(f"passes must be 'forward' or 'forward+backward', got {passes!r}")
    ratio = (t - 1) * itemsize * flops / (6 * h * bandwidth * (1 + s / (6 * h)))
    return ratio if passes == "forward" else 2 * ratio / 3


def break_even_hidden(t: int, flops: float, bandwidth: float, itemsize: int = 2, passes: str = "forward") -> float:
    """The hidden size h at which a layer's all-reduces take as long as its matrix products.

    :func:`comm_compute_ratio` = 1 without the attention term: ``h* = (t−1)·itemsize·flops /
    (6·bandwidth)`` for the forward pass, 2/3 of that for forward and backward. Below h*
    tensor parallelism of degree t is communication-bound (unless overlapped).
    """
    return comm_compute_ratio(1, t, flops, bandwidth, 0, itemsize, passes)


def layer_times(s: int, b: int, h: int, heads: int, t: int, link: str, efficiency: float = 0.5,
                peak: float = H100_BF16_PEAK, itemsize: int = 2) -> tuple[float, float]:
    """Seconds of compute and of all-reduces per layer and device, forward and backward.

    Compute: :func:`block_costs`' FLOPs at ``efficiency`` × ``peak``; communication: its
    4 all-reduces of s·b·h numbers on ``link`` (chapter 00's ring model, latency ignored).
    Refuses a degree t that no NVLink domain of ``link`` holds (:func:`check_link_degree`).
    """
    check_link_degree(t, link)
    if isinstance(efficiency, bool) or not isinstance(efficiency, (int, float)) or not 0 < efficiency <= 1:
        raise ValueError(f"efficiency (the fraction of peak the matrix products reach) must lie in (0, 1], "
                         f"got {efficiency!r}")
    _check_rate(peak, "the peak compute rate (FLOP/s)")
    c = block_costs(s, b, h, heads, t, itemsize)
    compute = c["step_flops"] / (peak * efficiency)
    comm_s = c["allreduces"] * collective_time("all_reduce", t, c["allreduce_S"], LINKS[link].bandwidth, 0.0)
    return compute, comm_s


# ---------------------------------------------------------------------------- linear layers

class ColumnParallelLinear(nn.Module):
    """``Y_i = X A_i``: this rank holds ``out_features/t`` output features (rows of the weight).

    ``parts`` > 1 treats the output features as that many stacked blocks (a fused q|k|v
    projection has 3) and gives each rank its slice of every block, so that the local
    output is again ``[q_i | k_i | v_i]``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group, gather_output: bool = False,
                 parts: int = 1, label: str = "column"):
        super().__init__()
        self.group, self.gather_output, self.parts, self.label = group, gather_output, parts, label
        self.t, self.rank = degree(group)
        self.in_features = weight.shape[1]
        self.weight = nn.Parameter(weight)                             # (out/t, in)
        self.bias = nn.Parameter(bias) if bias is not None else None   # (out/t,)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group, gather_output: bool = False, parts: int = 1,
                   label: str = "column", **options) -> "ColumnParallelLinear":
        """This rank's slice of ``linear``; ``options`` go to the constructor of ``cls``."""
        t, r = degree(group)
        if parts > 1 and linear.out_features % parts:
            raise ValueError(f"{linear.out_features} output features do not split into {parts} equal blocks")
        check_divisible(linear.out_features // parts, t,
                        "output features" if parts == 1 else f"each of the {parts} blocks' output features")
        if gather_output and parts > 1:
            raise ValueError("gather_output with parts > 1 would interleave the blocks; gather each block instead")
        weight = _rows(linear.weight.detach(), t, r, parts).clone()
        bias = None if linear.bias is None else _rows(linear.bias.detach(), t, r, parts).clone()
        return cls(weight, bias, group, gather_output, parts, label, **options)

    def shard(self, full: torch.Tensor, name: str) -> torch.Tensor:
        """This rank's piece of a dense ``weight`` or ``bias`` (or of its gradient)."""
        return _rows(full, self.t, self.rank, self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_shape(x, self.in_features, type(self).__name__, dims=(2, 3))
        _same_device(x, self.weight, type(self).__name__)
        x = comm.copy_to_group(x, self.group, f"{self.label} f")    # identity; all-reduce of dX backward
        y = F.linear(x, self.weight, self.bias)                     # (..., out/t)
        if self.gather_output:
            y = comm.gather_from_group(y, -1, self.group, f"{self.label} gather")   # (..., out)
        return y


class RowParallelLinear(nn.Module):
    """``Y = Σ_i X_i A_i``: this rank holds ``in_features/t`` input features (weight columns).

    With ``input_is_parallel`` the input is already this rank's ``(…, in/t)`` slice (the
    output of a column-parallel layer); otherwise the full input is split here. The bias
    is added after the all-reduce, so it is counted once, not t times.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group, input_is_parallel: bool = True,
                 label: str = "row"):
        super().__init__()
        self.group, self.input_is_parallel, self.label = group, input_is_parallel, label
        self.t, self.rank = degree(group)
        self.in_features = weight.shape[1] * self.t                    # the dense layer's
        self.weight = nn.Parameter(weight)                             # (out, in/t)
        self.bias = nn.Parameter(bias) if bias is not None else None   # (out,), replicated

    @classmethod
    def from_dense(cls, linear: nn.Linear, group, input_is_parallel: bool = True,
                   label: str = "row") -> "RowParallelLinear":
        t, r = degree(group)
        check_divisible(linear.in_features, t, "input features")
        weight = linear.weight.detach().chunk(t, dim=1)[r].clone()
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(weight, bias, group, input_is_parallel, label)

    def shard(self, full: torch.Tensor, name: str) -> torch.Tensor:
        return full.chunk(self.t, dim=1)[self.rank] if name == "weight" else full

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        who = type(self).__name__
        if self.input_is_parallel:
            check_shape(x, self.in_features // self.t, f"{who} (input_is_parallel: this rank's slice)", dims=(2, 3))
        else:
            check_shape(x, self.in_features, who, dims=(2, 3))
        _same_device(x, self.weight, who)
        if not self.input_is_parallel:
            x = comm.split(x, -1, self.group, f"{self.label} split")   # (..., in/t); all-gather backward
        y = comm.reduce_from_group(F.linear(x, self.weight), self.group, f"{self.label} g")   # (..., out)
        return y if self.bias is None else y + self.bias


def megatron_qkv_order(heads: int, kv_heads: int, d: int) -> torch.Tensor:
    """Row indices that turn a ``[q | k | v]`` projection into Megatron-Core's per-query-group layout.

    Megatron-Core lays its fused ``linear_qkv`` out as ``[ng, (np/ng + 2), hn]``: for each of
    the ng query groups, its np/ng query heads, then its key head, then its value head —
    ``q0 q1 k0 v0 | q2 q3 k1 v1`` for 4 heads in 2 groups (``attention.py``,
    ``get_query_key_value_tensors``). ``weight[order]`` is that layout: what a checkpoint
    converter does to a checkpoint that keeps ``q``, ``k`` and ``v`` apart. Each head is
    ``d`` rows; without grouping (``kv_heads == heads``) the layout is ``q0 k0 v0 | q1 k1 v1 …``.
    """
    kv_heads = check_kv_heads(_whole(heads, "number of heads"), _whole(kv_heads, "number of key/value heads"))
    _whole(d, "head dimension d")
    per = heads // kv_heads
    q, k, v = torch.arange((heads + 2 * kv_heads) * d).split([heads * d, kv_heads * d, kv_heads * d])
    return torch.cat([q.view(kv_heads, per * d), k.view(kv_heads, d), v.view(kv_heads, d)], dim=1).flatten()


class QKVParallelLinear(ColumnParallelLinear):
    """The fused q|k|v projection in Megatron-Core's per-group layout, split into t equal row blocks.

    ``from_dense`` permutes the dense ``[q | k | v]`` rows (:func:`megatron_qkv_order`) and
    gives rank r the r-th of t equal blocks, as Megatron's ``ColumnParallelLinear`` splits
    ``linear_qkv``. With t ≤ kv_heads that is kv_heads/t whole groups; with t > kv_heads,
    a 1/(t/kv_heads) piece of one group, which may hold only queries, or only the group's
    key and value rows: :class:`ParallelAttention` then gathers the group.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group, order: torch.Tensor,
                 label: str = "qkv"):
        super().__init__(weight, bias, group, label=label)
        self.order = order                                          # dense row of each per-group row

    @classmethod
    def from_dense(cls, linear: nn.Linear, group, heads: int, kv_heads: int,
                   label: str = "qkv") -> "QKVParallelLinear":
        t, r = degree(group)
        if linear.out_features % (heads + 2 * kv_heads):
            raise ValueError(f"{linear.out_features} output features are not {heads} query heads and "
                             f"2 × {kv_heads} key/value heads of one width")
        check_divisible(linear.out_features, t, "the fused q|k|v width")
        order = megatron_qkv_order(heads, kv_heads, linear.out_features // (heads + 2 * kv_heads))
        order = order.to(linear.weight.device)
        weight = linear.weight.detach()[order].chunk(t, dim=0)[r].clone()              # (w/t, h)
        bias = None if linear.bias is None else linear.bias.detach()[order].chunk(t, dim=0)[r].clone()
        return cls(weight, bias, group, order, label)

    def shard(self, full: torch.Tensor, name: str) -> torch.Tensor:
        """This rank's rows of a dense ``[q | k | v]`` weight or bias (or of its gradient)."""
        return full[self.order.to(full.device)].chunk(self.t, dim=0)[self.rank]


# ---------------------------------------------------------------------------- MLP, attention, block

class ParallelMLP(nn.Module):
    """Megatron's MLP: ``fc1`` by columns, GeLU on each rank's slice, ``fc2`` by rows."""

    def __init__(self, fc1: ColumnParallelLinear, fc2: RowParallelLinear):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    @classmethod
    def from_dense(cls, fc1: nn.Linear, fc2: nn.Linear, group, label: str = "mlp") -> "ParallelMLP":
        if fc1.out_features != fc2.in_features:
            raise ValueError(f"fc1 has {fc1.out_features} outputs but fc2 takes {fc2.in_features} inputs")
        return cls(ColumnParallelLinear.from_dense(fc1, group, label=f"{label}.fc1"),
                   RowParallelLinear.from_dense(fc2, group, input_is_parallel=True, label=f"{label}.fc2"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_shape(x, self.fc1.in_features, "ParallelMLP", dims=(2, 3))
        _same_device(x, self.fc1.weight, "ParallelMLP")
        return self.fc2(F.gelu(self.fc1(x)))                        # (s, b, ffn/t) → (s, b, h)


class ParallelAttention(Attention):
    """Self-attention with ``heads/t`` query heads on each rank.

    Multi-head attention: q|k|v column-parallel with each third split t ways (``parts=3``),
    so rank r holds whole heads and attends with no communication; it runs
    :class:`~intralayer.model.Attention`'s own forward with sharded projections.

    Grouped-query attention, as Megatron-Core runs it: ``qkv`` is a
    :class:`QKVParallelLinear` (the per-group layout, t equal row blocks). With t ≤
    kv_heads each rank holds kv_heads/t whole groups and attends alone. With t > kv_heads,
    t/kv_heads ranks share each group: :meth:`gather_qkv` all-gathers every rank's slice of
    the projection's output, and each rank keeps its group's key and value heads and its
    own heads/t query heads (Megatron-Core's ``get_query_key_value_tensors``). Every rank
    sharing a key/value head computes a gradient for it; the all-gather's backward, a
    reduce-scatter, sums them into the rows each rank holds.
    """

    def __init__(self, qkv: nn.Module, proj: nn.Module, heads: int, dense: Attention):
        nn.Module.__init__(self)
        grouped = isinstance(qkv, QKVParallelLinear)
        if dense.kv_heads != dense.heads and not grouped:
            raise ValueError(f"grouped-query attention ({dense.heads} heads, {dense.kv_heads} key/value heads) needs "
                             f"its q|k|v projection in Megatron's per-group layout (QKVParallelLinear), "
                             f"got {type(qkv).__name__}")
        self.qkv, self.proj, self.heads = qkv, proj, heads
        self.causal, self.p, self.fused, self.recompute = dense.causal, dense.p, dense.fused, dense.recompute
        self.query_groups, self.head_dim = dense.kv_heads, dense.proj.in_features // dense.heads
        self.kv_heads = max(dense.kv_heads // qkv.t, 1) if grouped else heads     # this rank's

    @classmethod
    def from_dense(cls, attn: Attention, group, label: str = "attn") -> "ParallelAttention":
        t, _ = degree(group)
        check_degrees(t, h=attn.proj.in_features, heads=attn.heads, kv_heads=attn.kv_heads)
        proj = RowParallelLinear.from_dense(attn.proj, group, input_is_parallel=True, label=f"{label}.proj")
        if attn.kv_heads == attn.heads:
            qkv = ColumnParallelLinear.from_dense(attn.qkv, group, parts=3, label=f"{label}.qkv")
        else:
            qkv = QKVParallelLinear.from_dense(attn.qkv, group, attn.heads, attn.kv_heads, label=f"{label}.qkv")
        return cls(qkv, proj, attn.heads // t, attn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_shape(x, self.qkv.in_features, type(self).__name__)   # (s, b, h), or (s/t, b, h) under SP
        _same_device(x, self.qkv.weight, type(self).__name__)
        if not isinstance(self.qkv, QKVParallelLinear):
            return super().forward(x)
        q, k, v = self.query_key_value(self.qkv(x))                 # (s, b, a/t·d), 2 × (s, b, kv·d)
        o = attend_heads(q, k, v, self.heads, self.kv_heads, self.causal, self.p if self.training else 0.0,
                         self.fused, self.recompute, self.generators)           # (s, b, a/t·d)
        return self.proj(o)                                          # (s, b, h)

    def query_key_value(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's queries and its groups' keys and values, from its slice of the per-group projection."""
        t, r, groups, d = self.qkv.t, self.qkv.rank, self.query_groups, self.head_dim
        share = t // groups                                          # ranks per group (0 when t < groups)
        if share > 1:
            mixed = self.gather_qkv(mixed)                           # (s, b, (a + 2·a_kv)·d): every group
            size = mixed.shape[-1] // groups
            g = r // share                                           # this rank's group
            mixed = mixed[..., g * size:(g + 1) * size]              # (s, b, (a/a_kv + 2)·d)
        s, b = mixed.shape[:2]
        local = max(groups // t, 1)                                  # groups here
        per = self.heads * t // groups                               # query heads per group
        q, k, v = mixed.reshape(s, b, local, (per + 2) * d).split([per * d, d, d], dim=-1)
        q, k, v = (part.reshape(s, b, -1) for part in (q, k, v))     # (s, b, local·per·d), 2 × (s, b, local·d)
        if share > 1:                                                # the group's queries: keep this rank's a/t
            i = r % share
            q = q[..., i * self.heads * d:(i + 1) * self.heads * d]  # (s, b, a/t·d)
        return q, k, v

    def gather_qkv(self, mixed: torch.Tensor) -> torch.Tensor:
        """All-gather the ranks' slices of the projection (last dim); backward reduce-scatters the gradient."""
        return comm.all_gather(mixed, -1, self.qkv.group, f"{self.qkv.label} gather")


class ParallelBlock(Block):
    """A GPT block with tensor parallelism; LayerNorms replicated on every rank.

    It runs :class:`~intralayer.model.Block`'s own forward (dropout and recomputation
    included) with a parallel attention and MLP.
    """

    def __init__(self, ln1: nn.LayerNorm, attn: nn.Module, ln2: nn.LayerNorm, mlp: nn.Module, dense: Block):
        nn.Module.__init__(self)
        self.ln1, self.attn, self.ln2, self.mlp = ln1, attn, ln2, mlp
        self.h, self.p, self.recompute = dense.h, dense.p, dense.recompute

    @classmethod
    def from_dense(cls, block: Block, group) -> "ParallelBlock":
        t, _ = degree(group)
        check_degrees(t, h=block.h, heads=block.attn.heads, ffn=block.mlp.fc1.out_features,
                      kv_heads=block.attn.kv_heads)
        return cls(copy.deepcopy(block.ln1), ParallelAttention.from_dense(block.attn, group),
                   copy.deepcopy(block.ln2), ParallelMLP.from_dense(block.mlp.fc1, block.mlp.fc2, group), block)


# ---------------------------------------------------------------------------- dropout randomness

#: Megatron-LM's offset between the default seed and the tensor-parallel one
#: (``model_parallel_cuda_manual_seed``: ``seed + 2718 + tp_rank``).
TP_SEED_OFFSET = 2718


class RNGTracker:
    """Named random generators on one device, after Megatron-LM's ``CudaRNGStatesTracker``.

    Megatron-LM keeps named CUDA generator states and switches to one inside
    ``tracker.fork(name)``; here each region's dropout is handed its ``torch.Generator``
    directly (``Block.generator``, ``Attention.generators``), which works on any device.
    As there, two names or two generators with the same seed are refused: two regions
    would draw the same masks.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._generators: dict[str, torch.Generator] = {}
        self._seeds: dict[int, str] = {}

    def add(self, name: str, seed: int) -> torch.Generator:
        seed = _whole(seed, "a seed", minimum=0)
        if name in self._generators:
            raise ValueError(f"the generator {name!r} already exists")
        if seed in self._seeds:
            raise ValueError(f"seed {seed} is already the seed of {self._seeds[seed]!r}: "
                             f"{name!r} would draw the same masks")
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        self._generators[name], self._seeds[seed] = g, name
        return g

    def __getitem__(self, name: str) -> torch.Generator:
        if name not in self._generators:
            raise ValueError(f"no generator named {name!r}; this tracker has {sorted(self._generators)}")
        return self._generators[name]

    def seed(self, name: str) -> int:
        self[name]
        return next(seed for seed, n in self._seeds.items() if n == name)


def model_parallel_seed(seed: int, rank: int, device: torch.device | str = "cpu") -> RNGTracker:
    """The generators of tensor-parallel rank ``rank``, seeded as Megatron-LM seeds them.

    - ``"default"``: ``seed``, the same on every rank of the group — for dropout where the
      activations are replicated (on the residual stream, after each all-reduce *g*);
    - ``"tensor-parallel"``: ``seed + 2718 + rank``, different on every rank — for dropout
      inside a split region (this rank's attention heads).
    """
    _whole(rank, "the tensor-parallel rank", minimum=0)
    tracker = RNGTracker(device)
    tracker.add("default", seed)
    tracker.add("tensor-parallel", seed + TP_SEED_OFFSET + rank)
    return tracker


def seed_dropout(block: "ParallelBlock", tracker: RNGTracker) -> None:
    """Draw one tensor-parallel block's dropout masks from ``tracker``, as Megatron-LM does.

    The two dropouts on the residual stream act on activations every rank holds whole:
    they draw from ``"default"``, so every rank drops the same elements and the copies
    stay identical. The attention dropout acts on this rank's heads only: it draws from
    ``"tensor-parallel"``, so each rank's heads get their own mask.
    """
    if not isinstance(block, ParallelBlock):
        raise ValueError(f"seed_dropout expects a tensor-parallel ParallelBlock, got {type(block).__name__}")
    if getattr(block, "sequence_parallel", False):
        raise ValueError("seed_dropout: under sequence parallelism the residual stream is split as well, and "
                         "Megatron-LM draws all of the block's dropout from the tensor-parallel generator; "
                         "this function places the masks of a block without sequence parallelism")
    if not isinstance(tracker, RNGTracker):
        raise ValueError(f"seed_dropout expects an RNGTracker, got {type(tracker).__name__}")
    block.generator = tracker["default"]
    block.attn.generators = [tracker["tensor-parallel"]]


def seed_dense_dropout(block: Block, seed: int, t: int) -> None:
    """Make a dense block draw the masks that t tensor-parallel ranks seeded with ``seed`` draw.

    The residual-stream dropouts draw from the shared default seed; the attention heads
    form t groups, and group r draws from rank r's tensor-parallel generator
    (``seed + 2718 + r``), so the dense mask of group r is rank r's mask.
    """
    if not isinstance(block, Block):
        raise ValueError(f"seed_dense_dropout expects a dense Block, got {type(block).__name__}")
    check_degrees(t, h=block.h, heads=block.attn.heads)
    device = block.ln1.weight.device
    trackers = [model_parallel_seed(seed, r, device) for r in range(t)]
    block.generator = trackers[0]["default"]
    block.attn.generators = [tr["tensor-parallel"] for tr in trackers]


# ---------------------------------------------------------------------------- vocabulary

class VocabParallelEmbedding(nn.Module):
    """Rank r holds embedding rows ``[r·v/t, (r+1)·v/t)``; other ids look up zeros; *g* sums."""

    def __init__(self, weight: torch.Tensor, vocab: int, group):
        super().__init__()
        self.group, self.vocab = group, vocab
        self.t, self.rank = degree(group)
        self.start = self.rank * weight.shape[0]
        self.weight = nn.Parameter(weight)                            # (v/t, h)

    @classmethod
    def from_dense(cls, emb: nn.Embedding, group) -> "VocabParallelEmbedding":
        t, r = degree(group)
        check_divisible(emb.num_embeddings, t, "vocabulary size")
        return cls(emb.weight.detach().chunk(t, dim=0)[r].clone(), emb.num_embeddings, group)

    def shard(self, full: torch.Tensor, name: str) -> torch.Tensor:
        return full.chunk(self.t, dim=0)[self.rank]

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial embedding: its rows for the ids it holds, zeros for the others'."""
        _check_ids(ids, self.vocab, type(self).__name__, self.weight.device)
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(mine, local, 0), self.weight)   # (s, b, h)
        return out * mine.unsqueeze(-1)                               # other ranks' ids → 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return comm.reduce_from_group(self.lookup(ids), self.group, "embed g")


def _check_ids(ids: torch.Tensor, vocab: int, who: str, device: torch.device | None = None) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{who} expects integer token ids (torch.long), got "
                         f"{getattr(ids, 'dtype', type(ids).__name__)}")
    if device is not None and ids.device != device:
        raise ValueError(f"{who}: the token ids are on {ids.device} but the weights are on {device}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"{who}: token ids must lie in [0, {vocab}), got {int(ids.min())}..{int(ids.max())}")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group):
        r = dist.get_rank(group)
        v_local = logits.shape[-1]
        start = r * v_local
        shift = comm.all_reduce_max(logits.max(dim=-1).values, group, "ce max")       # (...)
        e = torch.exp(logits - shift.unsqueeze(-1))                                     # (..., v/t)
        total = comm.all_reduce(e.sum(dim=-1), group, "ce sum-exp")                     # (...)
        local = targets - start
        mine = (local >= 0) & (local < v_local)
        shifted = logits - shift.unsqueeze(-1)                                          # (..., v/t)
        picked = torch.gather(shifted, -1, torch.where(mine, local, 0).unsqueeze(-1)).squeeze(-1)
        target = comm.all_reduce(picked * mine, group, "ce target")                     # z_y − M, (...)
        ctx.save_for_backward(e / total.unsqueeze(-1), torch.where(mine, local, 0), mine)
        # ℓ = log Σ e^(z−M) − (z_y − M): both terms small, so large logits lose no precision.
        return torch.log(total) - target                                                # (...)

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors                       # this rank's slice of softmax
        g = softmax.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), -mine.unsqueeze(-1).to(g.dtype))       # − one-hot(target)
        return g * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group) -> torch.Tensor:
    """Cross-entropy per token from this rank's ``(…, v/t)`` slice of the logits.

    Three all-reduces of one number per token (the maximum, the sum of exponentials and
    the target's logit) replace gathering ``(…, v)`` logits (Shoeybi et al. 2019, §3).
    Backward needs no communication: ``softmax − one_hot`` restricted to this rank's slice.
    """
    t, _ = degree(group)
    who = "vocab_parallel_cross_entropy"
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        got = (f"dtype {logits.dtype} and shape {tuple(logits.shape)}" if isinstance(logits, torch.Tensor)
               else type(logits).__name__)
        raise ValueError(f"{who}: logits must be a floating point tensor (…, v/t), got {got}")
    if not isinstance(targets, torch.Tensor):
        raise ValueError(f"{who}: targets must be a tensor of integer token ids, got {type(targets).__name__}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"{who}: targets {tuple(targets.shape)} must match the logits' leading shape "
                         f"{tuple(logits.shape[:-1])}")
    _check_group_device(logits, "logits", who, group)
    _check_ids(targets, logits.shape[-1] * t, who, logits.device)
    return _VocabParallelCrossEntropy.apply(logits, targets, group)


class ParallelGPT(nn.Module):
    """:class:`~intralayer.model.TinyGPT` with every layer split: the logits stay split by vocabulary."""

    def __init__(self, embed: VocabParallelEmbedding, blocks: list[ParallelBlock], ln_f: nn.LayerNorm,
                 head: ColumnParallelLinear, group):
        super().__init__()
        self.embed, self.blocks, self.ln_f, self.head, self.group = embed, nn.ModuleList(blocks), ln_f, head, group

    @classmethod
    def from_dense(cls, model: TinyGPT, group) -> "ParallelGPT":
        return cls(VocabParallelEmbedding.from_dense(model.embed, group),
                   [ParallelBlock.from_dense(b, group) for b in model.blocks], copy.deepcopy(model.ln_f),
                   ColumnParallelLinear.from_dense(model.head, group, label="head"), group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)                                          # (s, b, h)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))                               # (s, b, v/t): never gathered

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(self(ids), targets, self.group).mean()


# ---------------------------------------------------------------------------- checking

def expected_shards(parallel: nn.Module, dense: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """For every parameter of ``parallel``: the matching piece of ``dense`` (or of its gradient).

    The parallel modules keep their dense twins' names (``attn.qkv``, ``mlp.fc1`` …), so
    ``parallel.get_parameter(name)`` should equal ``expected_shards(...)[name]``.
    """
    out = {}
    for name, _ in parallel.named_parameters():
        owner_name, _, leaf = name.rpartition(".")
        owner = parallel.get_submodule(owner_name) if owner_name else parallel
        full = dense.get_parameter(name)
        full = full.grad if grads else full.detach()
        if full is None:
            raise ValueError(f"the dense parameter {name} has no gradient: run its backward first")
        out[name] = owner.shard(full, leaf) if hasattr(owner, "shard") else full
    return out


def weights_per_device(parallel: nn.Module) -> int:
    """Number of parameters this rank stores."""
    return sum(p.numel() for p in parallel.parameters())
