"""The Makefile does what README's Quick start promises: `make demo` installs the CPU build of torch and the package
without its dev extras; `make test` adds them. Checked with `make -n` (nothing is run); skipped without make."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def dry_run(target, tmp_path, *assignments):
    # run by `make test`, make's own variables would make this one print "Entering/Leaving directory" lines
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    proc = subprocess.run(["make", "--no-print-directory", "-n", target, f"VENV={tmp_path / 'venv'}", *assignments],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_make_demo_installs_cpu_torch_and_no_dev_extras(tmp_path):
    lines = dry_run("demo", tmp_path)
    torch_line = next(line for line in lines if '"torch==' in line)
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch_line
    assert any(line.endswith('pip install -q -e ".[demo]"') for line in lines)
    assert not any("[dev]" in line for line in lines)
    assert lines[-1].endswith("examples/demo.py")


def test_make_test_adds_the_dev_extras_and_torch_index_can_be_emptied(tmp_path):
    lines = dry_run("test", tmp_path, "TORCH_INDEX=")
    assert any('-e ".[dev]"' in line for line in lines)
    assert not any("--index-url" in line for line in lines)


def test_setup_cfg_has_no_deprecated_license_classifier():
    # setuptools >= 77 prints a deprecation banner for it at each of the editable install's three build steps
    assert "License ::" not in (ROOT / "setup.cfg").read_text()


def test_make_bench_gpu_runs_this_checkouts_package_without_installing_it(tmp_path):
    """The GPU image has torch but not this package, and the benchmark scripts do not edit sys.path: the target puts
    the checkout (and the wheels' folder) on PYTHONPATH."""
    line = next(line for line in dry_run("bench-gpu", tmp_path) if "benchmarks/bench_gpu.py" in line)
    assert line.startswith(f"PYTHONPATH={ROOT}:/tmp/site:")
