"""The notebook side of a lab check: hand the learner's code to the ranks, say what they found.

Used from a check cell::

    check = labs.Check("ring_all_reduce", ring_all_reduce)
    check.on(ranks=2)                  # the pairs of processes [1, 2] and [0, 3]
    check.on(ranks=4)
    check.run()                        # raises LabFailure, in words, or prints what it measured

:meth:`Check.run` packs the learner's objects (:mod:`.transport`), refuses at once code that
still raises ``NotImplementedError`` (a blank exercise) or uses what the lab forbids, runs
:func:`.runner.run_jobs` on four ranks of the pool (:mod:`intralayer.ranks`) and turns what
each rank found into sentences, with what the learner's code printed below them.
:func:`run_many` runs several checks in one start (the tests of wrong answers use it).
"""
from __future__ import annotations

import inspect
import re
import time
import types
from dataclasses import dataclass, field

from .. import ranks
from . import parts, runner, transport

#: Seconds a case's group may wait for a peer before its collective fails (a deadlock).
GROUP_TIMEOUT_S = 10.0
#: Seconds a whole check may take before its processes are stopped (an endless loop). A
#: passing check takes under a second once the pool is up; nbgrader's own limit per cell defaults to 30 s
#: (book/instructors.md says how to raise it).
DEADLINE_S = 60.0
MAX_LINES = 8
#: Lines of what the learner's code printed, shown under the verdict.
MAX_PRINTED = 24


class LabFailure(AssertionError):
    """The learner's code ran but is not right (or could not run): the message says why, in words."""


@dataclass
class Report:
    """What a passing check measured: one line per case."""

    part: str
    lines: list[str] = field(default_factory=list)
    seconds: float = 0.0                  # from the start of the ranks to their end
    start_method: str = ""                # how the pool started them: 'forkserver' (ranks.START_METHOD)

    def __str__(self) -> str:
        return "\n".join(self.lines)


def _module_of(value) -> str | None:
    """The module a global of the learner's code is, or comes from."""
    if isinstance(value, types.ModuleType):
        return value.__name__
    return getattr(value, "__module__", None)


class Check:
    """One graded check: a lab part or bug hunt, the learner's objects, and the cases to run."""

    def __init__(self, part: str, *objects):
        self.part = parts.get(part)
        if len(objects) != len(self.part.objects):
            raise ValueError(f"{self.part.name} checks {len(self.part.objects)} object(s), "
                             f"{', '.join(self.part.objects)}; got {len(objects)}")
        self.objects = dict(zip(self.part.objects, objects))
        self.cases: list[dict] = []

    def on(self, ranks: int, **params) -> "Check":
        """Add a case: a group of ``ranks`` ranks (2, 3 or 4) and the part's parameters.

        For a bug hunt, ``impl`` names the implementation(s) to run the test against; by
        default every one the graders use (each buggy variant and the correct one), so a
        test that passes here cannot fail at grading on a variant it never met.
        """
        if self.part.kind == "hunt":
            impls = params.pop("impl", None)
            if impls is None:
                impls = tuple(self.part.implementations)
            for impl in (impls,) if isinstance(impls, str) else tuple(impls):
                self.cases.append(self.part.case(ranks, {**params, "impl": impl}))
        else:
            self.cases.append(self.part.case(ranks, params))
        return self

    def _forbidden(self, name: str, value) -> str | None:
        module = _module_of(value) or ""
        for banned in self.part.forbid_modules:
            if module == banned or module.startswith(banned + "."):
                return self.part.why
        return None

    @classmethod
    def prepared(cls, part: str, package: transport.Package, cases: list[dict]) -> "Check":
        """A check of objects another process packed (the headless checker): none of them is unpickled here."""
        check = cls.__new__(cls)
        check.part, check.objects, check.cases, check._package = parts.get(part), {}, list(cases), package
        return check

    def prepare(self) -> transport.Package:
        """The learner's objects, packed; ``NotImplementedError`` for a blank exercise, :class:`LabFailure`
        for code that cannot travel to the ranks."""
        if not self.cases:
            raise ValueError(f"{self.part.name}: add at least one case with .on(ranks=...) before run()")
        if getattr(self, "_package", None) is not None:
            return self._package
        try:
            module = transport.pack(self.objects, self._forbidden)
        except transport.SourceError as exc:
            raise LabFailure(str(exc)) from None
        blank = transport.unwritten(self.objects)
        if blank:
            raise NotImplementedError(f"{', '.join(blank)} {'is' if len(blank) == 1 else 'are'} not written yet: "
                                      "replace the `raise NotImplementedError()` in the cell above with your code, "
                                      "run that cell, then this one")
        return module

    def run(self, deadline: float = DEADLINE_S) -> None:
        """Run the check; print one line per case when it passes, raise :class:`LabFailure` when not."""
        result = run_many([self], deadline)[0]
        PROGRESS[self.part.name] = not isinstance(result, BaseException)
        if isinstance(result, BaseException):
            raise result
        print(result)


#: Every part checked in this kernel: True once its last run passed.
PROGRESS: dict[str, bool] = {}


def progress(chapter: str) -> None:
    """Print, for every part of lab ``chapter`` ('04'), whether its check passed in this kernel."""
    mine = [p for p in parts.every() if p.chapter == chapter]
    if not mine:
        raise ValueError(f"there is no lab {chapter!r}; the labs are {sorted({p.chapter for p in parts.every()})}")
    done = sum(PROGRESS.get(p.name, False) for p in mine)
    print(f"Lab {chapter}: {done} of {len(mine)} parts pass")
    for p in mine:
        state = {True: "passes", False: "fails"}.get(PROGRESS.get(p.name), "not run yet")
        print(f"- {p.name} ({p.kind}): {state}")


# ---------------------------------------------------------------------------- running

def run_many(checks: list[Check], deadline: float = DEADLINE_S,
             group_timeout: float = GROUP_TIMEOUT_S) -> list[Report | BaseException]:
    """Run several checks in one start of the ranks; for each, its :class:`Report` or the exception
    its :meth:`Check.run` would raise (checks that fail before starting do not start anything)."""
    for value, what in ((deadline, "deadline"), (group_timeout, "group_timeout")):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"{what}={value!r} must be a positive, finite number of seconds")
    if group_timeout >= deadline:
        raise ValueError(f"group_timeout={group_timeout} must be shorter than deadline={deadline}: a deadlock "
                         "should be reported before the whole check is stopped")
    results: list[Report | BaseException | None] = [None] * len(checks)
    jobs, packages, which = [], [], []
    for i, check in enumerate(checks):
        try:
            package = check.prepare()
        except (NotImplementedError, LabFailure, ValueError) as exc:
            results[i] = exc
            continue
        jobs.append({"part": check.part.name, "payload": package.payload, "cases": check.cases,
                     "files": package.files})
        packages.append(package)
        which.append(i)
    if jobs:
        start = time.monotonic()
        outcomes = ranks.run(runner.run_jobs, runner.WORLD, (jobs, group_timeout), deadline=deadline)
        seconds = time.monotonic() - start
        for j, i in enumerate(which):
            results[i] = _verdict(checks[i], packages[j], j, outcomes, deadline, seconds)
    return results


# ---------------------------------------------------------------------------- verdicts in words

def _where(package: transport.Package, error: dict) -> str:
    """' at line 3 of ring_all_reduce: `dist.recv(buf, src)`' from the learner's innermost frame, and
    the learner's frames that called it ('called from line 9 of ring_attention'); the library's are cut."""
    places = [(package.where(file, line), file, line) for file, line, _ in error.get("frames", [])]
    places = [p for p in places if p[0]]
    if not places:
        return ""
    place, file, line = places[-1]
    callers = [p[0] for p in places[:-1]][-3:]
    return f" at {place}: `{package.line(file, line)}`" + (f" (called from {', '.join(reversed(callers))})"
                                                          if callers else "")


def _who(ranks: list[int], group_rank: int) -> str:
    if ranks == list(range(len(ranks))):
        return f"rank {group_rank}"
    return f"group rank {group_rank} (process {ranks[group_rank]})"


def _case_words(case: dict) -> str:
    extra = [f"{k} {v}" for k, v in case.items() if k not in ("ranks", "seed", "impl")]
    where = " and ".join(f"[{', '.join(map(str, g))}]" for g in runner.layout(case["ranks"]))
    return f"{case['ranks']} ranks (process{'es' if case['ranks'] > 1 else ''} {where})" + \
        (f", {', '.join(extra)}" if extra else "")


def _stack_of(outcome: ranks.Outcome, package: transport.Package) -> str:
    """Where a rank was when it was stopped, from the stack it printed on SIGTERM (innermost first)."""
    for m in re.finditer(r'File "(?P<file>[^"]+)", line (?P<line>\d+)', outcome.stderr):
        place = package.where(m["file"], int(m["line"]))
        if place:
            return f" at {place}: `{package.line(m['file'], int(m['line']))}`"
    return ""


def _last_error(outcome: ranks.Outcome) -> str:
    """The last 'SomeError: …' line a rank wrote to its standard error, or ''."""
    found = re.findall(r"^(\w*(?:Error|Exception|Exit)\b.*)$", outcome.stderr, re.M)
    return found[-1][:300] if found else ""


def _unfinished(name: str, package: transport.Package, job: int, outcomes: list[ranks.Outcome], late: bool,
                deadline: float) -> str:
    """Why processes did not finish the job: still running at the deadline, or ended early (root cause first)."""
    missing = [o for o in outcomes if len(o.messages) <= job]
    if late:
        done = [str(o.rank) for o in outcomes if len(o.messages) > job]
        pairs = [(f"process {o.rank}", f"was still running{_stack_of(o, package) or ' (outside your code)'}")
                 for o in missing]
        lines = [line.replace("every rank", "every process") for line in _grouped(pairs, len(outcomes), " ")]
        if done:
            lines.append(f"process{'es' if len(done) > 1 else ''} {', '.join(done)} had already finished "
                         f"{'their' if len(done) > 1 else 'its'} cases")
        return "\n".join([f"{name} did not finish: an endless loop, or a wait that no timeout ends? The check "
                          f"stopped it after {deadline:.0f} s:"] + [f"- {line}" for line in lines])
    roots, lost = [], []
    for o in missing:
        error = _last_error(o)
        if re.search(r"closed by peer|reset by peer|broken pipe", error, re.I):
            lost.append(str(o.rank))
        elif o.exitcode is not None and o.exitcode < 0:
            roots.append(f"process {o.rank} was killed by signal {-o.exitcode}")
        else:
            roots.append(f"process {o.rank} exited with code {o.exitcode}" +
                         (f" ({error})" if error else ", with no Python error"))
    if lost:
        roots.append(f"process{'es' if len(lost) > 1 else ''} {', '.join(lost)} then lost "
                     f"{'their' if len(lost) > 1 else 'its'} peer and stopped")
    return "\n".join([f"{name} ended a process before the check was done:"] + [f"- {line}" for line in roots])


def _printed(check: Check, job: int, outcomes: list[ranks.Outcome]) -> list[str]:
    """What the learner's code printed on the ranks, by case and rank (the first lines of each)."""
    lines = []
    for c, case in enumerate(check.cases):
        for o in outcomes:
            got = o.messages[job]["cases"][c] if len(o.messages) > job else None
            for text in (got or {}).get("printed", []):
                where = f"{_who(got['group'], got['group_rank'])}"
                lines.append(f"[case {c + 1}: {case['ranks']} ranks, {where}] {text}")
    if not lines:
        return []
    shown = lines[:MAX_PRINTED]
    more = [f"… and {len(lines) - len(shown)} more lines"] if len(lines) > len(shown) else []
    return ["", "What your code printed on the ranks:"] + shown + more


def _verdict(check: Check, package: transport.Package, job: int, outcomes: list[ranks.Outcome], deadline: float,
             seconds: float) -> Report | BaseException:
    part, name = check.part, check.part.name
    late = any(o.exitcode is None for o in outcomes)
    if late or any(len(o.messages) <= job for o in outcomes):
        return LabFailure(_unfinished(name, package, job, outcomes, late, deadline))
    report = Report(name, seconds=seconds, start_method=ranks.START_METHOD)
    blocks: list[str] = []
    shown = 0
    unwritten = None
    for c, case in enumerate(check.cases):
        found = [o.messages[job]["cases"][c] for o in outcomes]
        found = [f for f in found if f]
        words, missing = (_hunt_case if part.kind == "hunt" else _lab_case)(check, package, case, found)
        unwritten = unwritten or missing
        if words[0]:
            report.lines.append(words[0])
        if words[1] and shown < MAX_LINES:
            blocks.append(f"On {_case_words(case)}:")
            blocks += [f"- {p}" for p in words[1][:MAX_LINES - shown]]
            shown += len(words[1])
    if unwritten:
        return NotImplementedError(unwritten)
    printed = _printed(check, job, outcomes)
    if blocks:
        head = f"{name} is not right yet." if part.kind == "lab" else f"{part.objects[0]} does not do its job yet."
        missed = [b for b in blocks if "does not catch the bug" in b]
        hint = [f"Hint: {part.hint}."] if part.hint and missed else []
        return LabFailure("\n".join([head] + blocks + hint + printed))
    report.lines += printed
    return report


def _grouped(pairs: list[tuple[str, str]], everyone: int, sep: str) -> list[str]:
    """Join ``(who, sentence)`` pairs with the same sentence: 'every rank …', 'rank 0 (and 1 other) …'."""
    seen: dict[str, list[str]] = {}
    for who, sentence in pairs:
        seen.setdefault(sentence, []).append(who)
    lines = []
    for sentence, who in seen.items():
        if len(who) == everyone and everyone > 1:
            lines.append(f"every rank{sep}{sentence}")
        else:
            others = len(who) - 1
            also = f" (and {others} other{'s' if others > 1 else ''})" if others else ""
            lines.append(f"{who[0]}{also}{sep}{sentence}")
    return lines


def _errors(package: transport.Package, outcomes: list[dict]) -> tuple[list[str], str | None]:
    """Sentences for the errors the ranks raised, root causes first; and a NotImplementedError's text."""
    roots = [o for o in outcomes if o.get("error") and not (o["error"]["timed_out"] or o["error"]["lost_peer"])]
    waits = [o for o in outcomes if o.get("error") and (o["error"]["timed_out"] or o["error"]["lost_peer"])]
    pairs, unwritten = [], None
    for o in roots:
        e = o["error"]
        said = f"raised {e['type']}" + (f": {e['message']}" if e["message"] else "") + _where(package, e)
        if e["type"] == "NotImplementedError" and unwritten is None:
            unwritten = f"{_who(o['group'], o['group_rank'])} {said}"
        pairs.append((_who(o["group"], o["group_rank"]), said))
    lines = _grouped(pairs, len(outcomes), " ")
    pairs = []
    for o in waits:
        e = o["error"]
        why = ("after a peer had failed" if roots else
               "a send with no matching receive (or a receive with no send, or a collective that not every rank "
               "of the group called): a deadlock")
        verb = "timed out waiting" if e["timed_out"] else "lost its peer"
        pairs.append((_who(o["group"], o["group_rank"]), f"{verb}{_where(package, e)}: {why}"))
    done = [o for o in outcomes if not o.get("error")] if waits else []
    pairs += [(_who(o["group"], o["group_rank"]), "had already returned (it was not waiting for anyone)") for o in done]
    return lines + _grouped(pairs, len(outcomes), " "), unwritten


def _by_problem(outcomes: list[dict], texts) -> list[str]:
    """'rank 0 (and 1 other): …' / 'every rank: …', one line per distinct sentence."""
    return _grouped([(_who(o["group"], o["group_rank"]), p) for o in outcomes for p in texts(o)], len(outcomes), ": ")


def _lab_case(check: Check, package: transport.Package, case: dict, outcomes: list[dict]):
    errors, unwritten = _errors(package, outcomes)
    if errors:
        return ("", errors[:4]), unwritten
    lines = _by_problem(outcomes, lambda o: o.get("problems", []))
    if lines:
        return ("", lines), None
    first = min(outcomes, key=lambda o: (o["group"], o["group_rank"]))
    line = check.part.summary(first["facts"]) if check.part.summary else f"{case['ranks']} ranks: correct"
    return (f"{check.part.name} passed on {line}", []), None


def _hunt_case(check: Check, package: transport.Package, case: dict, outcomes: list[dict]):
    if not outcomes:                        # not run: an earlier case settled the verdict (runner.run_job)
        return ("", []), None
    impl = check.part.implementations[case["impl"]]
    test = check.part.objects[0]
    what = (impl.function.__doc__ or case["impl"]).strip().splitlines()[0].rstrip(".")
    what = what[0].lower() + what[1:]
    errors, unwritten = _errors(package, outcomes)
    if unwritten:
        return ("", []), unwritten
    failed = bool(errors)
    if impl.buggy and not failed:
        note = f" (the bug reported in {impl.source})" if impl.source else ""
        return ("", [f"{test} passes on the buggy {what}{note}: it does not catch the bug"]), None
    if not impl.buggy and failed:
        return ("", [f"{test} fails on the correct {what}: {errors[0]}. A test must pass on a correct "
                     "implementation"]), None
    groups = {tuple(o["group"]) for o in outcomes}
    missed = sorted(g for g in groups if not any(o.get("error") for o in outcomes if tuple(o["group"]) == g))
    if impl.buggy and missed:               # each group of the case runs the test on its own
        caught = sorted(groups - set(missed))
        return ("", [f"{test} passes on the buggy {what} in the group of processes {list(missed[0])} and "
                     f"catches it only in {list(caught[0])}: a test must fail wherever the bug is — does it "
                     "assert on one process only (dist.get_rank() == 0, say)? Every rank of every group "
                     "should check what it can"]), None
    if impl.buggy:
        first = next(o for o in outcomes if o.get("error"))
        e = first["error"]
        place = next((package.where(f, line) for f, line, _ in reversed(e.get("frames", [])) if package.where(f, line)),
                     None)
        said = f"{_who(first['group'], first['group_rank'])} raised {e['type']}" + (f" at {place}" if place else "")
        return (f"{test} catches the bug on {case['ranks']} ranks ({case['impl']}: {said})", []), None
    return (f"{test} passes on the correct implementation on {case['ranks']} ranks", []), None


def show(name: str) -> None:
    """Print the code under test of a bug hunt: its implementation with the reported bug, and the
    functions and classes of its module that it uses (those first)."""
    part = parts.get(name)
    if part.kind != "hunt":
        raise ValueError(f"{name} is a lab part, not a bug hunt: there is no code under test to show")
    impl = next(v for v in part.implementations.values() if v.buggy)
    pieces: list[str] = []

    def visit(obj) -> None:
        text = inspect.getsource(obj)
        if text in pieces:
            return
        for fn in transport.functions_of(obj):
            for _, value in transport.read_globals(fn):
                if isinstance(value, (types.FunctionType, type)) and value.__module__ == obj.__module__ \
                        and value is not obj:
                    visit(value)
        if text not in pieces:
            pieces.append(text)

    visit(impl.function)
    print("\n\n".join(p.strip() for p in pieces))

