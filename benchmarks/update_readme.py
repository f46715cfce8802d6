"""Copy the generated result tables into benchmarks/README.md, so that no figure there is typed by hand.

Each block between ``<!-- results:NAME:begin -->`` and ``<!-- results:NAME:end -->`` in the README is replaced by
``results/NAME.md`` (its title line dropped, headings pushed down two levels). Run it after a benchmark:

    python benchmarks/update_readme.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"
BLOCK = re.compile(r"(<!-- results:(?P<name>[\w.-]+):begin -->\n)(?P<body>.*?)(<!-- results:(?P=name):end -->)", re.S)


def render(name: str) -> str:
    path = HERE / "results" / f"{name}.md"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: run the benchmark that writes it first.")
    lines = path.read_text().splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    lines = ["###" + line if line.startswith("#") else line for line in lines]
    text = "\n".join(lines).strip()
    return f"_Generated from `results/{name}.md` by `python benchmarks/update_readme.py`._\n\n{text}\n"


def main() -> int:
    readme = README.read_text()
    names = [m.group("name") for m in BLOCK.finditer(readme)]
    if not names:
        print(f"No result blocks in {README}.", file=sys.stderr)
        return 1
    updated = BLOCK.sub(lambda m: m.group(1) + render(m.group("name")) + m.group(4), readme)
    README.write_text(updated)
    print(f"Updated {', '.join(names)} in {README}.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
