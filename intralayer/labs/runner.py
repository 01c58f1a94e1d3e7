"""The rank side of a lab check: :func:`run_jobs` runs on each of four pool ranks.

Case by case, each rank makes the case's groups (:func:`layout`, each with a timeout) and runs the
part's check on its own under :func:`watch`, with the forbidden library modules stubbed out; then all
four meet on the world group. Each job's outcomes are reported at once (:func:`intralayer.ranks.report`),
so a rank that dies later still leaves them; after a failed case a rank leaves without teardown.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import sys
import types
import weakref

import cloudpickle
import torch
import torch.distributed as dist

from .. import distributed, ranks
from ..record import COLLECTIVES, OPERATIONS, Mode, Recorder  # noqa: F401  (the chapters' names for them)
from . import parts

WORLD, PRINTED_LINES = 4, 12       # ranks of a check; lines of what the learner's code printed, per rank and case


def layout(ranks: int, world: int = WORLD) -> list[list[int]]:
    """A case's groups of process numbers: 2 ranks on [1, 2] and [0, 3] at once, 3 on [1, 2, 3], 4 on all; in all
    but the last some group rank differs from its process number, so a visible case catches dist.get_rank()."""
    if not 1 <= ranks <= world:
        raise ValueError(f"a case needs 1 to {world} ranks, not {ranks}")
    if 2 * ranks == world:
        return [list(range(1, ranks + 1)), sorted({0, *range(ranks + 1, world)})]
    return [list(range(world - ranks, world))]


class Forbidden(RuntimeError):
    """The learner's code called an operation the lab does not allow."""


FLIGHT: dict = {"posted": 0, "pending": {}, "sending": {}}   # receives posted in the outermost watch; receives
                                                              # and sends not waited for yet
_watches: list = []
_waited: weakref.WeakValueDictionary = weakref.WeakValueDictionary()   # a dropped request is forgotten


class _Recorder(Recorder):
    copy_sends = True

    def admit(self, op, group):
        if group is dist.group.WORLD:
            raise Forbidden("this call used the default process group (every process of the job), not the "
                            "group it was given: pass group=group to every torch.distributed call")
        for _, forbid, why in _watches:
            if op in forbid:
                raise Forbidden(f"{op.replace('_', '-')} is not allowed here: {why}")

    def record(self, calls):
        for recorded, _, _ in _watches:
            recorded.extend(calls)

    def issued(self, op, out):
        if op in ("send", "recv") and not isinstance(out, (torch.Tensor, list)):   # a c10d Work: in flight until
            work = dist.Work.unbox(out)                                             # its wait()
            FLIGHT["posted"] += op == "recv"
            FLIGHT["pending" if op == "recv" else "sending"][id(work)] = work


@contextlib.contextmanager
def watch(forbid=frozenset(), why: str = ""):
    """The block's data-moving calls, as a list of :class:`intralayer.record.Call`; :class:`Forbidden` for a
    forbidden one or one on the default group. ``Work.wait`` is a method, not an operator: it is wrapped, so
    that a second wait on a request is named (gloo would wait for ever) and a waited send or receive leaves
    FLIGHT."""
    if bad := set(forbid) - OPERATIONS:
        raise ValueError(f"unknown operations {sorted(bad)}; the operations are {sorted(OPERATIONS)}")
    calls, outermost, wait = [], not _watches, vars(dist.Work)["wait"]
    _watches.append((calls, frozenset(forbid), why))

    def wait_once(self, *args, **kwargs):
        if id(self) in _waited:
            raise Forbidden("wait() was called a second time on the same request: a request is waited on "
                            "once (after its first wait it is done; keep the result, not the request)")
        _waited[id(self)] = self
        FLIGHT["pending"].pop(id(self), None), FLIGHT["sending"].pop(id(self), None)
        return wait(self, *args, **kwargs)
    if outermost:
        dist.Work.wait, mode = wait_once, _Recorder().__enter__()
    try:
        yield calls
    finally:
        if outermost:
            mode.__exit__(None, None, None)
            dist.Work.wait = wait
            _waited.clear()
            FLIGHT.update(posted=0, pending={}, sending={})
        _watches.pop()


class _Refused(type):
    """A forbidden function's or class's stand-in: calling it, or reading an attribute of it, raises."""

    def __call__(cls, *args, **kwargs):
        raise Forbidden(cls._refusal)

    def __getattr__(cls, attr):
        raise Forbidden(cls._refusal)


@contextlib.contextmanager
def _guard(modules: tuple[str, ...], why: str):
    """The public functions and classes of the forbidden modules replaced by stand-ins that raise."""
    saved = [(m, a, v) for name in modules for m in [importlib.import_module(name)] for a, v in list(vars(m).items())
             if not a.startswith("_") and isinstance(v, (types.FunctionType, type)) and v.__module__ == name]
    for module, attr, value in saved:
        setattr(module, attr, _Refused(attr, (), {"_refusal": f"{module.__name__}.{attr} is not allowed here: {why}"}))
    try:
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


@contextlib.contextmanager
def _group_less(files: set[str]):
    """Which of dist.get_rank() and get_world_size() the learner's code called without its group."""
    seen, originals = [], (dist.get_rank, dist.get_world_size)

    def wrap(original):
        def wrapper(group=None, *args, **kwargs):
            if (group is None or group is dist.group.WORLD) and sys._getframe(1).f_code.co_filename in files:
                seen.append(original.__name__)
            return original(group, *args, **kwargs)
        return wrapper
    dist.get_rank, dist.get_world_size = map(wrap, originals)
    try:
        yield seen
    finally:
        dist.get_rank, dist.get_world_size = originals


def _process_number(seen: list[str], group) -> str | None:
    members, n = dist.get_process_group_ranks(group), dist.get_world_size(group)
    moved = [f"process {p} is rank {j}" for j, p in enumerate(members) if p != j]
    said = ([f"dist.get_rank() without its group is the process number, not the rank in the group (in this group "
             f"of processes {members}, {', '.join(moved)})"] if "get_rank" in seen and moved else []) + \
        ([f"dist.get_world_size() without its group counts every process ({dist.get_world_size()}), not the "
          f"group's {n} ranks"] if "get_world_size" in seen and dist.get_world_size() != n else [])
    return ("it used the global rank (the process number) where the group rank is needed: " + "; ".join(said)
            + ". Use dist.get_rank(group) and dist.get_world_size(group)") if said else None


def _reworded(text: str, said: str | None, group) -> str | None:
    """A first line for an error that a peer computed from the process number causes (gloo's and torch's
    words name neither), or None."""
    members = dist.get_process_group_ranks(group)
    if m := re.search(r"ProcessGroupGloo::alltoall: (invalid tensor size[^\n]*)", text):
        return (f"gloo's list dist.all_to_all needs every tensor the same size ({m[1].strip()}): for uneven "
                "splits use dist.all_to_all_single with input_split_sizes and output_split_sizes")
    if m := re.search(r"Global rank (\d+) is not part of group", text):
        return (f"torch read peer {m[1]} as a process number (dst=, src= and a P2POp's peer are global ranks, even "
                f"with group=), and process {m[1]} is not in this group (processes {members}): name the peer by its "
                f"rank in the group with group_dst=, group_src= or group_peer=" + (f". Also, {said}" if said else ""))
    if m := re.search(r"Group rank (\d+) is not part of group", text):
        what = f"it named group rank {m[1]} as a peer, but the group has only ranks 0 to {len(members) - 1}"
    elif "Pair is not connected" in text:
        what = "a rank sent to or received from itself (gloo says 'Pair is not connected')"
    else:
        return said
    return f"{said}; so {what}" if said else \
        what + " — a peer computed from dist.get_rank() (the process number) instead of dist.get_rank(group)?"


def error_info(exc: BaseException, files: set[str]) -> dict:
    """An exception as the notebook side reports it: type, first line, the learner's frames only."""
    info, comm = ranks.error_info(exc), isinstance(exc, (RuntimeError, dist.DistError))
    return {"type": info["type"], "message": re.sub(r"^\[[^\]]*\]\s*", "", (info["message"].splitlines() or [""])[0])[:400],
            "frames": [f for f in info["frames"] if f[0] in files],
            "timed_out": comm and bool(re.search(r"timed out|timeout", info["message"], re.I)),
            "lost_peer": comm and bool(re.search(r"closed by peer|reset by peer|broken pipe", info["message"], re.I))}


def _run_case(part, ns, case, group, files) -> dict:
    """One case on this rank: the part's check, what the learner's code printed, refusals, in words."""
    printed, mine = io.StringIO(), tuple(dist.get_process_group_ranks(group))
    with _group_less(files) as seen:
        try:
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed), \
                    watch(part.forbid_ops, part.why) as calls:
                outcome = part.run(ns, case, group)
                unwaited = [f"{len(FLIGHT[k])} {w}{'s' * (len(FLIGHT[k]) > 1)}" for k, w in
                            (("sending", "send"), ("pending", "receive")) if FLIGHT[k]]
                for work in [*FLIGHT["sending"].values(), *FLIGHT["pending"].values()]:
                    with contextlib.suppress(Exception):      # finished here, not in the next case's group
                        work.wait()
            if unwaited and part.kind == "lab":           # (torch: modifying a tensor before its request completes
                outcome.setdefault("problems", []).append(  # causes undefined behavior)
                    f"it returned with {' and '.join(unwaited)} not waited for: call wait() on every request "
                    "before the tensors it moves are used or changed, and before returning")
            if (said := _process_number(seen, group)) and outcome.get("problems"):
                outcome["problems"].append(said)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:                  # the learner's code may raise anything, SystemExit too
            if words := _reworded(str(exc), _process_number(seen, group), group):
                exc.args = (words,)
            outcome, calls = {"error": error_info(exc, files)}, []
            if not (outcome["error"]["timed_out"] or outcome["error"]["lost_peer"]):
                with contextlib.suppress(Exception):  # leave the case's group (peers learn it at its timeout)
                    dist.destroy_process_group(group)
    if strays := sorted({c.group for c in calls if not set(c.group) <= set(mine)}):
        outcome.setdefault("problems", []).append(
            f"it communicated in a group of ranks {list(strays[0])}, not in the group it was given "
            f"(ranks {list(mine)}): pass group=group to every call")
    return {**outcome, "printed": printed.getvalue().splitlines()[:PRINTED_LINES]}


def run_jobs(jobs: list[dict], group_timeout: float) -> None:
    """On each pool rank: every job's cases, each job's outcomes reported as soon as they are known."""
    broken = False
    with distributed.setup(timeout_s=group_timeout + 20.0) as d:
        for job in jobs:
            part, files, cases, settled = parts.get(job["part"]), set(job["files"]), [], False
            with _guard(part.forbid_modules, part.why):
                try:
                    ns, load_error = types.SimpleNamespace(**cloudpickle.loads(job["payload"])), None
                except Exception as exc:
                    ns, load_error = None, error_info(exc, files)
                for case in job["cases"]:
                    if settled:        # the verdict is known: a hunt's test failed on the correct implementation
                        cases.append(None)
                        continue
                    groups = [(r, distributed.new_group(r, timeout_s=group_timeout)) for r in layout(case["ranks"])]
                    outcome = None
                    for members, group in groups:
                        if d.rank in members:
                            outcome = {"error": load_error} if load_error else _run_case(part, ns, case, group, files)
                            outcome.update(group=members, group_rank=members.index(d.rank))
                    failed = torch.tensor([1.0 if outcome and outcome.get("error") else
                                           0.5 if outcome and outcome.get("problems") else 0.0])
                    dist.all_reduce(failed, op=dist.ReduceOp.MAX)     # wait for every group; did any rank fail?
                    broken, failed = broken or failed.item() == 1.0, failed.item()
                    cases.append(outcome)
                    settled = (failed == 1.0 and part.kind == "hunt" and not part.implementations[case["impl"]].buggy
                               or failed > 0 and part.kind == "lab" and job.get("first_failure", False))
            ranks.report({"cases": cases})
        if broken:                 # a group may hold a send no one will receive: leave without teardown
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(0)
