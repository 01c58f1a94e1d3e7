"""Collectives as autograd functions, and an accounting context that records them.

Every function takes the process group as an argument (``None`` means the default
group) and works on CPU tensors with gloo and on GPU tensors with NCCL.

Forward and backward come in conjugate pairs, as Megatron-LM (Shoeybi et al. 2019)
lays them out for tensor parallelism:

===========================  ==========================  ===========================
function                     forward                     backward
===========================  ==========================  ===========================
``copy_to_group`` (*f*)      identity                    all-reduce
``reduce_from_group`` (*g*)  all-reduce                  identity
``all_reduce``               all-reduce                  all-reduce
``all_gather``               all-gather along ``dim``    reduce-scatter along ``dim``
``reduce_scatter``           reduce-scatter along dim    all-gather along ``dim``
``split``                    keep this rank's chunk      all-gather along ``dim``
``gather_from_group``        all-gather along ``dim``    keep this rank's chunk
``all_to_all``               all-to-all (uneven splits)  all-to-all, splits swapped
``ring_shift``               send to rank+k, recv        send the gradient back
===========================  ==========================  ===========================

``all_reduce`` is the true gradient when each rank's copy of the sum feeds a different
loss; *f* and *g* are the pair to use when the output is replicated and every rank
computes the same loss (the tensor-parallel case). For the same reason
``gather_from_group`` (a replicated gathered output) splits the gradient instead of
reduce-scattering it, and ``split`` is its conjugate.

Accounting: inside ``with accounting() as acc:`` each call appends a :class:`Record`
(operation, group size, payload size *S* as nccl-tests defines it, bytes this rank
sends, forward or backward) to ``acc.records``. What a call moved is not this module's
arithmetic: while an accounting is open, each call runs under the course's one recorder
of communication (:class:`intralayer.record.Recorder`, a dispatch mode over the c10d
operators), and its record is made from the operators the dispatcher saw — the sends of a
ring exchange become one record. Only the call itself runs under the recorder, so the
products between collectives never go through Python dispatch. For point-to-point and
all-to-all the bytes sent are counted exactly (the split sizes the operator carried); for
all-reduce, all-gather and reduce-scatter, whose algorithm the backend chooses, they are
the bandwidth-optimal ring's traffic: 2(n−1)/n·S and (n−1)/n·S (nccl-tests,
doc/PERFORMANCE.md).
"""
from __future__ import annotations

import numbers
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import rules
from .record import Call, Recorder

# ---------------------------------------------------------------------------- accounting

@dataclass(frozen=True)
class Record:
    """One collective as one rank saw it."""

    op: str           # all_reduce, all_gather, reduce_scatter, all_to_all, send, recv
    group_size: int   # n
    elements: int     # S in elements: the nccl-tests "size" of the operation
    itemsize: int     # bytes per element
    sent: float       # bytes this rank put on the wire (see the module docstring)
    phase: str        # "forward" or "backward"
    label: str        # the caller's name for it, or ""
    seconds: float    # wall time of the blocking call on this rank
    peers: tuple[int, ...] | None = None  # exact bytes to each group rank, when known

    @property
    def bytes(self) -> int:
        """S in bytes."""
        return self.elements * self.itemsize


class Accounting:
    """The records of one ``with accounting():`` block, with small summaries."""

    def __init__(self):
        self.records: list[Record] = []

    def select(self, op: str | None = None, phase: str | None = None) -> list[Record]:
        return [r for r in self.records if (op is None or r.op == op) and (phase is None or r.phase == phase)]

    def count(self, op: str | None = None, phase: str | None = None) -> int:
        return len(self.select(op, phase))

    def sent(self, op: str | None = None, phase: str | None = None) -> float:
        """Bytes this rank sent, over the selected records."""
        return sum(r.sent for r in self.select(op, phase))

    def table(self) -> str:
        """One line per (phase, op): count, S and bytes sent by this rank."""
        rows: dict[tuple[str, str], list[Record]] = {}
        for r in self.records:
            rows.setdefault((r.phase, r.op), []).append(r)
        lines = [f"{'phase':9} {'op':15} {'calls':>5} {'S bytes':>12} {'sent bytes':>12}"]
        for (phase, op), recs in rows.items():
            lines.append(f"{phase:9} {op:15} {len(recs):5d} {sum(r.bytes for r in recs):12,d} "
                         f"{sum(r.sent for r in recs):12,.0f}")
        return "\n".join(lines)


_open: list[Accounting] = []


@contextmanager
def accounting():
    """Record every collective issued through this module while the block runs."""
    acc = Accounting()
    _open.append(acc)
    try:
        yield acc
    finally:
        _open.remove(acc)


def _observed(issue) -> tuple[object, list[Call]]:
    """``issue()``'s result and the c10d operators it issued (none are watched without an accounting)."""
    if not _open:
        return issue(), []
    with Recorder() as seen:
        out = issue()
    return out, seen.calls


def _account(calls: list[Call], phase: str, label: str, seconds: float) -> None:
    """One record of what one call of this module issued: its collective, or its sends as one ``send``."""
    if not _open or not calls:
        return
    sends = [c for c in calls if c.op == "send"]
    first = (sends or calls)[0]
    n = len(first.group)
    if sends:
        peers = [0] * n
        for c in sends:
            peers[c.peer] += c.bytes
        elements, sent, peer_bytes = sum(c.elements for c in sends), float(sum(peers)), tuple(peers)
    elif first.op == "all_to_all":
        splits = first.splits or (first.elements // n,) * n      # rows to each group rank (even: S/n elements)
        row = first.bytes / sum(splits) if sum(splits) else 0.0
        me = first.group.index(dist.get_rank())
        peer_bytes = tuple(0 if j == me else int(c * row) for j, c in enumerate(splits))
        elements, sent = first.elements, float(sum(peer_bytes))
    else:
        elements, sent, peer_bytes = first.elements, bus_factor(first.op, n) * first.bytes, None
    rec = Record(first.op, n, int(elements), int(first.itemsize), sent, phase, label, seconds, peer_bytes)
    for acc in _open:
        acc.records.append(rec)


def _blocking(issue, phase: str, label: str):
    """Run one blocking call, timed, and account for what it issued."""
    t0 = time.perf_counter()
    out, calls = _observed(issue)
    _account(calls, phase, label, time.perf_counter() - t0)
    return out


def bus_factor(op: str, n: int) -> float:
    """Bytes each rank sends per byte of S for a bandwidth-optimal algorithm on n ranks.

    nccl-tests (doc/PERFORMANCE.md): all-reduce 2(n−1)/n; all-gather, reduce-scatter and
    all-to-all (n−1)/n; broadcast and reduce 1.
    """
    if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 1:
        raise ValueError(f"number of ranks n={n!r} must be a whole number ≥ 1")
    factors = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
               "reduce_scatter": (n - 1) / n, "all_to_all": (n - 1) / n,
               "broadcast": 1.0, "reduce": 1.0}
    if op not in factors:
        raise ValueError(f"unknown collective {op!r}; expected one of {sorted(factors)}")
    return factors[op] if n > 1 else 0.0  # one rank sends nothing


# ---------------------------------------------------------------------------- plain ops

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases (a GPU cluster's
# own torch) have only the old names.
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _size(group) -> int:
    return dist.get_world_size(group)


def raw_all_reduce(x: torch.Tensor, group, phase: str, label: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """The all-reduce alone, outside autograd, recorded in the accounting under ``phase`` and
    ``label``: for autograd functions' own backward passes and for gradient syncs."""
    out = x.contiguous().clone()
    _blocking(lambda: dist.all_reduce(out, op=op, group=group), phase, label)
    return out


def raw_all_gather(x: torch.Tensor, dim: int, group, phase: str, label: str) -> torch.Tensor:
    """The all-gather along ``dim`` alone, outside autograd, recorded (see :func:`raw_all_reduce`)."""
    n = _size(group)
    dim = rules.check_dim(x, dim)
    src = x.movedim(dim, 0).contiguous()                            # (d, ...)
    out = torch.empty((n * src.shape[0], *src.shape[1:]), dtype=x.dtype, device=x.device)
    _blocking(lambda: _gather_single(out, src, group=group), phase, label)
    return out.movedim(0, dim)                                      # (..., n·d, ...)


def raw_reduce_scatter(x: torch.Tensor, dim: int, group, phase: str, label: str) -> torch.Tensor:
    """The reduce-scatter along ``dim`` alone, outside autograd, recorded (see :func:`raw_all_reduce`)."""
    n = _size(group)
    dim = rules.check_dim(x, dim)
    if x.shape[dim] % n:
        raise ValueError(f"reduce_scatter: size {x.shape[dim]} of dim {dim} is not divisible "
                         f"by the group size {n}")
    src = x.movedim(dim, 0).contiguous()                            # (n·d, ...)
    out = torch.empty((src.shape[0] // n, *src.shape[1:]), dtype=x.dtype, device=x.device)
    _blocking(lambda: _scatter_single(out, src, op=dist.ReduceOp.SUM, group=group), phase, label)
    return out.movedim(0, dim)                                      # (..., d, ...)


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
                phase: str, label: str) -> torch.Tensor:
    src = x.contiguous()
    out = torch.empty((sum(out_splits), *x.shape[1:]), dtype=x.dtype, device=x.device)
    _blocking(lambda: dist.all_to_all_single(out, src, out_splits, in_splits, group=group), phase, label)
    return out


def _exchange(src: torch.Tensor, out: torch.Tensor, dst: int, frm: int, group, phase: str,
              label: str) -> torch.Tensor:
    """Send ``src`` to group rank ``dst`` while receiving ``out`` from group rank ``frm``."""
    glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    ops = [dist.P2POp(dist.isend, src, glob(dst), group), dist.P2POp(dist.irecv, out, glob(frm), group)]

    def go():
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    _blocking(go, phase, label)
    return out


def _ring_shift(x: torch.Tensor, shift: int, group, phase: str, label: str) -> torch.Tensor:
    n, me = _size(group), dist.get_rank(group)
    src = x.contiguous()
    return _exchange(src, torch.empty_like(src), (me + shift) % n, (me - shift) % n, group, phase, label)


class PendingExchange:
    """Sends and receives in flight; :meth:`wait` returns the received tensors."""

    def __init__(self, works, received, calls: list[Call], phase: str, label: str, t0: float):
        self._works, self._received, self._calls, self._t0 = works, received, calls, t0
        self._phase, self._label = phase, label

    def wait(self) -> list[torch.Tensor]:
        for w in self._works:
            w.wait()
        _account(self._calls, self._phase, self._label, time.perf_counter() - self._t0)
        return self._received


def _started(issue, received_of, phase: str, label: str) -> PendingExchange:
    """Issue an asynchronous call now; its record carries the time from here to the end of its wait."""
    t0 = time.perf_counter()
    works, calls = _observed(issue)
    return PendingExchange(works, received_of(), calls, phase, label, t0)


def ring_exchange_start(tensors: list[torch.Tensor], shift: int = 1, group=None, label: str = "",
                        phase: str = "forward") -> PendingExchange:
    """Start sending ``tensors`` to rank r+shift and receiving the same shapes from r−shift.

    Returns at once, so the caller can compute while the bytes move (no autograd: the
    building block of ring attention). ``wait()`` finishes the exchange; the record (one
    ``send`` of all the tensors' bytes) carries the time from start to the end of the wait.
    """
    n, me = _size(group), dist.get_rank(group)
    if phase not in ("forward", "backward"):
        raise ValueError(f"phase must be 'forward' or 'backward', got {phase!r}")
    if n == 1 or shift % n == 0:
        return PendingExchange([], [t.clone() for t in tensors], [], phase, label, time.perf_counter())
    dst, frm = (me + shift) % n, (me - shift) % n
    glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    sends = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in sends]
    ops = [dist.P2POp(dist.isend, t, glob(dst), group) for t in sends]
    ops += [dist.P2POp(dist.irecv, t, glob(frm), group) for t in received]
    return _started(lambda: dist.batch_isend_irecv(ops), lambda: received, phase, label)


def all_gather_start(x: torch.Tensor, dim: int = 0, group=None, label: str = "",
                     phase: str = "forward") -> PendingExchange:
    """Start an all-gather along ``dim`` and return at once; ``wait()`` gives ``[gathered]``.

    No autograd (a building block of the overlapped matmuls in :mod:`intralayer.overlap`).
    Recorded like :func:`all_gather`, with the time from start to the end of the wait.
    """
    n = _size(group)
    dim = rules.check_dim(x, dim)
    src = x.movedim(dim, 0).contiguous()                                           # (d, ...)
    out = torch.empty((n * src.shape[0], *src.shape[1:]), dtype=x.dtype, device=x.device)
    return _started(lambda: [_gather_single(out, src, group=group, async_op=True)], lambda: [out.movedim(0, dim)],
                    phase, label)


def reduce_scatter_start(x: torch.Tensor, dim: int = 0, group=None, label: str = "",
                         phase: str = "forward") -> PendingExchange:
    """Start a reduce-scatter (sum) along ``dim``; ``wait()`` gives ``[this rank's chunk]``."""
    n = _size(group)
    dim = _divisible(x, dim, group, f"reduce_scatter ({label})" if label else "reduce_scatter")
    src = x.movedim(dim, 0).contiguous()                                           # (n·d, ...)
    out = torch.empty((src.shape[0] // n, *src.shape[1:]), dtype=x.dtype, device=x.device)
    return _started(lambda: [_scatter_single(out, src, op=dist.ReduceOp.SUM, group=group, async_op=True)],
                    lambda: [out.movedim(0, dim)], phase, label)


def all_reduce_start(x: torch.Tensor, group=None, label: str = "", phase: str = "forward") -> PendingExchange:
    """Start an all-reduce (sum) of a copy of ``x``; ``wait()`` gives ``[the sum]``."""
    out = x.contiguous().clone()
    return _started(lambda: [dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group, async_op=True)],
                    lambda: [out], phase, label)


def sendrecv(x: torch.Tensor, dst: int, src: int, recv_shape: tuple[int, ...] | None = None,
             group=None, label: str = "") -> torch.Tensor:
    """Send ``x`` to group rank ``dst`` and receive a tensor of ``recv_shape`` from ``src``.

    The building block of hand-written rings (no autograd). Records one ``send`` of
    exactly the bytes of ``x``.
    """
    n = _size(group)
    if not (0 <= dst < n and 0 <= src < n):
        raise ValueError(f"dst={dst} and src={src} must be ranks of the group (0..{n - 1})")
    shape = tuple(x.shape) if recv_shape is None else tuple(recv_shape)
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    return _exchange(x.contiguous(), out, dst, src, group, "forward", label)


# ---------------------------------------------------------------------------- autograd

class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, label):
        ctx.group, ctx.label = group, label
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return raw_all_reduce(g, ctx.group, "backward", ctx.label), None, None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, label):
        return raw_all_reduce(x, group, "forward", label)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, label):
        ctx.group, ctx.label = group, label
        return raw_all_reduce(x, group, "forward", label)

    @staticmethod
    def backward(ctx, g):
        return raw_all_reduce(g, ctx.group, "backward", ctx.label), None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, label):
        ctx.dim, ctx.group, ctx.label = dim, group, label
        return raw_all_gather(x, dim, group, "forward", label)

    @staticmethod
    def backward(ctx, g):
        return raw_reduce_scatter(g, ctx.dim, ctx.group, "backward", ctx.label), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, label):
        ctx.dim, ctx.group, ctx.label = dim, group, label
        return raw_reduce_scatter(x, dim, group, "forward", label)

    @staticmethod
    def backward(ctx, g):
        return raw_all_gather(g, ctx.dim, ctx.group, "backward", ctx.label), None, None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, label):
        ctx.dim, ctx.group, ctx.label = dim, group, label
        n, me = _size(group), dist.get_rank(group)
        return x.chunk(n, dim=dim)[me].contiguous()

    @staticmethod
    def backward(ctx, g):
        return raw_all_gather(g, ctx.dim, ctx.group, "backward", ctx.label), None, None, None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, label):
        ctx.dim, ctx.group = dim, group
        return raw_all_gather(x, dim, group, "forward", label)

    @staticmethod
    def backward(ctx, g):
        n, me = _size(ctx.group), dist.get_rank(ctx.group)
        return g.chunk(n, dim=ctx.dim)[me].contiguous(), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, label):
        ctx.splits, ctx.group, ctx.label = (out_splits, in_splits), group, label
        return _all_to_all(x, out_splits, in_splits, group, "forward", label)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return _all_to_all(g, in_splits, out_splits, ctx.group, "backward", ctx.label), None, None, None, None


class _RingShift(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shift, group, label):
        ctx.shift, ctx.group, ctx.label = shift, group, label
        return _ring_shift(x, shift, group, "forward", label)

    @staticmethod
    def backward(ctx, g):
        return _ring_shift(g, -ctx.shift, ctx.group, "backward", ctx.label), None, None, None


def _divisible(x: torch.Tensor, dim: int, group, what: str) -> int:
    dim = rules.check_dim(x, dim)
    n = _size(group)
    if x.shape[dim] % n:
        raise ValueError(f"{what}: size {x.shape[dim]} of dim {dim} is not divisible by the group size {n}")
    return dim


def copy_to_group(x: torch.Tensor, group=None, label: str = "") -> torch.Tensor:
    """Megatron's *f*: identity forward, all-reduce of the gradient backward."""
    return _CopyToGroup.apply(x, group, label)


def reduce_from_group(x: torch.Tensor, group=None, label: str = "") -> torch.Tensor:
    """Megatron's *g*: all-reduce (sum) forward, identity backward."""
    return _ReduceFromGroup.apply(x, group, label)


def all_reduce(x: torch.Tensor, group=None, label: str = "") -> torch.Tensor:
    """Sum over the group; backward sums the gradients of every rank's copy."""
    return _AllReduce.apply(x, group, label)


def all_gather(x: torch.Tensor, dim: int = 0, group=None, label: str = "") -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order; backward reduce-scatters."""
    return _AllGather.apply(x, rules.check_dim(x, dim), group, label)


def reduce_scatter(x: torch.Tensor, dim: int = 0, group=None, label: str = "") -> torch.Tensor:
    """Sum over the group and keep this rank's 1/n chunk along ``dim``; backward all-gathers."""
    return _ReduceScatter.apply(x, _divisible(x, dim, group, f"reduce_scatter ({label})" if label else
                                              "reduce_scatter"), group, label)


def split(x: torch.Tensor, dim: int = 0, group=None, label: str = "") -> torch.Tensor:
    """Keep this rank's 1/n chunk of a replicated ``x``; backward all-gathers (no forward traffic)."""
    return _Split.apply(x, _divisible(x, dim, group, "split"), group, label)


def gather_from_group(x: torch.Tensor, dim: int = -1, group=None, label: str = "") -> torch.Tensor:
    """All-gather along ``dim`` into an output every rank then uses identically.

    Backward keeps this rank's chunk of the gradient: each rank computes the same loss
    from the same gathered tensor, so summing the ranks' gradients (what the
    reduce-scatter of :func:`all_gather` does) would count it n times. Megatron-LM's
    ``gather_from_tensor_model_parallel_region``; the conjugate of :func:`split`.
    """
    return _GatherFromGroup.apply(x, rules.check_dim(x, dim), group, label)


def all_reduce_max(x: torch.Tensor, group=None, label: str = "") -> torch.Tensor:
    """Element-wise maximum over the group, with no gradient (a softmax's shift, say)."""
    return raw_all_reduce(x.detach(), group, "forward", label, op=dist.ReduceOp.MAX)


def exchange_counts(in_splits: list[int], group=None) -> list[int]:
    """Tell every rank how many rows it will receive from each rank (the all-to-all's first step)."""
    n = _size(group)
    if len(in_splits) != n or any(int(c) < 0 for c in in_splits):
        raise ValueError(f"in_splits {list(in_splits)} must hold {n} counts ≥ 0, one per rank of the group")
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    send = torch.tensor([int(c) for c in in_splits], dtype=torch.int64, device=device)
    recv = _all_to_all(send, [1] * n, [1] * n, group, "forward", "counts")
    return [int(c) for c in recv.tolist()]


def all_to_all(x: torch.Tensor, in_splits: list[int] | None = None, out_splits: list[int] | None = None,
               group=None, label: str = "") -> torch.Tensor:
    """Send rows ``in_splits[j]`` of ``x`` (dim 0, in order) to rank j; receive ``out_splits``.

    With no splits the rows are split evenly. With ``in_splits`` only, the counts are
    exchanged first (:func:`exchange_counts`). Backward runs the all-to-all the other way.
    """
    n = _size(group)
    if in_splits is None:
        if x.shape[0] % n:
            raise ValueError(f"all_to_all: {x.shape[0]} rows are not divisible by the group size {n}; pass in_splits")
        in_splits = [x.shape[0] // n] * n
    in_splits = [int(c) for c in in_splits]
    if len(in_splits) != n or sum(in_splits) != x.shape[0] or min(in_splits) < 0:
        raise ValueError(f"in_splits {in_splits} must be {n} counts ≥ 0 that add up to the {x.shape[0]} rows of x")
    if out_splits is None:
        out_splits = exchange_counts(in_splits, group)
    out_splits = [int(c) for c in out_splits]
    if len(out_splits) != n or min(out_splits) < 0:
        raise ValueError(f"out_splits {out_splits} must be {n} counts ≥ 0")
    return _AllToAll.apply(x, out_splits, in_splits, group, label)


def ring_shift(x: torch.Tensor, shift: int = 1, group=None, label: str = "") -> torch.Tensor:
    """Send ``x`` to rank (r+shift) mod n and return what rank (r−shift) mod n sent.

    All tensors in the ring must have the same shape. Backward sends the gradient back
    the other way. Records one ``send`` of this rank's bytes.
    """
    if not isinstance(shift, int):
        raise ValueError(f"shift={shift!r} must be a whole number")
    if _size(group) == 1 or shift % _size(group) == 0:
        return x.clone()
    return _RingShift.apply(x, shift, group, label)
