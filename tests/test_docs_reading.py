"""The pages a user reads: each opens with its answer in a few lines, and its sentences stay short enough to read.

A page's prose is what a reader reads as sentences: code blocks, indented blocks, tables, headings, HTML comments
and images are left out; inline code and a link count as one word each (a link by its text). A sentence ends at
". ", "? " or "! " (after any closing "**", ")" or quote) before a capital letter, a parenthesis, a quote, a link or
inline code; a list item or a paragraph break ends one too. A formula (`$...$`, `$$...$$`) counts as one word. Generated blocks are prose a reader reads, so they count.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
LONG_WORDS = 40  # a sentence longer than this is a long sentence
MAX_LONG_SHARE = 0.10  # of a page's sentences
OPENING_LINES = 5  # the answer, before anything else
# The changelog page is the CHANGELOG (history, in entries); the API reference is generated from the docstrings.
PAGES = [README, *(p for p in sorted(DOCS.glob("*.md")) if p.name not in {"changelog.md", "api.md"})]

ABBREVIATION = re.compile(r"(?:\b(?:Dr|e\.g|i\.e|et al|vs|cf|Fig|Eq|No)\.)$")
END = re.compile(r"(?<=[.!?])((?:\*\*|[)\"'_])*)\s+(?=[A-Z*_(\"`\[])")


def prose_lines(text: str) -> list[str]:
    """The page's lines a reader reads as prose; a line left out becomes a paragraph break."""
    out, fence, indented = [], False, False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            fence = not fence
            out.append("")
            continue
        # an indented block: 4 spaces after a blank line (a list item's continuation follows its item directly)
        indented = line.startswith("    ") and (indented or not out or not out[-1].strip())
        skip = fence or indented or stripped.startswith(("|", "#", "<!--", "![", "<"))
        out.append("" if skip else line)
    return out


def sentences(text: str) -> list[str]:
    lines = prose_lines(text)
    body = "\n".join(lines)
    body = re.sub(r"`[^`\n]*`", "CODE", body)
    body = re.sub(r"\$\$.*?\$\$|\$[^$\n]+\$", "MATH", body, flags=re.S)  # a formula reads as one word
    body = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", body)
    blocks = re.split(r"\n\s*\n|\n\s*(?:[-*]|\d+\.)\s+", "\n" + body)
    found = []
    for block in blocks:
        flat = re.sub(r"^(?:[-*]|\d+\.)\s+", "", " ".join(block.split()))
        if not flat:
            continue
        for part in END.sub(lambda m: m.group(1) + "\n", flat).split("\n"):
            if found and found[-1] is not None and ABBREVIATION.search(found[-1]):
                found[-1] += " " + part  # "Dr. GRPO", "et al. (2018)": not a sentence's end
            elif part.strip():
                found.append(part)
        found.append(None)  # a block's end always ends a sentence
    return [s for s in found if s is not None]


def words(sentence: str) -> int:
    return len(sentence.split())


def test_the_sentence_splitter_reads_markdown_as_a_reader_does():
    text = ("# Title\n\n**The answer.** It ends here (really). Then `code.here()` and [a link](x.md#y) follow.\n"
            "- an item without a stop\n- another item. With two sentences.\n\n```python\nx = 1. Not prose\n```\n"
            "| a | table. Not prose |\n\n    an indented block. Not prose\n")
    assert sentences(text) == ["**The answer.**", "It ends here (really).", "Then CODE and a link follow.",
                               "an item without a stop", "another item.", "With two sentences."]
    assert sentences("Each step applies $\\eta_{\\max} \\cdot f$, where f is\n$$f = \\frac{N}{N + B}$$\nthe factor.") == [
        "Each step applies MATH, where f is MATH the factor."]
    assert sentences("Dr. GRPO is 0.5x at e.g. 3 prompts. Next one.") == [
        "Dr. GRPO is 0.5x at e.g. 3 prompts.", "Next one."]  # no capital after "e.g." ends nothing


def test_a_long_sentence_counts_and_a_page_of_them_fails():
    long = " ".join(["word"] * (LONG_WORDS + 1)) + "."
    short = "A short sentence."
    assert [words(s) > LONG_WORDS for s in sentences(f"{long} {short}")] == [True, False]
    page = "\n\n".join([long] * 2 + [short] * 8)
    assert long_share(page) == pytest.approx(0.2)


def long_share(text: str) -> float:
    found = sentences(text)
    return sum(words(s) > LONG_WORDS for s in found) / max(1, len(found))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_at_most_one_sentence_in_ten_runs_over_40_words(page):
    found = sentences(page.read_text())
    long = [f"({words(s)} words) {s[:160]}..." for s in found if words(s) > LONG_WORDS]
    assert len(found) >= 5, f"{page.name}: the splitter found almost no prose"
    assert len(long) <= MAX_LONG_SHARE * len(found), \
        f"{page.name}: {len(long)} of {len(found)} sentences run over {LONG_WORDS} words:\n" + "\n".join(long)


def opening(text: str) -> list[str]:
    """The lines between the page's title and its first heading, table, code block, image or blank line after the
    first paragraph: what a reader sees first."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# ")) + 1
    while start < len(lines) and not lines[start].strip():
        start += 1
    para = []
    for line in lines[start:]:
        if not line.strip():
            break
        para.append(line)
    return para


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_each_page_opens_with_its_answer_in_at_most_5_lines(page):
    para = opening(page.read_text())
    assert para, f"{page.name}: no paragraph after the title"
    assert not para[0].lstrip().startswith(("#", "|", "```", "<!--", "![", "- ", "* ")), \
        f"{page.name}: the page opens with {para[0][:40]!r}, not with its answer"
    assert len(para) <= OPENING_LINES, f"{page.name}: the opening paragraph runs {len(para)} lines"
    assert sum(len(line) for line in para) >= 60, f"{page.name}: the opening says too little to be an answer"


def test_evidence_is_a_page_a_user_decides_with():
    """Evidence: at most 1,500 words (every word of the file, generated blocks included); the studies' tables live on
    the study pages it names, each of which exists."""
    text = (DOCS / "evidence.md").read_text()
    assert len(text.split()) <= 1500, f"docs/evidence.md: {len(text.split())} words"
    named = set(re.findall(r"`(?:benchmarks/)?(\w+\.md)`", text))
    assert {"ablation.md", "lr_window.md", "prompts_per_step.md", "when_to_use.md", "proxies.md"} <= named
    for name in named - {"README.md"}:
        assert (ROOT / "benchmarks" / name).exists() or (ROOT / "benchmarks" / "results" / name).exists(), name
    assert "results:ablation_when:begin" not in text and "results:prompts_per_step:begin" not in text
    for name, page in [("ablation_when", "ablation.md"), ("ablation_baseline", "ablation.md"),
                       ("when_to_use", "when_to_use.md"), ("prompts_per_step", "prompts_per_step.md")]:
        assert f"<!-- results:{name}:begin -->" in (ROOT / "benchmarks" / page).read_text(), (name, page)


def test_models_leads_with_the_support_table():
    text = (DOCS / "models.md").read_text()
    head = text.split("<!-- support:begin -->")[0]
    assert len(opening(text)) <= OPENING_LINES and head.count("\n## ") <= 1, \
        "docs/models.md: the support table must come right after the page's opening"
    assert "## Which layers are covered, and how" not in text  # the mechanisms live in How it works
