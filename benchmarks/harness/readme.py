"""README blocks: each block between ``<!-- results:NAME:begin -->`` and ``<!-- results:NAME:end -->`` is the
generated table ``benchmarks/results/NAME.md`` (its title line dropped, headings pushed down two levels), so that no
table in a README is typed by hand."""

from __future__ import annotations

import os
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
BLOCK = re.compile(r"(<!-- results:(?P<name>[\w.-]+):begin -->\n)(?P<body>.*?)(<!-- results:(?P=name):end -->)", re.S)


def render_block(name: str, readme_dir: Path, results: Path = RESULTS) -> str:
    """The body of block `name` in a README in `readme_dir`: ``results/NAME.md`` under a line naming its source."""
    path = results / f"{name}.md"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: run the benchmark that writes it first.")
    lines = path.read_text().splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    lines = ["##" + line if line.startswith("#") else line for line in lines]
    text = "\n".join(lines).strip()
    source = os.path.relpath(results / f"{name}.md", readme_dir)
    return f"_Generated from `{source}` by `python benchmarks/update_readme.py`._\n\n{text}\n"


def updated(text: str, readme_dir: Path, results: Path = RESULTS) -> str:
    """``text`` (a README or docs page in ``readme_dir``) with every result block rewritten from its generated table."""
    return BLOCK.sub(lambda m: m.group(1) + render_block(m.group("name"), readme_dir, results) + m.group(4), text)


def update_blocks(readme_path: Path, results: Path = RESULTS) -> list[str]:
    """Rewrite every result block of one README from its generated table; the names of the blocks (none: untouched)."""
    readme = readme_path.read_text()
    names = [m.group("name") for m in BLOCK.finditer(readme)]
    if names:
        readme_path.write_text(updated(readme, readme_path.parent, results))
    return names
