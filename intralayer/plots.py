"""One plot style for the whole course, and the units every chapter labels axes with."""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, Locator, LogLocator, MaxNLocator, NullFormatter

#: One colour per collective, the same in every chapter.
COLORS = {"all_reduce": "#1f5fa8", "all_gather": "#2e9e5b", "reduce_scatter": "#d9822b",
          "all_to_all": "#b3367a", "send": "#6b6b6b"}

STYLE = {
    "figure.figsize": (7.0, 3.6), "figure.dpi": 100, "savefig.dpi": 100,
    "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False,
    "axes.titlesize": 11, "axes.labelsize": 10, "legend.fontsize": 9, "legend.frameon": False,
    "font.size": 10,
}


def style() -> None:
    """Apply the course style (idempotent); every chapter calls it once at the top."""
    plt.rcParams.update(STYLE)


def figure(ncols: int = 1, nrows: int = 1, width: float | None = None, height: float | None = None):
    """A styled figure and its axes (a single ``Axes`` when 1×1)."""
    style()
    w = width or STYLE["figure.figsize"][0] * (1 if ncols == 1 else 0.75 * ncols)
    h = height or STYLE["figure.figsize"][1] * nrows
    fig, axes = plt.subplots(nrows, ncols, figsize=(w, h), layout="constrained", squeeze=True)
    return fig, axes


def human_bytes(n: float) -> str:
    """1536 → '1.5 KiB'; powers of 1024, as message sizes are usually given."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        shown = f"{n:.0f}" if unit == "B" or n == int(n) else f"{n:.1f}"
        if abs(float(shown)) < 1024 or unit == "TiB":       # decide after rounding: no "1024.0 KiB"
            return f"{shown} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_seconds(t: float) -> str:
    """0.00042 → '420 µs'."""
    if t == 0:
        return "0"
    for scale, unit in ((1, "s"), (1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns")):
        if float(f"{abs(t) / scale:.3g}") >= 1 or unit == "ns":   # after rounding: no "1e+03 µs"
            return f"{t / scale:.3g} {unit}"
    raise AssertionError("unreachable")


def bytes_axis(axis, log: bool = True) -> None:
    """Label an axis in B/KiB/MiB/GiB; a log axis gets ticks at powers of 16 (256 B, 4 KiB, …)."""
    if log:
        axis.set_major_locator(LogLocator(base=16, subs=[1.0]))
        axis.set_minor_formatter(NullFormatter())
    else:
        axis.set_major_locator(_BinaryLocator())
    axis.set_major_formatter(FuncFormatter(lambda v, _: human_bytes(v)))


class _BinaryLocator(Locator):
    """Round ticks in the unit the axis reaches (KiB, MiB, …): 0, 100 MiB, 200 MiB, not 143.1 MiB."""

    def __call__(self):
        return self.tick_values(*self.axis.get_view_interval())

    def tick_values(self, vmin, vmax):
        unit = 1024.0 ** max(0, math.floor(math.log(max(abs(vmax), 1.0), 1024)))
        return MaxNLocator(nbins=4, steps=[1, 2, 2.5, 5, 10]).tick_values(vmin / unit, vmax / unit) * unit


def seconds_axis(axis) -> None:
    """Label a log-scaled time axis in s/ms/µs."""
    axis.set_major_formatter(FuncFormatter(lambda v, _: human_seconds(v)))
