"""widgets.Explorer (grid, render, the ipywidgets UI) and the plots unit formatters."""
from __future__ import annotations

import itertools

import ipywidgets as w
import pytest

from intralayer import plots, widgets
from tests.explorer_table import lookup


def cost(n, link, mode="ring"):
    if n > 4 and mode == "tree":
        raise ValueError(f"the tree needs n ≤ 4, got n={n}")
    return f"{mode}: {n} ranks over {link:g} B/s"


def make(**kw):
    return widgets.Explorer(cost, title=kw.pop("title", ""), **(kw or dict(
        n=[2, 4, 8], link={"NVLink": 450e9, "PCIe": 63e9}, mode=["ring", "tree"])))


# ------------------------------------------------------------------ grid and render

def test_grid_enumerates_the_full_product_in_order():
    e = make()
    grid = list(e.grid())
    want = [dict(n=n, link=l, mode=m)
            for n, l, m in itertools.product([2, 4, 8], [450e9, 63e9], ["ring", "tree"])]
    assert grid == want
    assert len(grid) == 3 * 2 * 2
    assert len({tuple(sorted(g.items())) for g in grid}) == len(grid)   # no repeats


def test_grid_uses_values_not_labels_and_can_be_swept():
    e = make()
    results = [e.render(**values) for values in e.grid()]
    invalid = [r for r in results if r.startswith(widgets.INVALID)]
    assert len(invalid) == 2                                       # n=8 with the tree, both links
    assert "ring: 2 ranks over 4.5e+11 B/s" in results


def test_grid_of_a_single_control():
    e = widgets.Explorer(lambda n: n * n, n=range(1, 4))
    assert list(e.grid()) == [{"n": 1}, {"n": 2}, {"n": 3}]


def test_render_returns_the_function_value():
    e = make()
    assert e.render(n=4, link=63e9, mode="tree") == "tree: 4 ranks over 6.3e+10 B/s"


def test_render_turns_value_error_into_a_sentence():
    e = make()
    out = e.render(n=8, link=63e9, mode="tree")
    assert isinstance(out, str)
    assert out.startswith(widgets.INVALID)
    assert out == widgets.INVALID + "the tree needs n ≤ 4, got n=8"


def test_render_lets_other_errors_through():
    def broken(n):
        raise TypeError("a bug, not an invalid combination")

    e = widgets.Explorer(broken, n=[1, 2])
    with pytest.raises(TypeError, match="a bug"):
        e.render(n=1)


def test_no_controls_or_an_empty_control_is_an_error():
    with pytest.raises(ValueError, match="at least one control"):
        widgets.Explorer(cost)
    with pytest.raises(ValueError, match="control 'mode' has no values"):
        widgets.Explorer(cost, n=[2], link=[1e9], mode=[])
    with pytest.raises(ValueError, match="control 'link' has no values"):
        widgets.Explorer(cost, n=[2], link={})


def test_options_hold_labels_and_values():
    e = make()
    assert e.options["n"] == [("2", 2), ("4", 4), ("8", 8)]
    assert e.options["link"] == [("NVLink", 450e9), ("PCIe", 63e9)]
    assert e.options["mode"] == [("ring", "ring"), ("tree", "tree")]
    e = widgets.Explorer(cost, size=[1e6, 2.5])
    assert e.options["size"] == [("1e+06", 1e6), ("2.5", 2.5)]


def test_labels_of_distinct_values_are_distinct_and_faithful():
    e = widgets.Explorer(cost, size=[1.1e4, 1.2e4, 450e9])
    labels = [label for label, _ in e.options["size"]]
    assert len(set(labels)) == 3
    assert [float(label) for label in labels] == [1.1e4, 1.2e4, 450e9]


# ------------------------------------------------------------------ the live widget

def test_widget_builds_a_vbox_with_matching_controls():
    e = make(title="Ring or tree")
    box = e.widget()
    assert isinstance(box, w.VBox)
    title, controls, out = box.children
    assert isinstance(title, w.HTML) and "Ring or tree" in title.value
    assert isinstance(out, w.Output)
    n, link, mode = controls.children
    # Numbers become selection sliders, anything else a dropdown.
    assert isinstance(n, w.SelectionSlider) and isinstance(link, w.SelectionSlider)
    assert isinstance(mode, w.Dropdown)
    assert [c.description for c in (n, link, mode)] == ["n", "link", "mode"]
    for control, name in ((n, "n"), (link, "link"), (mode, "mode")):
        assert list(control.options) == e.options[name]
        assert list(control._options_labels) == [label for label, _ in e.options[name]]
    # Sliders start in the middle, dropdowns on the first value.
    assert n.value == 4 and link.value == 63e9 and mode.value == "ring"


def test_widget_without_title_and_with_initial_values():
    e = make()
    box = e.widget(n=8, mode="tree")
    assert len(box.children) == 2                      # no title line
    n, link, mode = box.children[0].children
    assert (n.value, link.value, mode.value) == (8, 63e9, "tree")


def test_widget_redraws_when_a_control_moves(capsys):
    calls = []

    def fn(n, mode):
        calls.append((n, mode))
        return cost(n, 1e9, mode)

    e = widgets.Explorer(fn, n=[2, 4, 8], mode=["ring", "tree"])
    box = e.widget()
    assert calls == [(4, "ring")]                      # drawn once at the start
    n, mode = box.children[0].children
    mode.value = "tree"
    n.value = 8
    assert calls == [(4, "ring"), (4, "tree"), (8, "tree")]
    # Outside a kernel the Output widget passes prints through: the invalid combination
    # is shown as the sentence, not as a traceback.
    shown = capsys.readouterr().out
    assert widgets.INVALID + "the tree needs n ≤ 4, got n=8" in shown
    assert "Traceback" not in shown


def test_booleans_get_a_dropdown():
    box = widgets.Explorer(lambda flag: str(flag), flag=[False, True]).widget()
    (flag,) = box.children[0].children
    assert isinstance(flag, w.Dropdown) and flag.value is False


# ------------------------------------------------------------------ unit formatters

@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1, "1 B"), (1023, "1023 B"), (1024, "1 KiB"), (1536, "1.5 KiB"),
    (4096, "4 KiB"), (2.5 * 1024 ** 2, "2.5 MiB"), (1024 ** 2, "1 MiB"), (3 * 1024 ** 3, "3 GiB"),
    (1024 ** 4, "1 TiB"), (1024 ** 5, "1024 TiB"), (-2048, "-2 KiB"),
])
def test_human_bytes(n, text):
    assert plots.human_bytes(n) == text


@pytest.mark.parametrize("t, text", [
    (0, "0"), (0.00042, "420 µs"), (1.5, "1.5 s"), (1, "1 s"), (2e-3, "2 ms"), (0.0125, "12.5 ms"),
    (5e-9, "5 ns"), (3.3e-6, "3.3 µs"), (1e-12, "0.001 ns"), (-0.002, "-2 ms"),
])
def test_human_seconds(t, text):
    assert plots.human_seconds(t) == text


def test_human_bytes_rounds_up_into_the_next_unit():
    assert plots.human_bytes(1024 ** 2 - 1) == "1.0 MiB"


def test_human_seconds_rounds_up_into_the_next_unit():
    assert plots.human_seconds(0.0009999) == "1 ms"


# ------------------------------------------------------------------ the static book's side

from intralayer.charts import Bars, Chart, Series  # noqa: E402


def chart_fn(n, mode="ring"):
    if n > 4 and mode == "tree":
        raise ValueError(f"the tree needs n ≤ 4, got n={n}")
    return Chart(f"{mode} on {n}", [Bars(["time"], [Series("t", [float(n)])])])


def chart_explorer(**kw):
    return widgets.Explorer(chart_fn, title="T", n=[2, 4, 8], mode=["ring", "tree"], **kw)


def test_start_defaults_to_the_middle_slider_value_and_the_first_dropdown_value():
    assert chart_explorer().start == {"n": 4, "mode": "ring"}
    assert chart_explorer(start={"n": 8}).start == {"n": 8, "mode": "ring"}
    with pytest.raises(ValueError, match="start value 5 of 'n' is not one of its values"):
        chart_explorer(start={"n": 5})
    with pytest.raises(ValueError, match=r"start names controls that do not exist: \['m'\]"):
        chart_explorer(start={"m": 1})


def test_the_widget_starts_at_start():
    n, mode = chart_explorer(start={"n": 8, "mode": "ring"}).widget().children[1].children
    assert (n.value, mode.value) == (8, "ring")


def test_size_and_key():
    e = chart_explorer()
    assert e.size == 6 == len(list(e.grid()))
    assert e.key(n=8, mode="tree") == "2-1"
    with pytest.raises(ValueError, match="n=5 is not one of the values of control 'n'"):
        e.key(n=5, mode="ring")


def test_table_holds_every_setting_in_grid_order_and_each_output_once():
    e = chart_explorer()
    table = e.table()
    assert table["name"] == "chart_fn" and table["title"] == "T"
    assert table["controls"] == [{"name": "n", "labels": ["2", "4", "8"], "numeric": True, "start": 1},
                                 {"name": "mode", "labels": ["ring", "tree"], "numeric": False, "start": 0}]
    assert len(table["index"]) == 6
    # n=8 with the tree is the only invalid setting; every other setting has its own chart.
    assert len(table["outputs"]) == 6
    for values in e.grid():
        stored = lookup(e, table, **values)
        result = e.render(**values)
        assert stored == ({"invalid": result} if isinstance(result, str) else result.to_data())
    # Equal outputs are stored once.
    same = widgets.Explorer(lambda n, mode: Chart("same", [Bars(["x"], [Series("s", [1.0])])]),
                            n=[1, 2, 3], mode=["a", "b"])
    t = same.table()
    assert len(t["outputs"]) == 1 and t["index"] == [0] * 6


def test_table_refuses_outputs_the_page_cannot_draw():
    with pytest.raises(TypeError, match="returned str; a static explorer needs a Chart"):
        make().table()                                 # cost() returns text, not a Chart

    def broken(n):
        raise KeyError(n)

    with pytest.raises(KeyError):
        widgets.Explorer(broken, n=[1]).table()       # only ValueError is an "invalid setting"


def test_placeholder_names_the_explorer_and_escapes_the_title():
    e = widgets.Explorer(chart_fn, title="<b>ring</b> & tree", n=[2])
    html = e.placeholder()
    assert html.startswith('<div class="itl-explorer" data-explorer="chart_fn">')
    assert "&lt;b&gt;ring&lt;/b&gt; &amp; tree" in html and "<b>ring</b>" not in html


def test_display_bundle_has_the_live_widget_and_the_placeholder():
    bundle = chart_explorer()._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/html"] == chart_explorer().placeholder()
    assert bundle["text/plain"] == "Explorer: T (6 settings)"       # stable, so nbval can compare it


def test_the_widget_draws_a_chart_with_matplotlib(monkeypatch):
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj, **kw: shown.append(obj))
    chart_explorer().widget()
    from matplotlib.figure import Figure

    assert len(shown) == 1 and isinstance(shown[0], Figure)


def notebook(tmp_path, cells):
    import nbformat

    nb = nbformat.v4.new_notebook()
    for source, tags in cells:
        cell = nbformat.v4.new_code_cell(source)
        cell.metadata["tags"] = tags
        nb.cells.append(cell)
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, path)
    return path


def test_load_runs_only_the_tagged_cells(tmp_path):
    path = notebook(tmp_path, [
        ("from intralayer.widgets import Explorer\nprint('a printed table')", ["explorer"]),
        ("raise RuntimeError('a launch the loader must not run')", []),
        ("def f(n):\n    return n\nexplorer = Explorer(f, n=[1, 2])", ["explorer", "other"]),
    ])
    found = widgets.load(path)
    assert list(found) == ["f"] and found["f"].size == 2


def test_load_of_tagged_cells_without_an_explorer_is_an_error(tmp_path):
    path = notebook(tmp_path, [("x = 1", ["explorer"])])
    with pytest.raises(ValueError, match="the cells tagged 'explorer' define no Explorer"):
        widgets.load(path)
    assert widgets.load(notebook(tmp_path, [("x = 1", [])])) == {}
