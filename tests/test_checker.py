"""The headless checker (``python -m intralayer.labs check``): solutions pass, blank notebooks fail, and
a submission that patches the checks from a cell earns nothing (its cells run in another process than
the verdict). Every solutions and blank notebook was run through it once by hand (book/instructors.md
has the command); here a lab and an exercise each way, and the patched submissions."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]


def checker(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "intralayer.labs", "check", *map(str, paths)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_solutions_pass_with_full_points():
    done = checker(ROOT / "solutions/labs/04_context_parallel.ipynb", ROOT / "solutions/02_megatron_tp.ipynb")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "FAIL" not in done.stdout and done.stdout.count("PASS") >= 6, done.stdout


def test_blank_notebooks_fail_at_every_check():
    done = checker(ROOT / "exercises/labs/06_expert_parallel.ipynb")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "0 of" in done.stdout and "PASS" not in done.stdout and "not written yet" in done.stdout, done.stdout


def _patched(blank: Path, folder: Path, patch: str) -> Path:
    """The blank notebook with ``patch`` added to its first answer cell, as a student could."""
    nb = nbformat.read(blank, as_version=4)
    first = next(c for c in nb.cells if c.get("metadata", {}).get("nbgrader", {}).get("solution"))
    first.source = patch + "\n" + first.source
    out = folder / ("labs" if "labs" in blank.parts else "") / blank.name
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out)
    return out


@pytest.mark.parametrize("patch", [
    "from intralayer import labs\nlabs.Check.run = lambda self, *a, **k: print('passed')",
    "from intralayer.labs import check as _c\n_c.run_many = lambda checks, *a, **k: [_c.Report('x') for _ in checks]",
    "import intralayer.labs.transport as _t\n_t.unwritten = lambda objects: []",
])
def test_a_blank_lab_that_patches_the_check_earns_nothing(tmp_path, patch):
    done = checker(_patched(ROOT / "exercises/labs/00_collectives.ipynb", tmp_path, patch))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "0 of 6 points" in done.stdout and "PASS" not in done.stdout, done.stdout


def test_a_blank_exercise_that_redefines_assert_helpers_earns_nothing(tmp_path):
    patch = "import builtins\nbuiltins.AssertionError = type('Fine', (Exception,), {})"
    done = checker(_patched(ROOT / "exercises/00_collectives.ipynb", tmp_path, patch))
    assert done.returncode == 1 and "PASS" not in done.stdout, done.stdout + done.stderr


def test_a_notebook_that_is_not_the_courses_is_refused_by_name(tmp_path):
    other = tmp_path / "99_unknown.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), other)
    done = checker(other)
    assert done.returncode != 0 and "no notebook of that name in solutions/" in done.stderr, done.stderr
