"""The docs' generated parts, computed from the code, so that no option, metric or warning is typed twice and none
can go stale. Each lies between ``<!-- generated:NAME:begin -->`` and ``<!-- generated:NAME:end -->`` and is committed
in the page (the repository's web view shows the whole page); ``python docs/generate.py`` rewrites them (``make docs``
runs it first), the site's build renders them again (``docs/hooks.py``), and ``tests/test_docs.py`` fails where a
committed part differs from what the code generates:

- ``config``: every ``OBLRPOConfig`` option that ``GRPOConfig`` lacks, and the ``GRPOConfig``
  options it redeclares, from the dataclass fields' ``help`` metadata (the one source of truth: the same text is
  ``examples/oblrpo.py --help``);
- ``warnings``: every warning of ``oblr_trl/advice.py`` with its meaning and remedy (``GUIDE``);
- ``metrics``: every ``oblr/`` metric with what it is and what a healthy run shows, from ``oblr_trl/metrics.py``'s
  ``CATALOGUE`` (which the trainer's logging, the model card and the plots read too);
- ``changelog``: CHANGELOG.md.

The benchmark tables are not made here: they are committed blocks that ``benchmarks/update_readme.py`` rewrites from
``benchmarks/results/`` (their runs take hours), as is the support table (``python
benchmarks/support_table.py``). :func:`logged_metrics` finds the ``oblr/`` metrics the package's code forms, for the
test that the catalogue holds each and no other.
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
PAGES = ["configuration.md", "troubleshooting.md", "metrics.md", "changelog.md"]  # the pages with generated parts
FIGURES = ROOT / "benchmarks" / "results"  # served as figures/<name>.png (docs/hooks.py)
FIGURE_LINK = re.compile(r"\]\(\.\./benchmarks/results/(?P<name>[\w.-]+\.png)\)")


def site_figures(markdown: str) -> str:
    """A page's figure links ``](../benchmarks/results/NAME.png)`` (the path in the repository) as the site serves
    them, ``](figures/NAME.png)``."""
    return FIGURE_LINK.sub(lambda m: f"](figures/{m.group('name')})", markdown)


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


# ----------------------------------------------------------------------------------------------- metrics
def metrics_table() -> str:
    """One row per metric of ``oblr_trl.metrics.CATALOGUE``, in its order: the log key, what it is, what a healthy
    run shows."""
    from oblr_trl.metrics import CATALOGUE

    rows = ["| metric | what it is | what a healthy run shows |", "|---|---|---|"]
    return "\n".join(rows + [f"| `{m.key}` | {m.meaning} | {m.healthy} |" for m in CATALOGUE])


# ----------------------------------------------------------------------------------------------- changelog
def changelog() -> str:
    """CHANGELOG.md, its title dropped (the page has its own)."""
    text = (ROOT / "CHANGELOG.md").read_text()
    return re.sub(r"\A# [^\n]*\n", "", text)


GENERATORS = {"config": config_reference, "warnings": troubleshooting, "metrics": metrics_table,
              "changelog": changelog}


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
