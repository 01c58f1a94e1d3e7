"""One way to build an explorer: a pure function plus the discrete values of each control.

``Explorer(fn, n=[2, 4, 8], link={"NVLink": 450e9, "PCIe": 63e9})`` turns every keyword
into a control (numbers become a selection slider, anything else a dropdown) and shows
``fn(**values)`` (a :class:`~intralayer.charts.Chart`, a matplotlib figure or text) below
them, redrawn as the controls move. A ``ValueError`` from ``fn`` is shown as a plain
sentence, never as a traceback.

The values are a finite grid on purpose: :meth:`Explorer.grid` lists every combination,
so a test can sweep them all, and the web book precomputes them. One definition serves
both places an explorer lives:

* in JupyterLab, displaying an explorer shows a live ipywidgets UI that calls ``fn``;
* in the static book, the same display output carries a placeholder
  (``<div class="itl-explorer" data-explorer="NAME">``). At build time the book's
  extension runs the notebook cells tagged ``explorer`` (:func:`load`), computes
  :meth:`Explorer.table` — every setting's chart as JSON, or its sentence — and the
  page's ``explorer.js`` draws the chart for whatever the reader selects, with no kernel.
"""
from __future__ import annotations

import contextlib
import html
import io
import itertools
import json
from pathlib import Path
from typing import Any, Callable

INVALID = "Not a valid combination: "
#: The notebook cell tag of the cells :func:`load` runs to rebuild a chapter's explorers.
TAG = "explorer"


class Explorer:
    def __init__(self, fn: Callable[..., Any], title: str = "", start: dict | None = None, **controls):
        if not controls:
            raise ValueError("an explorer needs at least one control")
        self.fn, self.title = fn, title
        self.name = getattr(fn, "__name__", "explorer")
        self.options: dict[str, list[tuple[str, Any]]] = {}
        for name, values in controls.items():
            pairs = list(values.items()) if isinstance(values, dict) else [(_label(v), v) for v in values]
            if not pairs:
                raise ValueError(f"control {name!r} has no values to choose from")
            self.options[name] = pairs
        self.start: dict[str, Any] = {}
        for name, pairs in self.options.items():
            default = pairs[len(pairs) // 2][1] if _numeric(pairs) else pairs[0][1]
            self.start[name] = (start or {}).get(name, default)
            if self.start[name] not in [v for _, v in pairs]:
                raise ValueError(f"start value {self.start[name]!r} of {name!r} is not one of its values")
        unknown = set(start or {}) - set(self.options)
        if unknown:
            raise ValueError(f"start names controls that do not exist: {sorted(unknown)}")

    @property
    def size(self) -> int:
        """How many settings the controls allow (the length of :meth:`grid`)."""
        n = 1
        for pairs in self.options.values():
            n *= len(pairs)
        return n

    def grid(self):
        """Every combination of control values, as keyword dictionaries."""
        names = list(self.options)
        for combo in itertools.product(*(self.options[n] for n in names)):
            yield {n: v for n, (_, v) in zip(names, combo)}

    def render(self, **values):
        """``fn(**values)``, or the sentence saying why the combination is invalid."""
        try:
            return self.fn(**values)
        except ValueError as exc:
            return INVALID + str(exc)

    def key(self, **values) -> str:
        """The setting's key in :meth:`table`: each control's value index, joined by ``-``."""
        idx = []
        for name, pairs in self.options.items():
            vals = [v for _, v in pairs]
            if name not in values or values[name] not in vals:
                raise ValueError(f"{name}={values.get(name)!r} is not one of the values of control {name!r}")
            idx.append(str(vals.index(values[name])))
        return "-".join(idx)

    def table(self) -> dict:
        """Every setting's output as JSON-ready data, for the static book.

        ``{"name", "title", "controls": [{"name", "labels", "numeric", "start"}],
        "outputs": [...], "index": [...]}``: ``outputs`` holds each distinct output once (a
        chart's data, or ``{"invalid": sentence}``) and ``index[i]`` is the output of the
        i-th setting of :meth:`grid` (the last control varies fastest). Each output must be
        a :class:`~intralayer.charts.Chart` or an invalid-combination sentence; anything
        else (or any exception but ``ValueError``) is an error here, so a build that
        computes the table has swept the whole grid.
        """
        from .charts import Chart

        outputs, index, seen = [], [], {}
        for values in self.grid():
            result = self.render(**values)
            if isinstance(result, Chart):
                data = result.to_data()
            elif isinstance(result, str) and result.startswith(INVALID):
                data = {"invalid": result}
            else:
                raise TypeError(f"{self.name}({values}) returned {type(result).__name__}; "
                                "a static explorer needs a Chart (or a ValueError for an invalid setting)")
            text = json.dumps(data, sort_keys=True)
            if text not in seen:
                seen[text] = len(outputs)
                outputs.append(data)
            index.append(seen[text])
        controls = [{"name": name, "labels": [label for label, _ in pairs], "numeric": _numeric(pairs),
                     "start": [v for _, v in pairs].index(self.start[name])} for name, pairs in self.options.items()]
        return {"name": self.name, "title": self.title, "controls": controls, "outputs": outputs, "index": index}

    def placeholder(self) -> str:
        """The HTML the static book fills in from the precomputed :meth:`table`."""
        return (f'<div class="itl-explorer" data-explorer="{html.escape(self.name)}">'
                f'<p class="itl-explorer-fallback"><b>{html.escape(self.title)}</b>: this explorer needs '
                "JavaScript in the web book, or a kernel in JupyterLab.</p></div>")

    def widget(self, **initial):
        """The live ipywidgets explorer (JupyterLab)."""
        import ipywidgets as w
        from IPython.display import display

        controls = {}
        for name, pairs in self.options.items():
            start = initial.get(name, self.start[name])
            common = dict(options=pairs, value=start, description=name, style={"description_width": "initial"})
            controls[name] = (w.SelectionSlider(**common, continuous_update=False, layout=w.Layout(width="420px"))
                              if _numeric(pairs) else w.Dropdown(**common))
        out = w.Output()

        def redraw(**values):
            import matplotlib.pyplot as plt

            result = self.render(**values)
            if hasattr(result, "figure") and hasattr(result, "to_data"):      # a Chart
                result = result.figure()
            out.clear_output(wait=True)
            with out:
                if isinstance(result, str):
                    print(result)
                else:
                    display(result)
                    if hasattr(result, "savefig"):
                        plt.close(result)

        w.interactive_output(redraw, controls)
        children = ([w.HTML(f"<b>{self.title}</b>")] if self.title else []) + [w.VBox(list(controls.values())), out]
        return w.VBox(children)

    def _repr_mimebundle_(self, include=None, exclude=None):
        """The live widget where a kernel runs it, and the static book's placeholder."""
        bundle = self.widget()._repr_mimebundle_()
        bundle["text/html"] = self.placeholder()
        bundle["text/plain"] = f"Explorer: {self.title} ({self.size} settings)"
        return bundle


def load(notebook: str | Path) -> dict[str, Explorer]:
    """Run a notebook's cells tagged ``explorer``, in order, and return its explorers by name.

    The tagged cells must be enough to define the explorers (imports, helpers, the
    explorer cell) and cheap: no launches, no measurements. Used by the book build and
    by the tests that sweep every setting.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = json.loads(Path(notebook).read_text())["cells"]
    namespace: dict[str, Any] = {"__name__": "__explorer__"}
    ran = 0
    for cell in cells:
        if cell["cell_type"] == "code" and TAG in cell.get("metadata", {}).get("tags", []):
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            with contextlib.redirect_stdout(io.StringIO()):           # the cells' printed tables
                exec(compile(source, str(notebook), "exec"), namespace)
            plt.close("all")
            ran += 1
    found = {v.name: v for v in namespace.values() if isinstance(v, Explorer)}
    if ran and not found:
        raise ValueError(f"{notebook}: the cells tagged {TAG!r} define no Explorer")
    return found


def _numeric(pairs) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for _, v in pairs)


def _label(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)
