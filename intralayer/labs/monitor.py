"""What the learner's code sends, seen from inside a rank: every collective and point-to-point call.

Every ``torch.distributed`` call that moves data — ``send``, ``isend``,
``batch_isend_irecv``, ``all_reduce``, ``all_gather_into_tensor``, ``all_to_all_single``, …,
and :mod:`intralayer.comm`, which calls them — reaches the dispatcher as a ``c10d`` operator
(``c10d::send``, ``c10d::allreduce_``, …). Inside ``with watch() as calls:`` a
:class:`~torch.utils._python_dispatch.TorchDispatchMode` (the mechanism of torch's own
``CommDebugMode``) sees each one before it runs and appends a :class:`Call`: the operation,
the group's ranks, the peer, the size, and a copy of what a send carries. A call of an
operation the lab forbids raises :class:`Forbidden` before anything is sent.

Measured on the pinned torch 2.13 with gloo: all of ``send``, ``recv`` (``recv_``, also from
``irecv`` and ``batch_isend_irecv``), ``allreduce_``, ``allgather_``, ``_allgather_base_``,
``_reduce_scatter_base_``, ``alltoall_base_`` and ``broadcast_`` reach the mode on CPU
tensors (so does ``barrier``, which moves no data and is neither recorded nor refused). What the dispatcher does not see is a request's ``wait()`` (``Work.wait`` is a
method, not an operator): :func:`watch` wraps it, to tell a second wait on the same request
apart from a deadlock, and to keep :data:`FLIGHT`, the receives posted and not yet waited for
(chapter 07's lab reads it at each matrix product). The process group arrives as a script object; ``ProcessGroup.unbox``
turns it back into the Python group (the same object the learner passed).
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


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


#: c10d operator → (the lab's name for it, the argument whose tensors give S, where the peer is).
_OPS = {
    "send": ("send", "tensors", "dst"), "recv_": ("recv", "tensors", "src"), "recv_any_source_": ("recv", "tensors", None),
    "allreduce_": ("all_reduce", "tensors", None), "allreduce_coalesced_": ("all_reduce", "tensors", None),
    "allgather_": ("all_gather", "output_tensors", None), "_allgather_base_": ("all_gather", "output_tensor", None),
    "allgather_coalesced_": ("all_gather", "output_lists", None),
    "allgather_into_tensor_coalesced_": ("all_gather", "outputs", None),
    "reduce_scatter_": ("reduce_scatter", "input_tensors", None),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor", None),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs", None),
    "alltoall_": ("all_to_all", "input_tensors", None), "alltoall_base_": ("all_to_all", "input", None),
    "broadcast_": ("broadcast", "tensors", None), "reduce_": ("reduce", "tensors", None),
    "gather_": ("gather", "input_tensors", None), "scatter_": ("scatter", "output_tensors", None),
}
#: Friendly names of every operation a lab may forbid (the ``op`` of a :class:`Call`).
OPERATIONS = frozenset(op for op, _, _ in _OPS.values())
COLLECTIVES = OPERATIONS - {"send", "recv"}


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    return [t for o in obj for t in _tensors(o)] if isinstance(obj, (list, tuple)) else []


def _reduction(op) -> str | None:
    """'SUM', 'AVG', … of a ReduceOp script object."""
    return None if op is None else dist.ReduceOp.RedOpType(op.op()).name      # its one method: the enum's value


class Mode(TorchDispatchMode):
    """A dispatch mode that torch does not wrap for torch.compile: the labs never compile, and the
    wrapper's first call imports ``torch._dynamo`` (measured: 1.9 s of CPU, in every rank of the first
    check, or in the pool's fork server). The hook is torch's own (``_should_skip_dynamo``)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


class _Recorder(Mode):
    def __init__(self, watches: list):
        super().__init__()
        self.watches = watches

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d" and func._opname in _OPS:
            op, sized, peer_arg = _OPS[func._opname]
            named = {a.name: v for a, v in zip(func._schema.arguments, args)}
            named.update(kwargs)
            group = dist.ProcessGroup.unbox(named["process_group"])
            if group is dist.group.WORLD:
                raise Forbidden("this call used the default process group (every process of the job), not the "
                                "group it was given: pass group=group to every torch.distributed call")
            for _, forbid, why in self.watches:
                if op in forbid:
                    raise Forbidden(f"{op.replace('_', '-')} is not allowed here: {why}")
            tensors = _tensors(named[sized])
            calls = [Call(op, tuple(dist.get_process_group_ranks(group)),
                          None if peer_arg is None else int(named[peer_arg]), t.numel(), t.element_size(),
                          t.detach().clone() if op == "send" else None, _reduction(named.get("reduce_op")))
                     for t in (tensors if op in ("send", "recv") else tensors[:1])]
            if calls and op not in ("send", "recv"):                # one call: S is the whole operand
                calls[0].elements = sum(t.numel() for t in tensors)
                if op in ("all_reduce", "reduce_scatter") and calls[0].reduce is None:
                    calls[0].reduce = "SUM"
            for recorded, _, _ in self.watches:
                recorded.extend(calls)
            out = func(*args, **kwargs)
            if op == "recv":                           # posted now, in flight until its wait()
                work = dist.Work.unbox(out)            # the object the learner's irecv returns
                FLIGHT["posted"] += 1
                FLIGHT["pending"][id(work)] = work
            return out
        return func(*args, **kwargs)


_watches: list[tuple[list[Call], frozenset, str]] = []
#: Receives posted inside the outermost watch, and those not yet waited for (chapter 07's schedule).
FLIGHT: dict = {"posted": 0, "pending": {}}
#: The requests waited on, weakly: a request the learner still holds is found there by its id, and one it
#: dropped is gone (a request holds its tensors: keeping it would keep every block a ring received).
_waited: weakref.WeakValueDictionary = weakref.WeakValueDictionary()



def _wait_once(wait):
    def checked(self, *args, **kwargs):
        if _watches:
            if id(self) in _waited:
                raise Forbidden("wait() was called a second time on the same request: a request is waited on "
                                "once (after its first wait it is done; keep the result, not the request)")
            _waited[id(self)] = self
            FLIGHT["pending"].pop(id(self), None)
        return wait(self, *args, **kwargs)
    return checked


@contextmanager
def watch(forbid: frozenset | set = frozenset(), why: str = ""):
    """Record every data-moving call in the block; raise :class:`Forbidden` on a forbidden one."""
    bad = set(forbid) - OPERATIONS
    if bad:
        raise ValueError(f"unknown operations {sorted(bad)}; the operations are {sorted(OPERATIONS)}")
    calls: list[Call] = []
    outermost = not _watches
    _watches.append((calls, frozenset(forbid), why))
    if outermost:
        wait = vars(dist.Work)["wait"]           # the descriptor itself: restored as it was
        dist.Work.wait = _wait_once(wait)
        mode = _Recorder(_watches)
        mode.__enter__()
    try:
        yield calls
    finally:
        if outermost:
            mode.__exit__(None, None, None)
            dist.Work.wait = wait
            _waited.clear()
            FLIGHT.update(posted=0, pending={})
        _watches.pop()
