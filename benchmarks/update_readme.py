"""Copy the generated result tables into the READMEs, so that no table there is typed by hand.

Each block between ``<!-- results:NAME:begin -->`` and ``<!-- results:NAME:end -->`` in benchmarks/README.md and the
project's README.md is replaced by
``results/NAME.md`` (its title line dropped, headings pushed down two levels). Run it after a benchmark:

    python benchmarks/update_readme.py
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
READMES = [HERE / "README.md", HERE.parent / "README.md"]
BLOCK = re.compile(r"(<!-- results:(?P<name>[\w.-]+):begin -->\n)(?P<body>.*?)(<!-- results:(?P=name):end -->)", re.S)


def render(name: str, readme_dir: Path) -> str:
    path = HERE / "results" / f"{name}.md"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: run the benchmark that writes it first.")
    lines = path.read_text().splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    lines = ["##" + line if line.startswith("#") else line for line in lines]
    text = "\n".join(lines).strip()
    source = os.path.relpath(HERE / "results" / f"{name}.md", readme_dir)
    return f"_Generated from `{source}` by `python benchmarks/update_readme.py`._\n\n{text}\n"


def main() -> int:
    updated_any = False
    for readme_path in READMES:
        if not readme_path.exists():
            continue
        readme = readme_path.read_text()
        names = [m.group("name") for m in BLOCK.finditer(readme)]
        if not names:
            continue
        readme_path.write_text(BLOCK.sub(lambda m: m.group(1) + render(m.group("name"), readme_path.parent) + m.group(4), readme))
        print(f"Updated {', '.join(names)} in {readme_path}.")
        updated_any = True
    if not updated_any:
        print("No result blocks found.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
