"""The one recorder of communication: every c10d operator a rank issues, seen by the dispatcher.

Each ``torch.distributed`` call that moves data (``send``, ``batch_isend_irecv``, ``all_reduce``,
``all_to_all_single``, …) reaches the dispatcher as a ``c10d`` operator. A :class:`Recorder`, a
``TorchDispatchMode`` (the mechanism of torch's own ``CommDebugMode``), turns each into a
:class:`Call`; :mod:`intralayer.comm`'s accounting and the labs' :func:`~intralayer.labs.runner.watch`
use it. Measured on the pinned torch 2.13 with gloo: ``send``, ``recv_`` (also from ``irecv`` and
``batch_isend_irecv``), ``allreduce_``, ``allgather_``, ``_allgather_base_``, ``_reduce_scatter_base_``,
``alltoall_base_`` and ``broadcast_`` reach the mode on CPU tensors. A request's ``wait()`` does not
(a method of ``Work``, not an operator): the labs wrap it, ``comm`` times its own waits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass
class Call:
    """One operation as this rank issued it."""

    op: str                        # send, recv, all_reduce, all_gather, reduce_scatter, all_to_all, ...
    group: tuple[int, ...]         # the global ranks of the group, in group-rank order
    peer: int | None               # send/recv: the peer's rank in the group (None: any source)
    elements: int                  # S in elements (nccl-tests): the gathered size for all-gather
    itemsize: int
    data: torch.Tensor | None = None   # a send's payload, copied when issued (copy_sends)
    reduce: str | None = None          # the reduction of an all-reduce or reduce-scatter
    splits: tuple[int, ...] = ()       # an all-to-all's input split sizes (() = even)

    @property
    def bytes(self) -> int:
        return self.elements * self.itemsize


_T, _O, _I = "tensors", "output_tensors", "input_tensors"
#: c10d operator → (the friendly name, the argument whose tensors give S, the peer's argument).
_OPS = {"send": ("send", _T, "dst"), "recv_": ("recv", _T, "src"), "recv_any_source_": ("recv", _T, None),
        "allreduce_": ("all_reduce", _T, None), "allreduce_coalesced_": ("all_reduce", _T, None),
        "allgather_": ("all_gather", _O, None), "_allgather_base_": ("all_gather", "output_tensor", None),
        "allgather_coalesced_": ("all_gather", "output_lists", None),
        "allgather_into_tensor_coalesced_": ("all_gather", "outputs", None),
        "reduce_scatter_": ("reduce_scatter", _I, None), "_reduce_scatter_base_": ("reduce_scatter", "input_tensor", None),
        "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs", None),
        "alltoall_": ("all_to_all", _I, None), "alltoall_base_": ("all_to_all", "input", None),
        "broadcast_": ("broadcast", _T, None), "reduce_": ("reduce", _T, None),
        "gather_": ("gather", _I, None), "scatter_": ("scatter", _O, None)}
#: torch's functional collectives (``torch.distributed._functional_collectives``, which DTensor uses) reach the
#: dispatcher as ``_c10d_functional`` operators, with no ``c10d`` one beneath them (measured on torch 2.13);
#: their peers are global ranks. batch_p2p_ops names each tensor's operation in its op_list.
_FUNCTIONAL = {**{name: (op, "input", None) for name, op in (
    ("all_gather_into_tensor", "all_gather"), ("all_gather_into_tensor_out", "all_gather"), ("all_reduce", "all_reduce"),
    ("all_reduce_", "all_reduce"), ("reduce_scatter_tensor", "reduce_scatter"), ("reduce_scatter_tensor_out",
    "reduce_scatter"), ("all_to_all_single", "all_to_all"), ("broadcast", "broadcast"), ("broadcast_", "broadcast"))},
    "all_gather_into_tensor_coalesced": ("all_gather", "inputs", None), "all_reduce_coalesced": ("all_reduce", "inputs", None),
    "all_reduce_coalesced_": ("all_reduce", "inputs", None), "reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs", None),
    "isend": ("send", "tensor", "dst"), "irecv": ("recv", "tensor", "src"), "batch_p2p_ops": (None, "tensors", "peer_list")}
_TABLES = {"c10d": _OPS, "_c10d_functional": _FUNCTIONAL}
OPERATIONS = frozenset(op for op, _, _ in _OPS.values())
COLLECTIVES = OPERATIONS - {"send", "recv"}


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    return [t for o in obj for t in _tensors(o)] if isinstance(obj, (list, tuple)) else []


class Mode(TorchDispatchMode):
    """A dispatch mode torch does not wrap for torch.compile (its wrapper's first call imports
    ``torch._dynamo``: 1.9 s of CPU per rank, measured); the hook is torch's own."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


class Recorder(Mode):
    """Inside ``with Recorder() as r:`` every data-moving c10d call is appended to ``r.calls``. A subclass
    may refuse a call before it runs (``admit``), see what it returned (``issued``), or keep the calls elsewhere."""

    copy_sends = False

    def __init__(self):
        super().__init__()
        self.calls: list[Call] = []

    def admit(self, op: str, group) -> None:
        pass

    def issued(self, op: str, out) -> None:
        pass

    def record(self, calls: list[Call]) -> None:
        self.calls.extend(calls)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        spec = _TABLES.get(func.namespace, {}).get(func._opname)
        if spec is None:
            return func(*args, **kwargs)
        (op, sized, peer), functional = spec, func.namespace != "c10d"
        named = {**{a.name: v for a, v in zip(func._schema.arguments, args)}, **kwargs}
        if functional:                                      # a group's name (or, in some overloads, the group)
            group = named["group_name"]
            group = group if isinstance(group, dist.ProcessGroup) else c10d._resolve_process_group(group)
        else:
            group = dist.ProcessGroup.unbox(named["process_group"])
        tensors, members = _tensors(named[sized]), tuple(dist.get_process_group_ranks(group))
        ops = [("send" if o == "isend" else "recv") for o in named["op_list"]] if op is None else [op] * len(tensors)
        peers = named[peer] if op is None else [named[peer]] * len(tensors) if peer else [None] * len(tensors)
        for o in dict.fromkeys(ops):
            self.admit(o, group)
        reduce = named.get("reduce_op")
        reduce = reduce.upper() if isinstance(reduce, str) else dist.ReduceOp.RedOpType(reduce.op()).name \
            if reduce is not None else ("SUM" if op in ("all_reduce", "reduce_scatter") else None)
        calls = [Call(o, members, None if p is None else dist.get_group_rank(group, p) if functional else int(p),
                      t.numel(), t.element_size(), t.detach().clone() if o == "send" and self.copy_sends else None,
                      reduce, tuple(named.get("input_split_sizes") or ()))
                 for o, p, t in zip(ops, peers, tensors) if o in ("send", "recv") or t is tensors[0]]
        if calls and calls[0].op not in ("send", "recv"):      # one call: S is the whole operand (gathered)
            calls[0].elements = sum(t.numel() for t in tensors) * (named.get("group_size", 1) if op == "all_gather" else 1)
        self.record(calls)
        out = func(*args, **kwargs)
        self.issued(ops[0] if ops else op, out)
        return out
