"""The headless checker (``python -m intralayer.labs check``): solutions pass, blank notebooks fail, and
a submission that patches the checks from a cell earns nothing (its cells run in another process than
the verdict). Every solutions and blank notebook was run through it once by hand (book/instructors.md
has the command); here a lab and an exercise each way, and the patched submissions."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]


def checker(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "intralayer.labs", "check", *map(str, paths)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_solutions_pass_and_a_blank_notebook_fails_at_every_check():
    """One run of the checker over three notebooks: the exit code is 1 because one fails, and each
    notebook's lines say which (a solutions lab and exercise at full points, a blank lab at none)."""
    done = checker(ROOT / "solutions/labs/04_context_parallel.ipynb", ROOT / "solutions/02_megatron_tp.ipynb",
                   ROOT / "exercises/labs/06_expert_parallel.ipynb")
    assert done.returncode == 1, done.stdout + done.stderr
    reports = done.stdout.split("\n" + str(ROOT / "solutions/02_megatron_tp.ipynb"))
    lab04, rest = reports[0], reports[1]
    ex02, blank = rest.split("\n" + str(ROOT / "exercises/labs/06_expert_parallel.ipynb"))
    assert "7 of 7 points" in lab04 and "FAIL" not in lab04, done.stdout
    assert "FAIL" not in ex02 and ex02.count("PASS") >= 3, done.stdout
    assert ": 0 of" in blank and "PASS" not in blank and "not written yet" in blank, done.stdout


def test_solutions_alone_exit_zero():
    done = checker(ROOT / "solutions/labs/00_collectives.ipynb")
    assert done.returncode == 0 and "6 of 6 points" in done.stdout, done.stdout + done.stderr


def _patched(blank: Path, folder: Path, patch: str) -> Path:
    """The blank notebook with ``patch`` added to its first answer cell, as a student could."""
    nb = nbformat.read(blank, as_version=4)
    first = next(c for c in nb.cells if c.get("metadata", {}).get("nbgrader", {}).get("solution"))
    first.source = patch + "\n" + first.source
    out = folder / ("labs" if "labs" in blank.parts else "") / blank.name
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out)
    return out


PATCHES = [
    "from intralayer import labs\nlabs.Check.run = lambda self, *a, **k: print('passed')",
    "from intralayer.labs import check as _c\n_c.run_many = lambda checks, *a, **k: [_c.Report('x') for _ in checks]",
    "import intralayer.labs.transport as _t\n_t.unwritten = lambda objects: []",
]


def test_blank_notebooks_that_patch_the_checks_earn_nothing(tmp_path):
    """Each patch a student could put in an answer cell (the check's run, the runner of checks, the
    blank-exercise test, Python's AssertionError) patches a process that grades nothing."""
    patched = [_patched(ROOT / "exercises/labs/00_collectives.ipynb", tmp_path / str(i), patch)
               for i, patch in enumerate(PATCHES)]
    patched.append(_patched(ROOT / "exercises/00_collectives.ipynb", tmp_path / "ex",
                            "import builtins\nbuiltins.AssertionError = type('Fine', (Exception,), {})"))
    done = checker(*patched)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.count("0 of 6 points") == len(PATCHES) and "0 of 5 points" in done.stdout, done.stdout
    assert "PASS" not in done.stdout, done.stdout


def test_a_notebook_that_is_not_the_courses_is_refused_by_name(tmp_path):
    other = tmp_path / "99_unknown.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), other)
    done = checker(other)
    assert done.returncode != 0 and "no notebook of that name in solutions/" in done.stderr, done.stderr


def test_a_submission_without_its_answer_cells_gets_no_solution_in_their_place(tmp_path):
    """Deleting an answer cell (or losing its metadata) must not bring in the course's solution."""
    nb = nbformat.read(ROOT / "solutions/labs/00_collectives.ipynb", as_version=4)
    nb.cells = [c for c in nb.cells if not c.get("metadata", {}).get("nbgrader", {}).get("solution")]
    out = tmp_path / "labs" / "00_collectives.ipynb"
    out.parent.mkdir()
    nbformat.write(nb, out)
    done = checker(out)
    assert done.returncode == 1 and "0 of 6 points" in done.stdout, done.stdout + done.stderr
