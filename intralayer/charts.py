"""Charts as data: one description, drawn by matplotlib in a notebook and by the page in the book.

An explorer's function returns a :class:`Chart` instead of drawing. In JupyterLab the chart
is drawn with matplotlib (``chart.figure()``; a chart at the end of a cell shows as a PNG).
For the static web book, ``chart.to_data()`` is plain JSON that the book's
``explorer.js`` draws as SVG in the browser, so an explorer can be precomputed over its
whole slider grid at build time and stay interactive without a kernel.

The vocabulary is deliberately small — what the course's explorers need:

* :class:`Bars`: stacked bars (one series is plain bars), horizontal or vertical, a value
  axis in bytes, seconds or plain numbers, text at the end of each bar, and reference
  lines (a device's memory, an expert's capacity).
* :class:`Heatmap`: a matrix (traffic rank → rank), with divider lines (node borders).
* :class:`Text`: lines of text (facts that are not a bar).
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass, field

UNITS = ("bytes", "seconds", "number")


def _round(x: float, digits: int = 4) -> float | int:
    """Round to ``digits`` significant digits, so the precomputed data stays small."""
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"a chart value must be finite, got {x}")
    if x == 0:
        return 0
    r = round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))
    return int(r) if r == int(r) and abs(r) < 2 ** 53 else r


@dataclass
class Series:
    """One colour of a (stacked) bar chart: a value per category."""

    label: str
    values: list[float]
    color: str = "#3182bd"


@dataclass
class Bars:
    """Stacked bars, one bar per category, series stacked in order."""

    categories: list[str]
    series: list[Series]
    horizontal: bool = True
    unit: str = "number"
    title: str = ""
    label: str = ""                                    # value-axis label
    category_label: str = ""                           # category-axis label
    ends: list[str] | None = None                      # text after each bar
    rules: list[tuple[float, str]] = field(default_factory=list)   # reference lines on the value axis
    note: str = ""                                     # text under the panel
    limit: float | None = None                         # value-axis maximum
    legend: bool = True

    def __post_init__(self):
        if self.unit not in UNITS:
            raise ValueError(f"unit {self.unit!r} must be one of {UNITS}")
        for s in self.series:
            if len(s.values) != len(self.categories):
                raise ValueError(f"series {s.label!r} has {len(s.values)} values for {len(self.categories)} categories")
        if self.ends is not None and len(self.ends) != len(self.categories):
            raise ValueError(f"{len(self.ends)} end labels for {len(self.categories)} categories")

    def totals(self) -> list[float]:
        return [sum(s.values[i] for s in self.series) for i in range(len(self.categories))]

    def top(self) -> float:
        """The value-axis maximum: ``limit``, or room above the longest bar, rule and label."""
        if self.limit is not None:
            return float(self.limit)
        biggest = max(self.totals() + [v for v, _ in self.rules] + [0.0])
        return (1.35 if self.ends and self.horizontal else 1.1) * biggest or 1.0

    def to_data(self) -> dict:
        return {"kind": "bars", "categories": list(map(str, self.categories)),
                "series": [{"label": s.label, "color": s.color, "values": [_round(v) for v in s.values]}
                           for s in self.series],
                "horizontal": self.horizontal, "unit": self.unit, "title": self.title, "label": self.label,
                "category_label": self.category_label,
                "ends": self.ends, "rules": [[_round(v), t] for v, t in self.rules], "note": self.note,
                "top": _round(self.top()), "legend": self.legend}

    def draw(self, ax) -> None:
        from . import plots

        n = len(self.categories)
        pos = list(range(n))
        base = [0.0] * n
        for s in self.series:
            if self.horizontal:
                ax.barh(pos, s.values, left=base, color=s.color, label=s.label or None)
            else:
                ax.bar(pos, s.values, bottom=base, color=s.color, label=s.label or None)
            base = [b + v for b, v in zip(base, s.values)]
        top = self.top()
        for value, text in self.rules:
            if self.horizontal:                        # label at the top, left of the line near the edge
                ax.axvline(value, color="k", ls="--", lw=1)
                right = value > 0.7 * top
                ax.text(value, -0.5, (text + " ") if right else (" " + text), fontsize=8, va="top",
                        ha="right" if right else "left")
            else:
                ax.axhline(value, color="k", ls="--", lw=1)
                ax.text(n - 0.5, value, text + " ", fontsize=8, va="bottom", ha="right")
        if self.ends:
            for i, text in enumerate(self.ends):
                if self.horizontal:
                    ax.text(base[i], i, "  " + text, va="center", fontsize=9)
                else:
                    ax.text(i, base[i], text, ha="center", va="bottom", fontsize=8)
        ticks = pos if n <= 16 else [0, n // 2, n - 1]
        value_axis = ax.xaxis if self.horizontal else ax.yaxis
        if self.horizontal:
            ax.set_yticks(ticks, [self.categories[i] for i in ticks])
            ax.set_ylim(n - 0.5, -0.5)                 # first category on top
            ax.set_xlim(0, top)
            ax.grid(False, axis="y")
        else:
            step = 1
            while step < n and _crowded(ax, [self.categories[i] for i in ticks[::step]]):
                step += 1                              # every step-th label, so none overlap
            ticks = ticks[::step]
            ax.set_xticks(ticks, [self.categories[i] for i in ticks])
            ax.set_ylim(0, top)
            ax.grid(False, axis="x")
        if self.unit == "bytes":
            plots.bytes_axis(value_axis, log=False)
        elif self.unit == "seconds":
            import matplotlib.pyplot as plt

            value_axis.set_major_locator(plt.MaxNLocator(nbins=4))
            value_axis.set_major_formatter(plt.FuncFormatter(lambda x, _: plots.human_seconds(x) if x else "0"))
        (ax.set_xlabel if self.horizontal else ax.set_ylabel)(self.label)
        (ax.set_ylabel if self.horizontal else ax.set_xlabel)(self.category_label)
        ax.set_title(self.title, fontsize=10)
        if self.legend and any(s.label for s in self.series):
            longest = max(len(s.label) for s in self.series)
            ax.legend(fontsize=7, loc="upper center", ncols=min(len(self.series), 4 if longest < 16 else 2),
                      bbox_to_anchor=(0.5, -0.18 if not (self.label or self.category_label) else -0.28))
        if self.note:
            ax.text(0.0, -0.32 if not self.legend else -0.55, self.note, transform=ax.transAxes, fontsize=8, va="top")


def _crowded(ax, labels: list[str]) -> bool:
    """Would these category labels, evenly spaced under ``ax``, run into each other?

    Each label gets the axis width divided by the number of labels; it needs about 0.6 em a
    character in the tick font plus a gap. The axes' share of the figure is taken before
    constrained layout shrinks it a little more (hence 0.8).
    """
    width = ax.get_figure().get_figwidth() * ax.get_position().width * 0.8 / len(labels)   # inches each
    size = _tick_font_size()
    return any(0.6 * size / 72 * len(label) + 0.08 > width for label in labels)


def _tick_font_size() -> float:
    """The tick-label font size in points."""
    import matplotlib as mpl
    from matplotlib.font_manager import FontProperties

    return FontProperties(size=mpl.rcParams["xtick.labelsize"]).get_size_in_points()


@dataclass
class Heatmap:
    """A matrix of values in one unit, darker for larger."""

    matrix: list[list[float]]
    title: str = ""
    xlabel: str = ""
    ylabel: str = ""
    dividers: list[int] = field(default_factory=list)  # borders after these rows/columns

    def to_data(self) -> dict:
        return {"kind": "heatmap", "matrix": [[_round(v, 3) for v in row] for row in self.matrix],
                "title": self.title, "xlabel": self.xlabel, "ylabel": self.ylabel, "dividers": list(self.dividers)}

    def draw(self, ax) -> None:
        ax.imshow(self.matrix, cmap="Blues", vmin=0)
        for d in self.dividers:
            ax.axhline(d - 0.5, color="#d9822b", lw=1.5)
            ax.axvline(d - 0.5, color="#d9822b", lw=1.5)
        n = len(self.matrix)
        if n > 16:
            ax.set_xticks([0, n - 1])
            ax.set_yticks([0, n - 1])
        ax.grid(False)
        ax.set(xlabel=self.xlabel, ylabel=self.ylabel, title=self.title)


@dataclass
class Text:
    """Lines of text in a panel of their own."""

    lines: list[str]
    title: str = ""

    def to_data(self) -> dict:
        return {"kind": "text", "lines": list(self.lines), "title": self.title}

    def draw(self, ax) -> None:
        ax.axis("off")
        for i, line in enumerate(self.lines):
            ax.text(0.0, 0.9 - 0.15 * i, line, fontsize=9, transform=ax.transAxes, va="top")
        if self.title:
            ax.set_title(self.title, fontsize=10)


@dataclass
class Chart:
    """A titled row of panels: what an explorer shows for one setting of its controls."""

    title: str
    panels: list
    width: float = 10.0
    height: float = 3.2

    def __post_init__(self):
        if not self.panels:
            raise ValueError("a chart needs at least one panel")

    def to_data(self) -> dict:
        return {"title": self.title, "panels": [p.to_data() for p in self.panels]}

    def figure(self):
        """The chart drawn with matplotlib in the course style (closed: display it or save it)."""
        import matplotlib.pyplot as plt

        from . import plots

        fig, axes = plots.figure(ncols=len(self.panels), width=self.width, height=self.height)
        axes = [axes] if len(self.panels) == 1 else list(axes)
        for ax, panel in zip(axes, self.panels):
            panel.draw(ax)
        fig.suptitle(self.title, fontsize=10)
        plt.close(fig)
        return fig

    def png(self) -> bytes:
        """The figure as PNG bytes, cropped to everything drawn: the notes and legends that sit
        below a panel are outside the axes, so a plain save would cut them off."""
        buf = io.BytesIO()
        self.figure().savefig(buf, format="png", bbox_inches="tight", pad_inches=0.1)
        return buf.getvalue()

    def _repr_mimebundle_(self, include=None, exclude=None):
        return {"image/png": self.png(), "text/plain": f"Chart: {self.title}"}
