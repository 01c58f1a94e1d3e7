"""Explorers that stay interactive in the static book, with no kernel.

At ``builder-inited`` this extension rebuilds each chapter's explorers from the notebook
cells tagged ``explorer`` (:func:`intralayer.widgets.load`) and precomputes every setting
of their controls (:meth:`intralayer.widgets.Explorer.table`: each chart as JSON, or the
sentence saying why the setting is invalid). The tables are written to
``_static/explorers/<chapter>.js`` and added to that chapter's page only, next to
``explorer.js``, which draws the selected setting's chart as SVG in the browser.

A setting whose function raises anything but ``ValueError`` fails the build: computing
the tables sweeps every explorer's whole grid.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from sphinx.errors import ExtensionError
from sphinx.util import logging

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"
_tables: dict[str, str] = {}                 # page name → the JavaScript holding its explorers


def _compute(app) -> None:
    import torch

    from intralayer import widgets

    torch.set_num_threads(1)            # thousands of tiny tensor ops: threads only add overhead
    _tables.clear()
    root = Path(app.srcdir)
    for notebook in sorted((root / "chapters").glob("*.ipynb")):
        start = time.monotonic()
        cwd = os.getcwd()
        try:
            os.chdir(notebook.parent)
            explorers = widgets.load(notebook)
            tables = {name: e.table() for name, e in explorers.items()}
        except Exception as exc:            # any failure is a broken explorer: stop the build
            raise ExtensionError(f"explorers of {notebook.name}: {type(exc).__name__}: {exc}") from exc
        finally:
            os.chdir(cwd)
        if not tables:
            continue
        body = "".join(f"window.ITL_EXPLORERS[{json.dumps(name)}] = {json.dumps(t, separators=(',', ':'))};\n"
                       for name, t in tables.items())
        _tables[f"chapters/{notebook.stem}"] = "window.ITL_EXPLORERS = window.ITL_EXPLORERS || {};\n" + body
        settings = sum(len(t["outputs"]) for t in tables.values())
        log.info(f"[explorers] {notebook.stem}: {settings} settings precomputed in "
                 f"{time.monotonic() - start:.1f} s ({len(_tables[f'chapters/{notebook.stem}']) / 1e6:.2f} MB)")


def _add_to_page(app, pagename, templatename, context, doctree):
    if pagename in _tables:
        app.add_js_file(f"explorers/{pagename.split('/')[-1]}.js", priority=700, defer="defer")


def _write(app, exception):
    if exception is not None or app.builder.format != "html":
        return
    folder = Path(app.outdir) / "_static" / "explorers"
    folder.mkdir(parents=True, exist_ok=True)
    for pagename, text in _tables.items():
        (folder / f"{pagename.split('/')[-1]}.js").write_text(text)


def setup(app):
    app.connect("builder-inited", _compute)
    app.connect("html-page-context", _add_to_page)
    app.connect("build-finished", _write)
    app.add_js_file("explorer.js", priority=800, defer="defer")
    app.add_css_file("explorer.css")
    return {"parallel_read_safe": True, "parallel_write_safe": True}
