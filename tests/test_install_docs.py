"""The GPU install of the README and of the docs' Quick start ("Install on a GPU machine"): as far as a CPU machine
can check it, its commands parse with the tools' own parsers, the extras it names exist in setup.cfg with what the GPU
recipes use, and the configs it points to load."""

import configparser
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "docs" / "quickstart.md"]  # both carry the GPU install


def section(title, page):
    return page.read_text().split(f"## {title}\n")[1].split("\n## ")[0]


def commands(text):
    blocks = re.findall(r"```bash\n(.*?)```", text, re.DOTALL)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [shlex.split(line) for line in lines if line]


def extras():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return {name: [r.strip() for r in value.strip().splitlines() if r.strip()]
            for name, value in config["options.extras_require"].items()}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_gpu_install_section_exists_with_cuda_torch_vllm_and_accelerate_config(page):
    text = section("Install on a GPU machine", page)
    words = [" ".join(c) for c in commands(text)]
    assert any(c.startswith("pip install torch --index-url https://download.pytorch.org/whl/cu") for c in words)
    assert "pip install -e .[gpu]" in words and "accelerate config" in words
    assert '".[vllm]"' in text


PIP_INSTALL_ARGS = ("import json, sys; from pip._internal.commands import create_command; "
                    "options, requirements = create_command('install').parse_args(sys.argv[1:]); "
                    "print(json.dumps([requirements, options.editables]))")


def pip_install_args(args: list[str]) -> tuple[list[str], list[str]]:
    """``pip install ARGS`` as pip parses them: (requirements, editables). In a process of its own: importing pip
    turns setuptools' distutils override off for the rest of the process, and a later test that builds an extension
    (PEFT's BOFT) then fails on setuptools' own check."""
    out = subprocess.run([sys.executable, "-c", PIP_INSTALL_ARGS, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    requirements, editables = json.loads(out.stdout.strip().splitlines()[-1])
    return requirements, editables


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_gpu_install_commands_parse(page):
    from accelerate.commands.accelerate_cli import main as _  # noqa: F401  (accelerate's CLI is installed)
    from accelerate.commands.config import get_config_parser

    for words in commands(section("Install on a GPU machine", page)):
        if words[:2] == ["pip", "install"]:
            requirements, editables = pip_install_args(words[2:])
            for requirement in requirements:
                assert requirement in ("torch", "pip"), requirement
            for editable in editables:
                path, _, extra = editable.partition("[")
                assert Path(ROOT, path).resolve() == ROOT and (not extra or extra.rstrip("]") in extras())
        elif words[:2] == ["accelerate", "config"]:
            get_config_parser().parse_args(words[2:])
        elif words[0] in ("git", "python3", "python", "source") or words[:1] == ["cd"]:
            continue
        else:
            pytest.fail(f"unexpected command in {page.name}'s GPU install: {' '.join(words)}")


def test_extras_hold_what_the_gpu_recipes_and_the_notebook_need():
    found = extras()
    assert any(r.startswith("trl[vllm]") for r in found["vllm"])
    gpu = " ".join(found["gpu"])
    assert "trl[vllm]" in gpu and "math-verify" in gpu and "trackio" in gpu  # accuracy_reward, report_to: trackio
    notebook = " ".join(found["notebook"])
    assert "jupyter" in notebook and "nbconvert" in notebook and "ipywidgets" in notebook
    dev = " ".join(found["dev"])  # what tests/test_notebook.py executes the notebook with
    assert all(name in dev for name in ("nbformat", "nbclient", "ipykernel", "ipywidgets"))


# ------------------------------------------------------------------ what the README and the docs name exists
DOC_PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "changelog.md"),
             *sorted((ROOT / "benchmarks").glob("*.md")), ROOT / "examples" / "recipes" / "README.md"]
# (the Changelog names what was renamed or moved, under its old name too)
PLACEHOLDER = re.compile(r"\bNAME\b|<\w+>")  # benchmarks/NAME.py: a pattern, not a file


def named(pattern: str) -> dict[str, list[str]]:
    found = {}
    for page in DOC_PAGES:
        for name in re.findall(pattern, page.read_text()):
            if not PLACEHOLDER.search(name):
                found.setdefault(name, []).append(str(page.relative_to(ROOT)))
    return found


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` is a module, or an attribute reached from the longest importable module in it."""
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for part in parts[i:]:
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True
    return False


def test_resolves_tells_a_moved_name_from_a_present_one():
    assert resolves("oblr_trl.demo.tasks.extract_answer") and resolves("oblr_trl.grad_norms")
    assert not resolves("oblr_trl.tasks.extract_answer") and not resolves("oblr_trl.config.no_such_name")


def test_every_oblr_trl_name_the_readme_and_the_docs_give_imports():
    """The README, the docs' pages, the study pages and the recipes' README."""
    names = named(r"\boblr_trl(?:\.[A-Za-z_]\w*)+")
    assert len(names) > 30
    missing = {name: pages for name, pages in names.items() if not resolves(name)}
    assert missing == {}, f"named in the docs, not importable: {missing}"


def test_every_file_the_readme_and_the_docs_give_exists():
    """Paths in the repository named as files (by their extension) or folders (by a trailing slash)."""
    paths = named(r"(?<![\w/.-])((?:oblr_trl|examples|benchmarks|tests|notebooks|docs)/[\w./-]*"
                  r"(?:\.(?:py|md|yaml|yml|ipynb|png|json|txt|cfg)\b|/))")
    assert len(paths) > 30
    missing = {path: pages for path, pages in paths.items() if not (ROOT / path).exists()}
    assert missing == {}, f"named in the docs, not in the repository: {missing}"


def test_every_script_the_readme_and_the_docs_run_exists_and_answers_help():
    """`python <dir>/<script>.py` in the README and the docs: each exists; the benchmarks' --help is run by
    tests/test_benchmark_scripts.py (every benchmarks/*.py), the others' here."""
    import os
    import subprocess
    import sys

    scripts = named(r"python3? ((?:examples|benchmarks|notebooks|docs)/[\w/]+\.py)")
    assert {"examples/demo.py", "examples/oblrpo.py", "benchmarks/update_readme.py"} <= set(scripts)
    assert [s for s in scripts if not (ROOT / s).exists()] == []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    for script in sorted(s for s in scripts if not s.startswith("benchmarks/")):
        if "__main__" not in (ROOT / script).read_text() or "argparse" not in (ROOT / script).read_text():
            continue  # a script with no options (docs/generate.py, notebooks/_build_walkthrough.py)
        proc = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, env=env,
                              timeout=300)
        assert proc.returncode == 0 and "usage:" in proc.stdout, (script, proc.stderr[-2000:])


# ------------------------------------------------------------------ the extras
def test_every_extra_is_documented_in_the_readme_s_install():
    text = (ROOT / "README.md").read_text()
    install = text.split("## Install\n")[1].split("\n## Two commands")[0]
    undocumented = [name for name in extras() if f'[{name}]' not in install]
    assert undocumented == [], f"extras the README's Install does not name: {undocumented}"


def test_the_readme_snippet_runs_after_make_demo():
    """`make` installs the demo extra; the README's snippet scores with TRL's accuracy_reward, which imports
    math-verify when called: the demo extra has it."""
    makefile = (ROOT / "Makefile").read_text()
    assert 'pip install -q -e ".[demo]"' in makefile.split("$(VENV)/.installed:")[1].split("\n\n")[0]
    snippet = (ROOT / "README.md").read_text().split("## Swap GRPOTrainer for OBLRPOTrainer\n")[1].split("\n## ")[0]
    assert "from trl.rewards import accuracy_reward" in snippet
    assert any(r.startswith("math-verify") for r in extras()["demo"])
