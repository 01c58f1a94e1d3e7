"""Every chapter's explorer answers each setting with a plot or a plain sentence, never a traceback.

The explorer's pure function is defined in the chapter notebook, so the test runs the
chapter's light cells (launches, measurements and long simulations are skipped), then
renders an evenly spaced sample of the explorer's slider grid. ``Explorer.render`` turns
a ``ValueError`` into a sentence; any other exception is a bug in the explorer.
"""
from __future__ import annotations

import itertools
from pathlib import Path

import matplotlib
import nbformat
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from intralayer.widgets import INVALID  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))
HEAVY = ("launch.run(", "gemm_throughput", "simulate(", "best_time(", "runs[", "measured[")
SAMPLES = 48


def explorer_of(path: Path):
    """Run the chapter's light code cells up to its explorer; return the explorer."""
    cells = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    last = next(i for i, src in enumerate(cells) if "explorer = Explorer(" in src)
    namespace: dict = {}
    for src in cells[:last]:
        if any(marker in src for marker in HEAVY):
            continue
        try:
            exec(compile(src, str(path), "exec"), namespace)
        except NameError:
            continue                       # it needed a skipped cell's result; the explorer does not
        finally:
            plt.close("all")
    exec(compile(cells[last], str(path), "exec"), namespace)
    plt.close("all")
    return namespace["explorer"]


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_explorer_gives_a_plot_or_a_sentence(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    explorer = explorer_of(path)
    grid = list(explorer.grid())
    step = max(1, len(grid) // SAMPLES)
    sample = grid[::step][:SAMPLES] + [grid[-1]]
    outcomes = {"plot": 0, "sentence": 0}
    for values in sample:
        result = explorer.render(**values)
        if isinstance(result, str):
            assert result.startswith(INVALID) and len(result) > len(INVALID) + 10, (values, result)
            outcomes["sentence"] += 1
        else:
            assert isinstance(result, Figure), (values, type(result))
            outcomes["plot"] += 1
        plt.close("all")
    assert outcomes["plot"] > 0, f"{path.stem}: no setting in the sample draws a plot"
