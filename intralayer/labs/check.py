"""The notebook side of a lab check: hand the learner's code to the ranks, say what they found.

Used from a check cell::

    check = labs.Check("ring_all_reduce", ring_all_reduce)
    check.on(ranks=2)                  # the pairs of processes [1, 2] and [0, 3]
    check.on(ranks=4)
    check.run()                        # raises LabFailure, in words, or prints what it measured

:meth:`Check.run` turns the learner's objects into a module file (:mod:`.source`),
refuses at once code that still raises ``NotImplementedError`` (a blank exercise) or
uses what the lab forbids, has the kernel's warm runner (:class:`_Warm`) fork a
:mod:`.runner` in a new session with a deadline, and reads each rank's findings. :func:`run_many` runs several checks in one start (the tests
of wrong answers use it).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

from . import parts, source

#: Seconds a case's group may wait for a peer before its collective fails (a deadlock).
GROUP_TIMEOUT_S = 10.0
#: Seconds a whole check may take before its processes are stopped (an endless loop). A
#: passing check takes a few seconds; nbgrader's own limit per cell defaults to 30 s
#: (book/instructors.md says how to raise it).
DEADLINE_S = 60.0
MAX_LINES = 8


class LabFailure(AssertionError):
    """The learner's code ran but is not right (or could not run): the message says why, in words."""


@dataclass
class Report:
    """What a passing check measured: one line per case."""

    part: str
    lines: list[str] = field(default_factory=list)
    seconds: float = 0.0                  # from the start of the ranks to their end
    start_method: str = ""                # how the runner started them: 'fork', or 'spawn' where fork is unsafe

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

    def prepare(self) -> source.Module:
        """The module file's text; ``NotImplementedError`` for a blank exercise, :class:`LabFailure`
        for code that cannot travel to the ranks."""
        if not self.cases:
            raise ValueError(f"{self.part.name}: add at least one case with .on(ranks=...) before run()")
        try:
            module = source.module_text(self.objects, self._forbidden)
        except source.SourceError as exc:
            raise LabFailure(str(exc)) from None
        blank = source.unwritten(module)
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

def _job(check: Check, index: int, folder: Path) -> tuple[dict, source.Module]:
    module = check.prepare()
    path = folder / f"learner{index}.py"
    path.write_text(module.text)
    return {"part": check.part.name, "module": str(path), "cases": check.cases}, module


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
    folder = Path(tempfile.mkdtemp(prefix="intralayer-lab-"))
    try:
        results: list[Report | BaseException | None] = [None] * len(checks)
        jobs, modules, which = [], [], []
        for i, check in enumerate(checks):
            try:
                job, module = _job(check, len(jobs), folder)
            except (NotImplementedError, LabFailure, ValueError) as exc:
                results[i] = exc
                continue
            jobs.append(job)
            modules.append(module)
            which.append(i)
        if jobs:
            start = time.monotonic()
            ranks, ended, late = _start(folder, jobs, deadline, group_timeout)
            seconds = time.monotonic() - start
            for j, i in enumerate(which):
                results[i] = _verdict(checks[i], modules[j], j, folder, ranks, ended.get("exits"), late, deadline,
                                      seconds)
                if isinstance(results[i], Report):
                    results[i].start_method = ended.get("start_method", "")
        return results
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _start(folder: Path, jobs: list[dict], deadline: float, group_timeout: float):
    """Run the job; return each rank's results, the exit codes, and whether the deadline passed."""
    spec = {"jobs": jobs, "group_timeout": group_timeout, "world_timeout": group_timeout + 20.0}
    (folder / "job.json").write_text(json.dumps(spec))
    late = _Warm.get(_env()).run(folder, deadline)
    ranks = {}
    for path in folder.glob("rank*.json"):
        ranks[int(path.stem[4:])] = json.loads(path.read_text())
    ended = json.loads((folder / "exit.json").read_text()) if (folder / "exit.json").exists() else {}
    return ranks, ended, late


def _env() -> dict:
    """The runner's environment: CPU ranks, one thread each, the course importable."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class Replies:
    """The lines ``WORD N`` a warm server writes (``pid 123``, ``exit 0``), each read within a deadline."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.buffer = proc, b""

    def next(self, word: str, until: float) -> int | None:
        """The number after ``word`` on the next line, or None if none comes by ``until`` (or the server died)."""
        while b"\n" not in self.buffer:
            wait = until - time.monotonic()
            if wait <= 0 or not select.select([self.proc.stdout], [], [], wait)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                return None                             # it died
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        head, value = line.decode().split()
        if head != word:
            raise RuntimeError(f"the warm server answered {line!r}, not {word!r}")
        return int(value)


def _session_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_session(pid: int, replies: Replies) -> bool:
    """Stop a late job forked in session ``pid``: SIGTERM first (its ranks print their stacks), then
    SIGKILL. True once the server has reported the job's end and no process of the session is left
    (a rank may outlive its runner for a moment while it prints its stack)."""
    ended = False
    for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)
        until = time.monotonic() + grace
        ended = ended or replies.next("exit", until) is not None
        while ended and _session_alive(pid) and time.monotonic() < until:
            time.sleep(0.02)
        if ended and not _session_alive(pid):
            return True
    return False


class _Warm:
    """This kernel's warm runner (``runner --serve``): torch imported once, a runner forked per check.

    A runner started afresh spends about 2.4 s importing torch; forked from this one, a
    passing check takes a fraction of a second more than its cases. Started at the first
    check, with that check's environment (a check with another starts a new one); it ends
    when this process ends (its input closes). Should it die, the next check starts another.
    """

    _current: "_Warm | None" = None

    def __init__(self, env: dict):
        self.env = env
        self.proc = subprocess.Popen([sys.executable, "-m", "intralayer.labs.runner", "--serve"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        self.replies = Replies(self.proc)

    @classmethod
    def get(cls, env: dict) -> "_Warm":
        warm = cls._current
        if warm is None or warm.proc.poll() is not None or warm.env != env:
            if warm is not None:
                warm.close()
            cls._current = warm = cls(env)
        return warm

    def close(self) -> None:
        from ..launch import stop

        stop(self.proc)

    def run(self, folder: Path, deadline: float) -> bool:
        """Run one job; stop it ``deadline`` seconds after its runner is forked (SIGTERM first: the
        ranks print their stacks);
        True if it was late. No process of the job outlives the call, also on KeyboardInterrupt."""
        start = time.monotonic()
        self.proc.stdin.write(f"{folder} {deadline}\n".encode())
        self.proc.stdin.flush()
        pid = self.replies.next("pid", start + 30.0)
        if pid is None:
            _Warm._current = None
            self.close()
            raise RuntimeError("the warm lab runner did not start the check's runner within 30 s")
        late, code = True, None
        try:
            code = self.replies.next("exit", time.monotonic() + deadline)    # from the fork, not the runner's start
            late = code is None
        finally:
            if code is None and not stop_session(pid, self.replies):   # late, or interrupted
                _Warm._current = None
                self.close()
        return late


# ---------------------------------------------------------------------------- verdicts in words

def _where(module: source.Module, error: dict) -> str:
    """' at line 3 of ring_all_reduce: `dist.recv(buf, src)`' from the learner's innermost frame."""
    for _, line, _ in reversed(error.get("frames", [])):
        place = module.where(line)
        if place:
            return f" at {place}: `{module.line(line)}`"
    return ""


def _who(ranks: list[int], group_rank: int) -> str:
    if ranks == list(range(len(ranks))):
        return f"rank {group_rank}"
    return f"group rank {group_rank} (process {ranks[group_rank]})"


def _case_words(case: dict) -> str:
    extra = [f"{k} {v}" for k, v in case.items() if k not in ("ranks", "seed", "impl")]
    where = " and ".join(f"[{', '.join(map(str, g))}]" for g in _layout(case["ranks"]))
    return f"{case['ranks']} ranks (process{'es' if case['ranks'] > 1 else ''} {where})" + \
        (f", {', '.join(extra)}" if extra else "")


def _layout(ranks: int) -> list[list[int]]:
    from .runner import layout

    return layout(ranks)


def _stack_of(folder: Path, rank: int, module: source.Module) -> str:
    """Where a rank was when it was stopped, from the stack it printed on SIGTERM."""
    err = folder / f"rank{rank}.err"
    if not err.exists():
        return ""
    path = None
    for line in err.read_text(errors="replace").splitlines():
        m = re.match(r'\s*File "(?P<file>[^"]+)", line (?P<line>\d+)', line)
        if m and Path(m["file"]).name.startswith("learner"):
            path = int(m["line"])
            break                               # faulthandler lists the innermost frame first
    place = module.where(path) if path else None
    return f" at {place}: `{module.line(path)}`" if place else ""


def _last_error(folder: Path, rank: int) -> str:
    """The last 'SomeError: …' line a rank wrote to its standard error, or ''."""
    err = folder / f"rank{rank}.err"
    text = err.read_text(errors="replace") if err.exists() else ""
    found = re.findall(r"^(\w*(?:Error|Exception|Exit)\b.*)$", text, re.M)
    return found[-1][:300] if found else ""


def _unfinished(name: str, module: source.Module, job: int, folder: Path, ranks: dict, exits, late: bool,
                deadline: float) -> str:
    """Why processes did not finish the job: still running at the deadline, or ended early (root cause first)."""
    missing = [r for r in range(4) if not (r in ranks and len(ranks[r]["jobs"]) > job)]
    if late:
        pairs = [(f"process {r}", f"was still running{_stack_of(folder, r, module) or ' (outside your code)'}")
                 for r in missing]
        lines = [line.replace("every rank", "every process") for line in _grouped(pairs, 4, " ")]
        return "\n".join([f"{name} did not finish: an endless loop, or a wait that no timeout ends? The check "
                          f"stopped it after {deadline:.0f} s:"] + [f"- {line}" for line in lines])
    roots, lost = [], []
    for r in missing:
        code = exits[r] if exits else None
        error = _last_error(folder, r)
        if re.search(r"closed by peer|reset by peer|broken pipe", error, re.I):
            lost.append(str(r))
        elif code is not None and code < 0:
            roots.append(f"process {r} was killed by signal {-code}")
        else:
            roots.append(f"process {r} exited with code {code}" + (f" ({error})" if error else ", with no Python error"))
    if lost:
        roots.append(f"process{'es' if len(lost) > 1 else ''} {', '.join(lost)} then lost "
                     f"{'their' if len(lost) > 1 else 'its'} peer and stopped")
    return "\n".join([f"{name} ended a process before the check was done:"] + [f"- {line}" for line in roots])


def _verdict(check: Check, module: source.Module, job: int, folder: Path, ranks: dict, exits, late: bool,
             deadline: float, seconds: float) -> Report | BaseException:
    part, name = check.part, check.part.name
    if late or len(ranks) < 4 or any(len(r["jobs"]) <= job for r in ranks.values()):
        return LabFailure(_unfinished(name, module, job, folder, ranks, exits, late, deadline))
    report = Report(name, seconds=seconds)
    blocks: list[str] = []
    shown = 0
    unwritten = None
    for c, case in enumerate(check.cases):
        outcomes = [r["jobs"][job]["cases"][c] for _, r in sorted(ranks.items())]
        outcomes = [o for o in outcomes if o]
        if part.kind == "hunt":
            words, missing = _hunt_case(check, module, case, outcomes)
        else:
            words, missing = _lab_case(check, module, case, outcomes)
        unwritten = unwritten or missing
        if words[0]:
            report.lines.append(words[0])
        if words[1] and shown < MAX_LINES:
            blocks.append(f"On {_case_words(case)}:")
            blocks += [f"- {p}" for p in words[1][:MAX_LINES - shown]]
            shown += len(words[1])
    if unwritten:
        return NotImplementedError(unwritten)
    if blocks:
        head = f"{name} is not right yet." if part.kind == "lab" else f"{part.objects[0]} does not do its job yet."
        hint = [f"Hint: {part.hint}."] if part.hint and any("does not catch the bug" in b for b in blocks) else []
        return LabFailure("\n".join([head] + blocks + hint))
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


def _errors(module: source.Module, outcomes: list[dict]) -> tuple[list[str], str | None]:
    """Sentences for the errors the ranks raised, root causes first; and a NotImplementedError's text."""
    roots = [o for o in outcomes if o.get("error") and not (o["error"]["timed_out"] or o["error"]["lost_peer"])]
    waits = [o for o in outcomes if o.get("error") and (o["error"]["timed_out"] or o["error"]["lost_peer"])]
    pairs, unwritten = [], None
    for o in roots:
        e = o["error"]
        said = f"raised {e['type']}" + (f": {e['message']}" if e["message"] else "") + _where(module, e)
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
        pairs.append((_who(o["group"], o["group_rank"]), f"{verb}{_where(module, e)}: {why}"))
    return lines + _grouped(pairs, len(outcomes), " "), unwritten


def _by_problem(outcomes: list[dict], texts) -> list[str]:
    """'rank 0 (and 1 other): …' / 'every rank: …', one line per distinct sentence."""
    return _grouped([(_who(o["group"], o["group_rank"]), p) for o in outcomes for p in texts(o)], len(outcomes), ": ")


def _lab_case(check: Check, module: source.Module, case: dict, outcomes: list[dict]):
    errors, unwritten = _errors(module, outcomes)
    if errors:
        return ("", errors[:4]), unwritten
    lines = _by_problem(outcomes, lambda o: o.get("problems", []))
    if lines:
        return ("", lines), None
    first = min(outcomes, key=lambda o: (o["group"], o["group_rank"]))
    line = check.part.summary(first["facts"]) if check.part.summary else f"{case['ranks']} ranks: correct"
    return (f"{check.part.name} passed on {line}", []), None


def _hunt_case(check: Check, module: source.Module, case: dict, outcomes: list[dict]):
    impl = check.part.implementations[case["impl"]]
    test = check.part.objects[0]
    what = (impl.function.__doc__ or case["impl"]).strip().splitlines()[0].rstrip(".")
    what = what[0].lower() + what[1:]
    errors, unwritten = _errors(module, outcomes)
    if unwritten:
        return ("", []), unwritten
    failed = bool(errors)
    if impl.buggy and not failed:
        note = f" (the bug reported in {impl.source})" if impl.source else ""
        return ("", [f"{test} passes on the buggy {what}{note}: it does not catch the bug"]), None
    if not impl.buggy and failed:
        return ("", [f"{test} fails on the correct {what}: {errors[0]}. A test must pass on a correct "
                     "implementation"]), None
    if impl.buggy:
        first = next(o for o in outcomes if o.get("error"))
        e = first["error"]
        place = next((module.where(line) for _, line, _ in reversed(e.get("frames", [])) if module.where(line)), None)
        said = f"{_who(first['group'], first['group_rank'])} raised {e['type']}" + (f" at {place}" if place else "")
        return (f"{test} catches the bug on {case['ranks']} ranks ({case['impl']}: {said})", []), None
    return (f"{test} passes on the correct implementation on {case['ranks']} ranks", []), None


def show(name: str) -> None:
    """Print the code under test of a bug hunt: its implementation with the reported bug."""
    part = parts.get(name)
    if part.kind != "hunt":
        raise ValueError(f"{name} is a lab part, not a bug hunt: there is no code under test to show")
    impl = next(v for v in part.implementations.values() if v.buggy)
    print(source.module_text({impl.function.__name__: impl.function}).text.split("\n", 1)[1].strip())
