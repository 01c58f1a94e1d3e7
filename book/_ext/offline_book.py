"""Serves ``book/_ext/static`` (the explorers' script and style), and keeps the book free
of console errors: jupyter-book 1.0 adds sphinx-thebe's inline configuration script twice,
so the second copy fails with "Identifier 'THEBE_JS_URL' has already been declared";
keep one copy.
"""
from pathlib import Path

STATIC = Path(__file__).parent / "static"


def _dedupe_scripts(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, kept = set(), []
    for js in scripts:
        key = (getattr(js, "filename", str(js)) or "", tuple(sorted(getattr(js, "attributes", {}).items())))
        if key not in seen:
            seen.add(key)
            kept.append(js)
    scripts[:] = kept


def _add_static(app):
    app.config.html_static_path.append(str(STATIC))


def setup(app):
    app.connect("builder-inited", _add_static)
    app.connect("html-page-context", _dedupe_scripts)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
