"""The built docs site as a reader meets it: opened from file:// in headless Chromium, with no network. Search finds
option and metric names, no table runs past the content column at 1366 px, lists are lists, the API reference shows
no raw Sphinx role, the formulas are typeset.

`make docs-check` installs Chromium (Debian's `chromium`) and Playwright's Python client, builds the site and runs
these; elsewhere they are skipped unless both are there (the static checks of the built HTML are in
tests/test_docs.py). OBLR_DOCS_SITE names a site already built (`make docs` writes site/); else it is built here."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
         "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1366, "height": 900}

sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright's client: make docs-check installs it")
if not (shutil.which(CHROMIUM) or Path(CHROMIUM).exists()):
    pytest.skip(f"no Chromium at {CHROMIUM}: make docs-check installs Debian's chromium", allow_module_level=True)
pytestmark = [pytest.mark.slow, pytest.mark.browser]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    if os.environ.get("OBLR_DOCS_SITE"):
        path = Path(os.environ["OBLR_DOCS_SITE"]).resolve()
        assert (path / "index.html").exists(), f"OBLR_DOCS_SITE={path} holds no built site"
        return path
    pytest.importorskip("mkdocs")
    path = tmp_path_factory.mktemp("site") / "site"
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(path)], cwd=ROOT, check=True,
                   capture_output=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=600)
    return path


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("profile")), executable_path=CHROMIUM, args=FLAGS, headless=True,
            viewport=VIEWPORT)
        yield context
        context.close()


@pytest.fixture
def page(browser):
    page = browser.new_page()
    page.requests = []
    page.on("request", lambda request: page.requests.append(request.url))
    yield page
    page.close()


def pages(site: Path) -> list[Path]:
    return sorted(p for p in site.glob("*.html") if p.name != "404.html")


def search(page, query: str) -> int:
    """Types ``query`` into the site's search box; the number of results it lists."""
    box = page.locator("input.md-search__input")
    if not box.is_visible():
        page.keyboard.press("s")  # Material's shortcut opens the search box
    box.fill(query, timeout=10_000)
    meta = page.locator(".md-search-result__meta")
    page.wait_for_function("() => !document.querySelector('.md-search-result__meta').innerText"
                           ".includes('Initializing')", timeout=20_000)
    page.wait_for_timeout(300)
    return page.locator(".md-search-result__item").count() if "No matching" not in meta.inner_text() else 0


@pytest.mark.parametrize("query", ["lr_mean", "noise_scale", "snr_estimator", "oblr/lr_scale", "one_backward"])
def test_search_finds_option_and_metric_names_from_file_urls_with_no_network(site, page, query):
    page.goto((site / "index.html").as_uri())
    assert search(page, query) >= 1, f"search found nothing for {query}"
    elsewhere = [url for url in page.requests if not url.startswith(("file:", "data:", "about:", "blob:"))]
    assert elsewhere == [], f"the page reached past the site: {elsewhere}"


def test_no_table_is_wider_than_the_content_column_at_1366_px(site, page):
    too_wide = []
    for path in pages(site):
        page.goto(path.as_uri())
        column, tables = page.evaluate("""() => [document.querySelector('.md-content__inner').clientWidth,
            [...document.querySelectorAll('.md-content__inner table')].map(t => [t.scrollWidth,
             t.rows[0].innerText.slice(0, 60)])]""")
        too_wide += [f"{path.name}: {width} px > {column} px: {head!r}" for width, head in tables if width > column + 1]
    assert too_wide == []


def test_lists_are_lists_on_every_page(site, page):
    """No paragraph holds a literal list ("- item" on a line of its own), and the Changelog's lists, nested by 2 spaces
    as GitHub reads them, are nested."""
    found = []
    for path in pages(site):
        page.goto(path.as_uri())
        found += [f"{path.name}: {text[:80]!r}" for text in page.evaluate(
            """() => [...document.querySelectorAll('.md-content__inner p')].map(p => p.innerHTML)
                .filter(t => /\\n\\s*([-*+]|\\d+\\.) \\S/.test(t))""")]
    assert found == []
    nested = len(re.findall(r"^ {2,}(?:[-*+]|\d+\.) ", (ROOT / "CHANGELOG.md").read_text(), re.M))
    page.goto((site / "changelog.html").as_uri())
    assert nested > 0 and page.locator(".md-content__inner li li").count() >= nested


def test_the_api_reference_renders_its_cross_references(site, page):
    page.goto((site / "api.html").as_uri())
    text = page.locator(".md-content__inner").inner_text()
    for role in (":func:", ":class:", ":meth:", ":mod:", ":attr:", ":data:"):
        assert role not in text
    assert page.locator(".md-content__inner a.autorefs-internal").count() >= 10
    assert page.locator(".md-content__inner table").first.inner_text().startswith("name")  # the package map


def test_formulas_are_typeset(site, page):
    checked = 0
    for name in ("index.html", "how-it-works.html", "glossary.html", "metrics.html"):
        page.goto((site / name).as_uri())
        page.wait_for_function("() => document.querySelectorAll('.arithmatex .katex').length > 0", timeout=10_000)
        total, typeset, errors = page.evaluate("""() => [document.querySelectorAll('.arithmatex').length,
            document.querySelectorAll('.arithmatex .katex').length, document.querySelectorAll('.katex-error').length]""")
        assert total >= 1 and typeset >= total and errors == 0, (name, total, typeset, errors)
        checked += total
    assert checked >= 5
