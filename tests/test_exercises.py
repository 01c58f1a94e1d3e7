"""Exercises both ways: each solution passes (nbval runs solutions/), each blank exercise
fails at its check cells with NotImplementedError and nowhere else, and exercises/ is
what `make exercises` generates from solutions/. The same for the labs and bug hunts
(solutions/labs/ → exercises/labs/), whose check cells run the learner's code on real
ranks (tests/test_labs.py proves their checks reject wrong answers)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
LABS = sorted((ROOT / "solutions" / "labs").glob("*.ipynb"))
import exercises as tool

#: Every solutions notebook with the student version generated from it.
PAIRS = tool.pairs()


def nbgrader(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def test_every_chapter_has_solutions_and_exercises():
    chapters = {p.name for p in (ROOT / "chapters").glob("*.ipynb")}
    assert chapters, "no chapters found"
    assert chapters == {p.name for p in SOLUTIONS}
    assert chapters == {p.name for p in (ROOT / "exercises").glob("*.ipynb")}


def test_exercises_are_generated_from_solutions():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "exercises.py"), "check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_solution_structure(solution):
    nb = nbformat.read(solution, as_version=4)
    solutions = [c for c in nb.cells if nbgrader(c).get("solution")]
    checks = [c for c in nb.cells if nbgrader(c).get("grade")]
    assert 3 <= len(solutions) <= 5, f"{len(solutions)} exercises; the course asks for 3 to 5"
    assert len(checks) == len(solutions), "every exercise needs one check cell"
    assert all("### BEGIN SOLUTION" in c.source for c in solutions)
    assert all("### BEGIN HIDDEN TESTS" in c.source for c in checks), "each check has hidden tests"
    ids = [nbgrader(c)["grade_id"] for c in solutions + checks]
    assert len(set(ids)) == len(ids), "nbgrader grade ids must be unique"


def test_every_lab_belongs_to_a_chapter_and_has_its_exercise():
    chapters = {p.name for p in (ROOT / "chapters").glob("*.ipynb")}
    labs = {p.name for p in LABS}
    assert labs, "no labs in solutions/labs"
    assert labs <= chapters, f"labs named after no chapter: {sorted(labs - chapters)}"
    assert labs == {p.name for p in (ROOT / "exercises" / "labs").glob("*.ipynb")}
    assert len(PAIRS) == len(SOLUTIONS) + len(LABS)


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_lab_structure(lab):
    """Each part: a solution cell, then one check cell that runs it with labs.Check on real ranks,
    its hidden cases between the markers and `check.run()` after them (so they run in the same start)."""
    nb = nbformat.read(lab, as_version=4)
    cells = [c for c in nb.cells if c.cell_type == "code" and nbgrader(c)]
    solutions = [c for c in cells if nbgrader(c).get("solution")]
    checks = [c for c in cells if nbgrader(c).get("grade")]
    assert 2 <= len(solutions) <= 5, f"{len(solutions)} parts; a lab has 2 to 5 (a bug hunt among them)"
    assert [bool(nbgrader(c).get("solution")) for c in cells] == [True, False] * len(solutions), \
        "each solution cell must be followed by its check cell"
    assert all("### BEGIN SOLUTION" in c.source for c in solutions)
    for c in checks:
        assert nbgrader(c)["points"] > 0 and nbgrader(c).get("locked")
        assert "labs.Check(" in c.source and "### BEGIN HIDDEN TESTS" in c.source, nbgrader(c)["grade_id"]
        assert c.source.rstrip().endswith("check.run()"), f"{nbgrader(c)['grade_id']}: run() must come last"
    hunts = [c for c in checks if "impl=" in c.source]
    assert len(hunts) == 1, "each lab has exactly one bug hunt (a check whose hidden cases name an impl)"
    ids = [nbgrader(c)["grade_id"] for c in cells]
    assert len(set(ids)) == len(ids), "nbgrader grade ids must be unique"


@pytest.mark.parametrize("solution, exercise", PAIRS,
                         ids=[("labs/" if s.parent.name == "labs" else "") + s.stem for s, _ in PAIRS])
def test_the_student_version_holds_no_solution_and_no_hidden_test(solution, exercise):
    """The committed student version gives nothing away. (That running it fails exactly at its
    check cells, with NotImplementedError, is checked in tests/test_nbgrader.py on what
    nbgrader's autograde ran: the same notebook, hidden tests put back.)"""
    text = nbformat.writes(nbformat.read(exercise, as_version=4))
    assert "### BEGIN SOLUTION" not in text and "HIDDEN TESTS" not in text
