"""Checks that cannot be fooled: every exercise of every chapter rejects its plausible wrong answers.

``tests/wrong_answers/NN_name.py`` keeps, for each exercise (by its nbgrader grade id), wrong
answers a learner could plausibly write — each the whole exercise cell, as the learner would
leave it — with the part of the check that must catch it (``"visible"``: the check the learner
sees; ``"hidden"``: only the instructor's hidden tests) and what is wrong with it.

For each wrong answer the solutions notebook runs with that one cell replaced, its code cells
in order, in one fresh namespace in this process (the check cells' visible part, then their
hidden part); the checks that cannot see the replaced cell — they and their exercise mention none
of the names it binds — are left out, as the unchanged solution passes them. It passes when

* the exercise's check cell fails, in the declared part, with an ``AssertionError`` whose
  message says in words what is wrong (not a bare assert, not a NumPy broadcasting error);
* every other cell runs: the wrong answer breaks no other exercise's check.

A wrong answer may also fail the checks of exercises declared to build on it (exercise 4 of
chapter 00 uses exercise 1's ``bus_factor``); those checks must then say so in words too.

Right answers written differently from the solution (``RIGHT`` in the same files) must pass
every check, so that the checks are not tied to one way of writing the answer.

One real kernel (nbclient) then runs every chapter with one wrong answer per exercise substituted, to
show that a notebook executed the way nbval and ``nbgrader autograde`` execute it fails in the
same cells with the same errors. The student notebooks (exercises/) import nothing from the
course library that answers an exercise.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import io
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
DATA = ROOT / "tests" / "wrong_answers"
HIDDEN = "### BEGIN HIDDEN TESTS"
PARTS = ("visible", "hidden")

# What a student notebook may import from the course library: helpers the exercises use, none
# of them the answer to an exercise (the hidden checks import the answers themselves).
ALLOWED_IMPORTS = {
    "00_collectives": {"intralayer.collectives.steps"},
    "01_split_matmul": set(),
    "02_megatron_tp": set(),
    "03_sequence_parallel": {"intralayer.memory.activation_bytes_per_layer", "intralayer.model.MLP",
                             "intralayer.model.Block"},
    "04_context_parallel": {"intralayer.collectives.LINKS"},
    "05_moe": set(),
    "06_expert_parallel": set(),
    "07_overlap": {"intralayer.overlap.model_times"},
    "08_planner": {"intralayer.planner"},
    "09_inference": set(),
}


def nbgrader(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


@dataclass(frozen=True)
class Exercise:
    grade_id: str
    cell: int        # index among the notebook's code cells
    check: int       # index of its check cell among the code cells


def code_cells(path: Path) -> list:
    return [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


def exercises(cells) -> dict[str, Exercise]:
    found, pending = {}, None
    for i, c in enumerate(cells):
        md = nbgrader(c)
        if md.get("solution"):
            pending = (md["grade_id"], i)
        elif md.get("grade"):
            assert pending, f"check cell {md['grade_id']} has no exercise before it"
            found[pending[0]] = Exercise(pending[0], pending[1], i)
            pending = None
    return found


@functools.cache
def answers(stem: str):
    """The module tests/wrong_answers/<stem>.py, or None when the chapter keeps none."""
    path = DATA / f"{stem}.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(f"answers_{stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wrong_answers(stem: str) -> dict[str, list[tuple[str, str, tuple[str, ...], str]]]:
    """{grade id: [(part that must catch it, what is wrong, exercises that build on it, cell source)]}."""
    entries = getattr(answers(stem), "WRONG", {})
    return {gid: [(e[0], e[1], e[2] if len(e) == 4 else (), e[-1]) for e in rows] for gid, rows in entries.items()}


def right_answers(stem: str) -> dict[str, list[tuple[str, str]]]:
    """{grade id: [(how it differs from the solution, cell source)]}: right answers the checks must accept."""
    return getattr(answers(stem), "RIGHT", {})


CASES = [(nb.stem, gid, k, *entry) for nb in NOTEBOOKS for gid, entries in wrong_answers(nb.stem).items()
         for k, entry in enumerate(entries)]
RIGHT_CASES = [(nb.stem, gid, k, *entry) for nb in NOTEBOOKS for gid, entries in right_answers(nb.stem).items()
               for k, entry in enumerate(entries)]


def run_in_process(cells, replace: dict[int, str], skip=frozenset()) -> dict[int, tuple[str, BaseException]]:
    """Run the code cells in order in one fresh namespace; return {cell: (part, exception)} for those that raised.

    A check cell runs as its visible part and then its hidden part, in the same namespace, as the
    kernel runs the whole cell; ``part`` says which of the two raised. Cells in ``skip`` do not run.
    """
    ns = {"__name__": "__main__"}
    failed = {}
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        for i, c in enumerate(cells):
            if i in skip:
                continue
            source = replace.get(i, c.source)
            visible, _, hidden = source.partition(HIDDEN)
            pieces = [("visible", visible)] + ([("hidden", HIDDEN + hidden)] if hidden else [])
            for part, text in pieces:
                try:
                    exec(compile(text, f"<{part} part of cell {i}>", "exec"), ns)
                except Exception as error:     # noqa: BLE001 - every failure is reported
                    failed[i] = (part, error)
                    break
    return failed


class _Bindings(ast.NodeVisitor):
    """The names a cell binds at top level: definitions, imports and assignments outside function bodies."""

    def __init__(self):
        self.names = set()

    def visit_FunctionDef(self, node):
        self.names.add(node.name)

    visit_AsyncFunctionDef = visit_ClassDef = visit_FunctionDef

    def visit_Import(self, node):
        self.names |= {(a.asname or a.name).split(".")[0] for a in node.names}

    visit_ImportFrom = visit_Import

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Store):
            self.names.add(node.id)


def bound(source: str) -> set[str]:
    visitor = _Bindings()
    visitor.visit(ast.parse(source))
    return visitor.names


def mentioned(source: str) -> set[str]:
    return {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}


def unaffected_checks(cells, found: dict[str, Exercise], grade_id: str, code: str) -> set[int]:
    """The check cells a wrong answer to ``grade_id`` cannot change: neither they nor the exercise they
    check mention a name that the wrong cell (or the solution it replaces) binds, directly or through
    another exercise that does. The unchanged solutions pass them (test_solution_passes_in_process)."""
    touched = bound(code) | bound(cells[found[grade_id].cell].source)
    grew = True
    while grew:
        grew = False
        for ex in found.values():
            if ex.grade_id != grade_id and mentioned(cells[ex.cell].source) & touched \
                    and not bound(cells[ex.cell].source) <= touched:
                touched |= bound(cells[ex.cell].source)
                grew = True
    return {ex.check for ex in found.values() if ex.grade_id != grade_id
            and not (mentioned(cells[ex.check].source) | mentioned(cells[ex.cell].source)) & touched}


def in_words(message: str) -> bool:
    """A message that says what is wrong: at least three words of letters, not only numbers or a repr."""
    return len(re.findall(r"[A-Za-zÀ-ÿ]{2,}", message)) >= 3


def describe(failed, ex_by_cell) -> str:
    return "; ".join(f"cell {i} ({ex_by_cell.get(i, 'not a check')}, {part}): {type(e).__name__}: {e}"
                     for i, (part, e) in failed.items())


@pytest.mark.parametrize("solution", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_exercise_keeps_wrong_answers(solution):
    found = exercises(code_cells(solution))
    wrong = wrong_answers(solution.stem)
    assert set(wrong) == set(found), f"wrong answers for {sorted(wrong)}, exercises {sorted(found)}"
    assert set(right_answers(solution.stem)) == set(found), "keep one right answer written differently per exercise"
    for gid, entries in wrong.items():
        assert len(entries) >= 3, f"{gid}: keep at least three plausible wrong answers, found {len(entries)}"
        assert all(part in PARTS for part, _, _, _ in entries), gid
        assert all(set(also) <= set(found) - {gid} for _, _, also, _ in entries), gid
        whys = [why for _, why, _, _ in entries]
        assert len(set(whys)) == len(whys), f"{gid}: two wrong answers share a description"


@pytest.mark.parametrize("solution", NOTEBOOKS, ids=lambda p: p.stem)
def test_solution_passes_in_process(solution):
    """The runner itself: the unchanged solutions run through every cell, hidden checks included."""
    cells = code_cells(solution)
    failed = run_in_process(cells, {})
    assert not failed, describe(failed, {e.check: e.grade_id for e in exercises(cells).values()})


@pytest.mark.parametrize("stem, grade_id, k, part, why, also, code", CASES,
                         ids=[f"{c[0][:2]}-{c[1]}-{c[2]}" for c in CASES])
def test_wrong_answer_is_rejected(stem, grade_id, k, part, why, also, code):
    cells = code_cells(ROOT / "solutions" / f"{stem}.ipynb")
    found = exercises(cells)
    ex = found[grade_id]
    assert "### BEGIN SOLUTION" not in code
    skip = unaffected_checks(cells, found, grade_id, code)
    failed = run_in_process(cells, {ex.cell: code}, skip)
    by_cell = {e.check: e.grade_id for e in found.values()}
    want = {ex.check} | {found[a].check for a in also}
    assert not want & skip, f"the analysis skips a check that '{why}' should fail: {sorted(want & skip)}"
    assert set(failed) == want, (f"wrong answer '{why}': expected exactly the checks of {[grade_id, *also]} "
                                 f"(cells {sorted(want)}) to fail, got: {describe(failed, by_cell) or 'nothing failed'}")
    for i, (got_part, error) in failed.items():
        assert isinstance(error, AssertionError), (
            f"'{why}' fails cell {i} with {type(error).__name__}: {error}; a check must fail with an "
            "AssertionError that says what is wrong")
        assert in_words(str(error)), f"'{why}' fails cell {i} without a message in words: {str(error)!r}"
    got_part = failed[ex.check][0]
    assert got_part == part, f"'{why}' should be caught by the {part} checks, but the {got_part} ones caught it"


@pytest.mark.parametrize("stem, grade_id, k, how, code", RIGHT_CASES,
                         ids=[f"{c[0][:2]}-{c[1]}-{c[2]}" for c in RIGHT_CASES])
def test_right_answer_written_differently_passes(stem, grade_id, k, how, code):
    """The checks are not tied to the solution's way of writing it: other right answers pass every check."""
    cells = code_cells(ROOT / "solutions" / f"{stem}.ipynb")
    found = exercises(cells)
    failed = run_in_process(cells, {found[grade_id].cell: code})
    assert not failed, f"right answer '{how}' is rejected: " + describe(failed, {e.check: e.grade_id for e in found.values()})


def test_rejected_in_a_real_kernel():
    """One kernel runs every chapter with the last wrong answer of each exercise substituted
    (``%reset -f`` between chapters): exactly the check cells fail, each with an AssertionError."""
    cells, expected = [], {}
    for solution in NOTEBOOKS:
        own = code_cells(solution)
        found = exercises(own)
        wrong = wrong_answers(solution.stem)
        cells.append(nbformat.v4.new_code_cell("%reset -f"))
        offset = len(cells)
        for i, c in enumerate(own):
            cells.append(nbformat.v4.new_code_cell(c.source, metadata=c.metadata))
        for gid, ex in found.items():
            chosen = [w for w in wrong[gid] if not w[2]][-1]         # the last that breaks no other exercise
            cells[offset + ex.cell].source = chosen[3]
            expected[offset + ex.check] = f"{solution.stem}: {gid} ({chosen[1]})"
    nb = nbformat.v4.new_notebook(cells=cells)
    NotebookClient(nb, timeout=120, allow_errors=True, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "solutions")}}).execute()
    errors = {i: o for i, c in enumerate(nb.cells) for o in c.outputs if o.output_type == "error"}
    assert set(errors) == set(expected), (
        "cells that failed: " + "; ".join(f"{i} {o.ename}: {o.evalue}" for i, o in errors.items())
        + " — expected exactly: " + "; ".join(f"{i} {w}" for i, w in expected.items()))
    wrong_kind = {expected[i]: f"{o.ename}: {o.evalue}" for i, o in errors.items()
                  if o.ename != "AssertionError" or not in_words(o.evalue)}
    assert not wrong_kind, wrong_kind


def imported_names(source: str) -> set[str]:
    """``module.name`` for each name a cell imports from the course library (whole modules as ``module``)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "intralayer":
            names |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.split(".")[0] == "intralayer"}
    return names


@pytest.mark.parametrize("solution", NOTEBOOKS, ids=lambda p: p.stem)
def test_student_notebook_imports_no_answer(solution):
    """What the learner sees imports only helpers from the course library, never an exercise's answer."""
    student = ROOT / "exercises" / solution.name
    got = set().union(*(imported_names(c.source) for c in code_cells(student)))
    extra = got - ALLOWED_IMPORTS[solution.stem]
    assert not extra, f"exercises/{solution.name} imports {sorted(extra)} from the course library"
