"""benchmarks/ as a whole (issue 48): every script answers --help, the scripts stay small and import only the harness,
the studies and oblr_trl (never each other), and memory is read and the runner's log written in one place each."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
SCRIPTS = sorted(BENCH.glob("*.py"))
SHARED = {"harness", "studies"}  # the packages scripts may import from, beside oblr_trl and third-party libraries


def is_script(path: Path) -> bool:
    return "__main__" in path.read_text()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_benchmark_answers_help_without_running(script, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, f"{script.name} --help: rc {proc.returncode}\n{proc.stderr[-2000:]}"
    if is_script(script):
        assert proc.stdout.startswith("usage:"), f"{script.name} --help printed no usage:\n{proc.stdout[:500]}"
    assert not any(tmp_path.iterdir()), f"{script.name} --help wrote {sorted(tmp_path.iterdir())}"


def local_imports(path: Path) -> set[str]:
    """The top-level names of the modules `path` imports that live in benchmarks/ (scripts, harness, studies)."""
    local = {p.stem for p in SCRIPTS} | {p.name for p in BENCH.iterdir() if (p / "__init__.py").exists()}
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & local


def test_scripts_import_the_harness_and_the_studies_never_each_other():
    found = {(p.stem, name) for p in SCRIPTS for name in local_imports(p) - SHARED}
    assert not found, f"benchmark scripts importing other scripts: {sorted(found)}"
    for package in SHARED:  # the shared code does not reach back into a script
        for path in (BENCH / package).rglob("*.py"):
            assert local_imports(path) <= SHARED, f"{path.relative_to(ROOT)} imports {local_imports(path) - SHARED}"


def edits_of_the_import_path(path: Path) -> list[int]:
    """The lines of ``path`` that read or change ``sys.path``."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Attribute)
            and node.attr == "path" and isinstance(node.value, ast.Name) and node.value.id == "sys"]


# scripts that the tests run in child processes, which find tests/ through their own location
CHILD_SCRIPTS = {"tests/integration/save_crash_child.py", "tests/integration/distributed/fsdp2_norms.py",
                 "tests/integration/distributed/zero3_norms.py"}


def test_no_benchmark_or_test_edits_the_import_path():
    """A script finds the harness and the studies beside it (``python benchmarks/NAME.py`` puts benchmarks/ first on
    the path) and ``oblr_trl`` where it is installed; the tests find tests/ and benchmarks/ through setup.cfg's
    ``pythonpath``; a child process gets a path through its environment (``PYTHONPATH``), not by editing its own."""
    files = [*BENCH.rglob("*.py"), *(p for p in (ROOT / "tests").rglob("*.py")
                                     if str(p.relative_to(ROOT)) not in CHILD_SCRIPTS)]
    found = {str(p.relative_to(ROOT)): lines for p in files if (lines := edits_of_the_import_path(p))}
    assert not found, f"sys.path used in: {found}"


def test_the_import_path_check_sees_an_edit(tmp_path):
    script = tmp_path / "x.py"
    script.write_text("import sys\nsys.path.insert(0, '.')\n")
    assert edits_of_the_import_path(script) == [2]


def test_no_benchmark_file_is_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in BENCH.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


def test_memory_is_read_and_the_runner_log_written_in_one_place():
    """One RSS reader (harness/memory.py) and one runner log (harness/log.py's RunnerLog, in runner.json)."""
    for needle, home in (("VmRSS", "harness/memory.py"), ("ru_maxrss", "harness/memory.py"),
                         ("/proc/meminfo", "harness/memory.py"), ('"runner.json"', "harness/log.py")):
        users = sorted(str(p.relative_to(BENCH)) for p in BENCH.rglob("*.py") if needle in p.read_text())
        assert users == [home], (needle, users)


def test_pass_overhead_times_this_checkout_on_a_spread_batch(tmp_path):
    """`pass_overhead.py --spread`: one round on the tiny model, its norms checked equal across versions before timing
    (here one), every call's times written."""
    import json

    out = tmp_path / "times.json"
    proc = subprocess.run([sys.executable, str(BENCH / "pass_overhead.py"), "--configs", "tiny:16", "--rounds",
                           "1", "--spread", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    times = json.loads(out.read_text())["configs"]["tiny:16"]["times"]["v_this"]
    assert set(times) == {"fwdbwd", "norms", "update_one_backward"}
    assert all(len(t["cpu"]) == 1 and t["cpu"][0] > 0 for t in times.values())
