"""The glossary (docs/glossary.md) defines each term of ours once, and every page links a term to it where it first
uses it: a newcomer never meets "ghost norm", "replay" or "the SNR factor" before being told what it is.

A page's first use of a term is its first occurrence in the page's prose: headings, code blocks, inline code (unless
the term is itself code, like `one_backward`), formulas, link targets, images and generated blocks do not count."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GLOSSARY = DOCS / "glossary.md"

# anchor in the glossary -> the term's forms in prose (spaces may be line breaks)
TERMS = {
    "exact-norms": r"\bexact (?:per-sequence )?(?:gradient )?norms\b",
    "ghost-norm": r"\bghost[- ]norms?\b",
    "gradient-weighted-baseline": r"\bgradient-weighted (?:mean|baseline)\b",
    "leave-one-out": r"\bleave-one-out\b",
    "snr-factor": r"\bSNR (?:step's )?factor\b",
    "snr": r"\bSNR\b",
    "noise-scale": r"\b(?:gradient )?noise scale\b",
    "eta_max": r"η_max|\beta_max\b",
    "ema_soft": r"`\"?ema_soft\"?`",
    "norms-pass": r"\bnorms pass\b",
    "two-passes": r"\btwo[- ]pass(?:es)?\b",
    "one_backward": r"`one_backward`",
    "chunks": r"\bchunks?\b",
    "replay": r"\breplay(?:ed|s)?\b",
    "host-sync": r"\bhost syncs?\b",
}
# Pages whose prose is generated from the code or is the code's reference (their generated blocks aside, they are
# read for what they add), the glossary itself and the changelog (history, in the words of its day).
SKIPPED = {"glossary.md", "changelog.md", "api.md"}
SPAN_SKIP = re.compile(
    r"(?s:<!--\s*(results|generated):[\w.-]+:begin\s*-->.*?<!--\s*\1:[\w.-]+:end\s*-->)"  # generated blocks
    r"|(?s:^```.*?^```[ \t]*$)"  # fenced code
    r"|(?s:\$\$.+?\$\$)|\$[^$\s][^$\n]*?\$"  # formulas (typeset as math, like code they are no prose)
    r"|^#.*$"  # headings
    r"|^!\[.*$|^_[^\n]*\.png[^\n]*_$"  # images and their captions
    r"|(?s:<!--.*?-->)"  # comments
    r"|\]\([^)]*\)"  # link targets
    r"|\{#[^}]*\}",  # attribute lists
    re.M)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]*)\)")


def pattern(term: str) -> re.Pattern:
    return re.compile(TERMS[term].replace(" ", r"\s+"), 0 if term == "snr" else re.I)


def indented_code(text: str) -> list[tuple[int, int]]:
    """Spans of indented code blocks: indented lines after a blank line whose paragraph before was neither indented
    nor a list item (an indented paragraph inside a list item is prose)."""
    spans, offset, previous, blank, code = [], 0, "", True, False
    for line in text.splitlines(keepends=True):
        indented = line.startswith(("    ", "\t"))
        if line.strip() and indented and (code or blank and not previous.startswith((" ", "\t", "-", "*"))
                                          and not re.match(r"\d+\. ", previous)):
            spans.append((offset, offset + len(line)))
            code = True
        elif line.strip():
            code, previous = False, line
        blank = not line.strip()
        offset += len(line)
    return spans


def masked(text: str) -> list[tuple[int, int]]:
    """Spans of ``text`` that are not prose: generated blocks, code, headings, images, link targets."""
    return [m.span() for m in SPAN_SKIP.finditer(text)] + indented_code(text)


def glossary_link(target: str, prefix: str) -> str | None:
    """The glossary anchor a link target names, None where it is not the glossary ('' for the page itself)."""
    path, _, anchor = target.partition("#")
    return anchor if path == prefix + "glossary.md" else None


def first_use(text: str, term: str, prefix: str = "") -> tuple[int, int, str] | None:
    """(start, end, how) of the page's first prose use of ``term``: how is 'linked' (a link to its glossary entry),
    'other-link' (inside a link elsewhere, or to the glossary without the term's anchor) or 'bare'."""
    skip = masked(text)
    is_code = TERMS[term].startswith("`")
    codes = [] if is_code else [m.span() for m in CODE.finditer(text)]
    links = [(m.span(1), glossary_link(m.group(2), prefix)) for m in LINK.finditer(text)]
    for m in pattern(term).finditer(text):
        s, e = m.span()
        if any(a <= s < b for a, b in skip) or any(a <= s < b for a, b in codes):
            continue
        inside = [anchor for (a, b), anchor in links if a <= s and e <= b]
        if inside and inside[0] in TERMS and inside[0] != term:
            continue  # part of another term's link ("SNR" in "SNR factor")
        if inside:
            return s, e, "linked" if inside[0] == term else "other-link"
        return s, e, "bare"
    return None


def pages() -> list[tuple[Path, str]]:
    """(page, the relative path from it to docs/) for README.md and every docs page but the skipped ones."""
    return [(ROOT / "README.md", "docs/"), *((p, "") for p in sorted(DOCS.glob("*.md")) if p.name not in SKIPPED)]


def slug(heading: str) -> str:
    """A heading's anchor as both the site (Python-Markdown's toc) and GitHub's web view make it, for the headings
    the glossary uses (ASCII words, spaces, hyphens, underscores and backticks)."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", heading).strip().lower())


def entries(text: str) -> dict[str, int]:
    """The glossary's entries: anchor -> where its heading starts."""
    return {slug(m.group(1)): m.start() for m in re.finditer(r"^### (.*)$", text, re.M)}


def test_every_term_has_its_glossary_entry_under_an_anchor_the_site_and_github_share():
    text = GLOSSARY.read_text()
    assert "{#" not in text, "attribute lists show as text on GitHub's web view: name the entry so its slug is the anchor"
    missing = [term for term in TERMS if term not in entries(text)]
    assert missing == [], f"docs/glossary.md has no entry for {missing}"
    assert all(h.isascii() for h in re.findall(r"^#+ (.*)$", text, re.M)), "the site drops non-ASCII from anchors"


def test_the_glossary_uses_no_term_before_defining_it():
    text = GLOSSARY.read_text()
    early = []
    for term in TERMS:
        use, defined = first_use(text, term), entries(text)[term]
        if use and use[0] < defined:
            early.append(f"glossary.md:{text[:use[0]].count(chr(10)) + 1}: {text[use[0]:use[1]]!r} before its entry")
    assert early == [], "\n".join(early)


@pytest.mark.parametrize("page,prefix", pages(), ids=lambda x: getattr(x, "name", x))
def test_each_page_links_a_term_to_the_glossary_where_it_first_uses_it(page, prefix):
    text = page.read_text()
    unlinked = []
    for term in TERMS:
        use = first_use(text, term, prefix)
        if use and use[2] != "linked":
            line = text[:use[0]].count("\n") + 1
            unlinked.append(f"{page.name}:{line}: {text[use[0]:use[1]]!r} ({use[2]}; link {prefix}glossary.md#{term})")
    assert unlinked == [], "first uses not linked to the glossary:\n" + "\n".join(unlinked)


@pytest.mark.parametrize("heading,anchor", [("`one_backward`", "one_backward"), ("Sample, N", "sample-n"),
                                            ("Gradient-weighted baseline", "gradient-weighted-baseline")])
def test_slug_is_the_anchor(heading, anchor):
    assert slug(heading) == anchor


@pytest.mark.parametrize("text,term,how", [
    ("The ghost norm is cheap.", "ghost-norm", "bare"),
    ("The [ghost norm](glossary.md#ghost-norm) is cheap. A ghost norm.", "ghost-norm", "linked"),
    ("[ghost norms](glossary.md) rules", "ghost-norm", "other-link"),
    ("## The ghost norm\n\n`ghost norm` in code, then [Ghost\nnorms](glossary.md#ghost-norm).", "ghost-norm", "linked"),
    ("in [chunks](how-it-works.md#chunks) first", "chunks", "other-link"),
    ("see [x](glossary.md#chunks) then chunks", "chunks", "bare"),
    ("the [SNR factor](glossary.md#snr-factor), the SNR", "snr", "bare"),
    ("text\n\n    ghost norm = code\n\n- a list\n    ghost norm continued", "ghost-norm", "bare"),
    ("text\n\n    ghost norm = code\n\n[ghost norm](glossary.md#ghost-norm)", "ghost-norm", "linked"),
    ("1. a list\n\n    ghost norm in its second paragraph", "ghost-norm", "bare"),
    ("`one_backward=None`, then [`one_backward`](glossary.md#one_backward)", "one_backward", "linked"),
])
def test_first_use_reads_prose_only(text, term, how):
    assert first_use(text, term)[2] == how
