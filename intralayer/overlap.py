"""Overlapping tensor-parallel communication with computation (chapter 07).

With sequence parallelism (chapter 03) a column-parallel layer's input arrives by
all-gather and a row-parallel layer's output leaves by reduce-scatter. Both can be
decomposed so that a transfer runs while a matrix product that does not need it computes:

- :func:`allgather_matmul` ≡ ``F.linear(all_gather(x_shard, dim), weight)``;
- :func:`matmul_reduce_scatter` ≡ ``reduce_scatter(F.linear(x, weight), dim)``.

Each is the other's backward, so both are differentiable with the same schedule in the
backward pass; a weight's gradient is this rank's own (no reduction across the group).

``schedule`` chooses how (every one gives the unfused result, forward and backward):

- ``"ring"`` (the default): Wang et al.'s decomposition (ASPLOS 2023). The all-gather
  becomes t−1 point-to-point steps round a ring: a rank multiplies the shard it holds
  while it passes that shard on and receives the next, starting with its own shard, so
  no transfer is exposed when each multiply lasts as long as a transfer. The
  reduce-scatter side passes partial sums round the ring: a rank computes its partial
  product for the next destination while the running sum travels.
- ``"bidirectional"``: the same with shards (and partial sums) travelling both ways
  round the ring at once, ⌊t/2⌋ steps instead of t−1; whether that also halves the bytes
  each step waits for depends on whether the two directions have links of their own
  (:func:`model_times`).
- ``"chunked"``: the input cut into ``chunks`` pieces, one collective (all-gather or
  reduce-scatter) per piece, the next piece's collective in flight while this piece
  multiplies. The first piece's collective is always exposed.
- ``"sequential"``: the same pieces, each collective waited for before its multiply
  (with ``chunks=1``: the unfused collective then the matmul, the baseline).

For the ring schedules ``chunks`` cuts each shard into pieces that travel as separate
messages (a piece is multiplied as soon as it arrives); ``chunks=1`` sends each shard
whole, one message per step.

Every send goes through :mod:`comm` (its ``accounting`` counts the bytes). Compute and
waits are named ``torch.profiler.record_function`` ranges ("compute: …", "wait: …"),
so a ``torch.profiler`` trace shows them beside the backend's own communication ranges;
:func:`trace_timeline` reads such a trace back. :func:`model_times` is the cost model,
with the share of the GPU a communication kernel takes while it runs.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import record_function

from . import comm, rules
from .collectives import NCCL_RING_NVLINK_STEP_US, collective_time
from .rules import check_group_device as _check_group_device, check_like as _check_like, \
    check_tensor as _check_tensor, whole as _whole

SCHEDULES = ("ring", "bidirectional", "chunked", "sequential")


# ---------------------------------------------------------------------------- the ring's plan

def ring_reach(t: int, bidirectional: bool) -> tuple[int, int]:
    """How far shards travel each way round a ring of ``t`` ranks: ``(forward, backward)``.

    Forward is towards rank r+1, backward towards r−1; together they cover the t−1 other
    ranks. One-way: ``(t−1, 0)``. Both ways: ``(⌈(t−1)/2⌉, ⌊(t−1)/2⌋)``, so the ring takes
    ⌈(t−1)/2⌉ = ⌊t/2⌋ steps instead of t−1.
    """
    _whole(t, "the ring's size", unit="ranks t")
    if not bidirectional:
        return t - 1, 0
    return t // 2, (t - 1) // 2


def ring_order(t: int, r: int, bidirectional: bool = False) -> list[list[int]]:
    """The shards rank ``r`` multiplies at each step of the ring all-gather matmul.

    Step 0 is its own shard; at step s it holds the shard of rank r−s (arrived from r−1)
    and, both ways, also that of rank r+s (arrived from r+1) while the other direction
    still has that far to go.
    """
    forward, backward = ring_reach(t, bidirectional)
    r = rules.index(r, "rank r=", t, f"the t={t} ranks of the ring")
    steps = [[r]]
    for s in range(1, forward + 1):
        steps.append([(r - s) % t] + ([(r + s) % t] if s <= backward else []))
    return steps


# ---------------------------------------------------------------------------- checks

def _check(x, weight, dim, chunks, schedule, who, group=None) -> int:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise ValueError(f"{who}: x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{who}: weight must be a (out_features, in_features) matrix")
    in_features = weight.shape[1]
    if x.shape[-1] != in_features:
        raise ValueError(f"{who}: x's last dimension {x.shape[-1]} does not match the weight's "
                         f"in_features {in_features}")
    _check_like(x, "x", weight, "the weight", who)
    dim = rules.check_dim(x, dim, who)
    if dim == x.dim() - 1:
        raise ValueError(f"{who}: dim={dim} is the feature dimension; gather or scatter tokens or sequence")
    _whole(chunks, f"{who}: chunks")
    if schedule not in SCHEDULES:
        raise ValueError(f"{who}: schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
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


def _rows_per_chunk(n: int, chunks: int, dim: int, who: str) -> int:
    if n % chunks:
        raise ValueError(f"{who}: {n} rows per rank along dim {dim} do not split into {chunks} chunks")
    return n // chunks


# ---------------------------------------------------------------------------- the ring

def _ring_gather_linear(x_shard, weight, group, chunks, dim, bidirectional, phase, label):
    """all_gather(x_shard, dim) @ weight.T round a ring; returns (output, gathered input).

    Each piece is passed on as soon as it has arrived, then multiplied while it travels.
    """
    t, r = dist.get_world_size(group), dist.get_rank(group)
    n = x_shard.shape[dim]
    c = _rows_per_chunk(n, chunks, dim, "allgather_matmul")
    out = x_shard.new_empty((*x_shard.shape[:dim], t * n, *x_shard.shape[dim + 1:-1], weight.shape[0]))
    full = x_shard.new_empty((*x_shard.shape[:dim], t * n, *x_shard.shape[dim + 1:]))
    reach = dict(zip((1, -1), ring_reach(t, bidirectional)))       # direction → steps it travels
    pending = {}

    def send_on(d, j, piece, s):
        pending[d, j] = comm.ring_exchange_start([piece], d, group, f"{label} step {s + 1} piece {j}", phase)

    def multiply(origin, j, piece, s, came=""):
        with record_function(f"compute: {label} step {s} piece {j}{came}"):
            rows = origin * n + j * c                                           # rank `origin`'s piece j
            out.narrow(dim, rows, c).copy_(F.linear(piece, weight))            # (…, c, …, out)
            full.narrow(dim, rows, c).copy_(piece)

    for j, piece in enumerate(x_shard.split(c, dim=dim)):                      # step 0: my own shard
        for d in (1, -1):
            if reach[d]:
                send_on(d, j, piece.contiguous(), 0)
        multiply(r, j, piece, 0)
    for s in range(1, reach[1] + 1):
        for j in range(chunks):
            for d in (1, -1):
                if s > reach[d]:
                    continue
                came = f" from r{'-' if d == 1 else '+'}1"                      # which neighbour sent it
                with record_function(f"wait: {label} step {s} piece {j}{came}"):
                    piece = pending.pop((d, j)).wait()[0]
                if s < reach[d]:
                    send_on(d, j, piece, s)                                     # pass it on first
                multiply((r - d * s) % t, j, piece, s, came)
    return out, full


def _ring_linear_scatter(x, weight, group, chunks, dim, bidirectional, phase, label):
    """reduce_scatter(x @ weight.T, dim) round a ring: partial sums travel, each rank adds its own.

    The sum for destination rank q travels forward from rank q − reach and (both ways)
    backward from q + reach; at each step a rank computes its partial product for the sum
    it will receive next, then waits for that sum, adds, and passes it on.
    """
    t, r = dist.get_world_size(group), dist.get_rank(group)
    total = x.shape[dim]
    if total % t:
        raise ValueError(f"matmul_reduce_scatter: {total} rows along dim {dim} do not split into "
                         f"{t} ranks × {chunks} chunks")
    n = total // t
    if n % chunks:
        raise ValueError(f"matmul_reduce_scatter: {total} rows along dim {dim} do not split into "
                         f"{t} ranks × {chunks} chunks")
    c = n // chunks
    reach = dict(zip((1, -1), ring_reach(t, bidirectional)))
    steps = reach[1]
    pending, result = {}, [None] * chunks

    def partial(dest, j, s, way=""):
        with record_function(f"compute: {label} step {s} piece {j}{way}"):
            return F.linear(x.narrow(dim, dest * n + j * c, c), weight)       # (…, c, …, out)

    def arrived(d, j, s):
        with record_function(f"wait: {label} step {s} piece {j} from r{'-' if d == 1 else '+'}1"):
            return pending.pop((d, j)).wait()[0]

    for s in range(steps + 1):
        left = steps - s                                                        # how far the sums still go
        for j in range(chunks):
            if left == 0:                                                       # my own rows: the last step
                acc = partial(r, j, s)
                for d in (1, -1):
                    if reach[d]:
                        acc = acc + arrived(d, j, s)
                result[j] = acc
                continue
            for d in (1, -1):
                if left > reach[d]:
                    continue                                                    # this direction starts later
                acc = partial((r + d * left) % t, j, s, f" to r{'+' if d == 1 else '-'}1")
                if left < reach[d]:
                    acc = acc + arrived(d, j, s)
                pending[d, j] = comm.ring_exchange_start([acc], d, group, f"{label} step {s + 1} piece {j}", phase)
    return torch.cat(result, dim=dim)                                           # (…, n, …, out)


# ---------------------------------------------------------------------------- chunked collectives

def _chunked_gather_linear(x_shard, weight, group, chunks, dim, overlap, phase, label):
    """all_gather(x_shard, dim) @ weight.T, one all-gather per chunk; returns (output, gathered input)."""
    t = dist.get_world_size(group)
    n = x_shard.shape[dim]
    c = _rows_per_chunk(n, chunks, dim, "allgather_matmul")
    pieces = x_shard.split(c, dim=dim)
    out = x_shard.new_empty((*x_shard.shape[:dim], t * n, *x_shard.shape[dim + 1:-1], weight.shape[0]))
    full = x_shard.new_empty((*x_shard.shape[:dim], t * n, *x_shard.shape[dim + 1:]))
    pending = comm.all_gather_start(pieces[0], dim, group, f"{label} chunk 0", phase)
    for i in range(chunks):
        with record_function(f"wait: {label} chunk {i}"):
            got = pending.wait()[0]                                             # (…, t·c, …): rank-major
        if i + 1 < chunks and overlap:                                          # the next one travels meanwhile
            pending = comm.all_gather_start(pieces[i + 1], dim, group, f"{label} chunk {i + 1}", phase)
        with record_function(f"compute: {label} chunk {i}"):
            y = F.linear(got, weight)                                           # (…, t·c, …, out)
            for j, (yj, xj) in enumerate(zip(y.split(c, dim=dim), got.split(c, dim=dim))):
                rows = j * n + i * c                                            # rank j's chunk i
                out.narrow(dim, rows, c).copy_(yj)
                full.narrow(dim, rows, c).copy_(xj)
        if i + 1 < chunks and not overlap:                                      # only now the next one
            pending = comm.all_gather_start(pieces[i + 1], dim, group, f"{label} chunk {i + 1}", phase)
    return out, full


def _chunked_linear_scatter(x, weight, group, chunks, dim, overlap, phase, label):
    """reduce_scatter(x @ weight.T, dim), one reduce-scatter per chunk."""
    t = dist.get_world_size(group)
    total = x.shape[dim]
    if total % (t * chunks):
        raise ValueError(f"matmul_reduce_scatter: {total} rows along dim {dim} do not split into "
                         f"{t} ranks × {chunks} chunks")
    n = total // t                                                              # this rank's rows
    c = n // chunks
    blocks = x.split(n, dim=dim)                                                # t destination blocks
    outs, pending = [], None
    for i in range(chunks):
        with record_function(f"compute: {label} chunk {i}"):
            part = torch.cat([F.linear(b.narrow(dim, i * c, c), weight) for b in blocks], dim=dim)  # (…, t·c, …)
        if pending is not None:
            with record_function(f"wait: {label} chunk {i - 1}"):
                outs.append(pending.wait()[0])
        pending = comm.reduce_scatter_start(part, dim, group, f"{label} chunk {i}", phase)
        if not overlap:
            with record_function(f"wait: {label} chunk {i}"):
                outs.append(pending.wait()[0])
            pending = None
    if pending is not None:
        with record_function(f"wait: {label} chunk {chunks - 1}"):
            outs.append(pending.wait()[0])
    return torch.cat(outs, dim=dim)                                             # (…, n, …, out)


def _gather_linear(x_shard, weight, group, chunks, dim, schedule, phase, label):
    if schedule in ("ring", "bidirectional"):
        return _ring_gather_linear(x_shard, weight, group, chunks, dim, schedule == "bidirectional", phase, label)
    return _chunked_gather_linear(x_shard, weight, group, chunks, dim, schedule == "chunked", phase, label)


def _linear_scatter(x, weight, group, chunks, dim, schedule, phase, label):
    if schedule in ("ring", "bidirectional"):
        return _ring_linear_scatter(x, weight, group, chunks, dim, schedule == "bidirectional", phase, label)
    return _chunked_linear_scatter(x, weight, group, chunks, dim, schedule == "chunked", phase, label)


# ---------------------------------------------------------------------------- autograd

class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_shard, weight, group, chunks, dim, schedule):
        out, full = _gather_linear(x_shard, weight, group, chunks, dim, schedule, "forward", "ag-matmul")
        ctx.save_for_backward(full, weight)
        ctx.group, ctx.chunks, ctx.dim, ctx.schedule = group, chunks, dim, schedule
        return out

    @staticmethod
    def backward(ctx, grad):
        full, weight = ctx.saved_tensors
        # dX: a reduce-scatter of grad @ W, on the same schedule (weight.T: out → in)
        dx = _linear_scatter(grad.contiguous(), weight.t(), ctx.group, ctx.chunks, ctx.dim, ctx.schedule,
                             "backward", "ag-matmul dX")
        with record_function("compute: ag-matmul dW"):
            dw = grad.reshape(-1, grad.shape[-1]).T @ full.reshape(-1, full.shape[-1])   # this rank's own
        return dx, dw, None, None, None, None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group, chunks, dim, schedule):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.chunks, ctx.dim, ctx.schedule = group, chunks, dim, schedule
        return _linear_scatter(x, weight, group, chunks, dim, schedule, "forward", "matmul-rs")

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        # dX: an all-gather of the gradient, multiplied as it arrives (weight.T: out → in)
        dx, full_grad = _gather_linear(grad.contiguous(), weight.t(), ctx.group, ctx.chunks, ctx.dim,
                                       ctx.schedule, "backward", "matmul-rs dX")
        with record_function("compute: matmul-rs dW"):
            dw = full_grad.reshape(-1, full_grad.shape[-1]).T @ x.reshape(-1, x.shape[-1])
        return dx, dw, None, None, None, None


def allgather_matmul(x_shard: torch.Tensor, weight: torch.Tensor, group, chunks: int, dim: int = 0,
                     schedule: str = "ring") -> torch.Tensor:
    """``F.linear(all_gather(x_shard, dim), weight)`` with the all-gather decomposed so that
    transfers run while shards already here multiply (``schedule``: see the module docstring)."""
    dim = _check(x_shard, weight, dim, chunks, schedule, "allgather_matmul", group)
    return _AllGatherMatmul.apply(x_shard, weight, group, int(chunks), dim, schedule)


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group, chunks: int, dim: int = 0,
                          schedule: str = "ring") -> torch.Tensor:
    """``reduce_scatter(F.linear(x, weight), dim)`` with the reduce-scatter decomposed so that
    partial sums travel while the next partial products compute (``schedule``: see the module docstring)."""
    dim = _check(x, weight, dim, chunks, schedule, "matmul_reduce_scatter", group)
    return _MatmulReduceScatter.apply(x, weight, group, int(chunks), dim, schedule)


# ---------------------------------------------------------------------------- two micro-batches

class _MLPMicrobatches(torch.autograd.Function):
    """Megatron's tensor-parallel MLP, f → fc1 → GELU → fc2 → g, on micro-batches along dim 0.

    Forward: each micro-batch's partial sum is all-reduced (g); overlapped, the all-reduce
    is left in flight while the next micro-batch multiplies. Backward: the output gradient
    is the same on every rank (g's backward is the identity); each micro-batch's input
    gradient is all-reduced (f's backward), in flight while the next micro-batch's
    backward computes. Weight gradients are this rank's own.
    """

    @staticmethod
    def forward(ctx, x, fc1, fc2, group, overlap, micro_batches):
        outs, pending, hidden = [], [], []
        for i, mb in enumerate(x.chunk(micro_batches)):
            with record_function(f"compute: MLP forward {i}"):
                h1 = F.linear(mb, fc1)                                          # (mb, …, ffn/t)
                partial = F.linear(F.gelu(h1), fc2)                            # (mb, …, h): this rank's share
            hidden.append(h1)
            pending.append(comm.all_reduce_start(partial, group, f"mb {i}", "forward"))
            if not overlap:
                with record_function(f"wait: MLP forward {i}"):
                    outs.append(pending.pop().wait()[0])
        for i, p in enumerate(pending):
            with record_function(f"wait: MLP forward {i}"):
                outs.append(p.wait()[0])
        ctx.save_for_backward(x, fc1, fc2, torch.cat(hidden))
        ctx.group, ctx.overlap, ctx.micro_batches = group, overlap, micro_batches
        return torch.cat(outs)

    @staticmethod
    def backward(ctx, grad):
        x, fc1, fc2, h1 = ctx.saved_tensors
        d_fc1, d_fc2 = torch.zeros_like(fc1), torch.zeros_like(fc2)
        want_dx = ctx.needs_input_grad[0]
        dxs, pending = [None] * ctx.micro_batches, []
        pieces = list(zip(x.chunk(ctx.micro_batches), h1.chunk(ctx.micro_batches), grad.chunk(ctx.micro_batches)))
        for i in reversed(range(ctx.micro_batches)):
            mb, h, dy = pieces[i]
            with record_function(f"compute: MLP backward {i}"):
                with torch.enable_grad():
                    leaf = h.detach().requires_grad_()
                    act = F.gelu(leaf)                                          # (mb, …, ffn/t)
                d_fc2 += dy.reshape(-1, dy.shape[-1]).T @ act.detach().reshape(-1, act.shape[-1])
                (dh,) = torch.autograd.grad(act, leaf, dy @ fc2)                # through GELU
                d_fc1 += dh.reshape(-1, dh.shape[-1]).T @ mb.reshape(-1, mb.shape[-1])
            if want_dx:
                pending.append((i, comm.all_reduce_start(dh @ fc1, group=ctx.group, label=f"mb {i} dX",
                                                         phase="backward")))
                if not ctx.overlap:
                    with record_function(f"wait: MLP backward {i}"):
                        dxs[i] = pending.pop()[1].wait()[0]
        for i, p in pending:
            with record_function(f"wait: MLP backward {i}"):
                dxs[i] = p.wait()[0]
        dx = torch.cat(dxs) if want_dx else None
        return dx, d_fc1, d_fc2, None, None, None


def mlp_microbatches(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, group, overlap: bool,
                     micro_batches: int = 2) -> torch.Tensor:
    """A tensor-parallel MLP on micro-batches along dim 0, forward and backward.

    Sequential: each micro-batch multiplies, then all-reduces, then the next starts.
    Overlapped: a micro-batch's all-reduce is left in flight while the next micro-batch
    multiplies, and the same in the backward pass. ``x`` is replicated (every rank the
    same), ``fc1`` is this rank's (ffn/t, h) slice, ``fc2`` its (h, ffn/t); the output is
    the replicated sum, as Megatron-LM's f and g make it.
    """
    _whole(micro_batches, "micro_batches")
    _check_mlp(x, fc1, fc2, group)
    if x.shape[0] % micro_batches:
        raise ValueError(f"{x.shape[0]} rows do not split into {micro_batches} micro-batches")
    return _MLPMicrobatches.apply(x, fc1, fc2, group, bool(overlap), int(micro_batches))


# ---------------------------------------------------------------------------- reading a trace

#: Names of the communication ranges a ``torch.profiler`` trace holds: gloo's operations
#: (CPU, recorded by PyTorch's gloo process group) and NCCL's kernels (CUDA activity).
COMM_PREFIXES = ("gloo:", "nccl:", "ncclDevKernel", "ncclKernel")
#: The calls that hand an operation to the backend (on the calling thread, when it is posted).
POST_PREFIX = "c10d::"
#: The ranges :func:`merge_traces` keeps: this module's, a program's runs, the backend's.
KEPT_PREFIXES = ("compute: ", "wait: ", "run: ", POST_PREFIX) + COMM_PREFIXES


def _load(trace) -> dict:
    if isinstance(trace, dict):
        return trace
    return json.loads(Path(trace).read_text())


def _kept(e) -> bool:
    return e.get("ph") == "X" and "dur" in e and (e["name"].startswith(KEPT_PREFIXES) or e.get("cat") == "kernel")


def merge_traces(traces: list, runs=None) -> dict:
    """One small Chrome trace from every rank's ``torch.profiler`` trace (paths or dicts, rank order).

    Rank r's events go under process id r, named "rank r"; only the ranges named in
    :data:`KEPT_PREFIXES` and the GPU's kernels are kept, with their thread, start and
    duration (no arguments); times are shifted so the earliest kept event starts at 0.
    ``runs``, a collection of names of ``run: …`` ranges, keeps only those ranges and what
    starts inside them (on the same rank), e.g. one run of each schedule out of several.
    Each kind of communication range gets a track of its own ("gloo:send", …): they
    overlap the compute ranges of the thread that posted them, and Perfetto draws only
    ranges that nest on one track. The ranks' clocks are taken to be the same clock (true
    for processes on one machine). It opens in Perfetto (ui.perfetto.dev) or
    chrome://tracing like the originals.
    """
    if not traces:
        raise ValueError("merge_traces needs at least one trace")
    kept, tracks = [], {}
    for rank, trace in enumerate(traces):
        events = [e for e in _load(trace).get("traceEvents", []) if _kept(e)]
        if runs is not None:
            spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] in runs]
            events = [e for e in events if any(a <= e["ts"] <= b for a, b in spans)]
        for e in events:
            tid = e.get("tid", 0)
            if e["name"].startswith(COMM_PREFIXES) and e.get("cat") != "kernel":
                tid = tracks.setdefault((rank, e["name"]), 10_000 + len(tracks))
            kept.append(dict(ph="X", name=e["name"], cat=e.get("cat", ""), pid=rank, tid=tid,
                             ts=float(e["ts"]), dur=float(e["dur"])))
    if not kept:
        raise ValueError("none of the traces holds a compute, wait, run or communication range")
    t0 = min(e["ts"] for e in kept)
    for e in kept:
        e["ts"] = round(e["ts"] - t0, 3)
        e["dur"] = round(e["dur"], 3)
    names = [dict(ph="M", name="process_name", pid=rank, tid=0, args=dict(name=f"rank {rank}"))
             for rank in range(len(traces))]
    names += [dict(ph="M", name="thread_name", pid=rank, tid=tid, args=dict(name=f"{name} (posted → waited for)"))
              for (rank, name), tid in tracks.items()]
    return dict(traceEvents=names + kept, displayTimeUnit="ms")


def trace_timeline(trace, within: str, pid=None) -> list[tuple[str, str, float, float]]:
    """``(kind, name, start, end)`` in seconds from the start of the range named ``within``.

    ``trace`` is a Chrome trace (``torch.profiler``'s ``export_chrome_trace`` or
    :func:`merge_traces`: a path or the loaded dict); ``pid`` picks one process (a rank of
    a merged trace). Kinds: ``"compute"`` and ``"wait"`` for this module's named ranges,
    ``"comm"`` for the backend's communication (gloo's ranges on the CPU, NCCL's kernels on
    the GPU's timeline), ``"post"`` for the calls that hand an operation to the backend
    (``c10d::…``, on the calling thread), ``"kernel"`` for the GPU's other kernels (the
    matmuls as the GPU ran them), each kept if it starts inside ``within``.
    """
    events = [e for e in _load(trace).get("traceEvents", [])
              if e.get("ph") == "X" and "dur" in e and (pid is None or e.get("pid") == pid)]
    outer = [e for e in events if e["name"] == within]
    if len(outer) != 1:
        where = "" if pid is None else f" in process {pid}"
        raise ValueError(f"the trace holds {len(outer)} ranges named {within!r}{where}; expected exactly one")
    t0, t1 = outer[0]["ts"], outer[0]["ts"] + outer[0]["dur"]
    found = []
    for e in events:
        name, start = e["name"], e["ts"]
        if not t0 <= start <= t1:
            continue
        if name.startswith("compute: "):
            kind = "compute"
        elif name.startswith("wait: "):
            kind = "wait"
        elif name.startswith(COMM_PREFIXES):
            kind = "comm"
        elif name.startswith(POST_PREFIX):
            kind = "post"
        elif e.get("cat") == "kernel":
            kind = "kernel"
        else:
            continue
        found.append((kind, name, (start - t0) / 1e6, (start + e["dur"] - t0) / 1e6))
    return sorted(found, key=lambda e: e[2])


# ---------------------------------------------------------------------------- cost model

def _step(transfer: float, compute: float, sm_fraction: float) -> float:
    """One overlapped step: ``compute`` (seconds at the full rate) runs beside a transfer
    that holds ``sm_fraction`` of the GPU while it lasts. Done when both are."""
    return max(transfer, compute + sm_fraction * transfer)


#: The default latency of one step (an all-gather's ring step, or one ring step's send/recv), in
#: seconds: NCCL's own figure for a ring step over NVLink with its Simple protocol, 3.4 µs
#: (``hwLatencies`` in src/graph/tuning.cc at 5067397c; :data:`collectives.NCCL_RING_NVLINK_STEP_US`).
#: Simple, not LL (0.6 µs) or LL128 (1.9 µs): a shard here is megabytes, NCCL's tuner picks Simple for
#: large messages, and its send/recv uses LL only up to 16 KiB per channel and never LL128
#: (``P2P_LL_THRESHOLD``, src/enqueue.cc).
ALPHA = NCCL_RING_NVLINK_STEP_US["Simple"] * 1e-6


def model_times(t: int, h: int, tokens: int, chunks: int, bandwidth: float, flops: float,
                alpha: float = ALPHA, overhead: float = 5e-6, itemsize: int = 2,
                sm_fraction: float = 0.0, separate_directions: bool = False) -> dict:
    """Predicted time of one all-gather + column-parallel matmul ``(tokens, h) → (tokens, 4h/t)``.

    Terms: the matmul, ``2·tokens·h·4h/t`` FLOPs at ``flops`` FLOP/s (the rate it reaches, ηF:
    η of the GPU's peak F), plus ``overhead`` per
    kernel; an all-gather of S bytes, chapter 00's ``collective_time`` ((t−1)·α + (t−1)/t·S/B);
    one ring step, a shard of ``tokens/t·h·e`` bytes point to point, ``α + shard/B``. ``alpha``
    defaults to :data:`ALPHA`, NCCL's Simple-protocol ring step over NVLink (3.4 µs).
    A communication call pays only those α's: no base latency per call, such as the one NCCL's
    tuning model adds to every collective (8.4 µs for a Simple ring,
    :data:`collectives.NCCL_BASE_US`), while every extra multiply pays ``overhead``. That
    favours the schedules that make more calls — the ring's t−1 steps against the sequential
    run's one all-gather, and the chunked schedules' pieces; chapter 07 prices it.
    ``sm_fraction`` (φ) is the share of the GPU's SMs a communication kernel holds while it
    runs: compute beside it runs at 1 − φ of its rate, so a step that overlaps a transfer
    τ_send with a multiply τ_mul takes ``max(τ_send, τ_mul + φ·τ_send)``. φ = 0 stands for
    copy-engine transfers, which leave the SMs alone but still read and write the GPU's
    memory: contention for memory bandwidth is not modelled, so φ = 0 gives a lower bound on
    the time (an upper bound on what overlap saves).

    ``bandwidth`` is the GPU's one-way bandwidth B, shared by everything it sends at once (a
    GPU reaches every peer through the same NVLink ports and NVSwitches, or through one NIC):
    the bidirectional ring's two shards per step share it. ``separate_directions=True`` gives
    each direction a link of its own, as a TPU's torus does (each chip has links to each
    neighbour; Wang et al.'s setting): a step that sends one shard each way then takes as
    long as one shard's transfer.

    Returns seconds for five schedules: ``sequential`` (the all-gather, then one matmul),
    ``sequential_chunked`` (``chunks`` pieces, each gathered then multiplied),
    ``chunked`` (the next piece's all-gather beside this piece's matmul: the first
    all-gather exposed), ``ring`` (t−1 steps, each shard multiplied beside the next
    transfer, one kernel per shard) and ``bidirectional`` (⌊t/2⌋ steps of up to two shards
    each way: half the latencies, the same bytes through the same B unless
    ``separate_directions``); and ``compute`` and ``comm``, the sequential run's two parts.
    """
    for value, what in ((t, "t"), (h, "h"), (tokens, "tokens"), (chunks, "chunks")):
        _whole(value, what)
    if tokens % (t * chunks):
        raise ValueError(f"{tokens} tokens do not split into t={t} ranks × {chunks} chunks")
    if not (bandwidth > 0 and flops > 0):
        raise ValueError("bandwidth and FLOP rate must be > 0")
    if not (alpha >= 0 and overhead >= 0):
        raise ValueError(f"latency α={alpha} and per-kernel overhead {overhead} must be ≥ 0 seconds")
    _whole(itemsize, "itemsize", unit="bytes")
    if not 0 <= sm_fraction < 1:
        raise ValueError(f"sm_fraction={sm_fraction!r} must be in [0, 1): the share of the SMs communication holds")
    S = tokens * h * itemsize                                                   # the gathered input, bytes
    matmul = 2 * tokens * h * (4 * h / t) / flops
    gather = collective_time("all_gather", t, S, bandwidth, alpha)

    piece_comm = collective_time("all_gather", t, S / chunks, bandwidth, alpha)
    piece_comp = matmul / chunks + overhead
    chunked = piece_comm + (chunks - 1) * _step(piece_comm, piece_comp, sm_fraction) + piece_comp

    shard_bytes = S / t
    shard = matmul / t + overhead                                               # one shard's multiply
    ring = (t - 1) * _step(alpha + shard_bytes / bandwidth, shard, sm_fraction) + shard

    forward, backward = ring_reach(t, True)
    bidirectional = 0.0
    for s in range(forward + 1):
        work = (1 if s == 0 else 1 + (s <= backward)) * shard                   # shards multiplied this step
        if s < forward:                                                         # shards sent on meanwhile
            sent = 1 if separate_directions else 1 + (s < backward)                # shards through one link
            bidirectional += _step(alpha + sent * shard_bytes / bandwidth, work, sm_fraction)
        else:
            bidirectional += work
    return dict(sequential=gather + matmul + overhead,
                sequential_chunked=chunks * (piece_comm + piece_comp),
                chunked=chunked, ring=ring, bidirectional=bidirectional,
                compute=matmul + overhead, comm=gather)


def ring_saving(t: int, hop: float, shard: float, overhead: float, sm_fraction: float) -> float:
    """What the ring saves against the sequential run: ``(t−1)·(min(τ_mul, (1−φ)·τ_send) − τ_launch)``.

    With τ_send the time of one ring step's transfer (``hop``), τ_mul one shard's multiply
    including its kernel overhead τ_launch (``shard``, ``overhead``) and φ the communication's
    share of the SMs: each of the t−1 overlapped steps hides the smaller of the shard's compute
    and the (1−φ) share of the transfer, and pays one more kernel's overhead. Overlap pays when
    min(τ_mul, (1−φ)·τ_send) > τ_launch.
    """
    if t < 1 or min(hop, shard, overhead) < 0 or not 0 <= sm_fraction < 1:
        raise ValueError("ring_saving needs t ≥ 1, times ≥ 0 and 0 ≤ sm_fraction < 1")
    return (t - 1) * (min(shard, (1 - sm_fraction) * hop) - overhead)
