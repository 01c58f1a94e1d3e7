"""widgets.Explorer (grid, render, the ipywidgets UI) and the plots unit formatters."""
from __future__ import annotations

import itertools

import ipywidgets as w
import pytest

from intralayer import plots, widgets


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
