"""The notebook side of a lab check: hand the learner's code to the ranks, say what they found.

:meth:`Check.run` packs the learner's objects (:mod:`.transport`), refuses at once code that
still raises ``NotImplementedError`` or uses what the lab forbids, runs :func:`.runner.run_jobs`
on four ranks of the pool (:mod:`intralayer.ranks`) and turns what each rank found into
sentences, with what the learner's code printed below them. :func:`run_many` runs several
checks in one start (the headless checker and the tests of wrong answers use it).
"""
from __future__ import annotations

import inspect
import re
import types
from dataclasses import dataclass, field

from .. import ranks
from . import parts, runner, transport

GROUP_TIMEOUT_S = 10.0     # seconds a case's group waits for a peer before its collective fails
DEADLINE_S = 60.0          # seconds a whole check may take before its processes are stopped
MAX_LINES = 8              # sentences of a failure shown
MAX_PRINTED = 24           # lines of what the learner's code printed, shown under the verdict


class LabFailure(AssertionError):
    """The learner's code ran but is not right, or could not run: the message says why, in words."""


@dataclass
class Report:
    """What a passing check measured: one line per case."""

    part: str
    lines: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return "\n".join(self.lines)


class Check:
    """One graded check: a lab part or bug hunt, the learner's objects, and the cases to run."""

    def __init__(self, part: str, *objects):
        self.part, self.cases, self._package = parts.get(part), [], None
        if len(objects) != len(self.part.objects):
            raise ValueError(f"{self.part.name} checks {len(self.part.objects)} object(s), "
                             f"{', '.join(self.part.objects)}; got {len(objects)}")
        self.objects = dict(zip(self.part.objects, objects))

    def on(self, ranks: int, **params) -> "Check":
        """Add a case: a group of ``ranks`` ranks (2, 3 or 4) and the part's parameters. A bug hunt's
        ``impl`` names the implementation(s) to run the test against; by default every one the graders use."""
        impls = params.pop("impl", None)
        if self.part.kind != "hunt" or isinstance(impls, str):
            impls = [impls]
        elif impls is None:
            impls = list(self.part.implementations)
        for impl in impls:
            self.cases.append(self.part.case(ranks, params if impl is None else {**params, "impl": impl}))
        return self

    @classmethod
    def prepared(cls, part: str, package: transport.Package, cases: list[dict]) -> "Check":
        """A check of objects another process packed (the headless checker): none of them is unpickled here."""
        check = cls.__new__(cls)
        check.part, check.objects, check.cases, check._package = parts.get(part), {}, list(cases), package
        return check

    def prepare(self) -> transport.Package:
        """The packed objects; ``NotImplementedError`` for a blank exercise, :class:`LabFailure` for code
        that cannot travel to the ranks."""
        if not self.cases:
            raise ValueError(f"{self.part.name}: add at least one case with .on(ranks=...) before run()")
        if self._package is not None:
            return self._package
        try:
            package = transport.pack(self.objects, self.part.forbid_modules, self.part.why)
        except transport.SourceError as exc:
            raise LabFailure(str(exc)) from None
        if blank := package.blank:
            raise NotImplementedError(f"{', '.join(blank)} {'is' if len(blank) == 1 else 'are'} not written yet: "
                                      "replace the `raise NotImplementedError()` in the cell above with your code, "
                                      "run that cell, then this one")
        return package

    def run(self, deadline: float = DEADLINE_S) -> None:
        """Run the check; print one line per case when it passes, raise :class:`LabFailure` when not."""
        result = run_many([self], deadline)[0]
        PROGRESS[self.part.name] = isinstance(result, Report)
        if not isinstance(result, Report):
            raise result
        print(result)


PROGRESS: dict[str, bool] = {}     # every part checked in this kernel: True once its last run passed


def progress(chapter: str) -> None:
    """Print, for every part of lab ``chapter`` ('04'), whether its check passed in this kernel."""
    mine = [p for p in parts.every() if p.chapter == chapter]
    if not mine:
        raise ValueError(f"there is no lab {chapter!r}; the labs are {sorted({p.chapter for p in parts.every()})}")
    print(f"Lab {chapter}: {sum(PROGRESS.get(p.name, False) for p in mine)} of {len(mine)} parts pass")
    for p in mine:
        print(f"- {p.name} ({p.kind}): {({True: 'passes', False: 'fails'}).get(PROGRESS.get(p.name), 'not run yet')}")


def run_many(checks: list[Check], deadline: float = DEADLINE_S, group_timeout: float = GROUP_TIMEOUT_S,
             first_failure: bool = False) -> list:
    """Several checks in one start of the ranks; for each, its :class:`Report` or the exception its
    :meth:`Check.run` would raise (a check that fails before starting starts nothing). ``first_failure``: a lab
    check runs no case after its first failing one (the tests of wrong answers; a learner sees every case)."""
    ranks.seconds("deadline", deadline)
    ranks.seconds("group_timeout", group_timeout)
    if group_timeout >= deadline:
        raise ValueError(f"group_timeout={group_timeout} must be shorter than deadline={deadline}: a deadlock "
                         "should be reported before the whole check is stopped")
    results = []
    for check in checks:
        try:
            results.append(check.prepare())
        except (NotImplementedError, LabFailure, ValueError) as exc:
            results.append(exc)
    if ready := [i for i, r in enumerate(results) if isinstance(r, transport.Package)]:
        jobs = [{"part": checks[i].part.name, "payload": results[i].payload, "cases": checks[i].cases,
                 "files": results[i].files, "first_failure": first_failure} for i in ready]
        outcomes = ranks.run(runner.run_jobs, runner.WORLD, (jobs, group_timeout), deadline=deadline)
        for job, i in enumerate(ready):
            results[i] = _Verdict(checks[i], results[i], job, outcomes, deadline).result()
    return results


def _who(found: dict) -> str:
    group, rank = found["group"], found["group_rank"]
    return f"rank {rank}" if group == list(range(len(group))) else f"group rank {rank} (process {group[rank]})"


def _grouped(pairs: list[tuple[str, str]], everyone: int, sep: str = " ") -> list[str]:
    """``(who, sentence)`` pairs joined by sentence: 'every rank …', 'rank 0 (and 1 other) …'."""
    seen: dict[str, list[str]] = {}
    for who, sentence in pairs:
        seen.setdefault(sentence, []).append(who)
    others = {1: "", 2: " (and 1 other)"}
    return [f"every rank{sep}{s}" if len(w) == everyone > 1 else
            f"{w[0]}{others.get(len(w), f' (and {len(w) - 1} others)')}{sep}{s}" for s, w in seen.items()]


class _Verdict:
    """What the ranks found for one check's job, in words."""

    def __init__(self, check, package, job, outcomes, deadline):
        self.check, self.part, self.package, self.job, self.outcomes, self.deadline = \
            check, check.part, package, job, outcomes, deadline

    def result(self):
        outs, late = self.outcomes, any(o.exitcode is None for o in self.outcomes)
        if late or any(len(o.messages) <= self.job for o in outs):
            return LabFailure(self.unfinished(late))
        report, blocks, shown, unwritten = Report(self.part.name), [], 0, None
        for c, case in enumerate(self.check.cases):
            found = [f for o in outs if (f := o.messages[self.job]["cases"][c])]
            line, problems, missing = (self.hunt_case if self.part.kind == "hunt" else self.lab_case)(case, found)
            unwritten = unwritten or missing
            report.lines += [line] if line else []
            if problems and shown < MAX_LINES:
                where = " and ".join(str(g) for g in runner.layout(case["ranks"]))
                extra = "".join(f", {k} {v}" for k, v in case.items() if k not in ("ranks", "seed", "impl"))
                blocks += [f"On {case['ranks']} ranks (processes {where}){extra}:"] + \
                    [f"- {p}" for p in problems[:MAX_LINES - shown]]
                shown += len(problems)
        printed = [f"[case {c + 1}: {case['ranks']} ranks, {_who(got)}] {text}" for c, case in
                   enumerate(self.check.cases) for o in outs if (got := o.messages[self.job]["cases"][c])
                   for text in got.get("printed", [])]
        printed = ["", "What your code printed on the ranks:", *printed[:MAX_PRINTED]] + \
            ([f"… and {len(printed) - MAX_PRINTED} more lines"] if len(printed) > MAX_PRINTED else []) if printed else []
        if unwritten:
            return NotImplementedError(unwritten)
        if not blocks:
            report.lines += printed
            return report
        head = f"{self.part.name} is not right yet." if self.part.kind == "lab" else \
            f"{self.part.objects[0]} does not do its job yet."
        hint = [f"Hint: {self.part.hint}."] if self.part.hint and any("does not catch the bug" in b for b in blocks) else []
        return LabFailure("\n".join([head, *blocks, *hint, *printed]))

    def unfinished(self, late: bool) -> str:
        """Why processes did not finish the job: still running at the deadline, or ended early."""
        missing = [o for o in self.outcomes if len(o.messages) <= self.job]
        if late:                                    # where each was stopped: the stack it printed on SIGTERM
            stacks = {o.rank: next((at for m in re.finditer(r'File "([^"]+)", line (\d+)', o.stderr)
                                    if (at := self.package.at([(m[1], int(m[2]))]))), "") for o in missing}
            done = [str(o.rank) for o in self.outcomes if o not in missing]
            lines = [s.replace("every rank", "every process") for s in _grouped(
                [(f"process {o.rank}", f"was still running{stacks[o.rank] or ' (outside your code)'}")
                 for o in missing], len(self.outcomes))]
            lines += [f"process{'es' if len(done) > 1 else ''} {', '.join(done)} had already finished "
                      f"{'their' if len(done) > 1 else 'its'} cases"] if done else []
            return "\n".join([f"{self.part.name} did not finish: an endless loop, or a wait that no timeout ends? "
                              f"The check stopped it after {self.deadline:.0f} s:"] + [f"- {s}" for s in lines])
        roots, lost = [], []
        for o in missing:
            error = (re.findall(r"^(\w*(?:Error|Exception|Exit)\b.*)$", o.stderr, re.M) or [""])[-1][:300]
            if re.search(r"closed by peer|reset by peer|broken pipe", error, re.I):
                lost.append(str(o.rank))
            elif m := re.search(r"op\.preamble\.length <= op\.nbytes\. (\d+) vs (\d+)", o.stderr):
                roots.append(f"process {o.rank} was stopped by gloo: a message of {m[1]} bytes arrived for a receive "
                             f"buffer of {m[2]} bytes — a receive buffer must have the size and dtype of what its "
                             "peer sends (torch.empty_like(the tensor sent))")
            elif o.exitcode is not None and o.exitcode < 0:
                roots.append(f"process {o.rank} was killed by signal {-o.exitcode}")
            else:
                roots.append(f"process {o.rank} exited with code {o.exitcode}" + (f" ({error})" if error else ", with no Python error"))
        if lost:
            roots.append(f"process{'es' if len(lost) > 1 else ''} {', '.join(lost)} then lost "
                         f"{'their' if len(lost) > 1 else 'its'} peer and stopped")
        return "\n".join([f"{self.part.name} ended a process before the check was done:"] + [f"- {s}" for s in roots])

    def errors(self, found: list[dict]) -> tuple[list[str], str | None]:
        """Sentences for the errors the ranks raised, root causes first; and a NotImplementedError's text."""
        waits = [o for o in found if o.get("error") and (o["error"]["timed_out"] or o["error"]["lost_peer"])]
        roots = [o for o in found if o.get("error") and o not in waits]
        said = [(_who(o), f"raised {o['error']['type']}" + (f": {o['error']['message']}" if o["error"]["message"] else "")
                 + self.package.at(o["error"]["frames"])) for o in roots]
        unwritten = next((f"{w} {s}" for (w, s), o in zip(said, roots) if o["error"]["type"] == "NotImplementedError"), None)
        why = ("after a peer had failed" if roots else "a send with no matching receive (or a receive with no send, "
               "or a collective that not every rank of the group called): a deadlock")
        stuck = [(_who(o), f"{'timed out waiting' if o['error']['timed_out'] else 'lost its peer'}"
                  f"{self.package.at(o['error']['frames'])}: {why}") for o in waits]
        stuck += [(_who(o), "had already returned (it was not waiting for anyone)") for o in found if waits and not o.get("error")]
        return _grouped(said, len(found)) + _grouped(stuck, len(found)), unwritten

    def lab_case(self, case: dict, found: list[dict]):
        if not found:                              # not run: an earlier case failed (first_failure)
            return "", [], None
        errors, unwritten = self.errors(found)
        problems = errors[:4] or _grouped([(_who(o), p) for o in found for p in o.get("problems", [])], len(found), ": ")
        if problems:
            return "", problems, unwritten
        first = min(found, key=lambda o: (o["group"], o["group_rank"]))
        line = self.part.summary(first["facts"]) if self.part.summary else f"{case['ranks']} ranks: correct"
        return f"{self.part.name} passed on {line}", [], None

    def hunt_case(self, case: dict, found: list[dict]):
        if not found:                              # not run: an earlier case settled the verdict
            return "", [], None
        impl, test = self.part.implementations[case["impl"]], self.part.objects[0]
        what = (impl.function.__doc__ or case["impl"]).strip().splitlines()[0].rstrip(".")
        what = what[0].lower() + what[1:]
        errors, unwritten = self.errors(found)
        groups = {tuple(o["group"]) for o in found}
        missed = sorted(g for g in groups if not any(o.get("error") for o in found if tuple(o["group"]) == g))
        if unwritten:
            return "", [], unwritten
        if impl.buggy and not errors:
            note = f" (the bug reported in {impl.source})" if impl.source else ""
            return "", [f"{test} passes on the buggy {what}{note}: it does not catch the bug"], None
        if not impl.buggy and errors:
            return "", [f"{test} fails on the correct {what}: {errors[0]}. A test must pass on a correct implementation"], None
        if not impl.buggy:
            return f"{test} passes on the correct implementation on {case['ranks']} ranks", [], None
        if missed:                                 # each group of the case runs the test on its own
            return "", [f"{test} passes on the buggy {what} in the group of processes {list(missed[0])} and catches "
                        f"it only in {list(sorted(groups - set(missed))[0])}: a test must fail wherever the bug is — "
                        "does it assert on one process only (dist.get_rank() == 0, say)? Every rank of every group "
                        "should check what it can"], None
        first = next(o for o in found if o.get("error"))
        return (f"{test} catches the bug on {case['ranks']} ranks ({case['impl']}: {_who(first)} raised "
                f"{first['error']['type']}{self.package.at(first['error']['frames'], code=False)})"), [], None


def show(name: str) -> None:
    """Print a bug hunt's code under test: the buggy implementation, and the functions and classes of
    its module that it uses (those first)."""
    part = parts.get(name)
    if part.kind != "hunt":
        raise ValueError(f"{name} is a lab part, not a bug hunt: there is no code under test to show")
    pieces, seen = [], set()

    def visit(obj) -> None:
        seen.add(obj)
        for fn in transport.functions_of(obj):
            for _, value in transport.read_globals(fn):
                if isinstance(value, (types.FunctionType, type)) and value.__module__ == obj.__module__ and value not in seen:
                    visit(value)
        if (text := inspect.getsource(obj)) not in pieces:
            pieces.append(text)
    visit(next(v.function for v in part.implementations.values() if v.buggy))
    print("\n\n".join(p.strip() for p in pieces))
