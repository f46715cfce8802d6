"""Copy the generated result tables into the READMEs and the docs pages, so that no table there is typed by hand.

Each block between ``<!-- results:NAME:begin -->`` and ``<!-- results:NAME:end -->`` in the study pages
(``benchmarks/*.md``), the project's README.md and the pages of docs/ (Performance, Evidence, The demos) is replaced by
``results/NAME.md`` (its title line dropped, headings pushed down two levels). Run it after a benchmark:

    python benchmarks/update_readme.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
from harness.readme import update_blocks  # noqa: E402
READMES = [*sorted(HERE.glob("*.md")), HERE.parent / "README.md", *sorted((HERE.parent / "docs").glob("*.md"))]


def main(argv=()) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    updated_any = False
    for readme_path in READMES:
        names = update_blocks(readme_path, HERE / "results") if readme_path.exists() else []
        if names:
            print(f"Updated {', '.join(names)} in {readme_path}.")
            updated_any = True
    if not updated_any:
        print("No result blocks found.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
