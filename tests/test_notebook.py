"""notebooks/oblrpo_walkthrough.ipynb runs end to end without errors, and is stored without outputs."""

import time
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "oblrpo_walkthrough.ipynb"

nbformat = pytest.importorskip("nbformat", reason="the notebook test needs nbformat (pip install nbformat)")
nbclient = pytest.importorskip("nbclient", reason="the notebook test needs nbclient (pip install nbclient)")
pytest.importorskip("ipykernel", reason="the notebook test needs a Python kernel (pip install ipykernel)")


def test_notebook_is_stored_without_outputs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(not cell.outputs and cell.execution_count is None for cell in code)


def test_notebook_runs_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    start = time.time()
    client.execute()  # raises CellExecutionError, naming the cell, on the first error
    assert time.time() - start < 180
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    text = "".join(out.get("text", "") for out in outputs)
    assert "after OBLR-PO:" in text and "training_curves.png" in text
