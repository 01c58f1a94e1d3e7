"""The instructor's path, end to end, in a temporary nbgrader course.

Every solutions notebook — the exercises (``solutions/NN_name.ipynb``, assignment
``NN_name``) and the labs (``solutions/labs/NN_name.ipynb``, assignment ``lab_NN_name``) —
goes in ``source/``; ``nbgrader generate_assignment`` releases them all; two students
submit every assignment: ``correct`` hands in the solutions, ``blank`` the untouched
release; ``nbgrader autograde`` grades all 2 × N notebooks in one run (hidden tests put
back, the labs' checks run on real ranks inside nbgrader's kernel); ``nbgrader
generate_feedback`` writes each student's report. Autograde's execution of the correct
submissions is also the suite's check of the solutions' stored outputs (nbval does not
collect solutions/). The commands are the ones
book/instructors.md shows (with ``--force``, which redoes a step that has run before),
and so is the per-cell time limit. One nbgrader call per step keeps the start-up cost (the
database, nbgrader's own imports) to once per step; this file is a test module of its
own, so under ``pytest -n 2 --dist loadfile`` it runs beside the rest of the suite.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
import determinism
import exercises as tool

STUDENTS = ("correct", "blank")
#: nbgrader's own limit for one cell (30 s by default) is short for a lab check on a busy
#: machine; a lab check stops itself after intralayer.labs.check.DEADLINE_S (60 s).
CELL_TIMEOUT_S = 300


def assignment(solution: Path) -> str:
    return ("lab_" if solution.parent.name == "labs" else "") + solution.stem


ASSIGNMENTS = {assignment(s): (s, e) for s, e in tool.pairs()}


def nbgrader(course: Path, *args: str) -> tuple[float, str]:
    """Run one nbgrader command in the course; return its seconds and its log. nbgrader calls
    ``alembic`` as a program, so this environment's ``bin`` goes first on PATH."""
    env = {**os.environ, "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")}
    start = time.monotonic()
    done = subprocess.run([str(Path(sys.executable).with_name("nbgrader")), *args], cwd=course, env=env,
                          capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return time.monotonic() - start, done.stdout + done.stderr


#: nbgrader's log line, with its time (the course config sets the format).
LOG = re.compile(r"^(?P<t>\d\d:\d\d:\d\d\.\d+) (?P<msg>.*)$", re.M)


def per_notebook(log: str) -> dict[str, float]:
    """Seconds autograde spent on each submission, from its 'Sanitizing' line to the next one
    (or the end): executing the notebook in a fresh kernel, hidden tests included."""
    marks = [(m["t"], m["msg"]) for m in LOG.finditer(log)]
    stamps = [(datetime.strptime(t, "%H:%M:%S.%f"), msg) for t, msg in marks]
    starts = [(i, msg.split("Sanitizing ", 1)[1]) for i, (_, msg) in enumerate(stamps) if "Sanitizing " in msg]
    out = {}
    for k, (i, path) in enumerate(starts):
        end = stamps[starts[k + 1][0]][0] if k + 1 < len(starts) else stamps[-1][0]
        parts = Path(path.strip()).parts
        out["/".join(parts[-3:-1])] = (end - stamps[i][0]).total_seconds()   # student/assignment
    return out


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    root = tmp_path_factory.mktemp("course")
    (root / "nbgrader_config.py").write_text(
        "c = get_config()\n"
        f"c.CourseDirectory.root = {str(root)!r}\n"
        "c.CourseDirectory.course_id = 'inside-the-layer'\n"
        f"c.Execute.timeout = {CELL_TIMEOUT_S}\n"
        "c.Application.log_format = '%(asctime)s.%(msecs)03d %(message)s'\n"
        "c.Application.log_datefmt = '%H:%M:%S'\n")
    for name, (solution, _) in ASSIGNMENTS.items():
        (root / "source" / name).mkdir(parents=True)
        shutil.copy(solution, root / "source" / name / solution.name)
    times = {"generate_assignment": nbgrader(root, "generate_assignment", "*", "--force")[0]}
    for name, (solution, _) in ASSIGNMENTS.items():
        for student, src in (("correct", root / "source" / name / solution.name),
                             ("blank", root / "release" / name / solution.name)):
            (root / "submitted" / student / name).mkdir(parents=True)
            shutil.copy(src, root / "submitted" / student / name / solution.name)
    times["autograde"], log = nbgrader(root, "autograde", "*", "--force")
    times["generate_feedback"] = nbgrader(root, "generate_feedback", "*", "--force")[0]
    graded = len(ASSIGNMENTS) * len(STUDENTS)
    each = per_notebook(log)
    print(f"\nnbgrader round trip, {len(ASSIGNMENTS)} assignments × {len(STUDENTS)} students: "
          + ", ".join(f"{step} {secs:.0f} s" for step, secs in times.items())
          + f"; autograde {times['autograde'] / graded:.1f} s per notebook on average")
    for name in ASSIGNMENTS:
        print(f"  autograde {name:28} " + "  ".join(f"{s} {each.get(f'{s}/{name}', float('nan')):5.1f} s"
                                                   for s in STUDENTS))
    assert len(each) == graded, f"the log names {len(each)} submissions, not {graded}"
    return root


NAMES = list(ASSIGNMENTS)
LABS = [name for name in NAMES if name.startswith("lab_")]
# One test per assignment: a failure names the assignment. (tests/conftest.py starts this file
# first, so its few minutes of set-up never come last beside an idle worker.)


@pytest.mark.parametrize("name", NAMES)
def test_the_release_is_the_student_version(course, name):
    """nbgrader's release has the cells `make exercises` writes to exercises/ (test_exercises.py
    checks that the committed exercises are up to date)."""
    solution, exercise = ASSIGNMENTS[name]
    released = nbformat.read(course / "release" / name / solution.name, as_version=4)
    ours = tool.generate(course / "source" / name / solution.name)
    assert [c.source for c in released.cells] == [c.source for c in ours.cells], \
        f"nbgrader's release of {name} differs from what `make exercises` writes to {exercise.relative_to(ROOT)}"


def _score(course: Path, name: str, student: str) -> tuple:
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        nb = gb.find_submission_notebook(ASSIGNMENTS[name][0].stem, name, student)
        return nb.score, nb.max_score, {g.name: g.score for g in nb.grades}


@pytest.mark.parametrize("name", NAMES)
def test_a_correct_submission_gets_every_point(course, name):
    score, top, _ = _score(course, name, "correct")
    assert top > 0 and score == top, f"the solutions of {name} score {score} of {top}"


@pytest.mark.parametrize("name", NAMES)
def test_the_correct_submission_reproduces_the_stored_outputs(course, name):
    """What nbval would check, on the execution autograde has just made (so the solutions are
    executed once in the suite, not also by nbval): every code cell nbval checks prints, as
    ``make determinism`` compares it (nbval's markers, coalesced streams, tests/sanitize.cfg,
    text only), what the committed solutions notebook shows, and no cell fails."""
    stored = nbformat.read(ASSIGNMENTS[name][0], as_version=4)
    graded = nbformat.read(course / "autograded" / "correct" / name / ASSIGNMENTS[name][0].name, as_version=4)
    assert len(stored.cells) == len(graded.cells), f"{name}: autograde's copy has another number of cells"
    sanitizers, compared, wrong = determinism.load_sanitizers(), 0, []
    code = [(i, a, b) for i, (a, b) in enumerate(zip(stored.cells, graded.cells)) if a.cell_type == "code"]
    for number, (index, mine, ran) in enumerate(code):
        errors = [f"{o.ename}: {o.evalue}" for o in ran.outputs if o.output_type == "error"]
        assert not errors, f"{name} Cell {number} fails under autograde: {errors[0]}"
        if determinism.exclusion(mine) or (mine.get("execution_count") is None and not mine.outputs):
            continue
        compared += 1
        views = [("stored", determinism.text_view(mine.outputs, sanitizers)),
                 ("autograde", determinism.text_view(ran.outputs, sanitizers))]
        if diff := determinism.cell_diff(number, index, views):       # make determinism's report of a cell
            wrong.append(f"Cell {number}: " + "; ".join(
                f"{v.sources[0]}{f' (line {v.line_no})' if v.line_no else ''}: {v.line!r}" for v in diff.variants))
    assert compared, f"{name}: no cell's output was compared"
    assert not wrong, f"{ASSIGNMENTS[name][0].relative_to(ROOT)} is stale or not deterministic:\n" + "\n".join(wrong)


@pytest.mark.parametrize("name", NAMES)
def test_the_untouched_student_version_gets_no_point(course, name):
    scored = {g: s for g, s in _score(course, name, "blank")[2].items() if s}
    assert not scored, f"the blank {name} scores points: {scored}"


@pytest.mark.parametrize("name", NAMES)
def test_the_untouched_student_version_fails_exactly_at_its_checks(course, name):
    """What a learner meets who runs every cell of an exercise or lab before writing anything:
    an error in each check cell, a NotImplementedError, and nowhere else — read from the blank
    submission autograde ran (the release, which is exercises/, with hidden tests put back)."""
    nb = nbformat.read(course / "autograded" / "blank" / name / ASSIGNMENTS[name][0].name, as_version=4)
    failed = {i: o for i, c in enumerate(nb.cells) if c.cell_type == "code"
              for o in c.outputs if o.output_type == "error"}
    checks = {i for i, c in enumerate(nb.cells) if c.metadata.get("nbgrader", {}).get("grade")}
    assert checks, f"{name}: autograde's copy has no check cells (nbgrader metadata lost?)"
    assert set(failed) == checks, (f"{name}: errors in cells {sorted(failed)}, expected exactly the check cells "
                                   f"{sorted(checks)}: " + "; ".join(f"{i}: {o.ename}" for i, o in failed.items()))
    assert {o.ename for o in failed.values()} == {"NotImplementedError"}


@pytest.mark.parametrize("name", LABS)
def test_the_labs_ran_on_ranks_inside_autograde(course, name):
    nb = nbformat.read(course / "autograded" / "correct" / name / ASSIGNMENTS[name][0].name, as_version=4)
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "passed on 4 ranks" in printed and "catches the bug on 3 ranks" in printed, \
        f"{name}: the checks' hidden cases did not run under autograde:\n{printed[:1500]}"


@pytest.mark.parametrize("student", STUDENTS)
@pytest.mark.parametrize("name", NAMES)
def test_feedback_for_every_submission(course, name, student):
    page = course / "feedback" / student / name / f"{ASSIGNMENTS[name][0].stem}.html"
    assert page.exists(), f"no feedback for {student} on {name}"
    assert "Score" in page.read_text(errors="replace")
