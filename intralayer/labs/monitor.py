"""What the learner's code sends, seen from inside a rank: every collective and point-to-point call.

:mod:`intralayer.comm`'s accounting records the calls made through the course's own
functions; a lab's learner writes raw ``torch.distributed`` calls instead. Every one of
those (``dist.send``, ``isend``, ``batch_isend_irecv``, ``all_reduce``, ``all_gather``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``, …, and
:mod:`intralayer.comm`, which calls them) ends in a method of the process group object:
``send``, ``recv``, ``allreduce``, ``allgather``, ``_allgather_base``, …. :func:`install`
wraps those methods once per rank; inside ``with watch() as calls:`` each call appends a
:class:`Call` (the operation, the group, the peer, the size, and a copy of what a send
carried), and a call of an operation the lab forbids raises :class:`Forbidden` before
anything is sent. Outside a ``watch`` the wrappers only pass the call on.

Collectives issued from C++ (``torch.distributed._functional_collectives``, DTensor) do
not pass through these methods and are not seen: a lab that counts its calls then sees
none, and fails the count.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import ProcessGroup


class Forbidden(RuntimeError):
    """The learner's code called an operation the lab does not allow."""


@dataclass
class Call:
    """One operation as this rank issued it."""

    op: str                        # send, recv, all_reduce, all_gather, reduce_scatter, all_to_all, ...
    group: tuple[int, ...]         # the global ranks of the group, in group-rank order
    peer: int | None               # send/recv: the peer's rank in the group (None: any source)
    elements: int                  # S in elements (nccl-tests): the gathered size for all-gather
    itemsize: int
    data: torch.Tensor | None = None   # a send's payload, copied when it was issued
    reduce: str | None = None          # the reduction of an all-reduce or reduce-scatter

    @property
    def bytes(self) -> int:
        return self.elements * self.itemsize


_active: list[tuple[list[Call], frozenset, str]] = []
_installed = False


def _ranks(pg) -> tuple[int, ...]:
    try:
        return tuple(dist.get_process_group_ranks(pg))
    except (ValueError, RuntimeError):
        return ()


def _first_tensor(obj):
    while isinstance(obj, (list, tuple)) and obj:
        obj = obj[0]
    return obj if isinstance(obj, torch.Tensor) else None


def _all_tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _all_tensors(o)]
    return []


def _reduce_name(args, kwargs) -> str | None:
    """'SUM', 'MAX', … from a call's options (``AllreduceOptions.reduceOp``) or a bare ReduceOp."""
    for a in list(args) + list(kwargs.values()):
        op = getattr(a, "reduceOp", a)
        op = getattr(op, "op", op)                               # a ReduceOp object wraps its RedOpType
        if isinstance(op, dist.ReduceOp.RedOpType):
            return str(op).split(".")[-1]
    return None


def _describe(method: str, args, kwargs) -> list[tuple]:
    """``[(op, peer, elements, itemsize, data, reduce)]`` for one process-group method call."""
    if method == "send":
        tensors, peer = args[0], args[1]
        return [("send", int(peer), t.numel(), t.element_size(), t.detach().clone(), None) for t in tensors]
    if method in ("recv", "recv_anysource"):
        tensors = args[0]
        peer = int(args[1]) if method == "recv" else None
        return [("recv", peer, t.numel(), t.element_size(), None, None) for t in tensors]
    reduce = _reduce_name(args[1:], kwargs)
    if method in ("allreduce", "allreduce_coalesced"):
        return [("all_reduce", None, t.numel(), t.element_size(), None, reduce or "SUM") for t in _all_tensors(args[0])]
    if method in ("allgather", "allgather_coalesced"):
        outs = _all_tensors(args[0])
        t = _first_tensor(args[1])
        return [("all_gather", None, sum(o.numel() for o in outs), t.element_size() if t is not None else 0,
                 None, None)]
    if method in ("_allgather_base", "all_gather_single", "all_gather_single_coalesced",
                  "allgather_into_tensor_coalesced"):
        outs = _all_tensors(args[0])
        return [("all_gather", None, sum(o.numel() for o in outs), outs[0].element_size() if outs else 0, None, None)]
    if method in ("reduce_scatter", "reduce_scatter_single", "_reduce_scatter_base",
                  "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced"):
        ins = _all_tensors(args[1])
        return [("reduce_scatter", None, sum(i.numel() for i in ins), ins[0].element_size() if ins else 0,
                 None, reduce or "SUM")]
    if method in ("alltoall", "alltoall_base", "all_to_all_single"):
        ins = _all_tensors(args[1])
        return [("all_to_all", None, sum(i.numel() for i in ins), ins[0].element_size() if ins else 0, None, None)]
    if method in ("broadcast", "reduce", "gather", "scatter"):
        t = _first_tensor(args[0]) if method in ("broadcast", "reduce") else (
            _first_tensor(args[1]) if len(args) > 1 and _first_tensor(args[1]) is not None else _first_tensor(args[0]))
        return [(method, None, t.numel() if t is not None else 0, t.element_size() if t is not None else 0,
                 None, reduce if method == "reduce" else None)]
    return []


#: The process-group methods that move data, wrapped by :func:`install`.
METHODS = ("send", "recv", "recv_anysource", "allreduce", "allreduce_coalesced", "allgather",
           "allgather_coalesced", "_allgather_base", "all_gather_single", "all_gather_single_coalesced",
           "allgather_into_tensor_coalesced", "reduce_scatter", "reduce_scatter_single", "_reduce_scatter_base",
           "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base",
           "all_to_all_single", "broadcast", "reduce", "gather", "scatter")

#: Friendly names of every operation a lab may forbid (the ``op`` of a :class:`Call`).
OPERATIONS = frozenset({"send", "recv", "all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                        "broadcast", "reduce", "gather", "scatter"})
COLLECTIVES = OPERATIONS - {"send", "recv"}


def _wrap(method: str):
    original = getattr(ProcessGroup, method)

    def wrapper(self, *args, **kwargs):
        if _active:
            described = _describe(method, args, kwargs)
            if described and self is dist.group.WORLD:
                raise Forbidden("this call used the default process group (every process of the job), not the "
                                "group it was given: pass group=group to every torch.distributed call")
            for _, forbid, why in _active:
                for op, *_ in described:
                    if op in forbid:
                        raise Forbidden(f"{op.replace('_', '-')} is not allowed here: {why}")
            group = _ranks(self)
            made = [Call(op, group, peer, elements, itemsize, data, reduce)
                    for op, peer, elements, itemsize, data, reduce in described]
            for calls, _, _ in _active:
                calls.extend(made)
        return original(self, *args, **kwargs)

    wrapper.__name__ = method
    wrapper.__wrapped__ = original
    return wrapper


def install() -> None:
    """Wrap the process group's data-moving methods (once per process)."""
    global _installed
    if _installed:
        return
    for method in METHODS:
        if hasattr(ProcessGroup, method):
            setattr(ProcessGroup, method, _wrap(method))
    _installed = True


@contextmanager
def watch(forbid: frozenset | set = frozenset(), why: str = ""):
    """Record every data-moving call in the block; raise :class:`Forbidden` on a forbidden one."""
    if not _installed:
        raise RuntimeError("call monitor.install() before watch()")
    bad = set(forbid) - OPERATIONS
    if bad:
        raise ValueError(f"unknown operations {sorted(bad)}; the operations are {sorted(OPERATIONS)}")
    calls: list[Call] = []
    _active.append((calls, frozenset(forbid), why))
    try:
        yield calls
    finally:
        _active.pop()
