"""README blocks: each block between ``<!-- results:NAME:begin -->`` and ``<!-- results:NAME:end -->`` is the
generated table ``benchmarks/results/NAME.md`` (its title line dropped, headings pushed down two levels), so that no
table in a README is typed by hand.

A page too narrow for a wide table names the columns to show: ``<!-- results:NAME:begin columns="a; b; c" -->``. Each
table of the file that has all of them shows those alone, followed by a line naming the file with every column."""

from __future__ import annotations

import os
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
BLOCK = re.compile(r"(<!-- results:(?P<name>[\w.-]+):begin(?: columns=\"(?P<columns>[^\"]+)\")? -->\n)(?P<body>.*?)"
                   r"(<!-- results:(?P=name):end -->)", re.S)


def _cells(row: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip())[1:-1]]


def fold_tables(text: str, columns: list[str], source: str) -> str:
    """``text`` with each markdown table that has every one of ``columns`` cut to those columns (in their order),
    followed by a line naming ``source``, where the table has all its columns; other tables are left whole."""
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1].strip()):
            end = i
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            header = _cells(lines[i])
            if all(c in header for c in columns):
                keep = [header.index(c) for c in columns]
                rows = [_cells(line) for line in lines[i:end]]
                rows[1] = ["---"] * len(header)
                out += ["| " + " | ".join(r[k] if k < len(r) else "" for k in keep) + " |" for r in rows]
                out += ["", f"_{len(columns)} of its {len(header)} columns; every column: `{source}`._"]
            else:
                out += lines[i:end]
            i = end
            continue
        out.append(lines[i])
        i += 1
    return "\n".join(out)


def render_block(name: str, readme_dir: Path, results: Path = RESULTS, columns: str | None = None) -> str:
    """The body of block `name` in a README in `readme_dir`: ``results/NAME.md`` under a line naming its source; its
    wide tables cut to ``columns`` (names separated by ``;``) where given."""
    path = results / f"{name}.md"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: run the benchmark that writes it first.")
    lines = path.read_text().splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    lines = ["##" + line if line.startswith("#") else line for line in lines]
    text = "\n".join(lines).strip()
    source = os.path.relpath(results / f"{name}.md", readme_dir)
    if columns:
        text = fold_tables(text, [c.strip() for c in columns.split(";")], source)
    return f"_Generated from `{source}` by `python benchmarks/update_readme.py`._\n\n{text}\n"


def updated(text: str, readme_dir: Path, results: Path = RESULTS) -> str:
    """``text`` (a README or docs page in ``readme_dir``) with every result block rewritten from its generated table."""
    return BLOCK.sub(lambda m: m.group(1) + render_block(m.group("name"), readme_dir, results, m.group("columns"))
                     + m.group(5), text)


def update_blocks(readme_path: Path, results: Path = RESULTS) -> list[str]:
    """Rewrite every result block of one README from its generated table; the names of the blocks (none: untouched)."""
    readme = readme_path.read_text()
    names = [m.group("name") for m in BLOCK.finditer(readme)]
    if names:
        readme_path.write_text(updated(readme, readme_path.parent, results))
    return names
