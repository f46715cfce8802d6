"""Markdown tables and result files (``stem.json`` beside ``stem.md``)."""

from __future__ import annotations

import json
from pathlib import Path


def fmt(x, spec: str = ".2f") -> str:
    """``format(x, spec)``, or ``n/a`` for None and NaN."""
    return "n/a" if x is None or x != x else format(x, spec)


def md_table(headers: list[str], rows: list[list]) -> list[str]:
    """Lines of a markdown table (cells are str()-ed)."""
    return (["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
            + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def write_results(out_dir: Path, stem: str, result: dict, markdown: str) -> tuple[Path, Path]:
    """``out_dir/stem.json`` (indented; NaN kept as NaN) and ``out_dir/stem.md``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    js, md = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    js.write_text(json.dumps(result, indent=1, default=float))
    md.write_text(markdown)
    return js, md
