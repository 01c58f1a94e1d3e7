"""The web book: builds with warnings as errors from the stored outputs, loads nothing
from the internet, every internal link and anchor resolves, and in a real (headless)
Chromium the math is typeset, the plots are shown, code is highlighted, no script fails,
and every chapter's explorer answers a moved slider with the precomputed chart of the new
setting — checked against the explorer's own Python function. The explorers' tables the
build precomputed hold a chart or a sentence for every setting, and what the function returns. Saves screenshots of each
page (its first screen; whole pages with ``SCREENSHOTS=full``, about 2.5 s more each) and of each explorer
after the move (``_build/screenshots/``)."""
from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urlparse

import pytest

from intralayer import widgets
from intralayer.charts import Chart
from tests.explorer_table import lookup

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted(p.stem for p in (ROOT / "chapters").glob("*.ipynb"))
SHOTS = ROOT / "_build" / "screenshots"
FULL_PAGE = os.environ.get("SCREENSHOTS") == "full"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]


@pytest.fixture(scope="module")
def html(tmp_path_factory) -> Path:
    """Build the book once, into a temporary folder (``make book`` writes _build/)."""
    if not (ROOT / "book" / "_vendor" / ".copied").exists():
        pytest.fail("book/_vendor is missing: run the tests through `make test`, which installs the npm assets")
    out = tmp_path_factory.mktemp("book")
    jb = Path(sys.executable).with_name("jupyter-book")
    done = subprocess.run([str(jb), "build", str(ROOT), "--path-output", str(out), "-W", "-n",
                           "--keep-going", "--all"], capture_output=True, text=True, timeout=600)
    warnings = [l for l in done.stdout.splitlines() + done.stderr.splitlines() if "WARNING" in l or "ERROR" in l]
    assert done.returncode == 0 and not warnings, "book build failed:\n" + "\n".join(warnings or [done.stdout[-3000:]])
    return out / "_build" / "html"


def test_every_chapter_page_is_built(html):
    for stem in CHAPTERS:
        page = html / "chapters" / f"{stem}.html"
        assert page.exists(), f"{stem} is not in the book (is it in _toc.yml?)"
        imgs = re.findall(r"<img[^>]+src=\"([^\"]+)\"", page.read_text())
        assert len(imgs) >= 3, f"{stem}: expected its plots as images, found {len(imgs)}"
        for src in imgs:
            assert (page.parent / src).resolve().exists(), f"{stem}: image {src} is missing"


def test_no_page_loads_from_a_cdn(html):
    external = re.compile(r"<(?:script|link|img)[^>]+(?:src|href)=\"(https?:)?//", re.I)
    for page in html.rglob("*.html"):
        hits = external.findall(page.read_text())
        assert not hits, f"{page.relative_to(html)} loads {len(hits)} resources from the internet"
    for asset in ("mathjax/tex-chtml.js", "explorer.js", "explorer.css"):
        assert (html / "_static" / asset).exists(), f"offline asset _static/{asset} is missing"


def test_every_internal_link_and_anchor_resolves(html):
    """Every relative href and src of every page names a file of the build, and its
    #fragment an id in that file (what Sphinx's -n/-W cannot see in raw HTML outputs)."""
    ids: dict[Path, set[str]] = {}

    def anchors(page: Path) -> set[str]:
        if page not in ids:
            ids[page] = set(re.findall(r"\bid=\"([^\"]+)\"", page.read_text(errors="replace")))
        return ids[page]

    broken, checked = [], 0
    pages = [p for p in sorted(html.rglob("*.html")) if p.relative_to(html).parts[0] not in ("_static", "_sources")]
    for page in pages:                         # (_static holds the theme's Jinja templates, not pages)
        text = page.read_text(errors="replace")
        for attr, link in re.findall(r"\b(href|src)=\"([^\"]*)\"", text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", link, re.I) or link.startswith("//") or not link:
                continue                       # external or data: URLs, javascript:, mailto:
            path, _, fragment = link.partition("#")
            path = path.split("?")[0]
            target = (page.parent / path).resolve() if path else page
            if target.is_dir():
                target = target / "index.html"
            checked += 1
            if not target.exists():
                broken.append(f"{page.relative_to(html)}: {link} (no such file)")
            elif fragment and target.suffix == ".html" and fragment not in anchors(target):
                broken.append(f"{page.relative_to(html)}: {link} (no id {fragment!r})")
    assert checked > 500, f"only {checked} links checked: is the build complete?"
    assert not broken, f"{len(broken)} broken internal links:\n" + "\n".join(broken[:20])


def test_every_chapter_page_carries_its_explorer_table(html):
    for stem in CHAPTERS:
        page = (html / "chapters" / f"{stem}.html").read_text()
        assert 'class="itl-explorer"' in page, f"{stem}: the explorer's placeholder is not on the page"
        assert f"_static/explorers/{stem}.js" in page, f"{stem}: the page does not load its explorer table"
        assert (html / "_static" / "explorers" / f"{stem}.js").stat().st_size > 1000
        assert "_static/explorer.js" in page


# ---------------------------------------------------------- the explorers' tables, as built
# The build sweeps every explorer's whole grid (book/_ext/static_explorers.py); these tests read
# the tables it wrote rather than sweeping the grids again.
DRAWN = 12           # settings per chapter also drawn with matplotlib


def _built_table(html: Path, stem: str) -> tuple[widgets.Explorer, dict]:
    """The chapter's explorer (from its cells tagged ``explorer``) and the table the build wrote."""
    import torch

    torch.set_num_threads(1)
    (explorer,) = widgets.load(ROOT / "chapters" / f"{stem}.ipynb").values()
    script = (html / "_static" / "explorers" / f"{stem}.js").read_text()
    found = re.findall(r"^window\.ITL_EXPLORERS\[(\"[^\"]+\")\] = (.*);$", script, re.M)
    tables = {json.loads(name): json.loads(body) for name, body in found}
    assert explorer.name in tables, f"{stem}: the build wrote tables for {list(tables)}, not {explorer.name!r}"
    return explorer, tables[explorer.name]


def test_every_chapter_has_exactly_one_explorer():
    for stem in CHAPTERS:
        found = widgets.load(ROOT / "chapters" / f"{stem}.ipynb")
        assert len(found) == 1, f"{stem}: expected one explorer in the cells tagged 'explorer', found {list(found)}"


@pytest.mark.parametrize("stem", CHAPTERS)
def test_the_whole_grid_gives_a_chart_or_a_sentence(html, stem, monkeypatch):
    monkeypatch.chdir(ROOT / "chapters")
    explorer, table = _built_table(html, stem)
    assert len(table["index"]) == explorer.size
    kinds = {"chart": 0, "sentence": 0}
    for out in table["outputs"]:
        if "invalid" in out:
            assert out["invalid"].startswith(widgets.INVALID) and len(out["invalid"]) > len(widgets.INVALID) + 10, out
            kinds["sentence"] += 1
        else:
            assert out["title"] and out["panels"], out
            kinds["chart"] += 1
    assert kinds["chart"] > 0, f"{stem}: no setting draws a chart"
    assert "panels" in lookup(explorer, table, **explorer.start), f"{stem}: the start setting is invalid"


@pytest.mark.parametrize("stem", CHAPTERS)
def test_the_table_holds_what_the_function_returns(html, stem, monkeypatch):
    """Settings spread over the grid, and the last: the built table holds what the explorer's
    function returns for them, and matplotlib draws that chart as the notebook does."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    monkeypatch.chdir(ROOT / "chapters")
    explorer, table = _built_table(html, stem)
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
        fig = result.figure()
        assert isinstance(fig, Figure) and len(fig.axes) >= len(result.panels)
        plt.close("all")


@pytest.fixture(scope="module")
def server(html):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(html))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def browser():
    chromium = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed; .ci/run installs Debian's chromium package")
        pytest.skip("chromium is not installed (apt-get install chromium); CI runs this test")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        yield b
        b.close()


@pytest.mark.parametrize("stem", CHAPTERS)
def test_chapter_renders_in_chromium(server, browser, stem):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    outside, errors = [], []

    def route(r):
        host = urlparse(r.request.url).hostname
        if host in ("127.0.0.1", "localhost") or r.request.url.startswith("data:"):
            r.continue_()
        else:
            outside.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    page.on("pageerror", lambda e: errors.append(str(e)))
    loaded, failed = {}, []
    page.on("response", lambda r: loaded.__setitem__(urlparse(r.url).path, r.status))
    page.on("requestfailed", lambda r: failed.append(r.url) if r.url not in outside else None)
    page.goto(f"{server}/chapters/{stem}.html", wait_until="networkidle")
    page.wait_for_function("() => window.MathJax && MathJax.startup && MathJax.startup.document"
                           " && document.querySelectorAll('mjx-container').length > 0", timeout=30_000)
    page.evaluate("() => MathJax.startup.promise")
    typeset = page.evaluate("() => document.querySelectorAll('mjx-container').length")
    raw_tex = page.evaluate("() => document.body.innerText.includes('\\\\frac')")
    images = page.evaluate("() => Array.from(document.querySelectorAll('article img'))"
                           ".map(i => i.complete && i.naturalWidth > 0)")
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{stem}.png"), full_page=FULL_PAGE)
    highlighted = page.evaluate("() => document.querySelectorAll('div.highlight pre span').length")
    page.close()
    assert not outside, f"the page tried to reach the internet: {outside[:5]}"
    bad = sorted(p for p, status in loaded.items() if status >= 400)
    assert not failed and not bad, f"requests failed: {failed[:5]}, error statuses: {bad[:5]}"
    assert typeset >= 10 and not raw_tex, f"math not typeset: {typeset} formulas, raw TeX left: {raw_tex}"
    assert len(images) >= 3 and all(images), f"plots missing or broken: {images}"
    assert highlighted > 50, f"code cells are not syntax-highlighted ({highlighted} highlighted tokens)"
    scripts = {p: s for p, s in loaded.items() if p.endswith(("/explorer.js", f"/explorers/{stem}.js"))}
    assert len(scripts) == 2 and set(scripts.values()) == {200}, f"the explorer's scripts did not load: {scripts}"
    assert not errors, f"JavaScript errors: {errors}"


def _open(browser, server, path, bad=None, math=True):
    """Open a page of the build offline; collect script errors (and, into ``bad``, failed requests).
    ``math=False`` leaves MathJax out (its typesetting is most of a chapter page's load)."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    if bad is not None:
        page.on("response", lambda r: bad.append(r.url) if r.status >= 400 else None)
        page.on("requestfailed", lambda r: bad.append(r.url))
    page.route("**/*", lambda r: r.continue_() if urlparse(r.request.url).hostname in ("127.0.0.1", "localhost")
               and (math or "/mathjax/" not in r.request.url) else r.abort())
    page.goto(f"{server}/{path}", wait_until="networkidle")
    return page, errors


def _shown(page) -> str:
    """What the explorer shows now: its chart's title, or its invalid-setting sentence."""
    return page.evaluate("""() => {
        const out = document.querySelector('.itl-explorer .itl-out');
        const t = out.querySelector('.itl-chart-title, .itl-invalid');
        return t ? t.textContent : '';
    }""")


def _a_move(explorer):
    """A control and a neighbouring value of it whose setting draws a different chart."""
    start = explorer.render(**explorer.start)
    for k, (name, pairs) in enumerate(explorer.options.items()):
        values = [v for _, v in pairs]
        i = values.index(explorer.start[name])
        for j in (i + 1, i - 1):
            if 0 <= j < len(values):
                moved = {**explorer.start, name: values[j]}
                result = explorer.render(**moved)
                if not isinstance(result, str) and result.title != start.title:
                    return k, name, i, j, moved, result
    raise AssertionError("no single step of any control changes the chart")


@pytest.mark.parametrize("stem", CHAPTERS)
def test_explorer_moves_in_the_static_page(server, browser, stem, monkeypatch):
    """Move one control of the chapter's explorer in the built page: the page must show the
    precomputed chart of the new setting, equal to what the Python function returns."""
    import torch

    torch.set_num_threads(1)
    monkeypatch.chdir(ROOT / "chapters")
    (explorer,) = widgets.load(ROOT / "chapters" / f"{stem}.ipynb").values()
    page, errors = _open(browser, server, f"chapters/{stem}.html", math=False)   # the math: the test above
    page.wait_for_selector(".itl-explorer.itl-ready .itl-out svg, .itl-explorer.itl-ready .itl-out .itl-text",
                           timeout=15_000)
    assert page.locator(".itl-explorer.itl-ready").count() == 1
    assert _shown(page) == explorer.render(**explorer.start).title, "the page does not start at the start setting"
    assert page.evaluate("() => document.querySelector('.itl-out').dataset.key") == explorer.key(**explorer.start)
    k, name, i, j, moved, want = _a_move(explorer)
    control = page.locator(f".itl-explorer [data-control='{name}']")
    if control.evaluate("el => el.tagName") == "INPUT":
        control.focus()
        page.keyboard.press("ArrowRight" if j > i else "ArrowLeft")
        label = page.locator(".itl-explorer .itl-control-value").nth(
            sum(1 for c in list(explorer.options.values())[:k] if widgets._numeric(c)))
        assert label.text_content() == explorer.options[name][j][0]
    else:
        control.select_option(str(j))
    page.wait_for_function("key => document.querySelector('.itl-out').dataset.key === key",
                           arg=explorer.key(**moved), timeout=5_000)
    assert _shown(page) == want.title
    marks = page.evaluate("() => document.querySelectorAll('.itl-out rect, .itl-out .itl-text div').length")
    assert marks > 0, "the chart drew nothing"
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.locator(".itl-explorer").screenshot(path=str(SHOTS / f"{stem}-explorer.png"))
    page.close()
    assert not errors, f"JavaScript errors: {errors}"


BOOK_PAGES = sorted(p.stem for p in (ROOT / "book").glob("*.md"))


@pytest.mark.parametrize("name", BOOK_PAGES)
def test_book_page_loads_cleanly(html, server, browser, name):
    """The front page, setup, notation, glossary, instructor guide and references: every
    request answered from the build, no script error, math typeset where there is math."""
    has_math = 'class="math' in (html / "book" / f"{name}.html").read_text()
    bad = []
    page, errors = _open(browser, server, f"book/{name}.html", bad)
    if has_math:
        page.wait_for_function("() => document.querySelectorAll('mjx-container').length > 0", timeout=30_000)
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"book-{name}.png"), full_page=FULL_PAGE)
    title = page.title()
    page.close()
    assert not bad, f"requests failed: {bad[:5]}"
    assert not errors, f"JavaScript errors: {errors}"
    assert "Inside the Layer" in title, title
