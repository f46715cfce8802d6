"""Every module of the package imports, and every ``python -m oblr_trl...`` entry point answers ``--help``.
Before: ``python -m oblr_trl.grad_norms.support_table``, the README table's generator, failed with an ImportError
(``per_sequence_grad_sq_norms`` had moved to ``api.py``) and no test imported it. The tools that wrote the docs'
tables and the tiny test models have since left the package (``benchmarks/support_table.py``, ``peft_sweep.py``,
``studies/zoo.py``), and the model fingerprint and the TRL seam table with its hash printer with the tests
(``tests/fingerprint.py``, ``tests/seam_table.py``): the package has no ``python -m`` tool today."""

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import oblr_trl

MODULES = sorted(m.name for m in pkgutil.walk_packages(oblr_trl.__path__, "oblr_trl."))
ROOT = Path(oblr_trl.__file__).parent


def _entry_points(modules: list[str] = MODULES, root: Path = ROOT) -> list[str]:
    """Modules that run as ``python -m``: those with a ``__main__`` block, and packages' ``__main__`` modules."""
    found = []
    for name in modules:
        path = root.joinpath(*name.split(".")[1:])
        source = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        if name.endswith(".__main__") or 'if __name__ == "__main__"' in source.read_text():
            found.append(name.removesuffix(".__main__"))
    return found


def test_every_module_imports():
    code = ("import importlib, sys\n"
            f"for name in {MODULES!r}:\n"
            "    try:\n        importlib.import_module(name)\n"
            "    except Exception as error:\n        print(f'{name}: {type(error).__name__}: {error}')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         cwd=ROOT.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
    assert len(MODULES) > 30


def test_the_package_holds_no_tool_and_no_test_model():
    """The sweep, the support-table generator and the tiny model zoo live with the benchmarks, the model fingerprint
    and the TRL seam table with its hash printer with the tests, not in what
    ``pip install`` installs."""
    tools = ("peft_sweep", "support_table", "zoo", "fingerprint", "seam_table")
    assert not {m for m in MODULES if m.rsplit(".", 1)[-1] in tools}


def test_the_entry_points_are_found(tmp_path):
    """The finder sees a ``__main__`` block and a package's ``__main__`` module (in a stand-in package)."""
    (tmp_path / "tool.py").write_text('if __name__ == "__main__":\n    pass\n')
    (tmp_path / "quiet.py").write_text("x = 1\n")
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "__init__.py").write_text("")
    (tmp_path / "cli" / "__main__.py").write_text("")
    modules = ["pkg.tool", "pkg.quiet", "pkg.cli", "pkg.cli.__main__"]
    assert _entry_points(modules, tmp_path) == ["pkg.tool", "pkg.cli"]


@pytest.mark.parametrize("module", _entry_points())
def test_every_entry_point_answers_help(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=600,
                         cwd=ROOT.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage:")
