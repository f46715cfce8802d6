"""notebooks/oblrpo_walkthrough.ipynb: committed executed at its default size, with its plots (the repository page
shows them), holding exactly the builder's cells; and it runs again end to end, at a small size (SmolLM2-135M-Instruct,
2 steps of 16 completions per trainer, 16 held-out problems: a real model load, twice)."""

import importlib.util
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOK = NOTEBOOKS / "oblrpo_walkthrough.ipynb"

nbformat = pytest.importorskip("nbformat", reason="the notebook tests need nbformat (the dev extra)")

# The end-to-end run's size (the notebook's environment variables), and a per-cell limit in seconds that only guards
# against a hang: the run took ~2 minutes on a quiet 2-core machine and a cell alone over 4 beside a real-model
# training run, so no speed is asserted here (timings belong to the benchmarks).
SMALL = {"OBLR_WALKTHROUGH_STEPS": 2, "OBLR_WALKTHROUGH_BATCH": 16, "OBLR_WALKTHROUGH_EVAL": 16}
LIMIT_S = 900


def builder():
    spec = importlib.util.spec_from_file_location("build_walkthrough", NOTEBOOKS / "_build_walkthrough.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def images(notebook):
    return [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs
            if "image/png" in out.get("data", {})]


def test_notebook_is_committed_executed_with_its_plots():
    committed = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in committed.cells if cell.cell_type == "code"]
    # every code cell ran, top to bottom in one kernel, without an error
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1))
    assert not [out for cell in code for out in cell.outputs if out.output_type == "error"]
    plots = images(committed)
    assert len(plots) >= 2 and all(len(out["data"]["image/png"]) > 10_000 for out in plots)
    text = "".join(out.get("text", "") for cell in code for out in cell.outputs)
    assert "after OBLR-PO:" in text and "after GRPO:" in text and "training_curves.png" in text
    assert "adapter_model.safetensors" in text  # the LoRA adapter was saved beside the card
    # executed at the builder's default size (the meaningful setting), not at the test's small one
    module = builder()
    steps, batch, num_eval = (module.DEFAULTS[name] for name in module.SIZE_VARIABLES)
    assert module.size_line(steps, batch, num_eval) in text
    assert NOTEBOOK.stat().st_size < 600_000  # reasonable for a repository page


def test_first_cell_reads_the_size_variables_with_the_builders_defaults():
    first = next(cell for cell in builder().build().cells if cell.cell_type == "code").source
    module = builder()
    for name, default in module.DEFAULTS.items():
        assert f'os.environ.get("{name}", "{default}")' in first, name


def test_committed_notebook_holds_the_builders_cells():
    """Edit notebooks/_build_walkthrough.py and rebuild; a hand edit of the .ipynb alone would drift from it."""
    committed = nbformat.read(NOTEBOOK, as_version=4)
    built = builder().build()
    assert [(c.cell_type, c.source) for c in committed.cells] == [(c.cell_type, c.source) for c in built.cells]


@pytest.mark.slow
def test_notebook_runs_end_to_end(tmp_path, monkeypatch):
    nbclient = pytest.importorskip("nbclient", reason="the notebook test needs nbclient (the dev extra)")
    pytest.importorskip("ipykernel", reason="the notebook test needs a Python kernel (the dev extra)")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name, value in SMALL.items():  # the kernel inherits the environment
        monkeypatch.setenv(name, str(value))
    notebook = builder().build()
    client = nbclient.NotebookClient(
        notebook, timeout=LIMIT_S, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, on the first error
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    text = "".join(out.get("text", "") for out in outputs)
    assert "after OBLR-PO:" in text and "after GRPO:" in text and "training_curves.png" in text
    assert "size: 2 RL steps per trainer x 16 completions (2 prompts x 8), 16 held-out problems" in text
    assert len(images(notebook)) >= 2  # the plots show inline (oblr_trl.plotting switches matplotlib to Agg)
