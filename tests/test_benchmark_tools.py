"""benchmarks/update_readme.py: the README's result blocks are the generated tables, never hand-typed copies."""

import importlib.util
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "update_readme", Path(__file__).resolve().parents[1] / "benchmarks" / "update_readme.py"
)


def load(tmp_path, monkeypatch):
    module = importlib.util.module_from_spec(SPEC)
    SPEC.loader.exec_module(module)
    monkeypatch.setattr(module, "HERE", tmp_path)
    monkeypatch.setattr(module, "READMES", [tmp_path / "README.md"])
    (tmp_path / "results").mkdir()
    return module


def test_blocks_are_replaced_by_the_generated_tables(tmp_path, monkeypatch):
    module = load(tmp_path, monkeypatch)
    (tmp_path / "results" / "demo.md").write_text("# Title\n\n## Section\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    (tmp_path / "README.md").write_text(
        "intro\n<!-- results:demo:begin -->\nstale | 9 |\n<!-- results:demo:end -->\noutro\n"
    )
    assert module.main() == 0
    text = (tmp_path / "README.md").read_text()
    assert "stale" not in text and "| 1 | 2 |" in text and "#### Section" in text and "# Title" not in text
    assert text.startswith("intro\n") and text.endswith("<!-- results:demo:end -->\noutro\n")
    assert module.main() == 0 and (tmp_path / "README.md").read_text() == text  # idempotent


def test_a_missing_result_file_is_an_error(tmp_path, monkeypatch):
    module = load(tmp_path, monkeypatch)
    (tmp_path / "README.md").write_text("<!-- results:absent:begin -->\n<!-- results:absent:end -->\n")
    with pytest.raises(FileNotFoundError, match="absent"):
        module.main()
