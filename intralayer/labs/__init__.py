"""Labs and bug hunts: the learner's ``torch.distributed`` code, checked on real ranks.

A check cell collects its cases, then runs them together in one start of four pool ranks::

    check = labs.Check("ring_all_reduce", ring_all_reduce)
    check.on(ranks=2)                 # the pairs of processes [1, 2] and [0, 3]
    check.on(ranks=4)
    check.run()                       # raises LabFailure, in words, or prints what it measured

The learner's objects travel by value (:mod:`.transport`) to ranks of :mod:`intralayer.ranks`;
the rank side is :mod:`.runner`, the verdict in words :mod:`.check`, the parts of every chapter
are registered by ``chNN`` (:mod:`.parts`). How to add a lab: book/instructors.md.
"""
from .check import Check, LabFailure, Report, progress, run_many, show
from .parts import every, get

every()          # every chapter's parts, registered at once: a rank finds them all already imported

__all__ = ["Check", "LabFailure", "Report", "every", "get", "progress", "run_many", "show"]
