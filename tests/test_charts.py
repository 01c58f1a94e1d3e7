"""intralayer.charts: a chart is data (for the book's page) and a matplotlib figure (for the notebook)."""
from __future__ import annotations

import json
import math

import matplotlib
import pytest

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402

from intralayer.charts import Bars, Chart, Heatmap, Series, Text, _round  # noqa: E402


def bars(**kw):
    args = dict(categories=["a", "b"], series=[Series("x", [1.0, 2.0], "#111111"), Series("y", [3.0, 0.5])])
    args.update(kw)
    return Bars(**args)


@pytest.mark.parametrize("x, want", [(0, 0), (123456, 123500), (0.000123456, 0.0001235), (-98765.4, -98770),
                                     (2.0, 2), (1e300, 1e300), (2 ** 60, 1.153e18)])
def test_round_keeps_four_significant_digits(x, want):
    got = _round(x)
    assert got == pytest.approx(want, rel=1e-12)
    assert not isinstance(got, float) or not float(got).is_integer() or abs(got) >= 2 ** 53


@pytest.mark.parametrize("x", [math.nan, math.inf, -math.inf])
def test_round_refuses_non_finite_values(x):
    with pytest.raises(ValueError, match="finite"):
        _round(x)


def test_bars_validate_their_shape_and_unit():
    with pytest.raises(ValueError, match="unit 'furlongs'"):
        bars(unit="furlongs")
    with pytest.raises(ValueError, match="series 'x' has 1 values for 2 categories"):
        bars(series=[Series("x", [1.0])])
    with pytest.raises(ValueError, match="1 end labels for 2 categories"):
        bars(ends=["one"])
    with pytest.raises(ValueError, match="at least one panel"):
        Chart("empty", [])


def test_bars_totals_and_axis_top():
    b = bars()
    assert b.totals() == [4.0, 2.5]
    assert b.top() == pytest.approx(1.1 * 4.0)
    assert bars(ends=["4", "2.5"]).top() == pytest.approx(1.35 * 4.0)        # room for the labels
    assert bars(rules=[(10.0, "limit")]).top() == pytest.approx(11.0)         # the rule stays visible
    assert bars(limit=7.0).top() == 7.0
    assert bars(series=[Series("x", [0.0, 0.0])]).top() == 1.0                # an empty chart still has an axis


def test_to_data_is_plain_json_with_rounded_values():
    chart = Chart("t", [bars(ends=["a", "b"], rules=[(3.333333, "r")], note="n"),
                        Heatmap([[1.23456, 0.0], [2.0, 3.0]], title="h", dividers=[1]), Text(["one", "two"])])
    data = json.loads(json.dumps(chart.to_data()))
    assert data["title"] == "t"
    b, h, t = data["panels"]
    assert b["kind"] == "bars" and b["series"][0] == {"label": "x", "color": "#111111", "values": [1, 2]}
    assert b["rules"] == [[3.333, "r"]] and b["ends"] == ["a", "b"] and b["note"] == "n"
    assert b["top"] == pytest.approx(1.35 * 4.0)
    assert b["label"] == "" and b["category_label"] == ""
    assert h == {"kind": "heatmap", "matrix": [[1.23, 0], [2, 3]], "title": "h", "xlabel": "", "ylabel": "",
                 "dividers": [1]}
    assert t == {"kind": "text", "lines": ["one", "two"], "title": ""}


@pytest.mark.parametrize("unit", ["bytes", "seconds", "number"])
@pytest.mark.parametrize("horizontal", [True, False])
def test_every_panel_kind_draws_with_matplotlib(unit, horizontal):
    chart = Chart("title", [bars(unit=unit, horizontal=horizontal, ends=["1", "2"], rules=[(2.0, "two")], note="n"),
                            Heatmap([[0.0] * 20 for _ in range(20)], dividers=[10]), Text(["fact"], title="facts")])
    fig = chart.figure()
    assert isinstance(fig, Figure) and len(fig.axes) == 3
    assert fig.get_suptitle() == "title"
    assert fig.axes[0].get_title() == ""


def test_many_categories_get_sparse_ticks_and_both_axes_their_labels():
    b = Bars([str(i) for i in range(64)], [Series("x", [1.0] * 64)], horizontal=False, label="load",
             category_label="expert")
    ax = Chart("t", [b]).figure().axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "32", "63"]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("expert", "load")


def test_a_chart_displays_as_a_png_with_a_stable_text():
    bundle = Chart("the title", [bars()])._repr_mimebundle_()
    assert bundle["text/plain"] == "Chart: the title"
    assert bundle["image/png"][:8] == b"\x89PNG\r\n\x1a\n"


def _png_size(png: bytes) -> tuple[int, int]:
    import struct

    return struct.unpack(">II", png[16:24])                    # the IHDR chunk: width, height


def test_the_png_keeps_the_note_under_a_panel():
    """A note (memory, bytes, a refusal's reason) sits below the axes; the saved image must hold it."""
    import io

    import matplotlib.image as mpimg

    plain = Chart("t", [bars(note="")]).png()
    noted = Chart("t", [bars(note="the reason this setting is refused\nand a second line")]).png()
    (_, h0), (_, h1) = _png_size(plain), _png_size(noted)
    assert h1 > h0 + 20, f"the image with a note is {h1} px high, without {h0}: the note was cut off"
    image = mpimg.imread(io.BytesIO(noted))                     # (height, width, channels) in [0, 1]
    extra = image[h0 - 5:, :, :3]                                # the rows only the note can fill
    assert (extra < 0.5).any(), "no dark pixel below the plot: the note is not in the image"


@pytest.mark.parametrize("n", [8, 16, 32, 72])
def test_category_labels_side_by_side_never_overlap(n):
    b = Bars([f"dev {i}" for i in range(n)], [Series("x", [1.0] * n)], horizontal=False)
    fig = Chart("t", [b, bars()], width=10).figure()
    fig.canvas.draw()
    boxes = sorted((t.get_window_extent() for t in fig.axes[0].get_xticklabels() if t.get_text()),
                   key=lambda box: box.x0)
    assert len(boxes) >= 3, "too few labels left"
    for left, right in zip(boxes, boxes[1:]):
        assert left.x1 < right.x0, f"labels overlap at {n} categories: {left} and {right}"
