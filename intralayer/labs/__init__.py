"""Labs and bug hunts: the learner's ``torch.distributed`` code, checked on real ranks.

A lab notebook (``solutions/labs/NN_name.ipynb``, given to learners as
``exercises/labs/NN_name.ipynb``) asks for distributed code — a ring all-reduce from
send and recv, Megatron's f and g, a tensor-parallel MLP — and checks it on 2, 3 and 4
gloo ranks against the dense result, forward and backward, counting every message and
collective its code issues. A bug hunt gives the learner an implementation with a bug a
real system shipped; the learner writes a test, which is run against the buggy and the
correct implementation on real ranks: it must fail on the first and pass on the second.

The check cell of a lab part::

    check = labs.Check("ring_all_reduce", ring_all_reduce)
    check.on(ranks=2)
    check.on(ranks=4)
    ### BEGIN HIDDEN TESTS
    check.on(ranks=3, chunk=5, dtype="float64", seed=3)
    ### END HIDDEN TESTS
    check.run()

The cases are collected first and run together, in one start of the ranks, when ``run()``
is called, so the hidden cases nbgrader adds cost no extra start (a whole check takes
well under a second once the pool's fork server is up; its first start, which imports
torch once, about 2 s here). It works the same under ``make lab``, nbval and ``nbgrader
autograde``: the learner's functions and classes travel by value, pickled with cloudpickle
(:mod:`.transport`), to four ranks of the pool (:mod:`intralayer.ranks`; the rank-side code
is :mod:`.runner`), and what they find comes back in words (:mod:`.check`), as a
:class:`LabFailure` (an ``AssertionError``, so that it reads as a failed check; nbgrader
scores any error in a graded cell as zero) or, for a check that passes, one printed line
per case with what was measured, and under either what the learner's code printed.

The parts are registered by the chapter modules ``chNN`` of this package (:mod:`.parts`
explains how); the rank-side recording of every send and collective is :mod:`.monitor`.

How to add a chapter's lab: book/instructors.md, "Writing the lab of a new chapter".
"""
from .check import Check, LabFailure, Report, progress, run_many, show
from .parts import every, get

every()          # every chapter's parts, registered at once: a rank finds them all already imported

__all__ = ["Check", "LabFailure", "Report", "every", "get", "progress", "run_many", "show"]
