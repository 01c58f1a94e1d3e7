"""``make determinism``: execute every notebook several times and check its text outputs never change.

Each run executes one notebook top to bottom in a fresh ``python3`` kernel of this environment,
in the notebook's own folder, with a 300 s limit per cell, and never writes the notebook back.
For every code cell the text outputs -- stream text (stdout, stderr), ``text/*`` data
(``text/plain`` and any other text MIME type; never images, whose bytes differ from run to run)
and an error's name and value -- of all runs and of the outputs stored in the notebook are
compared after the regex replacements nbval applies from ``tests/sanitize.cfg``. Outputs are
gathered the way nbval compares them: the stream pieces of one name joined (with ``\\r`` and
``\\b`` applied), and one output kind compared with the same kind only.

Cells nbval does not compare are left out and counted: those tagged ``nbval-ignore-output`` or
``nbval-skip`` (or marked with the ``# NBVAL_IGNORE_OUTPUT`` / ``# NBVAL_SKIP`` comments);
``nbval-skip`` cells are not executed, as under nbval. A cell whose stored copy was never run
(no execution count, no outputs) is compared across the runs only; nbval does not check it.

Two runs of the same notebook never run at the same time; runs of different notebooks do, up
to ``--jobs``. Each notebook is read once, at the start: all its runs execute that version and
its stored outputs are the reference even if the file is edited meanwhile (the report says so).

Every differing cell is listed, either as nondeterministic (the runs disagree among themselves)
or as stale (every run agrees, the stored output does not), with each variant's first line that
parts from run 1's. Then a table: notebook, runs, cells compared, cells excluded, identical,
cells whose runs differ, cells whose stored output differs, seconds (all runs together).
Exit status 0 when every compared cell is identical in every run and as stored, 1 otherwise.

    make determinism                     # or: .venv/bin/python tools/determinism.py
    .venv/bin/python tools/determinism.py --runs 2 --jobs 1 chapters/05_moe.ipynb
"""
from __future__ import annotations

import argparse
import concurrent.futures as futures
import multiprocessing
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from traitlets import default

ROOT = Path(__file__).resolve().parents[1]
SANITIZE_CFG = ROOT / "tests" / "sanitize.cfg"
NOTEBOOK_GLOBS = ("chapters/*.ipynb", "solutions/*.ipynb")
KERNEL = "python3"
CELL_TIMEOUT = 300

#: Tags and comment markers that make nbval leave a cell's output unchecked (skip: unexecuted too).
IGNORE_TAGS = {"nbval-ignore-output"}
SKIP_TAGS = {"nbval-skip"}
IGNORE_MARKERS = {"NBVAL_IGNORE_OUTPUT", "PYTEST_VALIDATE_IGNORE_OUTPUT"}
SKIP_MARKERS = {"NBVAL_SKIP"}
#: The tag this tool puts on skipped cells of its in-memory copy so that nbclient passes them by.
_NOT_RUN_TAG = "determinism-not-run"
#: The view of a cell that a run never reached (it stopped early).
NOT_REACHED = ("(not executed: the run stopped before this cell)",)


# --------------------------------------------------------------------------------------------
# sanitize.cfg
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sanitizer:
    section: str
    regex: str
    replace: str


def parse_sanitize_config(text: str) -> list[Sanitizer]:
    """The (regex, replace) pairs of an nbval sanitize file, in file order.

    The format: ``[section name]`` headers (names only), each followed by a line
    ``regex: PATTERN`` and, directly under it, ``replace: TEXT``. As in nbval, everything after
    ``regex: `` / ``replace: `` is taken verbatim (trailing spaces included), a regex line not
    directly followed by a replace line is ignored, and a regex given twice keeps its first
    place but its last replacement.
    """
    found: dict[str, Sanitizer] = {}
    section = ""
    regex: str | None = None
    for line in text.splitlines():
        if regex is not None and line.startswith("replace: "):
            found[regex] = Sanitizer(found[regex].section if regex in found else section, regex,
                                     line[len("replace: "):])
            regex = None
            continue
        regex = None
        stripped = line.strip()
        if stripped.startswith("[") and stripped.endswith("]"):
            section = stripped[1:-1].strip()
        elif line.startswith("regex: "):
            regex = line[len("regex: "):]
    for item in found.values():
        re.compile(item.regex)  # a broken pattern is reported here, by name, not mid-run
    return list(found.values())


def load_sanitizers(path: Path | str = SANITIZE_CFG) -> list[Sanitizer]:
    return parse_sanitize_config(Path(path).read_text(encoding="utf-8"))


def sanitize(text: str, sanitizers: list[Sanitizer]) -> str:
    """Apply every replacement in order to the whole text, as nbval does to each output value."""
    for item in sanitizers:
        text = re.sub(item.regex, item.replace, text)
    return text


# --------------------------------------------------------------------------------------------
# What is compared in a cell
# --------------------------------------------------------------------------------------------
def _markers(cell) -> set[str]:
    """nbval's comment markers in a cell's source: a whole comment line such as ``# NBVAL_SKIP``."""
    found = set()
    for line in cell.get("source", "").splitlines():
        line = line.strip()
        if line.startswith("#"):
            found.add(line.lstrip("#").strip())
    return found


def exclusion(cell) -> str | None:
    """Why nbval leaves this code cell's output unchecked (``"nbval-skip"`` /
    ``"nbval-ignore-output"``), or None when it is compared."""
    tags = cell.get("metadata", {}).get("tags", [])
    tags = set(tags) if isinstance(tags, list) else set()
    markers = _markers(cell)
    if tags & SKIP_TAGS or markers & SKIP_MARKERS:
        return "nbval-skip"
    if tags & IGNORE_TAGS or markers & IGNORE_MARKERS:
        return "nbval-ignore-output"
    return None


def _terminal_text(text: str) -> str:
    """Stream text as a terminal leaves it: ``x\\b`` erased, a line rewritten after ``\\r`` kept
    from its last rewrite on (a ``\\r`` right before the newline changes nothing)."""
    previous = None
    while previous != text:
        previous, text = text, re.sub(r"[^\n\x08]\x08", "", text)
    lines = []
    for line in text.split("\n"):
        lines.append(line.rstrip("\r").rpartition("\r")[2] if "\r" in line else line)
    return "\n".join(lines)


def _as_text(value) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def text_view(outputs, sanitizers: list[Sanitizer]) -> tuple[str, ...]:
    """The lines this tool compares for one cell's outputs.

    Each line is ``KIND: text`` (``KIND#2`` for a second output of the same kind): stream
    names first (all pieces of one stream joined), then ``text/*`` data, then errors as
    ``error: Name: value``. Images, widget model ids, metadata, execution counts and
    tracebacks are not compared (nbval does not compare them either).
    """
    streams: dict[str, str] = {}
    kinds: dict[str, list[str]] = {}
    for out in outputs:
        kind = out.get("output_type")
        if kind == "stream":
            name = out.get("name", "stdout")
            streams[name] = streams.get(name, "") + _as_text(out.get("text", ""))
        elif kind in ("execute_result", "display_data", "update_display_data"):
            for mime, value in out.get("data", {}).items():
                if mime.startswith("text/"):
                    kinds.setdefault(mime, []).append(_as_text(value))
        elif kind == "error":
            kinds.setdefault("error", []).append(f"{out.get('ename', '')}: {out.get('evalue', '')}")
    ordered = [(name, [_terminal_text(text)]) for name, text in
               sorted(streams.items(), key=lambda kv: (kv[0] != "stdout", kv[0]))]
    ordered += sorted(((k, v) for k, v in kinds.items() if k != "error"))
    if "error" in kinds:
        ordered.append(("error", kinds["error"]))
    lines: list[str] = []
    for kind, values in ordered:
        for number, value in enumerate(values, start=1):
            label = kind if number == 1 else f"{kind}#{number}"
            text = sanitize(value, sanitizers)
            lines += [f"{label}: {line}" for line in (text.splitlines() or [""])]
    return tuple(lines)


# --------------------------------------------------------------------------------------------
# Running a notebook once
# --------------------------------------------------------------------------------------------
@dataclass
class RunResult:
    notebook: str
    run: int
    seconds: float
    outputs: dict[int, list] = field(default_factory=dict)  # cell index -> outputs (plain dicts)
    slowest: tuple[float, int] | None = None  # (seconds, nbval cell number) of its slowest cell
    failure: str | None = None  # why the run stopped early, if it did


class _ThisEnvironmentSpecs(KernelSpecManager):
    """``python3`` is always this interpreter's ipykernel, whatever kernelspecs the user's Jupyter
    folders hold (what ``--nbval-current-env`` does for the test suite)."""

    def get_kernel_spec(self, kernel_name):
        if kernel_name == KERNEL:
            from ipykernel.kernelspec import RESOURCES, get_kernel_dict

            spec = get_kernel_dict()
            spec["argv"][0] = sys.executable
            return self.kernel_spec_class(resource_dir=RESOURCES, **spec)
        return super().get_kernel_spec(kernel_name)


class _ThisEnvironmentKernel(AsyncKernelManager):
    @default("kernel_spec_manager")
    def _kernel_spec_manager_default(self):
        return _ThisEnvironmentSpecs(data_dir=self.data_dir)


def execute_once(notebook: str, run: int, timeout: int = CELL_TIMEOUT, text: str | None = None) -> RunResult:
    """Execute ``notebook`` top to bottom in a fresh kernel, in its folder; the file is not touched.

    ``text`` is the notebook's JSON as read at the start of the check (so that every run executes
    the same version, whatever happens to the file meanwhile); by default the file is read now.
    """
    import nbformat
    from nbclient import NotebookClient

    path = Path(notebook)
    nb = nbformat.reads(text, as_version=4) if text is not None else nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            if exclusion(cell) == "nbval-skip":
                cell.metadata.setdefault("tags", []).append(_NOT_RUN_TAG)
    client = NotebookClient(nb, kernel_name=KERNEL, kernel_manager_class=_ThisEnvironmentKernel,
                            timeout=timeout, allow_errors=True, skip_cells_with_tag=_NOT_RUN_TAG,
                            record_timing=True, resources={"metadata": {"path": str(path.resolve().parent)}})
    result = RunResult(notebook, run, 0.0)
    start = time.perf_counter()
    failure = None
    try:
        client.execute()
    except Exception as exc:  # a cell timeout, a dead kernel: the run stops; report it
        failure = exc
    result.seconds = time.perf_counter() - start
    last_run = max((i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.execution_count is not None),
                   default=-1)
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    if failure is not None:
        first_line = (str(failure).strip().splitlines() or [""])[0][:200]
        where = (f"in Cell {sum(c.cell_type == 'code' for c in nb.cells[:last_run])} (cell index {last_run})"
                 if last_run >= 0 else "before its first cell")
        result.failure = f"stopped {where}: {type(failure).__name__}: {first_line}"
    timed = [(_cell_seconds(c), number) for number, c in enumerate(code_cells)]
    result.slowest = max((t for t in timed if t[0] is not None), default=None)
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or exclusion(cell) == "nbval-skip":
            continue
        if failure is None or index <= last_run:
            result.outputs[index] = [dict(o) for o in cell.outputs]
    return result


def _cell_seconds(cell) -> float | None:
    """How long the cell ran, from the timestamps nbclient records in its metadata."""
    from datetime import datetime

    stamps = cell.metadata.get("execution", {})
    try:
        start = datetime.fromisoformat(stamps["iopub.execute_input"].replace("Z", "+00:00"))
        end = datetime.fromisoformat(stamps["shell.execute_reply"].replace("Z", "+00:00"))
    except (KeyError, ValueError):
        return None
    return (end - start).total_seconds()


def _schedule(notebooks: dict[str, str], runs: int, jobs: int, timeout: int, progress) -> dict[str, list[RunResult]]:
    """Every run of every notebook (name -> JSON text), ``jobs`` at a time, never two runs of one
    notebook at once."""
    pending = [(nb, run) for run in range(1, runs + 1) for nb in notebooks]
    results: dict[str, list[RunResult]] = {nb: [] for nb in notebooks}
    total = len(pending)

    def done(res: RunResult):
        results[res.notebook].append(res)
        slowest = f" (slowest: Cell {res.slowest[1]}, {res.slowest[0]:.1f} s)" if res.slowest else ""
        progress(f"[{sum(map(len, results.values()))}/{total}] {_display(res.notebook)} run {res.run}: "
                 f"{res.seconds:.1f} s{slowest}" + (f"  ({res.failure})" if res.failure else ""))

    if jobs <= 1:
        for nb, run in pending:
            done(execute_once(nb, run, timeout, notebooks[nb]))
    else:
        context = multiprocessing.get_context("spawn")  # a clean interpreter per worker, no forked threads
        busy: dict[futures.Future, tuple[str, int]] = {}
        with futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
            while pending or busy:
                running = {nb for nb, _ in busy.values()}
                while len(busy) < jobs:
                    task = next((t for t in pending if t[0] not in running), None)
                    if task is None:
                        break
                    pending.remove(task)
                    running.add(task[0])
                    busy[pool.submit(execute_once, task[0], task[1], timeout, notebooks[task[0]])] = task
                finished, _ = futures.wait(busy, return_when=futures.FIRST_COMPLETED)
                for fut in finished:
                    nb, run = busy.pop(fut)
                    try:
                        done(fut.result())
                    except Exception as exc:  # the worker process itself failed
                        done(RunResult(nb, run, 0.0, failure=f"worker failed: {type(exc).__name__}: {exc}"))
    for nb in results:
        results[nb].sort(key=lambda r: r.run)
    return results


# --------------------------------------------------------------------------------------------
# Comparing
# --------------------------------------------------------------------------------------------
def _line(view: tuple[str, ...], at: int) -> str:
    if at < len(view):
        return view[at]
    return "(no output)" if not view else f"(no line {at + 1}: its output has {len(view)})"


@dataclass
class Variant:
    sources: list[str]  # "run 1", "run 2", "stored", ...: those that gave exactly this text
    line_no: int | None = None  # first (1-based) line where it parts from the reference; None: the reference
    line: str = ""  # its text at line_no (for the reference: its first line)
    reference_line: str = ""  # the reference's text at line_no


@dataclass
class CellDiff:
    notebook: str
    cell: int  # nbval's number: the index among the notebook's code cells ("Cell N")
    index: int  # the index among all the notebook's cells
    runs_differ: bool  # the runs disagree among themselves: nondeterministic
    stored_differs: bool  # the stored output is not what the (first) run gave
    variants: list[Variant]  # the first is the reference: the one run 1 gave


@dataclass
class NotebookReport:
    notebook: str
    runs: int
    compared: int = 0
    excluded: int = 0
    excluded_why: dict[str, int] = field(default_factory=dict)
    unrun_cells: list[int] = field(default_factory=list)  # compared across runs only: never run when stored
    seconds: float = 0.0
    run_seconds: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    diffs: list[CellDiff] = field(default_factory=list)
    changed_meanwhile: bool = False  # the file on disk changed while it was being checked

    @property
    def identical(self) -> bool:
        return not self.diffs and not self.failures

    @property
    def runs_differ(self) -> int:
        return sum(d.runs_differ for d in self.diffs)

    @property
    def stored_differs(self) -> int:
        return sum(d.stored_differs for d in self.diffs)


def compare_notebook(notebook: str, results: list[RunResult], sanitizers: list[Sanitizer],
                     stored=None) -> NotebookReport:
    """Compare the runs of one notebook with each other and with ``stored`` (the notebook as it was
    executed; read from the file when not given)."""
    import nbformat

    stored = stored if stored is not None else nbformat.read(notebook, as_version=4)
    report = NotebookReport(_display(notebook), len(results), seconds=sum(r.seconds for r in results),
                            run_seconds=[r.seconds for r in results],
                            failures=[f"run {r.run}: {r.failure}" for r in results if r.failure])
    code_number = -1
    for index, cell in enumerate(stored.cells):
        if cell.cell_type != "code":
            continue
        code_number += 1
        why = exclusion(cell)
        if why:
            report.excluded += 1
            report.excluded_why[why] = report.excluded_why.get(why, 0) + 1
            continue
        report.compared += 1
        views = []
        for res in results:
            outs = res.outputs.get(index)
            views.append((f"run {res.run}", NOT_REACHED if outs is None else text_view(outs, sanitizers)))
        if cell.execution_count is not None or cell.outputs:
            views.append(("stored", text_view(cell.outputs, sanitizers)))
        else:
            report.unrun_cells.append(code_number)
        diff = _difference(views)
        if diff is not None:
            runs_differ, stored_differs, variants = diff
            report.diffs.append(CellDiff(report.notebook, code_number, index, runs_differ, stored_differs, variants))
    return report


def _difference(views: list[tuple[str, tuple[str, ...]]]):
    """None when all views agree; else (runs differ, stored differs, variants), the first variant
    being the reference (the first view's) and each other one with the first line where it parts."""
    distinct: dict[tuple[str, ...], list[str]] = {}
    for source, view in views:
        distinct.setdefault(view, []).append(source)
    if len(distinct) < 2:
        return None
    reference, *others = distinct
    variants = [Variant(distinct[reference], None, _line(reference, 0))]
    for view in others:
        at = 0
        while at < len(view) and at < len(reference) and view[at] == reference[at]:
            at += 1
        variants.append(Variant(distinct[view], at + 1, _line(view, at), _line(reference, at)))
    run_views = {view for source, view in views if source != "stored"}
    stored = [view for source, view in views if source == "stored"]
    return len(run_views) > 1, bool(stored) and stored[0] != views[0][1], variants


def check(notebooks: list[str | Path], runs: int = 3, jobs: int = 2, timeout: int = CELL_TIMEOUT,
          sanitize_with: Path | str = SANITIZE_CFG, progress=None) -> list[NotebookReport]:
    """Execute each notebook ``runs`` times and compare; one report per notebook, in order.

    Each notebook is read once, at the start: every run executes that version and its stored
    outputs are the reference, even if the file is edited meanwhile (which the report notes)."""
    import nbformat

    sanitizers = load_sanitizers(sanitize_with)
    texts = {str(Path(nb)): Path(nb).read_text(encoding="utf-8") for nb in notebooks}
    results = _schedule(texts, runs, jobs, timeout, progress or (lambda line: None))
    reports = []
    for name, text in texts.items():
        report = compare_notebook(name, results[name], sanitizers, nbformat.reads(text, as_version=4))
        report.changed_meanwhile = Path(name).read_text(encoding="utf-8") != text
        reports.append(report)
    return reports


# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------
def _display(notebook: str | Path) -> str:
    path = Path(notebook).resolve()
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(notebook)


def format_diffs(reports: list[NotebookReport]) -> str:
    lines = []
    for rep in reports:
        if rep.changed_meanwhile:
            lines.append(f"{rep.notebook}: the file changed on disk during the check; "
                         "compared with the version read at the start")
        for failure in rep.failures:
            lines.append(f"{rep.notebook}: {failure}")
        for diff in rep.diffs:
            what = ("the runs differ" + (", and the stored output differs from run 1" if diff.stored_differs else "")
                    if diff.runs_differ else "every run agrees; the stored output differs")
            lines.append(f"{diff.notebook} Cell {diff.cell} (cell index {diff.index}): {what}")
            reference = diff.variants[0]
            ref_name = reference.sources[0]
            width = max(len(", ".join(v.sources)) for v in diff.variants)
            lines.append(f"    {', '.join(reference.sources):<{width}}  line 1: {reference.line}")
            for var in diff.variants[1:]:
                lines.append(f"    {', '.join(var.sources):<{width}}  line {var.line_no}: {var.line}")
                lines.append(f"    {'':<{width}}  ({ref_name} there: {var.reference_line})")
    return "\n".join(lines)


def format_table(reports: list[NotebookReport]) -> str:
    header = ("notebook", "runs", "cells compared", "cells excluded", "identical", "runs differ",
              "stored differs", "seconds")
    rows = [(r.notebook + (" *" if r.changed_meanwhile else ""), str(r.runs), str(r.compared), str(r.excluded),
             "yes" if r.identical else "no", str(r.runs_differ), str(r.stored_differs), f"{r.seconds:.1f}")
            for r in reports]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def fmt(row):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    out = [fmt(header), "  ".join("-" * w for w in widths), *map(fmt, rows)]
    why: dict[str, int] = {}
    for r in reports:
        for k, v in r.excluded_why.items():
            why[k] = why.get(k, 0) + v
    out.append(f"{sum(r.compared for r in reports)} cells compared, {sum(r.excluded for r in reports)} excluded"
               + (f" ({', '.join(f'{v} {k}' for k, v in sorted(why.items()))})" if why else "")
               + f"; {sum(not r.identical for r in reports)} of {len(reports)} notebooks not identical: "
               f"{sum(r.runs_differ for r in reports)} cells differ between runs, "
               f"{sum(r.stored_differs for r in reports)} differ from the stored output"
               + (f", {sum(len(r.failures) for r in reports)} runs stopped early" if any(r.failures for r in reports)
                  else ""))
    unrun = [f"{r.notebook} Cell {c}" for r in reports for c in r.unrun_cells]
    if unrun:
        out.append(f"{len(unrun)} compared cells were never run in the stored notebook (compared across the runs "
                   f"only): {', '.join(unrun[:10])}" + (", ..." if len(unrun) > 10 else ""))
    if any(r.changed_meanwhile for r in reports):
        out.append("* the file changed on disk during the check (compared with the version read at the start)")
    return "\n".join(out)


def default_notebooks() -> list[Path]:
    return [p for pattern in NOTEBOOK_GLOBS for p in sorted(ROOT.glob(pattern))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", help="notebooks to check (default: chapters/ and solutions/)")
    parser.add_argument("--runs", type=int, default=3, help="executions of each notebook (default 3)")
    parser.add_argument("--jobs", type=int, default=2, help="notebooks executed at once (default 2)")
    parser.add_argument("--timeout", type=int, default=CELL_TIMEOUT, help="seconds per cell (default 300)")
    parser.add_argument("--sanitize-with", default=str(SANITIZE_CFG), help="nbval sanitize config")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.jobs < 1:
        parser.error("--runs and --jobs must be at least 1")
    notebooks = [Path(p) for p in args.notebooks] or default_notebooks()
    missing = [str(p) for p in notebooks if not p.is_file()]
    if missing:
        parser.error(f"no such notebook: {', '.join(missing)}")

    print(f"Executing {len(notebooks)} notebooks {args.runs} times each, {args.jobs} at a time "
          f"(fresh {KERNEL} kernel per run, {args.timeout} s per cell).", flush=True)
    start = time.perf_counter()
    reports = check(notebooks, args.runs, args.jobs, args.timeout, args.sanitize_with,
                    progress=lambda line: print(line, flush=True))
    wall = time.perf_counter() - start
    diffs = format_diffs(reports)
    print()
    print("Differences (sanitized text outputs; stored = the outputs saved in the notebook):" if diffs
          else "No differences: every compared cell gave the same text in every run and as stored.")
    if diffs:
        print(diffs)
    print()
    print(format_table(reports))
    print(f"wall time {wall:.1f} s (--jobs {args.jobs})")
    return 0 if all(r.identical for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
