"""The docs' generated parts, computed from the code, so that no option, metric or warning is typed twice and none
can go stale. Each lies between ``<!-- generated:NAME:begin -->`` and ``<!-- generated:NAME:end -->`` and is committed
in the page (the repository's web view shows the whole page); ``python docs/generate.py`` rewrites them (``make docs``
runs it first), the site's build renders them again (``docs/hooks.py``), and ``tests/test_docs.py`` fails where a
committed part differs from what the code generates:

- ``config``: every ``OBLRPOConfig`` option that ``GRPOConfig`` lacks, and the ``GRPOConfig``
  options it redeclares, from the dataclass fields' ``help`` metadata (the one source of truth: the same text is
  ``examples/oblrpo.py --help``);
- ``warnings``: every warning of ``oblr_trl/advice.py`` with its meaning and remedy (``GUIDE``);
- ``changelog``: CHANGELOG.md;
- ``api``: the API reference's map of the names ``oblr_trl`` exports, from their docstrings.

The benchmark tables are not made here: they are committed blocks that ``benchmarks/update_readme.py`` rewrites from
``benchmarks/results/`` (their runs take hours), as is the support table (``python
benchmarks/support_table.py``). :func:`logged_metrics` finds the ``oblr/`` metrics the trainer logs, for the
test that each has its row on the Logged metrics page.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MARKER = re.compile(r"(?P<begin><!-- generated:(?P<name>[\w-]+):begin -->\n)(?P<body>.*?)(?P<end><!-- generated:(?P=name):end -->)",
                    re.S)
PAGES = ["configuration.md", "troubleshooting.md", "changelog.md", "api.md"]  # the pages with generated parts
FIGURES = ROOT / "benchmarks" / "results"  # served as figures/<name>.png (docs/hooks.py)
FIGURE_LINK = re.compile(r"\]\(\.\./benchmarks/results/(?P<name>[\w.-]+\.png)\)")


def site_figures(markdown: str) -> str:
    """A page's figure links ``](../benchmarks/results/NAME.png)`` (the path in the repository) as the site serves
    them, ``](figures/NAME.png)``."""
    return FIGURE_LINK.sub(lambda m: f"](figures/{m.group('name')})", markdown)


# ----------------------------------------------------------------------------------------------- the site's rendering
WIDE_COLUMNS = 13  # a table with at least this many columns and fewer body rows than columns is turned on the site
CELL = re.compile(r"(?<!\\)\|")  # a table's cell separator (an escaped \| is a cell's text)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in CELL.split(line.strip().strip("|"))]


CODE_SPAN = re.compile(r"(`+).*?\1")
LONG_WORD = re.compile(r"[^\s|`<>]{16,}")


def _breakable(cell: str) -> str:
    """A table cell whose long words (a module path, a class name; not in code spans or links) may wrap: a ``<wbr>``
    after each dot, underscore and slash, and between a lower-case letter and an upper-case one."""
    def word(match: re.Match) -> str:
        text = match.group(0)
        if "](" in text or "://" in text or "#" in text or "<" in text:
            return text
        return re.sub(r"(?<=[a-z])(?=[A-Z])|(?<=[._/])(?=\w)", "<wbr>", text)

    parts, last = [], 0
    for span in CODE_SPAN.finditer(cell):
        parts += [LONG_WORD.sub(word, cell[last:span.start()]), span.group(0)]
        last = span.end()
    return "".join(parts + [LONG_WORD.sub(word, cell[last:])])


def site_tables(markdown: str) -> str:
    """A page's very wide tables as the site shows them: a table of at least ``WIDE_COLUMNS`` columns and fewer body
    rows than columns (a few runs of many measurements: 21 columns of 4 models) turned, its columns as rows, so that
    it fits the content column; the repository's web view scrolls the table as written. In every table, long words
    may wrap (:func:`_breakable`). Fenced code is left alone."""
    lines, out, i, fenced = markdown.split("\n"), [], 0, False
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if (not fenced and line.startswith("|") and i + 1 < len(lines)
                and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+\s*", lines[i + 1])):
            end = i + 2
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            rows = [_cells(line), *(_cells(row) for row in lines[i + 2:end])]
            width = len(rows[0])
            if width >= WIDE_COLUMNS and len(rows) - 1 < width and all(len(r) == width for r in rows):
                rows = [list(column) for column in zip(*rows)]
                rule = "|" + "---|" * len(rows[0])
            else:
                rule = lines[i + 1]
            rows = [[_breakable(c) for c in row] for row in rows]
            out += ["| " + " | ".join(rows[0]) + " |", rule, *("| " + " | ".join(row) + " |" for row in rows[1:])]
            i = end
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


TABLE = re.compile(r"<table>.*?</table>", re.S)
TABLE_CODE = re.compile(r"<code>([^<]{13,})</code>")


def site_table_code(html: str) -> str:
    """A page's HTML with each long code span in a table breakable only between its parts: a ``<wbr>`` after each
    slash, dot, underscore, comma and equals sign (the site's stylesheet stops a table's code from breaking anywhere
    else, so ``oblr/lr_scale`` wraps as ``oblr/`` ``lr_scale``, never as ``oblr/l`` ``r_scal`` ``e``)."""
    def code(match: re.Match) -> str:
        return "<code>" + re.sub(r"(?<=[/._,=])(?=[^/._,=\s])", "<wbr>", match.group(1)) + "</code>"

    return TABLE.sub(lambda table: TABLE_CODE.sub(code, table.group(0)), html)


LIST_ITEM = re.compile(r"^(?P<indent> *)(?P<marker>[-*+]|\d+[.)]) ")
TOP_ITEM = re.compile(r"(?:[-*+]|\d+[.)]) ")


def _list_end(lines: list[str], i: int) -> int:
    """Where the list that starts at line ``i`` ends: after its items, their indented lines, lazy continuation lines
    and the blank lines between them."""
    end = i + 1
    while end < len(lines):
        line = lines[end]
        if line.startswith(" ") or TOP_ITEM.match(line):
            end += 1
        elif not line.strip() and end + 1 < len(lines) and (lines[end + 1].startswith(" ")
                                                            or TOP_ITEM.match(lines[end + 1])):
            end += 1
        elif line.strip() and lines[end - 1].strip() and not line.startswith(("#", "|", ">", "```", "<", "!!!")):
            end += 1  # a lazy continuation line of an item's paragraph
        else:
            break
    return end


def _renest(block: list[str]) -> list[str]:
    """One list re-indented by 4 spaces a level, its levels read as GitHub (CommonMark) reads them: an item is nested
    in the item above it when it starts at or past that item's text; a line that continues a paragraph stays in its
    item; after a blank line an indented line belongs to the deepest item whose text it reaches. An item right after
    a paragraph that is not an item's own (GitHub starts the item there; Python-Markdown would run it into the
    paragraph) gets a blank line before it."""
    out, stack, fence, previous_blank = [], [], None, False  # stack: the open items' text columns
    in_item_paragraph = True  # whether the paragraph going on is an item's first (an item line began it)
    for line in block:
        indent = len(line) - len(line.lstrip(" "))
        if fence is not None:  # fenced code in an item keeps its indent relative to the fence
            out.append(" " * max(0, 4 * len(stack) + indent - fence) + line.lstrip(" ") if line.strip() else line)
            if line.lstrip().startswith("```") and indent <= fence + 3:
                fence = None
            continue
        if not line.strip():
            out.append(line)
            previous_blank, in_item_paragraph = True, False
            continue
        item = LIST_ITEM.match(line)
        if item:
            while stack and indent < stack[-1]:
                stack.pop()
            if not previous_blank and not in_item_paragraph:
                out.append("")
            in_item_paragraph = True
            out.append(" " * (4 * len(stack)) + line.lstrip(" "))
            stack.append(indent + len(item.group("marker")) + 1)
        else:
            if previous_blank:
                while stack and indent < stack[-1]:
                    stack.pop()
            out.append(" " * (4 * len(stack)) + line.lstrip(" "))
            if line.lstrip().startswith("```"):
                fence = indent
        previous_blank = False
    return out


def site_lists(markdown: str) -> str:
    """A page's lists as the site's Markdown reads them: Python-Markdown nests a list item only where it is indented
    by 4 spaces, GitHub where it starts under the text of the item above (2 spaces after "- "); a list nested by 2
    would run into its item's paragraph on the site, literal "- " and all. So each list is re-indented by 4 spaces a
    level, the levels as GitHub reads them (a list already nested by 4 comes out the same). Fenced code outside
    lists is left alone."""
    lines = markdown.split("\n")
    out, i, fenced = [], 0, False
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not TOP_ITEM.match(line):
            out.append(line)
            i += 1
            continue
        end = _list_end(lines, i)
        out += _renest(lines[i:end])
        i = end
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------- markdown helpers
def escape(text: str) -> str:
    """``text`` as literal markdown: the characters that would start emphasis, a table cell, a link, an attribute list
    or HTML escaped."""
    return re.sub(r"([\\`*_|>\[\]{}])", r"\\\1", text).replace("<", "&lt;")


def summary(text: str, limit: int = 150) -> str:
    """The first sentence of a help text; where it runs over ``limit`` characters, cut at its first colon, else at its
    first parenthesis (the one line the options table shows; the whole text is the option's detail)."""
    first = re.split(r"(?<=[.!?])\s+(?=[A-Z'\"])", text.strip(), maxsplit=1)[0].rstrip(".")
    if len(first) <= limit:
        return first
    for sep in (": ", " ("):
        if 20 <= first.find(sep):
            return first[: first.find(sep)]
    return first


def code(value) -> str:
    """A Python value as inline code (strings in double quotes)."""
    return f"`{value!r}`".replace("'", '"') if isinstance(value, str) else f"`{value!r}`"


# ----------------------------------------------------------------------------------------------- configuration
def field_default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def config_fields() -> tuple[list[dataclasses.Field], list[dataclasses.Field]]:
    """``OBLRPOConfig``'s own fields (those ``GRPOConfig`` lacks), and the ``GRPOConfig`` fields it redeclares (a new
    default or a new meaning), each in declaration order."""
    from trl import GRPOConfig

    from oblr_trl import OBLRPOConfig

    base = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    fields = dataclasses.fields(OBLRPOConfig)
    own = [f for f in fields if f.name not in base]
    redeclared = [f for f in fields if f.name in base and f is not base[f.name]]
    return own, redeclared


def field_help(f: dataclasses.Field) -> str:
    """The field's ``help``; an option without one is an error (the docs would have nothing to say)."""
    text = (f.metadata or {}).get("help", "").strip()
    if not text:
        raise ValueError(f"OBLRPOConfig.{f.name} has no help text: give its field metadata={{'help': ...}}; the docs' "
                         "Configuration page is generated from it.")
    return text


def page_title(link: str) -> str:
    """The title (first ``# `` line) of the docs page a link ``page.md#anchor`` points to."""
    text = (DOCS / link.split("#")[0]).read_text()
    return re.search(r"^# (.+)$", text, re.M).group(1)


# Where the docs say more about an option than its help text (the strict build checks each anchor exists).
SEE_ALSO = {
    "grad_norm_estimator": "evidence.md#gradient-variance-and-baseline-weight-proxies-on-smollm2-135m-instruct",
    "snr_sample_unit": "troubleshooting.md#few_samples",
    "lr_scale_min": "troubleshooting.md#stalled",
    "weight_clip": "troubleshooting.md#weight_spread",
    "snr_estimator": "how-it-works.md#the-snr-estimator",
    "one_backward": "how-it-works.md#one_backward-norms-and-update-from-one-backward",
    "learning_rate": "how-it-works.md#choosing-the-learning-rate",
}


def option_row(f: dataclasses.Field) -> str:
    return f"| [`{f.name}`](#{f.name}) | {code(field_default(f))} | {escape(summary(field_help(f)))} |"


def option_detail(f: dataclasses.Field, grpo_default=dataclasses.MISSING) -> str:
    facts = [f"**type** `{f.type}`", f"**default** {code(field_default(f))}"]
    if grpo_default is not dataclasses.MISSING:
        facts.append(f"**GRPOConfig's default** {code(grpo_default)}")
    choices = (f.metadata or {}).get("choices")
    if choices is not None:
        facts.append("**allowed** " + ", ".join(code(c) for c in choices))
    more = f" More: [{page_title(SEE_ALSO[f.name])}]({SEE_ALSO[f.name]})." if f.name in SEE_ALSO else ""
    return f"### `{f.name}`\n\n{' · '.join(facts)}\n\n{escape(field_help(f))}{more}\n"


def config_reference() -> str:
    """The Configuration page's generated part: one table row per option with a link to its detail, then the
    details (type, default, allowed values, the whole help)."""
    from trl import GRPOConfig

    own, redeclared = config_fields()
    grpo = {f.name: field_default(f) for f in dataclasses.fields(GRPOConfig)}
    head = ["| option | default | what it does |", "|---|---|---|"]
    parts = [
        "## Options GRPOConfig lacks\n", *head, *map(option_row, own), "",
        "## GRPOConfig options with OBLR-PO's own default\n", *head,
        *map(option_row, redeclared), "", "## Every option in detail\n",
        "Each option's help text, whole; the class docstring in the [API reference](api.md#oblr_trl.OBLRPOConfig) "
        "describes some at more length.\n",
        *(option_detail(f) for f in own), *(option_detail(f, grpo[f.name]) for f in redeclared),
    ]
    return "\n".join(parts)


# ----------------------------------------------------------------------------------------------- troubleshooting
def warning_text(template: str) -> str:
    """A warning's text as the log shows it, its run-time values as ``{name}``."""
    return re.sub(r"\{(\w+)(:[^}]*)?\}", r"{\1}", template)


def troubleshooting() -> str:
    """One entry per warning of ``oblr_trl/advice.py``: the text, what it means, what to do. A warning without its
    ``GUIDE`` entry is an error."""
    from oblr_trl.advice import GUIDE, WARNINGS

    missing = sorted(set(WARNINGS) - set(GUIDE))
    if missing:
        raise ValueError(f"oblr_trl/advice.py: no GUIDE entry (meaning, remedy) for the warning(s) {missing}.")
    entries = []
    for key, template in WARNINGS.items():
        guide = GUIDE[key]
        entries.append(f"### `{key}`\n\n> {escape(warning_text(template))}\n\n"
                       f"**What it means.** {guide.meaning}\n\n**What to do.** {guide.remedy}\n")
    return "\n".join(entries)


# ----------------------------------------------------------------------------------------------- changelog
def changelog() -> str:
    """CHANGELOG.md, its title dropped (the page has its own), its links to ``docs/PAGE.md`` made relative to the
    page, which sits in docs/."""
    text = (ROOT / "CHANGELOG.md").read_text()
    return re.sub(r"\A# [^\n]*\n", "", text).replace("](docs/", "](")


# ----------------------------------------------------------------------------------------------- API reference
ABBREVIATIONS = ("Dr.", "App.", "e.g.", "i.e.", "al.", "vs.", "Eq.")


def first_sentence(doc: str) -> str:
    """A docstring's first sentence, on one line (an abbreviation's dot does not end it)."""
    text = " ".join(doc.strip().split("\n\n")[0].split())
    for match in re.finditer(r"[.!?](?=\s+[A-Z`'\"(]|$)", text):
        if not text[: match.end()].endswith(ABBREVIATIONS):
            return text[: match.start()]
    return text.rstrip(".")


def _plain(text: str) -> str:
    """A docstring's sentence as a table cell: Sphinx roles and mkdocstrings' ``[`name`]`` as code; a norm's ``||``
    as ``‖`` and any other pipe as ``∣`` (a pipe in a table's code span needs an escape on GitHub that the site's
    Markdown would show)."""
    text = re.sub(r":(?:py:)?\w+:`~?\.?([^`]+)`", r"`\1`", text)
    text = re.sub(r"\[(`[^`\]]+`)\](?!\()", r"\1", text)
    return text.replace("||", "\u2016").replace("|", "\u2223")


def api_table() -> str:
    """The API reference's map: each name ``oblr_trl`` exports, what it is (its docstring's first sentence; for a
    registry, the option whose values it holds) and where it is defined, linked to its entry where the page renders
    one. The page's ``:::`` entries are rendered on the site only; this table reads on the repository's view too."""
    import inspect

    import oblr_trl
    from oblr_trl.registry import Registry

    rendered = set(re.findall(r"^::: (oblr_trl\.\w+)$", (DOCS / "api.md").read_text(), re.M))
    rows = ["| name | what it is | defined in |", "|---|---|---|"]
    for name in oblr_trl.__all__:
        obj = getattr(oblr_trl, name)
        if isinstance(obj, Registry):
            what, module, anchor = (f"The registry of `OBLRPOConfig.{obj.option}`'s values: each entry's name is an "
                                    f"allowed value"), "oblr_trl.registry", "#registries"
        else:
            what = _plain(first_sentence(inspect.getdoc(obj) or ""))
            module = inspect.getmodule(obj).__name__
            anchor = f"#oblr_trl.{name}" if f"oblr_trl.{name}" in rendered else ""
        link = f"[`{name}`]({anchor})" if anchor else f"`{name}`"
        rows.append(f"| {link} | {what} | `{module}` |")
    return "\n".join(rows)


GENERATORS = {"config": config_reference, "warnings": troubleshooting, "changelog": changelog, "api": api_table}


def render(markdown: str) -> str:
    """``markdown`` with the body of each ``<!-- generated:NAME:begin -->`` ... ``<!-- generated:NAME:end -->`` block
    replaced by its generator's output; an unknown name is an error."""
    def one(match: re.Match) -> str:
        name = match.group("name")
        if name not in GENERATORS:
            raise ValueError(f"unknown docs block <!-- generated:{name}:begin -->; known: {sorted(GENERATORS)}")
        return f"{match.group('begin')}\n{GENERATORS[name]().strip()}\n\n{match.group('end')}"
    return MARKER.sub(one, markdown)


def stale_pages(docs: Path = DOCS) -> list[str]:
    """The pages whose committed generated parts differ from what the code generates now."""
    return [name for name in PAGES if render((docs / name).read_text()) != (docs / name).read_text()]


def main() -> int:
    """Rewrite the generated parts of the pages in place; print the pages that changed."""
    for name in PAGES:
        page = DOCS / name
        text = page.read_text()
        if render(text) != text:
            page.write_text(render(text))
            print(f"Updated the generated parts of docs/{name}.")
    return 0


# ----------------------------------------------------------------------------------------------- logged metrics
METRIC = re.compile(r"oblr/(?P<name>[a-z][a-z0-9_]*)")


def _dict_keys(node: ast.AST) -> set[str]:
    return {k.value for k in getattr(node, "keys", []) if isinstance(k, ast.Constant) and isinstance(k.value, str)}


def metric_names_in(source: str) -> set[str]:
    """The ``oblr/`` metric names one module of the package logs or reads, by its code's conventions: a string
    ``"oblr/NAME"``; the string keys of a dict a function named ``metrics`` or ``*_metrics`` returns; the keys of a
    dict assigned to a variable ``metrics``, or set as ``metrics["NAME"]``. (The trainer logs each such dict under
    ``oblr/``: ``OBLRPOTrainer._log``.)"""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and METRIC.fullmatch(node.value):
            names.add(METRIC.fullmatch(node.value).group("name"))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.endswith("metrics"):
            for ret in (n for n in ast.walk(node) if isinstance(n, ast.Return) and isinstance(n.value, ast.Dict)):
                names |= _dict_keys(ret.value)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "metrics" for t in node.targets):
            names |= _dict_keys(node.value)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == "metrics"
                        and isinstance(t.slice, ast.Constant) and isinstance(t.slice.value, str)):
                    names.add(t.slice.value)
    return names


def logged_metrics(package: Path = ROOT / "oblr_trl") -> set[str]:
    """Every ``oblr/`` metric name in the package's code (the demo's room aside: it logs nothing of its own)."""
    names = set()
    for path in sorted(package.rglob("*.py")):
        if "demo" not in path.relative_to(package).parts:
            names |= metric_names_in(path.read_text())
    return names


def documented_metrics(page: Path = DOCS / "metrics.md") -> set[str]:
    """The metrics with a row on the Logged metrics page: rows that start ``| `oblr/NAME` |``."""
    return set(re.findall(r"^\| `oblr/([a-z][a-z0-9_]*)` \|", page.read_text(), re.M))


if __name__ == "__main__":
    raise SystemExit(main())
