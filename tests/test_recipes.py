"""The recipes and the training script's command line: every recipe parses into OBLRPOConfig (an unknown key fails),
its arithmetic and GPU layout hold, its launch commands use real flags; `--help` puts OBLR-PO's options first."""

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from trl import ModelConfig

from oblr_trl import OBLRPOConfig
from oblr_trl import config as oblr_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
RECIPES = sorted((EXAMPLES / "recipes").glob("*.yaml"))
RECIPES_README = (EXAMPLES / "recipes" / "README.md").read_text()
FULL_FINETUNING = {"qwen3_4b_base_math.yaml": "Qwen/Qwen3-4B-Base", "qwen3_8b_base_math.yaml": "Qwen/Qwen3-8B-Base"}
ONE_GPU = "qwen3_4b_base_math_1gpu.yaml"
QLORA = "qwen3_4b_base_math_qlora_24gb.yaml"
CPU_RECIPES = ("tiny_cpu.yaml", "smollm2_cpu.yaml", "tiny_cpu_zero2.yaml")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}

# "# Prompts per step: 4 training GPUs x per_device_train_batch_size 16 x gradient_accumulation_steps 16
#  #   = 1024 completions = 128 prompts x num_generations 8."
ARITHMETIC = re.compile(
    r"# Prompts per step: (\d+) (?:training GPUs?|process(?:es)?) x per_device_train_batch_size (\d+) x "
    r"gradient_accumulation_steps (\d+)\s*#\s*= (\d+) completions = (\d+) prompts x num_generations (\d+)"
)


def load_script(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SCRIPT = load_script("oblrpo")


def parse_recipe(recipe, *extra):
    # bf16 recipes are for GPUs; on a CPU-only test machine TrainingArguments refuses bf16 without use_cpu.
    cpu = [] if recipe.name == "tiny_cpu.yaml" else ["--use_cpu", "true"]
    return SCRIPT.make_parser().parse_args_and_config(["--config", str(recipe), *cpu, *extra])


@pytest.fixture(autouse=True)
def _restore_env(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "1"))  # a recipe's `env:` block sets it


# ------------------------------------------------------------------ recipes
def test_all_expected_recipes_exist():
    assert {p.name for p in RECIPES} >= {*CPU_RECIPES, ONE_GPU, QLORA, *FULL_FINETUNING}


def test_cpu_recipes_name_their_model_and_smollm2_cpu_holds_the_demos_measured_settings():
    """tiny_cpu.yaml names `tiny` (the script's default is SmolLM2 now); smollm2_cpu.yaml is the real-model demo's
    preset (examples/demo.py PRESETS["smollm2"], chosen by measurement) in the script's options."""
    _, _, model_args = parse_recipe(EXAMPLES / "recipes" / "tiny_cpu.yaml")
    assert model_args.model_name_or_path == "tiny"

    demo = load_script("demo")
    preset, defaults = demo.PRESETS["smollm2"], demo.parse_args(["--model", "smollm2"])
    script_args, config, model_args = parse_recipe(EXAMPLES / "recipes" / "smollm2_cpu.yaml")
    assert model_args.model_name_or_path == "smollm2" and model_args.dtype == "float32"
    assert model_args.use_peft and model_args.lora_r == preset["lora_r"] and model_args.lora_dropout == 0.0
    assert model_args.lora_alpha == 2 * preset["lora_r"]  # the demo's LoraConfig(lora_alpha=2 * r)
    assert model_args.lora_target_modules in ("all-linear", ["all-linear"])
    assert script_args.prompt_template == preset["prompt_template"] and script_args.task == defaults.task
    assert script_args.format_reward == preset["format_reward"] and script_args.reward_funcs == [defaults.task]
    assert script_args.num_train_examples == preset["num_train"]
    assert (config.learning_rate, config.lr_scheduler_type, config.max_steps) == (
        preset["learning_rate"], preset["lr_scheduler_type"], preset["max_steps"])
    assert (config.per_device_train_batch_size, config.num_generations, config.max_completion_length) == (
        defaults.per_device_train_batch_size, defaults.num_generations, preset["max_completion_length"])
    assert config.one_backward is preset["one_backward"] and config.temperature == 1.0 and config.seed == 0
    assert not config.bf16 and not config.activation_checkpointing  # fp32, as the demo trains on a CPU
    assert (config.baseline, config.snr_lr, config.snr_estimator) == ("gradient_weighted", True, "ema_soft")


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_parses_into_oblrpo_config_and_its_arithmetic_holds(recipe):
    script_args, config, model_args = parse_recipe(recipe)
    assert isinstance(config, OBLRPOConfig)

    match = ARITHMETIC.search(recipe.read_text())
    assert match, f"{recipe.name} must state its prompts-per-step arithmetic in a comment"
    processes, per_device, accumulation, completions, prompts, generations = map(int, match.groups())
    assert per_device == config.per_device_train_batch_size
    assert accumulation == config.gradient_accumulation_steps
    assert generations == config.num_generations
    assert processes * per_device * accumulation == completions == prompts * generations
    # Whole groups on each rank, so the SNR counts prompts (snr_sample_unit="group").
    assert (per_device * config.steps_per_generation) % generations == 0
    if recipe.name in CPU_RECIPES:
        return

    # GPU recipes: the paper's group size and prompts per step, OBLR-PO's defaults, a tracker, bounded disk.
    assert (config.num_generations, prompts) == (8, 128)
    assert script_args.dataset_name and script_args.reward_funcs == ["latex_accuracy_reward"]  # bare-LaTeX solutions
    assert (config.baseline, config.snr_lr, config.scale_rewards) == ("gradient_weighted", True, "none")
    assert config.bf16 and (config.use_vllm or recipe.name == QLORA)
    assert config.save_total_limit == 2
    assert config.report_to and set(config.report_to) & {"trackio", "wandb", "tensorboard"}, config.report_to
    if recipe.name in FULL_FINETUNING:
        assert model_args.model_name_or_path == FULL_FINETUNING[recipe.name]
        assert config.vllm_mode == "server"
        # fp32 master weights under bf16 autocast: updates at lr ~1e-6 round away on bf16 weights
        assert model_args.dtype == "float32" and not model_args.use_peft
    elif recipe.name == QLORA:  # one 24 GB GPU: a 4-bit base under LoRA, no second (vLLM) copy of the weights
        assert processes == 1 and model_args.use_peft and not config.use_vllm
        assert model_args.model_name_or_path == "Qwen/Qwen3-4B-Base"
    else:
        assert recipe.name == ONE_GPU and processes == 1
        assert config.vllm_mode == "colocate" and model_args.use_peft  # bf16 base, fp32 adapters (PEFT's default)


def test_the_qlora_recipe_loads_a_4bit_nf4_double_quantized_base():
    from trl import get_quantization_config

    _, _, model_args = parse_recipe(EXAMPLES / "recipes" / QLORA)
    quantization = get_quantization_config(model_args)
    assert quantization.load_in_4bit and quantization.bnb_4bit_quant_type == "nf4"
    assert quantization.bnb_4bit_use_double_quant
    assert "qwen3_4b_base_math_qlora_24gb.yaml" in RECIPES_README


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_an_unknown_recipe_key_fails_loudly(recipe, tmp_path):
    bad = tmp_path / recipe.name
    bad.write_text(recipe.read_text() + "\nsnr_lr_typo: true\n")
    with pytest.raises(ValueError, match="snr_lr_typo"):
        parse_recipe(bad)


def test_recipes_tell_no_false_fsdp_story_and_mark_times_as_estimates():
    for recipe in RECIPES:
        assert "FSDP does not" not in recipe.read_text(), recipe.name
    assert "FSDP does not" not in RECIPES_README
    for row in [line for line in RECIPES_README.splitlines() if line.startswith("| `qwen3")]:
        assert re.search(r"~\d+ h .*\(estimate\)", row), row


def test_accelerate_configs_load():
    from accelerate.commands.config.config_args import load_config_from_file

    ddp = load_config_from_file(str(EXAMPLES / "accelerate_configs" / "multi_gpu.yaml"))
    fsdp = load_config_from_file(str(EXAMPLES / "accelerate_configs" / "fsdp2.yaml"))
    assert ddp.distributed_type == "MULTI_GPU"
    assert fsdp.distributed_type == "FSDP" and fsdp.fsdp_config["fsdp_version"] == 2
    for stage in (2, 3):
        zero = load_config_from_file(str(EXAMPLES / "accelerate_configs" / f"deepspeed_zero{stage}.yaml"))
        assert zero.distributed_type == "DEEPSPEED" and zero.deepspeed_config["zero_stage"] == stage


def shell_commands(text):
    """The commands in a markdown text's bash blocks, continuation lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", text, re.DOTALL)
    return [line.strip() for block in blocks for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_recipes_readme_launch_commands_parse():
    """Every command of the recipes README parses with the parser of the program it runs."""
    from accelerate.commands.launch import launch_command_parser
    from trl.scripts.vllm_serve import ScriptArguments as VLLMServeArguments
    from trl.scripts.vllm_serve import make_parser as vllm_serve_parser

    commands = shell_commands(RECIPES_README)
    assert commands
    seen = set()
    for command in commands:
        words = [w for w in command.split() if "=" not in w or w.startswith("-")]  # drop VAR=value prefixes
        if words[:2] == ["trl", "vllm-serve"]:
            args = vllm_serve_parser().parse_args_and_config(words[2:])[0]
            assert isinstance(args, VLLMServeArguments)
            seen.add("vllm-serve")
            if "Qwen3-4B" in command:
                assert args.data_parallel_size == 4 and args.tensor_parallel_size == 1  # a 4B model fits one GPU
        elif words[:2] == ["accelerate", "launch"]:
            launch = launch_command_parser().parse_args(words[2:])
            assert launch.training_script == "examples/oblrpo.py" and Path(ROOT, launch.config_file).is_file()
            config = yaml.safe_load(Path(ROOT, launch.config_file).read_text())
            recipe = Path(ROOT, launch.training_script_args[launch.training_script_args.index("--config") + 1])
            if recipe.name in FULL_FINETUNING:
                assert config["distributed_type"] == "FSDP"  # fp32 weights + AdamW states need sharding
            parse_recipe(recipe, *[a for i, a in enumerate(launch.training_script_args)
                                   if "--config" not in launch.training_script_args[max(0, i - 1):i + 1]])
            seen.add("accelerate")
        elif words[0] == "python" and words[1] == "examples/oblrpo.py":
            recipe = Path(ROOT, words[words.index("--config") + 1])
            parse_recipe(recipe)
            seen.add("python oblrpo")
        elif words[0] == "python" and words[1] == "examples/evaluate.py":
            load_script("evaluate").parse_args(words[2:])
            seen.add("python evaluate")
        else:
            raise AssertionError(f"unexpected command in examples/recipes/README.md: {command}")
    assert seen == {"vllm-serve", "accelerate", "python oblrpo", "python evaluate"}
    assert any(ONE_GPU in c for c in commands)


def test_recipes_readme_flags_are_real():
    """Every `--flag` in the recipes README exists in trl vllm-serve, accelerate launch or the example scripts."""
    from trl.scripts.vllm_serve import ScriptArguments as VLLMServeArguments

    known = {f.name for cls in (SCRIPT.OBLRPOScriptArguments, OBLRPOConfig, ModelConfig, VLLMServeArguments)
             for f in dataclasses.fields(cls)}
    known |= {a.dest for a in load_script("evaluate").make_parser()._actions}
    known |= {"config", "config_file", "num_processes", "mixed_precision"}
    flags = set(re.findall(r"(?<![\w-])--([a-z][a-z0-9_]*)", RECIPES_README))
    assert flags and flags <= known, f"unknown flags in examples/recipes/README.md: {sorted(flags - known)}"


# ------------------------------------------------------------------ the script's --help
@pytest.fixture(scope="module")
def help_text():
    result = subprocess.run([sys.executable, str(EXAMPLES / "oblrpo.py"), "--help"], cwd=ROOT, env=ENV,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_help_puts_oblr_options_first_under_their_own_heading(help_text):
    lines = help_text.splitlines()
    headings = [line for line in lines if line and not line.startswith(" ") and line.endswith(":")]
    assert headings[:3] == ["options:", "OBLR-PO options (OBLRPOConfig; paper defaults):",
                            "GRPO options that OBLR-PO's theory constrains:"], headings
    assert len(lines[0]) < 120  # the usage line names the recipe, not all ~400 flags
    oblr_block = help_text.split("OBLR-PO options (OBLRPOConfig; paper defaults):")[1].split("\n\n")[0]
    squashed = "".join(oblr_block.split())  # argparse wraps (and may break at hyphens): compare without whitespace
    fields = {f.name: f for f in dataclasses.fields(OBLRPOConfig)}
    for name in ("baseline", "leave_one_out", "grad_norm_estimator", "snr_lr", "snr_sample_unit", "lr_scale_min",
                 "snr_ema", "one_backward", "weight_clip"):
        assert f"--{name}" in oblr_block, name
        assert "".join(fields[name].metadata["help"].split()) in squashed, name
    assert "--reward_funcs" in help_text and "--use_peft" in help_text and "--learning_rate" in help_text


def test_help_for_loss_type_lists_exactly_what_the_config_accepts(help_text):
    supported = tuple(oblr_config.SUPPORTED_LOSS_TYPES)
    listed = re.search(r"--loss_type \{([a-z_,]+)\}", help_text).group(1).split(",")
    assert tuple(listed) == supported
    for loss_type in listed:  # every listed value is accepted
        OBLRPOConfig(output_dir="/tmp/unused", loss_type=loss_type, use_cpu=True, report_to="none")
    with pytest.raises(SystemExit):  # and anything else is refused by the parser, naming the choices
        SCRIPT.make_parser().parse_args_and_config(["--loss_type", "not_a_loss", "--use_cpu", "true"])


def test_negative_switches_do_not_repeat_the_positive_help(help_text):
    block = help_text.split("--no_snr_lr, --no-snr-lr")[1].split("\n  --")[0]
    assert "Turn off --snr_lr" in block and "Theorem 4" not in block and "(default" not in block
    _, config, _ = SCRIPT.make_parser().parse_args_and_config(["--no_snr_lr", "--use_cpu", "true"])
    assert config.snr_lr is False
    _, config, _ = SCRIPT.make_parser().parse_args_and_config(["--use_cpu", "true"])
    assert config.snr_lr is True


def test_script_has_no_install_header_naming_an_unpublished_package():
    """A PEP 723 header listing `oblr-trl` (not on PyPI) made `uv run examples/oblrpo.py` fail."""
    text = (EXAMPLES / "oblrpo.py").read_text()
    header = re.search(r"^# /// script\n(.*?)^# ///$", text, re.DOTALL | re.MULTILINE)
    assert header is None or "oblr-trl" not in header.group(1)
    assert "pip install -e ." in text


# ------------------------------------------------------------------ the script's own flag handling
def test_one_backward_and_weight_clip_can_be_set_back_to_their_none_from_the_command_line():
    parser = SCRIPT.make_parser()
    _, config, _ = parser.parse_args_and_config(["--use_cpu", "true", "--output_dir", "/tmp/oblr-test",
                                                 "--one_backward", "auto", "--weight_clip", "none"])
    assert config.one_backward is None and config.weight_clip is None
    _, config, _ = parser.parse_args_and_config(["--use_cpu", "true", "--output_dir", "/tmp/oblr-test",
                                                 "--one_backward", "false", "--weight_clip", "10"])
    assert config.one_backward is False and config.weight_clip == 10.0
    with pytest.raises(SystemExit):
        parser.parse_args(["--one_backward", "sometimes"])


def test_the_script_trains_on_a_cpu_without_use_cpu():
    assert SCRIPT.cpu_flags(["--model_name_or_path", "tiny"], cuda_available=False) == [
        "--model_name_or_path", "tiny", "--use_cpu", "true"]
    assert SCRIPT.cpu_flags(["--use_cpu", "false"], cuda_available=False) == ["--use_cpu", "false"]  # as given
    assert SCRIPT.cpu_flags(["--model_name_or_path", "tiny"], cuda_available=True) == ["--model_name_or_path", "tiny"]
    # and what it adds is enough for TRL's config on a machine without a GPU
    _, config, _ = SCRIPT.make_parser().parse_args_and_config(
        SCRIPT.cpu_flags(["--output_dir", "/tmp/oblr-test", "--model_name_or_path", "tiny"], cuda_available=False))
    assert config.use_cpu


def test_latex_accuracy_reward_scores_bare_latex_solutions_that_accuracy_reward_misreads():
    """DeepMath-103K's solutions are bare LaTeX (rows written here in its format, not downloaded): the math recipes'
    reward scores a right boxed answer 1 and a wrong one 0 on each; TRL's accuracy_reward on the same rows skips some
    (None) or scores a wrong answer 1 (bare `2\\sqrt{2}` parses as 2)."""
    pytest.importorskip("math_verify")
    from trl.rewards import accuracy_reward

    rows = [(r"\dfrac{1}{2}", r"$\boxed{\frac{1}{2}}$", r"$\boxed{\frac{1}{3}}$"),
            (r"2\sqrt{2}", r"\boxed{2\sqrt{2}}", r"\boxed{2}"),
            (r"e^{-2}", r"\boxed{\frac{1}{e^{2}}}", r"\boxed{e^{2}}"),
            ("12", r"\boxed{12}", r"\boxed{13}"),
            (r"$\frac{\pi}{4}$", r"\boxed{\frac{\pi}{4}}", r"\boxed{\pi}")]
    solutions = [s for s, _, _ in rows]
    right, wrong = ([[{"role": "assistant", "content": row[i]}] for row in rows] for i in (1, 2))
    reward = SCRIPT.build_reward_funcs(
        SCRIPT.OBLRPOScriptArguments(dataset_name="x", reward_funcs=["latex_accuracy_reward"]), None)[0]
    assert reward(right, solutions) == [1.0] * len(rows)
    assert reward(wrong, solutions) == [0.0] * len(rows)
    assert (accuracy_reward(right, solutions), accuracy_reward(wrong, solutions)) != ([1.0] * 5, [0.0] * 5)


# ------------------------------------------------------------------ each recipe learns as shipped
# Rows in `trl-lib/DeepMath-103K`'s format, written here (not downloaded): a conversational `prompt` holding the bare
# question (the dataset asks for no answer format) and the final answer as bare LaTeX in `solution`. Each with a
# completion answering in the form the recipe's prompt asks for (right, then wrong).
DEEPMATH_ROWS = [
    ("Evaluate the limit \\(\\lim_{x\\to\\infty} \\left(\\sqrt[3]{x+1}-\\sqrt[3]{x}\\right)\\).", "0",
     "The difference behaves like 1/(3x^{2/3}), so the limit is \\(\\boxed{0}\\).", "\\(\\boxed{1}\\)"),
    ("A fair coin is tossed twice. What is the probability of exactly one head?", "\\dfrac{1}{2}",
     "Two of the four outcomes have one head: $\\boxed{\\frac{1}{2}}$.", "$\\boxed{\\frac{1}{4}}$"),
    ("Find the distance between the points (0, 0) and (2, 2).", "2\\sqrt{2}",
     "By Pythagoras the distance is \\boxed{2\\sqrt{2}}.", "The distance is \\boxed{2}."),
    ("Compute \\(\\lim_{n\\to\\infty} (1 - 2/n)^n\\).", "e^{-2}",
     "This is the exponential limit: \\boxed{\\frac{1}{e^{2}}}.", "\\boxed{e^{2}}"),
    ("In how many ways can 2 of 4 distinct books be placed in order on a shelf?", "12",
     "4 x 3 orderings: \\boxed{12}.", "\\boxed{6}"),
]


def prompts_per_step(recipe, config) -> int:
    processes = int(ARITHMETIC.search(recipe.read_text()).group(1))
    return config.per_device_train_batch_size * config.gradient_accumulation_steps * processes \
        // config.num_generations


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_each_recipe_asks_for_the_answer_its_reward_reads_and_scores_rows_of_its_dataset(recipe):
    """A recipe learns as shipped: its prompt asks for the answer in the form its reward reads, the completion budget
    holds that answer (Qwen3 without its thinking block), every step has >= 8 prompts, and its reward functions,
    built by the script from the recipe, score a right answer 1 and a wrong one 0 on rows in its dataset's format."""
    script_args, config, _ = parse_recipe(recipe)
    assert prompts_per_step(recipe, config) >= 8
    rewards = SCRIPT.build_reward_funcs(script_args, config)
    if script_args.dataset_name:  # the math recipes
        pytest.importorskip("math_verify")
        assert script_args.dataset_name == "trl-lib/DeepMath-103K"
        rows = [dict(prompt=[{"role": "user", "content": q}], solution=s) for q, s, _, _ in DEEPMATH_ROWS]
        asked = [SCRIPT.append_to_prompt(row["prompt"], script_args.prompt_suffix or "") for row in rows]
        assert all("\\boxed{}" in p[-1]["content"] for p in asked), "the prompt never asks for the \\boxed{} answer"
        assert [p[-1]["content"] for p in asked] != [row["prompt"][-1]["content"] for row in rows]
        assert config.chat_template_kwargs == {"enable_thinking": False}  # Qwen3: no <think> before the answer
        kwargs = dict(solution=[row["solution"] for row in rows])
        right, wrong = ([[{"role": "assistant", "content": r[i]}] for r in DEEPMATH_ROWS] for i in (2, 3))
    else:  # reasoning-gym problems, worded as the recipe words them
        from oblr_trl.demo import make_dataset

        data = make_dataset(script_args.task, size=6, seed=config.seed, prompt_template=SCRIPT.prompt_template(script_args))
        asked = data["prompt"]
        kwargs = dict(prompts=asked, entry=data["entry"], answer=data["answer"])
        if "Reply with only the number" in asked[0][-1]["content"]:
            right = [[{"role": "assistant", "content": a}] for a in data["answer"]]
        else:  # reasoning-gym's own wording; the verifier reads the reply's final number
            right = [[{"role": "assistant", "content": f"The answer is {a}"}] for a in data["answer"]]
        wrong = [[{"role": "assistant", "content": str(int(a) + 1)}] for a in data["answer"]]
        assert config.max_completion_length >= max(len(a) for a in data["answer"])
    for reward in rewards:
        assert reward(completions=right, **kwargs) == [1.0] * len(right), reward.__name__
        assert reward(completions=wrong, **kwargs) == [0.0] * len(wrong), reward.__name__


def test_append_to_prompt_asks_in_the_last_user_message_and_refuses_a_prompt_without_one():
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"},
                    {"role": "assistant", "content": "4"}, {"role": "user", "content": "3 + 3?"}]
    asked = SCRIPT.append_to_prompt(conversation, " Box it.")
    assert [m["content"] for m in asked] == ["Be brief.", "2 + 2?", "4", "3 + 3? Box it."]
    assert conversation[-1]["content"] == "3 + 3?"  # copied, not changed in place
    assert SCRIPT.append_to_prompt("2 + 2?", " Box it.") == "2 + 2? Box it."
    with pytest.raises(ValueError, match="examples/oblrpo.py: --prompt_suffix"):
        SCRIPT.append_to_prompt([{"role": "system", "content": "Be brief."}], " Box it.")


def test_the_hub_example_asks_for_the_boxed_answer_without_thinking_at_8_prompts_per_step():
    """The script's Hub command (its docstring, as a shell reads it from the source) as the parser reads it."""
    import shlex

    source = (EXAMPLES / "oblrpo.py").read_text().split('"""')[1].replace("\\\\", "\\")  # the docstring's \\
    command = re.search(r"^    python examples/oblrpo\.py (\\\n.*?)\n\n", source, re.S | re.M).group(1)
    argv = shlex.split(command.replace("\\\n", " "))  # as bash joins a line ending in \\
    script_args, config, model_args = SCRIPT.make_parser().parse_args_and_config([*argv, "--use_cpu", "true"])
    assert model_args.model_name_or_path.startswith("Qwen/Qwen3") and script_args.dataset_name == "trl-lib/DeepMath-103K"
    assert script_args.reward_funcs == ["latex_accuracy_reward"]
    assert "\\boxed{}" in script_args.prompt_suffix
    assert config.chat_template_kwargs == {"enable_thinking": False}
    assert config.per_device_train_batch_size * config.gradient_accumulation_steps // config.num_generations >= 8
