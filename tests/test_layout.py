"""The house's shape, checked: no import cycle in oblr_trl/, no function in it over 60 lines (docstrings aside: a
long one is a mechanism that wants its own object), a trainer of at most 300 lines, and a wheel that holds what
training needs and no test apparatus."""

import ast
import collections
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "oblr_trl"


def _modules() -> dict[str, Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        name = ".".join(f.relative_to(PACKAGE.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = f
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (at the top or inside a function: a lazy import is still a cycle)."""
    mods, graph = _modules(), collections.defaultdict(set)
    for name, f in mods.items():
        package = name if f.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                subs = {f"{base}.{a.name}" for a in node.names} & set(mods)
                graph[name] |= (subs or ({base} & set(mods))) - {name}
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names} & set(mods)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, done = [], set()

    def visit(node, path):
        if node in path:
            found.append(path[path.index(node):] + [node])
            return
        if node in done:
            return
        done.add(node)
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])

    for node in sorted(graph):
        visit(node, [])
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_import_cycle_in_the_package():
    assert cycles(import_graph()) == []


def _body_lines(node) -> int:
    """A function's lines, its docstring left out."""
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0] if node.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def test_no_function_in_the_package_over_60_lines():
    long = []
    for f in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _body_lines(node) > 60:
                long.append(f"{f.relative_to(PACKAGE)}:{node.lineno} {node.name} ({_body_lines(node)} lines)")
    assert long == []


def test_the_trainer_is_overrides_only_in_at_most_300_lines():
    """The trainer holds no mechanism: each override hands TRL's data to a function or an object elsewhere."""
    assert len((PACKAGE / "trainer.py").read_text().splitlines()) <= 300


# ------------------------------------------------------------------------------- the demo in its own room (issue 48)
def test_no_module_of_the_trainer_package_imports_the_demo_room():
    """The arrows point one way: oblr_trl.demo may use the trainer package, never the reverse (at the top or lazily)."""
    into_demo = {(name, target) for name, targets in import_graph().items() if not _in_demo(name)
                 for target in targets if _in_demo(target)}
    assert into_demo == set()


def _in_demo(module: str) -> bool:
    return module == "oblr_trl.demo" or module.startswith("oblr_trl.demo.")


def test_the_graph_sees_an_import_of_the_demo_room():
    """The check above can fail: the demo's own modules import each other, and the graph has those edges."""
    assert "oblr_trl.demo.tiny" in import_graph()["oblr_trl.demo.reference_model"]


def test_importing_the_trainer_loads_neither_the_demo_room_nor_its_packages():
    code = ("import sys, oblr_trl, oblr_trl.trainer; from oblr_trl import *; "
            "print(sorted(m for m in sys.modules if m == 'oblr_trl.demo' or m.startswith('oblr_trl.demo.') "
            "or m.split('.')[0] in ('reasoning_gym', 'matplotlib', 'gguf')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_demo_room_holds_the_demo_and_the_top_level_none_of_it():
    assert {"tiny.py", "tasks.py", "reference_model.py", "defaults.py", "card.py"} <= {
        f.name for f in (PACKAGE / "demo").glob("*.py")}
    assert not {"tiny.py", "tasks.py", "reference_model.py", "defaults.py"} & {f.name for f in PACKAGE.glob("*.py")}


def test_no_test_module_imports_another():
    """Shared builders live in tests/helpers.py (or fixtures); a test module imported by another would run its
    module-level setup twice and tie the two files' names together (issue 48)."""
    tests, found = Path(__file__).resolve().parent, []
    names = {f.stem for f in tests.rglob("test_*.py")}
    for f in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            imported = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                        else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            found += [f"{f.relative_to(tests)}: {name}" for name in imported if name.split(".")[-1] in names]
    assert found == []


# -------------------------------------------------------------------------- the wheel: training, not test apparatus
# what tests/fingerprint.py and tests/seam_table.py define
APPARATUS = {"fingerprint", "differences", "Seam", "SEAMS", "drift", "source_hash"}


def wheel_names(wheel: Path) -> dict[str, set[str]]:
    """Each module of ``wheel``: the names it defines at its top level (functions, classes, assignments)."""
    out = {}
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.endswith(".py"):
                tree = ast.parse(archive.read(name))
                out[name] = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                             for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                             if isinstance(t, ast.Name)} | {
                    node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    return out


@pytest.mark.slow
def test_the_wheel_trains_and_holds_no_test_apparatus(tmp_path):
    """``pip wheel`` of a copy of the checkout: every module of oblr_trl/ is in it, importing the trainer from the
    unpacked wheel alone works, and none of its modules defines the model fingerprint or the TRL seam table, which
    live in tests/ (fingerprint.py, seam_table.py)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(PACKAGE.parent / name, source / name)
    shutil.copytree(PACKAGE, source / "oblr_trl", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist")], check=True, capture_output=True, timeout=600)
    (wheel,) = (tmp_path / "dist").glob("oblr_trl-*.whl")
    names = wheel_names(wheel)
    assert set(names) == {str(f.relative_to(PACKAGE.parent)) for f in PACKAGE.rglob("*.py")}
    assert {f"{module}: {name}" for module, defined in names.items() for name in defined & APPARATUS} == set()
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    code = ("import sys, oblr_trl, oblr_trl.trainer; from oblr_trl import *; "
            "print(oblr_trl.__file__); print(sorted(m for m in sys.modules if m in ('fingerprint', 'seam_table')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert out.stdout.splitlines()[-2:] == [str(tmp_path / "site" / "oblr_trl" / "__init__.py"), "[]"]


def test_the_wheel_check_sees_test_apparatus(tmp_path):
    """The check above can fail: a module that defines the fingerprint or the seam table is named."""
    wheel = tmp_path / "x.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("oblr_trl/trl_seam.py", "SEAMS: tuple = ()\ndef sequence_inputs(batch): ...\n")
        archive.writestr("oblr_trl/grad_norms/fingerprint.py", "def fingerprint(model): ...\nclass Other: ...\n")
    assert wheel_names(wheel) == {"oblr_trl/trl_seam.py": {"SEAMS", "sequence_inputs"},
                                  "oblr_trl/grad_norms/fingerprint.py": {"fingerprint", "Other"}}


# ----------------------------------------------------------------------------- the tests mirror the package: the rules
RULE_TESTS = Path(__file__).resolve().parent / "grad_norms" / "rules"


def rule_modules() -> list[str]:
    """The layer-rule modules of oblr_trl/grad_norms/rules/ (one per family, and the registry)."""
    return sorted(f.stem for f in (PACKAGE / "grad_norms" / "rules").glob("*.py") if f.stem != "__init__")


def missing_rule_tests(modules: list[str], tests: Path = RULE_TESTS) -> list[str]:
    """Each of ``modules`` without its ``test_<module>.py`` in ``tests``."""
    return [f"tests/grad_norms/rules/test_{m}.py" for m in modules if not (tests / f"test_{m}.py").is_file()]


def test_every_rule_module_has_its_own_test_file():
    """oblr_trl/grad_norms/rules/<module>.py is tested in tests/grad_norms/rules/test_<module>.py."""
    assert len(rule_modules()) >= 10
    assert missing_rule_tests(rule_modules()) == []


def test_the_mirror_check_names_a_rule_module_without_tests():
    """The check above can fail: a rule module with no test file is named."""
    assert missing_rule_tests(["linear", "no_such_family"]) == ["tests/grad_norms/rules/test_no_such_family.py"]
