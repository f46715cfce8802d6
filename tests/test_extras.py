"""The trainer needs none of the demo extra's packages (reasoning-gym, matplotlib, gguf); the demo's helpers, used
without them, name the extra."""

import configparser
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO_PACKAGES = ("reasoning-gym", "matplotlib", "gguf")
BLOCKED = ("reasoning_gym", "matplotlib", "matplotlib.figure", "gguf")


def _requirements(value: str) -> list[str]:
    return [line.split(">")[0].split("=")[0].split("[")[0].strip() for line in value.strip().splitlines()
            if line.strip() and not line.strip().startswith("#")]


def test_the_demo_packages_are_an_extra_not_a_requirement():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    required = _requirements(config["options"]["install_requires"])
    extras = config["options.extras_require"]
    assert not set(DEMO_PACKAGES) & set(required)
    for extra in ("demo", "dev", "notebook", "gpu"):  # every extra whose users run the demo's helpers
        assert set(DEMO_PACKAGES) <= set(_requirements(extras[extra])), extra


def test_the_trainer_trains_and_writes_its_card_without_the_demo_packages(tmp_path):
    """In a process where importing any of them fails: import oblr_trl, train a step, write the model card."""
    code = f"""
import sys
for name in {BLOCKED!r}:
    sys.modules[name] = None  # import raises ImportError
sys.path.insert(0, {str(ROOT / "tests")!r})
from helpers import common_args, train
from oblr_trl import OBLRPOConfig, OBLRPOTrainer
trainer, _ = train(OBLRPOTrainer, OBLRPOConfig(**common_args(max_steps=1, output_dir={str(tmp_path)!r})))
trainer.create_model_card()
card = open({str(tmp_path / "README.md")!r}).read()
assert "oblr-po" in card and ".png" not in card, card
print("TRAINED", trainer.state.global_step)
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TRAINED 1" in proc.stdout


@pytest.mark.parametrize("call", ["make_dataset", "make_reward_func", "plot_training"])
def test_the_demo_helpers_name_the_extra_when_its_packages_are_missing(monkeypatch, tmp_path, call):
    import oblr_trl.demo

    for name in BLOCKED:
        monkeypatch.setitem(sys.modules, name, None)
    args = {"make_dataset": ("chain_sum",), "make_reward_func": ("chain_sum",), "plot_training": ([], tmp_path)}[call]
    with pytest.raises(ImportError, match=r'pip install -e "\.\[demo\]" from your clone') as info:
        getattr(oblr_trl.demo, call)(*args)
    assert f"{'oblr_trl.plotting' if call == 'plot_training' else 'oblr_trl.demo'}.{call}" in str(info.value)


def test_the_reference_model_names_the_extra_without_gguf(monkeypatch, tmp_path):
    from oblr_trl.demo import reference_model

    monkeypatch.setitem(sys.modules, "gguf", None)
    spec = reference_model.REFERENCE_MODELS["smollm2"]
    with pytest.raises(ImportError, match=r'load_reference_model .*pip install -e "\.\[demo\]" from your clone'):
        reference_model._convert(spec, tmp_path / "missing.whl", tmp_path / "target")
