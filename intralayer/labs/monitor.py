"""What the learner's code sends, seen from inside a rank: the labs' rules on :mod:`intralayer.record`.

Inside ``with watch() as calls:`` the course's one recorder of communication
(:class:`intralayer.record.Recorder`, a ``TorchDispatchMode`` over the c10d operators) appends
a :class:`~intralayer.record.Call` for every collective and point-to-point call, with a copy of
what each send carries. A call of an operation the lab forbids, or one on the default group
instead of the group the case gave, raises :class:`Forbidden` before anything is sent.

What the dispatcher does not see is a request's ``wait()`` (``Work.wait`` is a method, not an
operator): :func:`watch` wraps it, to tell a second wait on the same request apart from a
deadlock, and to keep :data:`FLIGHT`, the receives posted and not yet waited for (chapter 07's
lab reads it at each matrix product).
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch.distributed as dist

from ..record import COLLECTIVES, OPERATIONS, Call, Mode, Recorder  # noqa: F401 (the labs' names for them)


class Forbidden(RuntimeError):
    """The learner's code called an operation the lab does not allow."""


class _Recorder(Recorder):
    copy_sends = True

    def __init__(self, watches: list):
        super().__init__()
        self.watches = watches

    def admit(self, op, group):
        if group is dist.group.WORLD:
            raise Forbidden("this call used the default process group (every process of the job), not the "
                            "group it was given: pass group=group to every torch.distributed call")
        for _, forbid, why in self.watches:
            if op in forbid:
                raise Forbidden(f"{op.replace('_', '-')} is not allowed here: {why}")

    def record(self, calls):
        for recorded, _, _ in self.watches:
            recorded.extend(calls)

    def issued(self, op, out):
        if op == "recv":                               # posted now, in flight until its wait()
            work = dist.Work.unbox(out)                # the object the learner's irecv returns
            FLIGHT["posted"] += 1
            FLIGHT["pending"][id(work)] = work


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
