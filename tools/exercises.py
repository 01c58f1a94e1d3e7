"""Generate exercises/ from solutions/ with nbgrader's own preprocessors.

    python tools/exercises.py write   # (re)write exercises/NN_name.ipynb and exercises/labs/NN_name.ipynb
    python tools/exercises.py check   # exit 1 if a committed exercise or lab is out of date

Solutions are replaced by ``raise NotImplementedError()`` (ClearSolutions), hidden
tests are removed (ClearHiddenTests), outputs are cleared (ClearOutput). The labs and
bug hunts (``solutions/labs/`` → ``exercises/labs/``) are generated the same way.
"""
from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbgrader.preprocessors import ClearHiddenTests, ClearOutput, ClearSolutions

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS, EXERCISES = ROOT / "solutions", ROOT / "exercises"
#: Each solutions folder and the folder its student versions go to.
FOLDERS = ((SOLUTIONS, EXERCISES), (SOLUTIONS / "labs", EXERCISES / "labs"))


def pairs() -> list[tuple[Path, Path]]:
    """(solution, exercise) for every solutions notebook: the exercises, then the labs."""
    return [(solution, out / solution.name) for src, out in FOLDERS for solution in sorted(src.glob("*.ipynb"))]


def generate(solution: Path) -> nbformat.NotebookNode:
    """The student notebook for one solutions notebook."""
    nb = nbformat.read(solution, as_version=4)
    for pre in (ClearSolutions(enforce_metadata=True), ClearHiddenTests(enforce_metadata=True), ClearOutput()):
        nb, _ = pre.preprocess(nb, {})
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.execution_count = None
    return nb


def text(nb: nbformat.NotebookNode) -> str:
    return nbformat.writes(nb) + "\n"


def main(argv: list[str]) -> int:
    if argv not in (["write"], ["check"]):
        print(__doc__)
        return 2
    stale = []
    for solution, target in pairs():
        new = text(generate(solution))
        if argv == ["write"]:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(new)
            print(f"wrote {target.relative_to(ROOT)}")
        elif not target.exists() or target.read_text() != new:
            stale.append(target.relative_to(ROOT))
    if stale:
        print("out of date with solutions/ (run `make exercises`):", *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
