"""Every chapter's explorer answers every setting of its controls with a chart or a plain
sentence, never a traceback, and matplotlib can draw what the book's page draws.

The explorers are rebuilt exactly as the book build does it: :func:`intralayer.widgets.load`
runs the chapter's cells tagged ``explorer``. :meth:`Explorer.table` then sweeps the
whole slider grid (it raises on anything but a chart or a ``ValueError``'s sentence).
"""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import pytest
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from intralayer import widgets  # noqa: E402
from intralayer.charts import Chart  # noqa: E402
from tests.explorer_table import lookup  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))
DRAWN = 12           # settings per chapter drawn with matplotlib as well


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """Thousands of tiny tensor ops: extra threads only contend on a loaded machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.chdir(ROOT / "chapters")
    yield
    torch.set_num_threads(before)


_TABLES: dict = {}


def explorer_and_table(path: Path):
    """The chapter's explorer and its whole-grid table, computed once per test session."""
    if path not in _TABLES:
        (explorer,) = widgets.load(path).values()
        _TABLES[path] = explorer, explorer.table()
    return _TABLES[path]


def test_every_chapter_has_exactly_one_explorer():
    for path in CHAPTERS:
        found = widgets.load(path)
        assert len(found) == 1, f"{path.stem}: expected one explorer in the cells tagged 'explorer', found {list(found)}"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_the_whole_grid_gives_a_chart_or_a_sentence(path):
    explorer, table = explorer_and_table(path)
    assert len(table["index"]) == explorer.size
    kinds = {"chart": 0, "sentence": 0}
    for out in table["outputs"]:
        if "invalid" in out:
            assert out["invalid"].startswith(widgets.INVALID) and len(out["invalid"]) > len(widgets.INVALID) + 10, out
            kinds["sentence"] += 1
        else:
            assert out["title"] and out["panels"], out
            kinds["chart"] += 1
    assert kinds["chart"] > 0, f"{path.stem}: no setting draws a chart"
    # The table is plain JSON, and its start setting (what the page shows first) draws a chart.
    json.dumps(table)
    assert "panels" in lookup(explorer, table, **explorer.start), f"{path.stem}: the start setting is invalid"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_the_table_holds_what_the_function_returns(path):
    explorer, table = explorer_and_table(path)
    grid = list(explorer.grid())
    step = max(1, len(grid) // DRAWN)
    for values in grid[::step][:DRAWN] + [grid[-1]]:
        result = explorer.render(**values)
        stored = lookup(explorer, table, **values)
        if isinstance(result, str):
            assert stored == {"invalid": result}
            continue
        assert isinstance(result, Chart)
        assert json.dumps(stored, sort_keys=True) == json.dumps(result.to_data(), sort_keys=True), values
        fig = result.figure()                        # and the notebook's matplotlib drawing works
        assert isinstance(fig, Figure) and len(fig.axes) >= len(result.panels)
        plt.close("all")
