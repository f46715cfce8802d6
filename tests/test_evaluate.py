"""examples/evaluate.py: the same starting model as the demo, clear errors, documented flags, adapter folders."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


def load_script(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Built(Exception):
    pass


def warm_model_call(monkeypatch, run):
    """The arguments `run()` passes to `load_or_build_warm_model` (stopped right there)."""
    import oblr_trl.demo.tiny

    calls = []

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        raise Built

    monkeypatch.setattr(oblr_trl.demo.tiny, "load_or_build_warm_model", record)
    with pytest.raises(Built):
        run()
    return calls[0]


def test_default_start_is_the_demos_the_scripts_and_the_notebooks(monkeypatch):
    """Without --model, evaluate.py scores the model the tiny demo (`--model tiny`, make demo-tiny) starts RL from
    (issue: it used 300 warm-up steps)."""
    demo, evaluate = load_script("demo"), load_script("evaluate")
    demo_call = warm_model_call(monkeypatch, lambda: demo.main(demo.parse_args(["--model", "tiny"])))
    eval_call = warm_model_call(monkeypatch, lambda: evaluate.load_model(None, evaluate.parse_args([])))
    assert eval_call == demo_call
    (task,), kwargs = demo_call
    assert (task, kwargs["seed"], kwargs["steps"]) == ("chain_sum", 0, 200)

    from oblr_trl.demo.defaults import TINY_TASK, TINY_WARMUP_SEED, TINY_WARMUP_STEPS

    assert (task, kwargs["seed"], kwargs["steps"]) == (TINY_TASK, TINY_WARMUP_SEED, TINY_WARMUP_STEPS)
    # examples/oblrpo.py --model_name_or_path tiny (warm seed = the run's seed, 0 by default), its tiny recipe
    script = load_script("oblrpo")
    assert (script.OBLRPOScriptArguments().task, script.OBLRPOScriptArguments().tiny_warmup_steps) == (task, 200)
    recipe = yaml.safe_load((EXAMPLES / "recipes" / "tiny_cpu.yaml").read_text())
    assert (recipe["task"], recipe["tiny_warmup_steps"], recipe["seed"]) == (task, 200, 0)
    # the notebook trains SmolLM2 now; any tiny model it builds must still be this one
    notebook = (ROOT / "notebooks" / "oblrpo_walkthrough.ipynb").read_text()
    calls = re.findall(r'load_or_build_warm_model\((.*?)\)', notebook)
    assert all(call == '\\"chain_sum\\", steps=200' for call in calls), calls


def test_help_shows_defaults_and_every_flag_has_help():
    parser = load_script("evaluate").make_parser()
    assert all(action.help for action in parser._actions), [a.dest for a in parser._actions if not a.help]
    text = parser.format_help()
    assert "(default: 200)" in text and "(default: 64)" in text


def test_a_folder_without_a_model_is_a_one_line_error(tmp_path):
    (tmp_path / "checkpoint-50").mkdir()
    result = subprocess.run([sys.executable, str(EXAMPLES / "evaluate.py"), "--model", str(tmp_path)], cwd=ROOT,
                            env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    # the script's own output: one line (optional quantization libraries, bitsandbytes and torchao, may print their
    # own notices while transformers imports them; those are not the script's)
    lines = [line for line in result.stderr.strip().splitlines() if "evaluate.py" in line or "error" in line.lower()]
    lines = [line for line in lines if not line.startswith(("Failed to load", "W1", "E1"))]
    assert len(lines) == 1 and "holds no model" in lines[0] and "checkpoint-50" in lines[0], result.stderr


def test_a_missing_folder_is_a_one_line_error(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        load_script("evaluate").load_model(str(tmp_path / "nowhere"))


def test_scores_a_peft_adapter_folder_and_records_the_results_on_it(tmp_path):
    """The folder a LoRA run saves (adapter only, no tokenizer): merged into its base model, then scored."""
    from peft import LoraConfig, get_peft_model

    from oblr_trl.demo import build_model, build_tokenizer

    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    build_model(tokenizer).save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    from transformers import AutoModelForCausalLM

    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir),
                                LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft_model.save_pretrained(adapter_dir)
    assert not (adapter_dir / "config.json").exists() and not (adapter_dir / "tokenizer.json").exists()

    evaluate = load_script("evaluate")
    args = evaluate.parse_args(["--model", str(adapter_dir), "--num_examples", "8", "--output",
                                str(tmp_path / "eval.md")])
    rows = evaluate.main(args)
    assert rows[0][0] == "reasoning-gym chain_sum (seed 1)" and rows[0][3] == "8"
    results = json.loads((adapter_dir / "eval_results.json").read_text())
    assert results["results"][0]["problems"] == 8 and 0.0 <= results["results"][0]["accuracy"] <= 1.0


def test_prompt_template_asks_the_held_out_problems_in_that_wording(tmp_path, monkeypatch):
    """--prompt_template (a template or a task name of PROMPT_TEMPLATES) rewrites the questions the model is asked,
    as examples/demo.py does, so the demo's re-score command scores the problems the demo scored."""
    import torch

    from oblr_trl.demo.tasks import PROMPT_TEMPLATES
    from oblr_trl.demo.tiny import build_model, build_tokenizer

    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    model_dir = tmp_path / "model"
    build_model(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    evaluate = load_script("evaluate")
    asked = []
    import oblr_trl.demo.tasks as tasks

    real = tasks.evaluate_held_out

    def spy(model, tok, dataset, **kwargs):
        asked.extend(row["prompt"][-1]["content"] for row in dataset)
        return real(model, tok, dataset, **kwargs)

    monkeypatch.setattr(tasks, "evaluate_held_out", spy)
    for template, expected in ((None, "="), ("chain_sum", "Reply with only the number."), ("{expression} =", " =")):
        asked.clear()
        argv = ["--model", str(model_dir), "--num_examples", "4", "--output", str(tmp_path / "eval.md"),
                "--no-update_card"] + (["--prompt_template", template] if template else [])
        rows = evaluate.main(evaluate.parse_args(argv))
        assert len(asked) == 4 and all(q.endswith(expected) for q in asked), (template, asked)
        wording = PROMPT_TEMPLATES.get(template, template)
        assert (f"asked as {wording!r}" in rows[0][0]) == (template is not None)
