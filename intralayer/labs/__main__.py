"""The headless checker: ``python -m intralayer.labs check NOTEBOOK.ipynb [...]``.

For each submitted lab or exercise notebook it runs every check, outside any kernel, from
the code of the submission's answer cells only (nbgrader's ``solution`` cells; one it lacks runs as an empty cell): the other
cells — set-up and checks, hidden cases included — come from the course's own
``solutions/`` notebook of the same name. It prints, per check, pass or fail and the points
(nbgrader's), and exits 0 only when every check passes (2 for a notebook that is missing).

Three processes, so that the verdict is never computed where the submission's cells ran (the
learner and grader processes are one-rank jobs of this process's pool, :func:`_role`):

1. a *learner* process runs the set-up cells and the submission's answer cells, then reads
   each check cell with a stand-in for ``labs`` that only records the part and its cases,
   and packs the learner's objects (:mod:`.transport`); a cell that patches ``labs.Check``
   or anything else patches this process only;
2. for a lab, this process hands the packages to the ranks of its own pool (which ran
   nothing of the submission's) and turns their findings into the verdict;
3. for an exercise, a fresh *grader* process runs the set-up cells and the check cells from
   ``solutions/`` with only the functions and classes the answer cells defined (by value).

What it cannot stop: the learner's functions themselves run (on the ranks, or in the grader)
when a check calls them, and code in them could tamper with what runs there.
"""
from __future__ import annotations

import argparse
import importlib
import linecache
import os
import sys
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _cells(path: Path) -> list[dict]:
    import nbformat

    cells = []
    for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
        if cell.cell_type != "code":
            continue
        meta = cell.get("metadata", {}).get("nbgrader", {})
        cells.append({"source": cell.source, "id": meta.get("grade_id") or f"cell-{i}",
                      "solution": bool(meta.get("solution")), "grade": bool(meta.get("grade")),
                      "points": float(meta.get("points", 0) or 0)})
    return cells


def reference(submission: Path) -> Path:
    """The course's notebook with the same name: solutions/labs/NAME or solutions/NAME."""
    lab = "labs" in submission.resolve().parts
    for folder in ([ROOT / "solutions" / "labs"] if lab else []) + [ROOT / "solutions", ROOT / "solutions" / "labs"]:
        if (folder / submission.name).is_file():
            return folder / submission.name
    raise ValueError(f"{submission}: no notebook of that name in solutions/ or solutions/labs/: the checker "
                     "grades the course's own labs and exercises")


def _plan(submission: Path) -> list[dict]:
    """The cells to run, in the reference's order: its set-up and check cells, the submission's answers."""
    answers = {c["id"]: c for c in _cells(submission) if c["solution"]}
    # An answer cell the submission lacks (deleted, or its metadata lost) runs as an empty cell: never
    # the course's own solution.
    return [answers.get(c["id"], {**c, "source": ""}) if c["solution"] else c
            for c in _cells(reference(submission))]


def _exec(cell: dict, ns: dict) -> None:
    name = f"<cell {cell['id']}>"
    linecache.cache[name] = (len(cell["source"]), None, cell["source"].splitlines(True), name)
    exec(compile(cell["source"], name, "exec"), ns)  # noqa: S102 (the checker's purpose)


class _Recorder:
    """Stands in for ``labs`` in a check cell: records the part, the objects and the cases."""

    def __init__(self):
        self.found = []

    def Check(self, part, *objects):                      # noqa: N802 (the name the cell calls)
        found = {"part": part, "objects": objects, "cases": []}
        self.found.append(found)

        class _Check:
            def on(self, ranks, **params):
                found["cases"].append((ranks, params))
                return self

            def run(self, *args, **kwargs):
                pass

        return _Check()

    def __getattr__(self, name):                         # labs.show(...), labs.progress(...): nothing to grade
        return lambda *args, **kwargs: None


def learner(request: dict) -> list[dict]:
    """Process 1: run the answer cells; for each check cell, the packed objects or why they cannot go."""
    import cloudpickle

    from intralayer import labs

    sys.modules["__main__"] = types.ModuleType("__main__")      # the notebook's: its objects travel by value
    ns = vars(sys.modules["__main__"])
    defined: dict[str, object] = {}
    results = []
    for cell in request["cells"]:
        if cell["grade"]:
            result = {"id": cell["id"], "points": cell["points"]}
            if "labs.Check(" in cell["source"]:
                recorder = _Recorder()
                try:
                    _exec(cell, {**ns, "labs": recorder})
                    [found] = recorder.found
                    check = labs.Check(found["part"], *found["objects"])
                    for ranks, params in found["cases"]:
                        check.on(ranks, **params)
                    result.update(part=found["part"], cases=check.cases, package=check.prepare())
                except BaseException as exc:       # noqa: BLE001 (a blank or broken answer: its words)
                    result["error"] = f"{type(exc).__name__}: {exc}"
            results.append(result)
            continue
        before = dict(ns)
        try:
            _exec(cell, ns)
        except BaseException:                          # noqa: BLE001 (a cell that fails: its check says so)
            traceback.print_exc()
        if cell["solution"]:
            defined.update({k: v for k, v in ns.items() if isinstance(v, (types.FunctionType, type))
                            and before.get(k) is not v and getattr(v, "__module__", "") == "__main__"})
    results.append({"answers": cloudpickle.dumps(defined)})
    return results


def grader(request: dict) -> list[dict]:
    """Process 3: an exercise's checks, with the reference's set-up and only the learner's functions."""
    import cloudpickle

    sys.modules["__main__"] = types.ModuleType("__main__")
    ns = vars(sys.modules["__main__"])
    answers = cloudpickle.loads(request["answers"])
    results = []
    for cell in request["cells"]:
        if cell["solution"]:
            ns.update(answers)
            continue
        try:
            _exec(cell, ns)
            ok, why = True, ""
        except BaseException as exc:                    # noqa: BLE001
            ok, why = False, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        if cell["grade"]:
            results.append({"id": cell["id"], "points": cell["points"], "ok": ok, "why": why})
    return results


def _role(role: str, request: dict):
    """The body of the learner or grader process: a one-rank job of the pool (:mod:`intralayer.ranks`),
    forked from its fork server, which has torch and the library imported already (about 0.2 s a start
    against 2.5 s for a fresh interpreter, measured here). What the submission's cells change there —
    a patched ``labs.Check``, say — stays in that process."""
    os.chdir(request["cwd"])
    sys.path.insert(0, request["cwd"])
    return (learner if role == "learner" else grader)(request)


def _in_process(role: str, request: dict, timeout: float = 600.0) -> list[dict]:
    from intralayer import ranks

    here = importlib.import_module("intralayer.labs.__main__")     # by its name, so a rank can import it
    [outcome] = ranks.run(here._role, 1, (role, request), deadline=timeout)
    if not outcome.ok:
        why = outcome.error["traceback"] if outcome.error else outcome.stderr[-3000:]
        raise RuntimeError(f"the {role} process failed:\n{why}")
    return outcome.value


def check(submission: Path) -> tuple[bool, float, float, list[str]]:
    """Whether every check passed, points earned, points possible, and one line per check."""
    from intralayer import labs

    cells = _plan(submission)
    request = {"cells": cells, "cwd": str(submission.resolve().parent)}
    found = _in_process("learner", request)
    answers = found.pop()["answers"]
    if not any("part" in f or "error" in f for f in found):                   # an exercise
        found = _in_process("grader", {**request, "answers": answers})
        verdicts = [(f, f["ok"], f["why"]) for f in found]
    else:
        runnable = [f for f in found if "package" in f]
        checks = [labs.Check.prepared(f["part"], f["package"], f["cases"]) for f in runnable]
        reports = dict(zip((f["id"] for f in runnable), labs.run_many(checks)))
        verdicts = []
        for f in found:
            result = reports.get(f["id"])
            if "error" in f:
                verdicts.append((f, False, f["error"]))
            else:
                verdicts.append((f, isinstance(result, labs.Report), "" if isinstance(result, labs.Report)
                                 else f"{type(result).__name__}: {result}"))
    earned = sum(f["points"] for f, ok, _ in verdicts if ok)
    lines = [f"{'PASS' if ok else 'FAIL'}  {f['id']}  {f['points'] if ok else 0:g}/{f['points']:g}"
             + ("" if ok else "\n      " + why.replace("\n", "\n      ")) for f, ok, why in verdicts]
    return all(ok for _, ok, _ in verdicts), earned, sum(f["points"] for f, _, _ in verdicts), lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m intralayer.labs",
                                     description="Run every check of lab or exercise notebooks, outside their kernel.")
    parser.add_argument("command", choices=["check"])
    parser.add_argument("notebooks", nargs="+", type=Path)
    args = parser.parse_args(argv)
    everything = True
    for path in args.notebooks:
        if not path.is_file():
            print(f"{path}: no such notebook", file=sys.stderr)
            return 2
        passed, earned, possible, lines = check(path)
        print(f"{path}: {earned:g} of {possible:g} points")
        print("\n".join(f"  {line}" for line in lines))
        everything = everything and passed
    return 0 if everything else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
