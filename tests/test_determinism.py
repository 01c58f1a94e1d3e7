"""tools/determinism.py (``make determinism``) on tiny notebooks: it tells a fixed output from a
changing one, names the cell, applies tests/sanitize.cfg and leaves out the cells nbval ignores."""
from __future__ import annotations

import random
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parents[1]
import determinism


def _notebook(path: Path, cells) -> Path:
    """A notebook whose stored outputs are those given: cells are (source, stdout or None, tags)."""
    nb = new_notebook(cells=[new_markdown_cell("# tiny")])
    nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for count, (source, stdout, tags) in enumerate(cells, start=1):
        cell = new_code_cell(source, execution_count=count, metadata={"tags": tags} if tags else {})
        if stdout is not None:
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=stdout)]
        nb.cells.append(cell)
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """One check of two tiny notebooks, two runs each, two at a time (the CLI's default jobs)."""
    folder = tmp_path_factory.mktemp("determinism")
    steady = _notebook(folder / "steady.ipynb", [
        ("print('fixed', 6 * 7)", "fixed 42\n", None),
        ("import random\nrandom.seed(0)\nprint(random.randint(0, 10**9))", None, None),
        ("x = [1, 2]", None, None),
        ("x", None, None),
        # a fresh object's address and a fresh /tmp path: both differ per run and from the
        # stored text, and sanitize.cfg maps both to fixed words
        ("import uuid\nprint(object())\nprint('/tmp/run-' + uuid.uuid4().hex)",
         "<object object at 0x7f0011223344>\n/tmp/some/other/folder\n", None),
    ])
    # the stored output of cell 1 of steady.ipynb is that of the seeded draw, whatever it is
    nb = nbformat.read(steady, as_version=4)
    random.seed(0)
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"{random.randint(0, 10**9)}\n")]
    nb.cells[4].outputs = [nbformat.v4.new_output("execute_result", data={"text/plain": "[1, 2]"},
                                                  execution_count=4)]
    nbformat.write(nb, steady)
    drifting = _notebook(folder / "drifting.ipynb", [
        ("print('same every time')", "same every time\n", None),
        ("import time\nprint('now', time.time_ns())", "now 1\n", None),
        ("import time\nprint(time.time_ns())", "whatever\n", ["nbval-ignore-output"]),
        ("print('never run')", "stored only\n", ["nbval-skip"]),
        ("print('new text')", "old text\n", None),
    ])
    got = determinism.check([steady, drifting], runs=2, jobs=2)
    return {Path(r.notebook).stem: r for r in got}


def test_a_deterministic_notebook_is_identical(reports):
    rep = reports["steady"]
    assert rep.identical, determinism.format_diffs([rep])
    assert (rep.runs, rep.compared, rep.excluded) == (2, 5, 0)


def test_a_changing_output_is_reported_with_its_cell(reports):
    rep = reports["drifting"]
    assert not rep.identical
    # nbval's "Cell 1" and "Cell 4"; the ignored (2) and skipped (3) cells are not compared
    assert [d.cell for d in rep.diffs] == [1, 4]
    clock, stale = rep.diffs
    assert clock.index == 2  # the markdown cell comes first
    assert (clock.runs_differ, clock.stored_differs) == (True, True)
    assert [v.sources for v in clock.variants] == [["run 1"], ["run 2"], ["stored"]]
    assert all(v.line.startswith("stdout: now ") for v in clock.variants)
    assert [v.line_no for v in clock.variants] == [None, 1, 1]
    assert (stale.runs_differ, stale.stored_differs) == (False, True)
    assert [(v.sources, v.line) for v in stale.variants] == [(["run 1", "run 2"], "stdout: new text"),
                                                             (["stored"], "stdout: old text")]
    assert (rep.compared, rep.excluded, rep.excluded_why) == (3, 2, {"nbval-ignore-output": 1, "nbval-skip": 1})
    assert (rep.runs_differ, rep.stored_differs) == (1, 2)
    text = determinism.format_diffs([rep])
    assert "drifting.ipynb Cell 1 (cell index 2): the runs differ" in text and "stdout: now" in text
    assert "drifting.ipynb Cell 4 (cell index 5): every run agrees; the stored output differs" in text
    table = determinism.format_table(list(reports.values()))
    assert "2 excluded" in table and "1 nbval-skip" in table


def test_sanitize_cfg_replacements_make_outputs_compare_equal(reports):
    rep = reports["steady"]
    assert 4 not in [d.cell for d in rep.diffs], determinism.format_diffs([rep])
    raw = [nbformat.v4.new_output("stream", name="stdout", text="<object object at 0x7f0011223344>\n/tmp/x/y\n")]
    assert determinism.text_view(raw, determinism.load_sanitizers()) == ("stdout: <object object at 0xADDRESS>",
                                                                         "stdout: TMPPATH")


def test_the_sanitize_file_is_read_by_nbval():
    found = determinism.load_sanitizers(ROOT / "tests" / "sanitize.cfg")
    assert ("0x[0-9a-fA-F]{6,}", "0xADDRESS") in found and all(regex for regex, _ in found)
    cell = nbformat.v4.new_code_cell("# NBVAL_IGNORE_OUTPUT\nprint(1)")
    assert determinism.exclusion(cell) == "nbval-ignore-output"
    assert determinism.exclusion(nbformat.v4.new_code_cell("x", metadata={"tags": ["nbval-skip"]})) == "nbval-skip"
    assert determinism.exclusion(nbformat.v4.new_code_cell("print(1)")) is None


def test_stream_pieces_and_kinds_are_compared_as_nbval_does():
    out = nbformat.v4.new_output
    one = [out("stream", name="stdout", text="a\n"), out("stream", name="stderr", text="warn\n"),
           out("stream", name="stdout", text="b\n")]
    two = [out("stream", name="stderr", text="warn\n"), out("stream", name="stdout", text="a\nb\n")]
    assert determinism.text_view(one, []) == determinism.text_view(two, [])
    assert determinism.text_view([out("stream", name="stdout", text="10%\r50%\r100%\n")], []) == ("stdout: 100%",)
    images = [out("display_data", data={"image/png": "AAAA", "text/plain": "<Figure>"})]
    assert determinism.text_view(images, []) == ("text/plain: <Figure>",)
    error = [out("error", ename="ValueError", evalue="bad", traceback=["long", "trace"])]
    assert determinism.text_view(error, []) == ("error: ValueError: bad",)
