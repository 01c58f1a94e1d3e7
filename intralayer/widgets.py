"""One way to build an explorer: a pure function plus the discrete values of each control.

``Explorer(fn, n=[2, 4, 8], link={"NVLink": 450e9, "PCIe": 63e9})`` turns every keyword
into a control (numbers become a selection slider, anything else a dropdown) and shows
``fn(**values)`` (a matplotlib figure or text) below them, redrawn as the controls move.
A ``ValueError`` from ``fn`` is shown as a plain sentence, never as a traceback. The
values are a finite grid on purpose: :meth:`Explorer.grid` lists every combination, so a
test can sweep them all, and a static page can precompute them.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable

INVALID = "Not a valid combination: "


class Explorer:
    def __init__(self, fn: Callable[..., Any], title: str = "", **controls):
        if not controls:
            raise ValueError("an explorer needs at least one control")
        self.fn, self.title = fn, title
        self.options: dict[str, list[tuple[str, Any]]] = {}
        for name, values in controls.items():
            pairs = list(values.items()) if isinstance(values, dict) else [(_label(v), v) for v in values]
            if not pairs:
                raise ValueError(f"control {name!r} has no values to choose from")
            self.options[name] = pairs

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

    def widget(self, **initial):
        """The live ipywidgets explorer (JupyterLab)."""
        import ipywidgets as w
        from IPython.display import display

        controls = {}
        for name, pairs in self.options.items():
            start = initial.get(name, pairs[len(pairs) // 2][1] if _numeric(pairs) else pairs[0][1])
            common = dict(options=pairs, value=start, description=name, style={"description_width": "initial"})
            controls[name] = (w.SelectionSlider(**common, continuous_update=False, layout=w.Layout(width="420px"))
                              if _numeric(pairs) else w.Dropdown(**common))
        out = w.Output()

        def redraw(**values):
            import matplotlib.pyplot as plt

            result = self.render(**values)
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

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget())


def _numeric(pairs) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for _, v in pairs)


def _label(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)
