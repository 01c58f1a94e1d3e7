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


def _sections(stdout: str, paths: list[Path]) -> dict[Path, str]:
    """The checker's report cut into each notebook's lines (it reports them in the order given)."""
    starts = [stdout.find(str(path)) for path in paths]
    assert -1 not in starts and starts == sorted(starts), stdout
    return {path: stdout[a:b] for path, a, b in zip(paths, starts, [*starts[1:], len(stdout)])}


def test_solutions_alone_exit_zero():
    """One run over a solutions lab and a solutions exercise notebook: every check passes, exit 0."""
    lab04, ex02 = ROOT / "solutions/labs/04_context_parallel.ipynb", ROOT / "solutions/02_megatron_tp.ipynb"
    done = checker(lab04, ex02)
    assert done.returncode == 0, done.stdout + done.stderr
    report = _sections(done.stdout, [lab04, ex02])
    assert "7 of 7 points" in report[lab04] and "FAIL" not in report[lab04], done.stdout
    assert "FAIL" not in report[ex02] and report[ex02].count("PASS") >= 3, done.stdout


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
    "import intralayer.labs.transport as _t\n_t._blank = lambda fn: False",
]


def test_blank_patched_and_stripped_notebooks_earn_nothing(tmp_path):
    """One run, exit 1: a blank lab fails at every check with 'not written yet'; each patch a student could
    put in an answer cell (the check's run, the runner of checks, the blank-exercise test, Python's
    AssertionError) patches a process that grades nothing; and a submission without its answer cells (deleted,
    or their metadata lost) gets no solution in their place."""
    blank = ROOT / "exercises/labs/06_expert_parallel.ipynb"
    patched = [_patched(ROOT / "exercises/labs/00_collectives.ipynb", tmp_path / str(i), patch)
               for i, patch in enumerate(PATCHES)]
    patched.append(_patched(ROOT / "exercises/00_collectives.ipynb", tmp_path / "ex",
                            "import builtins\nbuiltins.AssertionError = type('Fine', (Exception,), {})"))
    nb = nbformat.read(ROOT / "solutions/labs/00_collectives.ipynb", as_version=4)
    nb.cells = [c for c in nb.cells if not c.get("metadata", {}).get("nbgrader", {}).get("solution")]
    stripped = tmp_path / "stripped" / "labs" / "00_collectives.ipynb"
    stripped.parent.mkdir(parents=True)
    nbformat.write(nb, stripped)
    paths = [blank, *patched, stripped]
    done = checker(*paths)
    assert done.returncode == 1, done.stdout + done.stderr
    report = _sections(done.stdout, paths)
    assert ": 0 of" in report[blank] and "PASS" not in report[blank] and "not written yet" in report[blank], done.stdout
    for path in patched[:-1]:
        assert "0 of 6 points" in report[path] and "PASS" not in report[path], report[path]
    assert "0 of 5 points" in report[patched[-1]] and "PASS" not in report[patched[-1]], report[patched[-1]]
    assert "0 of 6 points" in report[stripped] and "PASS" not in report[stripped], report[stripped]


def test_a_notebook_that_is_not_the_courses_is_refused_by_name(tmp_path):
    other = tmp_path / "99_unknown.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), other)
    done = checker(other)
    assert done.returncode != 0 and "no notebook of that name in solutions/" in done.stderr, done.stderr
