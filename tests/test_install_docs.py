"""The GPU install of the README and of the docs' Quick start ("Install on a GPU machine"): as far as a CPU machine
can check it, its commands parse with the tools' own parsers, the extras it names exist in setup.cfg with what the GPU
recipes use, and the configs it points to load."""

import configparser
import re
import shlex
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


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_gpu_install_commands_parse(page):
    from accelerate.commands.accelerate_cli import main as _  # noqa: F401  (accelerate's CLI is installed)
    from accelerate.commands.config import get_config_parser
    from pip._internal.commands import create_command

    for words in commands(section("Install on a GPU machine", page)):
        if words[:2] == ["pip", "install"]:
            options, requirements = create_command("install").parse_args(words[2:])
            for requirement in requirements:
                assert requirement in ("torch", "pip"), requirement
            for editable in options.editables:
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
