"""The web book: builds with warnings as errors from the stored outputs, loads nothing
from the internet, and in a real (headless) Chromium the math is typeset, the plots are
shown, the widget manager loads from the build and no script fails. Saves a screenshot
of each chapter page."""
from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urlparse

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted(p.stem for p in (ROOT / "chapters").glob("*.ipynb"))
SHOTS = ROOT / "_build" / "screenshots"
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
    for asset in ("mathjax/tex-chtml.js", "require.js", "html-manager/embed-amd.js"):
        assert (html / "_static" / asset).exists(), f"offline asset _static/{asset} is missing"


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
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
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
    loaded = {}
    page.on("response", lambda r: loaded.__setitem__(urlparse(r.url).path, r.status))
    page.goto(f"{server}/chapters/{stem}.html", wait_until="networkidle")
    page.wait_for_function("() => window.MathJax && MathJax.startup && MathJax.startup.document"
                           " && document.querySelectorAll('mjx-container').length > 0", timeout=30_000)
    page.evaluate("() => MathJax.startup.promise")
    typeset = page.evaluate("() => document.querySelectorAll('mjx-container').length")
    raw_tex = page.evaluate("() => document.body.innerText.includes('\\\\frac')")
    images = page.evaluate("() => Array.from(document.querySelectorAll('article img'))"
                           ".map(i => i.complete && i.naturalWidth > 0)")
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{stem}.png"), full_page=True)
    amd = page.evaluate("() => typeof window.require === 'function' && typeof window.define === 'function'")
    page.close()
    assert not outside, f"the page tried to reach the internet: {outside[:5]}"
    assert typeset >= 10 and not raw_tex, f"math not typeset: {typeset} formulas, raw TeX left: {raw_tex}"
    assert len(images) >= 3 and all(images), f"plots missing or broken: {images}"
    manager = {p: s for p, s in loaded.items() if p.endswith(("/require.js", "/html-manager/embed-amd.js"))}
    assert amd and len(manager) == 2 and set(manager.values()) == {200}, \
        f"the widget manager (require.js, embed-amd.js) did not load from the build: {manager}"
    assert not errors, f"JavaScript errors: {errors}"
