"""Overlapping tensor-parallel communication with computation (chapter 07).

With sequence parallelism (chapter 03) a column-parallel layer's input arrives by
all-gather and a row-parallel layer's output leaves by reduce-scatter. Both can be cut
into chunks so that the collective of one chunk runs while another chunk multiplies
("collective matmul", Wang et al. 2023):

- :func:`allgather_matmul` ≡ ``F.linear(all_gather(x_shard, dim), weight)``: chunk i+1's
  all-gather is in flight while chunk i's rows are multiplied.
- :func:`matmul_reduce_scatter` ≡ ``reduce_scatter(F.linear(x, weight), dim)``: chunk i's
  partial products are reduce-scattered while chunk i+1 is computed.

Each is the other's backward, so both are differentiable with the same overlap in the
backward pass; a weight's gradient is this rank's own (no reduction across the group).
``with timeline() as events:`` records when each piece of compute and communication
started and ended on this rank, for the chapter's Gantt charts; :func:`model_times` is
the cost model of sequential and overlapped execution.
"""
from __future__ import annotations

import numbers
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import comm
from .rules import check_group_device as _check_group_device, check_like as _check_like, \
    check_tensor as _check_tensor

# ---------------------------------------------------------------------------- timeline

_timelines: list[tuple[list, float]] = []      # (events, the block's start)


@contextmanager
def timeline():
    """Record ``(kind, label, start, end)`` events (seconds from the block's start) on this rank."""
    entry = ([], time.perf_counter())
    _timelines.append(entry)
    try:
        yield entry[0]
    finally:
        _timelines.remove(entry)


def _event(kind: str, label: str, start: float) -> None:
    if _timelines:
        now = time.perf_counter()
        for events, t0 in _timelines:
            events.append((kind, label, start - t0, now - t0))


def _now() -> float:
    return time.perf_counter()


# ---------------------------------------------------------------------------- checks

def _check(x: torch.Tensor, weight: torch.Tensor, dim: int, chunks: int, who: str, group=None) -> int:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise ValueError(f"{who}: x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{who}: weight must be a (out_features, in_features) matrix")
    in_features = weight.shape[1]
    if x.shape[-1] != in_features:
        raise ValueError(f"{who}: x's last dimension {x.shape[-1]} does not match the weight's "
                         f"in_features {in_features}")
    if x.dtype != weight.dtype or x.device != weight.device:
        raise ValueError(f"{who}: x and the weight must share dtype and device: x is {x.dtype} on {x.device}, "
                         f"the weight {weight.dtype} on {weight.device}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{who}: dim={dim} is out of range for a tensor with {x.dim()} dimensions")
    dim = dim % x.dim()
    if dim == x.dim() - 1:
        raise ValueError(f"{who}: dim={dim} is the feature dimension; gather or scatter tokens or sequence")
    if not isinstance(chunks, numbers.Integral) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"{who}: chunks must be a whole number ≥ 1, got {chunks!r}")
    _check_group_device(x, "x", who, group)
    return dim


def _check_mlp(x, fc1, fc2, group) -> None:
    who = "mlp_microbatches"
    _check_tensor(fc1, "fc1", who, dims=2, layout="(ffn/t, h)")
    _check_tensor(x, "x", who, min_dims=2, layout="(rows, …, h)", last=fc1.shape[1], last_is="fc1's in_features")
    _check_tensor(fc2, "fc2", who, dims=2, layout="(h, ffn/t)", last=fc1.shape[0], last_is="fc1's out_features")
    _check_like(x, "x", fc1, "fc1", who)
    _check_like(fc2, "fc2", fc1, "fc1", who)
    _check_group_device(x, "x", who, group)


# ---------------------------------------------------------------------------- forward kernels

def _gather_linear(x_shard, weight, group, chunks, dim, phase, label):
    """all_gather(x_shard, dim) @ weight.T in chunks; returns (output, gathered input)."""
    P = dist.get_world_size(group)
    n = x_shard.shape[dim]
    if n % chunks:
        raise ValueError(f"allgather_matmul: {n} rows per rank along dim {dim} do not split into {chunks} chunks")
    c = n // chunks
    pieces = x_shard.split(c, dim=dim)
    out = x_shard.new_empty((*x_shard.shape[:dim], P * n, *x_shard.shape[dim + 1:-1], weight.shape[0]))
    full = x_shard.new_empty((*x_shard.shape[:dim], P * n, *x_shard.shape[dim + 1:]))
    start = _now()
    pending = comm.all_gather_start(pieces[0], dim, group, f"{label} chunk 0", phase)
    for i in range(chunks):
        got = pending.wait()[0]                                                 # (…, P·c, …): rank-major
        _event("comm", f"all-gather {i}", start)
        if i + 1 < chunks:                                                      # next chunk goes out now
            start = _now()
            pending = comm.all_gather_start(pieces[i + 1], dim, group, f"{label} chunk {i + 1}", phase)
        t = _now()
        y = F.linear(got, weight)                                               # (…, P·c, …, out)
        for j, (yj, xj) in enumerate(zip(y.split(c, dim=dim), got.split(c, dim=dim))):
            rows = slice(j * n + i * c, j * n + (i + 1) * c)                   # rank j's chunk i
            out.narrow(dim, rows.start, c).copy_(yj)
            full.narrow(dim, rows.start, c).copy_(xj)
        _event("compute", f"matmul {i}", t)
    return out, full


def _linear_scatter(x, weight, group, chunks, dim, phase, label):
    """reduce_scatter(x @ weight.T, dim) in chunks: chunk i is reduced while chunk i+1 computes."""
    P, r = dist.get_world_size(group), dist.get_rank(group)
    total = x.shape[dim]
    if total % (P * chunks):
        raise ValueError(f"matmul_reduce_scatter: {total} rows along dim {dim} do not split into "
                         f"{P} ranks × {chunks} chunks")
    n = total // P                                                              # this rank's rows
    c = n // chunks
    blocks = x.split(n, dim=dim)                                                # P destination blocks
    outs, pending = [], None
    for i in range(chunks):
        t = _now()
        part = torch.cat([F.linear(b.narrow(dim, i * c, c), weight) for b in blocks], dim=dim)  # (…, P·c, …)
        _event("compute", f"matmul {i}", t)
        if pending is not None:
            outs.append(pending[0].wait()[0])
            _event("comm", f"reduce-scatter {i - 1}", pending[1])
        pending = (comm.reduce_scatter_start(part, dim, group, f"{label} chunk {i}", phase), _now())
    outs.append(pending[0].wait()[0])
    _event("comm", f"reduce-scatter {chunks - 1}", pending[1])
    return torch.cat(outs, dim=dim)                                             # (…, n, …, out)


# ---------------------------------------------------------------------------- autograd

class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_shard, weight, group, chunks, dim):
        out, full = _gather_linear(x_shard, weight, group, chunks, dim, "forward", "ag-matmul")
        ctx.save_for_backward(full, weight)
        ctx.group, ctx.chunks, ctx.dim = group, chunks, dim
        return out

    @staticmethod
    def backward(ctx, grad):
        full, weight = ctx.saved_tensors
        # dX: reduce-scatter of grad @ W, overlapped the same way (weight.T: out → in)
        dx = _linear_scatter(grad.contiguous(), weight.t(), ctx.group, ctx.chunks, ctx.dim, "backward", "ag-matmul dX")
        dw = grad.reshape(-1, grad.shape[-1]).T @ full.reshape(-1, full.shape[-1])   # this rank's own
        return dx, dw, None, None, None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group, chunks, dim):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.chunks, ctx.dim = group, chunks, dim
        return _linear_scatter(x, weight, group, chunks, dim, "forward", "matmul-rs")

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        # dX: all-gather of the gradient, multiplied chunk by chunk (weight.T: out → in)
        dx, full_grad = _gather_linear(grad.contiguous(), weight.t(), ctx.group, ctx.chunks, ctx.dim, "backward",
                                       "matmul-rs dX")
        dw = full_grad.reshape(-1, full_grad.shape[-1]).T @ x.reshape(-1, x.shape[-1])
        return dx, dw, None, None, None


def allgather_matmul(x_shard: torch.Tensor, weight: torch.Tensor, group, chunks: int, dim: int = 0) -> torch.Tensor:
    """``F.linear(all_gather(x_shard, dim), weight)`` with the all-gather cut into ``chunks``
    pieces, each multiplied as soon as it arrives while the next is in flight."""
    dim = _check(x_shard, weight, dim, chunks, "allgather_matmul", group)
    return _AllGatherMatmul.apply(x_shard, weight, group, int(chunks), dim)


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group, chunks: int, dim: int = 0) -> torch.Tensor:
    """``reduce_scatter(F.linear(x, weight), dim)`` computed in ``chunks`` pieces, each
    reduce-scattered while the next one is computed."""
    dim = _check(x, weight, dim, chunks, "matmul_reduce_scatter", group)
    return _MatmulReduceScatter.apply(x, weight, group, int(chunks), dim)


# ---------------------------------------------------------------------------- two micro-batches

def mlp_microbatches(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, group, overlap: bool,
                     micro_batches: int = 2) -> torch.Tensor:
    """A tensor-parallel MLP forward (no autograd) on micro-batches along dim 0.

    Sequential: each micro-batch multiplies, then all-reduces, then the next starts.
    Overlapped: a micro-batch's all-reduce is started and left in flight while the next
    micro-batch multiplies. ``fc1`` is this rank's (ffn/t, h) slice, ``fc2`` its (h, ffn/t).
    """
    if not isinstance(micro_batches, numbers.Integral) or isinstance(micro_batches, bool) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a whole number ≥ 1, got {micro_batches!r}")
    _check_mlp(x, fc1, fc2, group)
    if x.shape[0] % micro_batches:
        raise ValueError(f"{x.shape[0]} rows do not split into {micro_batches} micro-batches")
    outs, pending = [], []
    with torch.no_grad():
        for i, mb in enumerate(x.chunk(micro_batches)):
            t = _now()
            partial = F.linear(F.gelu(F.linear(mb, fc1)), fc2)                  # this rank's partial sum
            _event("compute", f"MLP {i}", t)
            p = (comm.all_reduce_start(partial, group, f"mb {i}"), _now(), i)
            if overlap:
                pending.append(p)
            else:
                outs.append(p[0].wait()[0])
                _event("comm", f"all-reduce {i}", p[1])
        for p, started, i in pending:
            outs.append(p.wait()[0])
            _event("comm", f"all-reduce {i}", started)
    return torch.cat(outs)


# ---------------------------------------------------------------------------- cost model

def model_times(t: int, h: int, tokens: int, chunks: int, bandwidth: float, flops: float,
                alpha: float = 5e-6, overhead: float = 5e-6, itemsize: int = 2) -> dict:
    """Predicted time of one all-gather + column-parallel matmul ``(tokens, h) → (tokens, 4h/t)``.

    Communication: the all-gather of ``tokens·h`` numbers in ``chunks`` pieces, each
    ``α + (t−1)/t · tokens·h·e / chunks / B`` (chapter 00's α–β model). Compute: 
    ``2·tokens·h·4h/t`` FLOPs at ``flops`` FLOP/s, split evenly, each piece paying a fixed
    ``overhead`` (a kernel launch). Sequential: all communication, then all compute.
    Overlapped: the first chunk's transfer, then each step the longer of the next
    transfer and this chunk's compute, then the last compute.
    """
    for value, what in ((t, "t"), (h, "h"), (tokens, "tokens"), (chunks, "chunks")):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{what} must be a whole number ≥ 1, got {value!r}")
    if tokens % (t * chunks):
        raise ValueError(f"{tokens} tokens do not split into t={t} ranks × {chunks} chunks")
    if not (bandwidth > 0 and flops > 0):
        raise ValueError("bandwidth and FLOP rate must be > 0")
    if alpha < 0 or overhead < 0:
        raise ValueError(f"latency α={alpha} and per-chunk overhead {overhead} must be ≥ 0 seconds")
    if not isinstance(itemsize, numbers.Integral) or itemsize < 1:
        raise ValueError(f"itemsize must be a whole number of bytes ≥ 1, got {itemsize!r}")
    comm_c = (alpha + (t - 1) / t * tokens * h * itemsize / chunks / bandwidth) if t > 1 else 0.0
    comp_c = 2 * tokens * h * 4 * h / t / flops / chunks + overhead
    sequential = chunks * comm_c + chunks * comp_c
    overlapped = comm_c + (chunks - 1) * max(comm_c, comp_c) + comp_c
    comm_total = chunks * comm_c
    exposed = overlapped - chunks * comp_c
    hidden = 0.0 if comm_total == 0 or chunks == 1 else max(0.0, min(1.0, 1 - exposed / comm_total))
    return dict(sequential=sequential, overlapped=overlapped, compute=chunks * comp_c, comm=comm_total,
                hidden=hidden)
