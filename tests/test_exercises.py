"""Exercises both ways: each solution passes (nbval runs solutions/), each blank exercise
fails at its check cells with NotImplementedError and nowhere else, and exercises/ is
what `make exercises` generates from solutions/."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
sys.path.insert(0, str(ROOT / "tools"))
import exercises as tool  # noqa: E402


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


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_blank_exercise_fails_exactly_at_its_checks(solution):
    exercise = ROOT / "exercises" / solution.name
    nb = nbformat.read(exercise, as_version=4)
    text = nbformat.writes(nb)
    assert "### BEGIN SOLUTION" not in text and "HIDDEN TESTS" not in text
    NotebookClient(nb, timeout=120, allow_errors=True, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "exercises")}}).execute()
    failed = {i: o for i, c in enumerate(nb.cells) if c.cell_type == "code"
              for o in c.outputs if o.output_type == "error"}
    checks = {i for i, c in enumerate(nb.cells) if nbgrader(c).get("grade")}
    assert set(failed) == checks, (f"errors in cells {sorted(failed)}, expected exactly the check cells "
                                   f"{sorted(checks)}: " + "; ".join(f"{i}: {o.ename}" for i, o in failed.items()))
    assert {o.ename for o in failed.values()} == {"NotImplementedError"}
