"""The rank side of a lab check: :func:`run_jobs` runs on each of four pool ranks.

:class:`intralayer.labs.Check` hands :func:`intralayer.ranks.run` this function with the
jobs (which part, the learner's objects pickled by :mod:`.transport`, the cases). Each
rank joins one gloo group of all four, then, job by job and case by case, makes the case's
groups (:func:`layout`) and runs the part's rank-side check on its group, with what the lab
forbids refused (:mod:`.monitor`, and stand-ins for the library's answer) and what the
learner's code prints captured. After each job it reports its outcomes at once
(:func:`intralayer.ranks.report`), so a rank that dies later still leaves them.

Safety: every case's group has a timeout (``group_timeout``: a send that no one receives
fails in seconds); after each case all ranks meet on the world group, so a rank stuck in a
communication call of its case holds the others only until that timeout (one stuck in an
endless loop, until the world group's timeout or the check's deadline). A rank whose case
raised closes its side of the case's group at once, so that its peers stop waiting. After a
job in which any rank of a case failed, each rank leaves without tearing its groups down
(``os._exit``), once its results are reported; the pool stops what is left at its deadline.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import sys
import types

import cloudpickle
import torch
import torch.distributed as dist

from .. import distributed, ranks
from . import monitor, parts

WORLD = 4
#: Lines of what the learner's code printed, kept per rank and case.
PRINTED_LINES = 12


def layout(ranks: int, world: int = WORLD) -> list[list[int]]:
    """The groups a case of ``ranks`` ranks runs on, each as sorted process numbers.

    Two ranks run on the pairs [1, 2] and [0, 3] at once, three on [1, 2, 3], four on all:
    in every case but the last, some group rank differs from its process number, so code
    that uses ``dist.get_rank()`` (the process number) where it needs ``dist.get_rank(group)``
    fails in the visible cases too.
    """
    if not 1 <= ranks <= world:
        raise ValueError(f"a case needs 1 to {world} ranks, not {ranks}")
    if ranks == world:
        return [list(range(world))]
    if 2 * ranks == world:
        return [list(range(1, ranks + 1)), sorted({0, *range(ranks + 1, world)})]
    return [list(range(world - ranks, world))]


def error_info(exc: BaseException, files: set[str]) -> dict:
    """An exception as the notebook side reports it: type, first line, the learner's frames."""
    info = ranks.error_info(exc)
    text = info["message"]
    first = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0]) if text else ""
    comm = isinstance(exc, (RuntimeError, dist.DistError))
    return {"type": info["type"], "message": first[:400], "frames": [f for f in info["frames"] if f[0] in files],
            "timed_out": comm and bool(re.search(r"timed out|timeout", text, re.I)),
            "lost_peer": comm and bool(re.search(r"closed by peer|reset by peer|broken pipe", text, re.I))}


class _Refused(type):
    """The type of a stand-in class: calling it, or reading any attribute it lacks, raises."""

    def __call__(cls, *args, **kwargs):
        raise monitor.Forbidden(cls._refusal)

    def __getattr__(cls, attr):
        raise monitor.Forbidden(cls._refusal)


def _stub(qualified: str, why: str, original):
    """A stand-in for a forbidden function or class that raises :class:`monitor.Forbidden` when used."""
    refusal = f"{qualified} is not allowed here: {why}"
    if isinstance(original, type):
        return _Refused(original.__name__, (), {"_refusal": refusal, "__module__": original.__module__})

    def stub(*args, **kwargs):
        raise monitor.Forbidden(refusal)
    stub.__name__ = original.__name__
    return stub


@contextlib.contextmanager
def _guard(modules: tuple[str, ...], why: str):
    """The public functions and classes of the forbidden modules replaced by stubs that raise."""
    saved = []
    for name in modules:
        module = importlib.import_module(name)
        for attr, value in list(vars(module).items()):
            if not attr.startswith("_") and isinstance(value, (types.FunctionType, type)) \
                    and getattr(value, "__module__", None) == name:
                saved.append((module, attr, value))
                setattr(module, attr, _stub(f"{name}.{attr}", why, value))
    try:
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


def _run_case(part, ns, case, group, files) -> dict:
    """One case on this rank: the part's check, what the learner's code printed, refusals."""
    printed = io.StringIO()
    mine = tuple(dist.get_process_group_ranks(group))
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed), \
                monitor.watch(part.forbid_ops, part.why) as calls:
            outcome = part.run(ns, case, group)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:                      # the learner's code may raise anything, SystemExit too
        outcome, calls = {"error": error_info(exc, files)}, []
        if not (outcome["error"]["timed_out"] or outcome["error"]["lost_peer"]):
            # Leave the case's group. (Measured on 2.13: this does not close gloo's connections while the
            # group object lives — the failed frames hold it — so a peer still waiting for this rank in a
            # send or a collective learns it at the group's timeout. Freeing the group to close them at
            # once broke the next cases' groups: the job's world group lost its peers.)
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)
    strays = sorted({c.group for c in calls if not set(c.group) <= set(mine)})     # sub-groups of it are fine
    if strays:
        outcome.setdefault("problems", []).append(
            f"it communicated in a group of ranks {list(strays[0])}, not in the group it was given "
            f"(ranks {list(mine)}): pass group=group to every call")
    outcome["printed"] = printed.getvalue().splitlines()[:PRINTED_LINES]
    return outcome


def run_job(job: dict, d: distributed.Dist, group_timeout: float) -> tuple[dict, bool]:
    """This rank's outcome of every case of one job, and whether a group timed out (or failed)."""
    part = parts.get(job["part"])
    files = set(job["files"])
    parts.LEARNER_FILES.clear()
    parts.LEARNER_FILES.update(files)
    with _guard(part.forbid_modules, part.why):
        try:
            ns, load_error = types.SimpleNamespace(**cloudpickle.loads(job["payload"])), None
        except Exception as exc:
            ns, load_error = None, error_info(exc, files)
        cases, broken, verdict_known = [], False, False
        for case in job["cases"]:
            if verdict_known:          # every rank knows it (the all-reduce below): no groups, no waits
                cases.append(None)
                continue
            groups = [(r, distributed.new_group(r, timeout_s=group_timeout)) for r in layout(case["ranks"], d.world_size)]
            mine = [(r, g) for r, g in groups if d.rank in r]
            outcome = None
            if mine:
                members, group = mine[0]
                outcome = {"error": load_error} if load_error else _run_case(part, ns, case, group, files)
                outcome.update(group=members, group_rank=members.index(d.rank))
            failed = torch.tensor([1.0 if outcome and outcome.get("error") else 0.0])
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)     # wait for every group; did any rank fail?
            broken = broken or bool(failed.item())
            cases.append(outcome)
            # A test that fails on a correct implementation has its verdict: the buggy cases after it
            # would each wait out the group timeout for nothing (a failed rank leaves its peers waiting).
            verdict_known = bool(failed.item()) and part.kind == "hunt" and \
                not part.implementations[case["impl"]].buggy
    return {"cases": cases}, broken


def run_jobs(jobs: list[dict], group_timeout: float) -> None:
    """On each pool rank: every job's cases; each job's outcomes reported as soon as they are known."""
    broken = False
    with distributed.setup(timeout_s=group_timeout + 20.0) as d:
        for job in jobs:
            result, failed = run_job(job, d, group_timeout)
            ranks.report(result)
            broken = broken or failed
        if broken:                 # a group may hold a send that no one will receive: leave without teardown
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
