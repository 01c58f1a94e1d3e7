"""The one recorder of communication: every c10d operator a rank issues, seen by the dispatcher.

Every ``torch.distributed`` call that moves data — ``send``, ``isend``, ``batch_isend_irecv``,
``all_reduce``, ``all_gather_into_tensor``, ``all_to_all_single``, … — reaches the dispatcher
as a ``c10d`` operator (``c10d::send``, ``c10d::allreduce_``, …). A :class:`Recorder`, a
:class:`~torch.utils._python_dispatch.TorchDispatchMode` (the mechanism of torch's own
``CommDebugMode``), sees each one before it runs and turns it into a :class:`Call`: the
operation, the group's global ranks, the peer, the size *S* as nccl-tests defines it, the
split sizes of an all-to-all, and (if asked) a copy of what a send carries.

Two users, one mechanism: :func:`intralayer.comm.accounting` (each of ``comm``'s collectives
runs under a recorder of its own, only while an accounting is open, so the matrix products
around it never pass through Python dispatch and chapter 07's timings stay the kernels'), and
the labs (:mod:`intralayer.labs.monitor`, a recorder around the learner's whole case, which
also refuses forbidden operations).

Measured on the pinned torch 2.13 with gloo: ``send``, ``recv_`` (also from ``irecv`` and
``batch_isend_irecv``), ``allreduce_``, ``allgather_``, ``_allgather_base_``,
``_reduce_scatter_base_``, ``alltoall_base_`` and ``broadcast_`` reach the mode on CPU
tensors (``barrier`` does too; it moves no data and is not recorded). What the dispatcher does
not see is a request's ``wait()`` (``Work.wait`` is a method, not an operator): the labs wrap it
(:mod:`intralayer.labs.monitor`), ``comm`` times its own waits. The process group arrives as a
script object; ``ProcessGroup.unbox`` turns it back into the Python group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass
class Call:
    """One operation as this rank issued it."""

    op: str                        # send, recv, all_reduce, all_gather, reduce_scatter, all_to_all, ...
    group: tuple[int, ...]         # the global ranks of the group, in group-rank order
    peer: int | None               # send/recv: the peer's rank in the group (None: any source)
    elements: int                  # S in elements (nccl-tests): the gathered size for all-gather
    itemsize: int
    data: torch.Tensor | None = None   # a send's payload, copied when it was issued (copy_sends)
    reduce: str | None = None          # the reduction of an all-reduce or reduce-scatter
    splits: tuple[int, ...] = ()       # an all-to-all's input split sizes (rows to each group rank; () = even)

    @property
    def bytes(self) -> int:
        return self.elements * self.itemsize


#: c10d operator → (the friendly name, the argument whose tensors give S, where the peer is).
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
#: Every operation's friendly name (the ``op`` of a :class:`Call`).
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
    """A dispatch mode that torch does not wrap for torch.compile: the course never compiles here, and
    the wrapper's first call imports ``torch._dynamo`` (measured: 1.9 s of CPU, in every rank of a
    lab's first check). The hook is torch's own (``_should_skip_dynamo``)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


class Recorder(Mode):
    """Inside ``with Recorder() as r:`` every data-moving c10d call is appended to ``r.calls``.

    Subclasses may refuse a call before it is sent (:meth:`admit`), or note what it returned
    (:meth:`issued`); ``copy_sends`` keeps a copy of every send's payload.
    """

    copy_sends = False

    def __init__(self):
        super().__init__()
        self.calls: list[Call] = []

    def admit(self, op: str, group) -> None:
        """Called before the operation runs; raise to refuse it."""

    def issued(self, op: str, out) -> None:
        """Called with what the operator returned."""

    def record(self, calls: list[Call]) -> None:
        self.calls.extend(calls)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        spec = _OPS.get(func._opname) if func.namespace == "c10d" else None
        if spec is None:
            return func(*args, **kwargs)
        op, sized, peer_arg = spec
        named = {a.name: v for a, v in zip(func._schema.arguments, args)}
        named.update(kwargs)
        group = dist.ProcessGroup.unbox(named["process_group"])
        self.admit(op, group)
        tensors = _tensors(named[sized])
        members = tuple(dist.get_process_group_ranks(group))
        calls = [Call(op, members, None if peer_arg is None else int(named[peer_arg]), t.numel(), t.element_size(),
                      t.detach().clone() if op == "send" and self.copy_sends else None,
                      _reduction(named.get("reduce_op")), tuple(named.get("input_split_sizes") or ()))
                 for t in (tensors if op in ("send", "recv") else tensors[:1])]
        if calls and op not in ("send", "recv"):                # one call: S is the whole operand
            calls[0].elements = sum(t.numel() for t in tensors)
            if op in ("all_reduce", "reduce_scatter") and calls[0].reduce is None:
                calls[0].reduce = "SUM"
        self.record(calls)
        out = func(*args, **kwargs)
        self.issued(op, out)
        return out
