"""``make determinism``: execute every notebook ``--runs`` times (fresh kernels, ``--jobs`` notebooks at
once) and compare the runs with each other and with the stored outputs, judged with nbval's own code
(its skip/ignore markers, coalesced streams, ``tests/sanitize.cfg``; text only). A differing cell is
nondeterministic (runs disagree) or stale (runs agree, the stored output does not); exit status 1 if any.

    .venv/bin/python tools/determinism.py --runs 2 --jobs 1 chapters/05_moe.ipynb
"""
import argparse
import re
import sys
import time
from collections import namedtuple
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbval.kernel import CURRENT_ENV_KERNEL_NAME, NbvalKernelspecManager
from nbval.plugin import coalesce_streams, find_comment_markers, find_metadata_tags, get_sanitize_patterns

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_GLOBS = ("chapters/*.ipynb", "solutions/*.ipynb", "solutions/labs/*.ipynb")
CELL_TIMEOUT = 300
NOT_RUN = "determinism-not-run"          # the tag skipped cells get in this tool's in-memory copy


def load_sanitizers(path: Path | str = ROOT / "tests" / "sanitize.cfg") -> list[tuple[str, str]]:
    return get_sanitize_patterns(Path(path).read_text(encoding="utf-8"))   # nbval's own parser


def exclusion(cell) -> str | None:
    """Why nbval leaves this code cell unchecked (its markers, then its tags, as nbval reads them)."""
    options = dict(find_comment_markers(cell.source)) | dict(find_metadata_tags(cell.metadata))
    return "nbval-skip" if options.get("skip") else "nbval-ignore-output" if options.get("check") is False else None


def text_view(outputs, sanitizers) -> tuple[str, ...]:
    """The compared lines of one cell's outputs: ``kind: text``, streams (coalesced, ``\\r`` and
    ``\\b`` applied) first, then ``text/*`` data, then errors by name and value; never images."""
    parts = []
    for out in coalesce_streams([nbformat.from_dict(dict(o)) for o in outputs]):
        if out.output_type == "stream":
            parts.append((0, out.name != "stdout", out.name, out.text))
        elif out.output_type == "error":
            parts.append((2, 0, "error", f"{out.ename}: {out.evalue}"))
        else:
            parts += [(1, 0, mime, "".join(v) if isinstance(v, list) else v)
                      for mime, v in out.get("data", {}).items() if mime.startswith("text/")]
    for regex, replace in sanitizers:
        parts = [(*p[:3], re.sub(regex, replace, p[3])) for p in parts]
    return tuple(f"{kind}: {line}" for *_, kind, text in sorted(parts, key=lambda p: p[:3])
                 for line in text.splitlines() or [""])


def execute(notebook: Path, text: str, timeout: int = CELL_TIMEOUT) -> tuple[dict[int, list], str | None]:
    """One run of the notebook as read at the start: code cell index → outputs, and why it stopped early."""
    nb = nbformat.reads(text, as_version=4)
    for cell in (c for c in nb.cells if c.cell_type == "code"):
        cell.outputs, cell.execution_count = [], None
        if exclusion(cell) == "nbval-skip":
            cell.metadata.setdefault("tags", []).append(NOT_RUN)
    km = KernelManager(kernel_name=CURRENT_ENV_KERNEL_NAME, kernel_spec_manager=NbvalKernelspecManager())
    failure = None
    try:
        NotebookClient(nb, km=km, timeout=timeout, allow_errors=True, skip_cells_with_tag=NOT_RUN,
                       resources={"metadata": {"path": str(notebook.resolve().parent)}}).execute()
    except Exception as exc:                     # a cell timeout, a dead kernel: report it, keep what ran
        failure = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
    finally:                                     # the client does not own a kernel manager it was given
        if km.has_kernel:
            km.shutdown_kernel(now=True)
    return {i: c.outputs for i, c in enumerate(nb.cells) if c.get("execution_count") is not None}, failure


#: A distinct output of a cell: who printed it ("run 1", "stored"), its first line (from 1) unlike the
#: first variant's (None for that one), and that line; a differing cell: nbval's "Cell N", its index.
Variant = namedtuple("Variant", "sources line_no line")
CellDiff = namedtuple("CellDiff", "cell index runs_differ stored_differs variants")


@dataclass
class NotebookReport:
    notebook: str
    runs: int
    compared: int = 0
    excluded_why: dict[str, int] = field(default_factory=dict)
    diffs: list[CellDiff] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    excluded = property(lambda self: sum(self.excluded_why.values()))
    runs_differ = property(lambda self: sum(d.runs_differ for d in self.diffs))
    stored_differs = property(lambda self: sum(d.stored_differs for d in self.diffs))
    identical = property(lambda self: not self.diffs and not self.failures)


def cell_diff(number: int, index: int, views: list[tuple[str, tuple[str, ...]]]) -> CellDiff | None:
    """How the views of one cell (source, lines) differ, or None when they agree."""
    distinct = list(dict.fromkeys(v for _, v in views))
    if len(distinct) == 1:
        return None
    first, runs = distinct[0], {v for s, v in views if s != "stored"}
    parts = {v: next((k for k, (a, b) in enumerate(zip(v, first)) if a != b), min(len(v), len(first)))
             for v in distinct[1:]}                                      # where each parts from the first
    at = {v: parts.get(v, min(parts.values())) for v in distinct}
    return CellDiff(number, index, len(runs) > 1, views[-1][0] == "stored" and views[-1][1] not in runs,
                    [Variant([s for s, w in views if w == v], parts[v] + 1 if v in parts else None,
                             v[at[v]] if at[v] < len(v) else "(no further output)") for v in distinct])


def compare(notebook: Path, runs: int, sanitizers, timeout: int = CELL_TIMEOUT) -> NotebookReport:
    text, start = notebook.read_text(encoding="utf-8"), time.perf_counter()
    results = [execute(notebook, text, timeout) for _ in range(runs)]
    report = NotebookReport(str(notebook), runs, seconds=time.perf_counter() - start,
                            failures=[f"run {r}: {why}" for r, (_, why) in enumerate(results, 1) if why])
    code = [(i, c) for i, c in enumerate(nbformat.reads(text, as_version=4).cells) if c.cell_type == "code"]
    for number, (index, cell) in enumerate(code):
        if why := exclusion(cell):
            report.excluded_why[why] = report.excluded_why.get(why, 0) + 1
            continue
        report.compared += 1
        views = [(f"run {r}", text_view(outs[index], sanitizers) if index in outs else ("(not executed)",))
                 for r, (outs, _) in enumerate(results, 1)]
        if cell.get("execution_count") is not None or cell.outputs:      # nbval checks only cells once run
            views.append(("stored", text_view(cell.outputs, sanitizers)))
        if diff := cell_diff(number, index, views):
            report.diffs.append(diff)
    return report


def check(notebooks, runs: int = 3, jobs: int = 2, timeout: int = CELL_TIMEOUT) -> list[NotebookReport]:
    sanitizers = load_sanitizers()
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:   # a notebook's runs stay on one thread
        return list(pool.map(lambda nb: compare(Path(nb), runs, sanitizers, timeout), notebooks))


def format_diffs(reports: list[NotebookReport]) -> str:
    out = []
    for rep in reports:
        out += [f"{rep.notebook}: {failure}" for failure in rep.failures]
        for d in rep.diffs:
            what = "the runs differ" if d.runs_differ else "every run agrees; the stored output differs"
            out += [f"{rep.notebook} Cell {d.cell} (cell index {d.index}): {what}"] + [
                f"    {', '.join(v.sources)}" + (f" (line {v.line_no})" if v.line_no else "") + f": {v.line}"
                for v in d.variants]
    return "\n".join(out)


def format_table(reports: list[NotebookReport]) -> str:
    return "\n".join([f"{'notebook':40} runs compared identical runs-differ stale      s"] + [
        f"{Path(r.notebook).name:40} {r.runs:4} {r.compared:8} {r.compared - len(r.diffs):9} {r.runs_differ:11} "
        f"{r.stored_differs:5} {r.seconds:6.0f}  {r.excluded} excluded ("
        + ", ".join(f"{n} {k}" for k, n in sorted(r.excluded_why.items())) + ")" for r in reports])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*", help="default: chapters/, solutions/ and solutions/labs/")
    ap.add_argument("--runs", type=int, default=3), ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args(argv)
    if a.runs < 2 or a.jobs < 1:
        ap.error(f"--runs must be at least 2 (got {a.runs}) and --jobs at least 1 (got {a.jobs})")
    reports = check(a.notebooks or sorted(str(p) for g in NOTEBOOK_GLOBS for p in ROOT.glob(g)), a.runs, a.jobs)
    print(format_diffs(reports) or "every compared cell identical in every run and as stored")
    print(format_table(reports))
    return 0 if all(r.identical for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
