"""examples/demo.py's held-out curve (`--eval_every`): evaluated at the right steps, recorded in `curve`, and the
training run's random state left as it was (sampling held-out replies does not change the run's own samples); and
`--task_config` reaching the problems."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo():
    spec = importlib.util.spec_from_file_location("demo_example", ROOT / "examples" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_held_out_callback_records_every_n_steps_and_restores_the_random_state(demo):
    calls = []

    def evaluate(model, step):  # consumes random numbers, as sampling replies does
        calls.append(step)
        torch.rand(100)
        held = SimpleNamespace(accuracy=step / 100, mean_score=step / 50)
        return held, held

    curve = []
    callback = demo.held_out_callback(evaluate, 10, curve)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    for step in range(1, 41):
        callback.on_step_end(None, SimpleNamespace(global_step=step, max_steps=40), None, model=None)
    assert calls == [10, 20, 30]  # the last step is the run's own after-RL evaluation
    assert [c["step"] for c in curve] == [10, 20, 30] and curve[1]["accuracy"] == 0.2
    assert curve[1]["sampled_mean_score"] == 0.4
    assert torch.equal(torch.rand(3), expected)  # as if no evaluation had run


def test_task_config_and_scale_rewards_parse(demo):
    args = demo.parse_args(["--task_config", '{"max_digits": 2}', "--scale_rewards", "group", "--baseline", "mean",
                            "--leave_one_out", "false", "--eval_every", "10"])
    assert args.task_config == {"max_digits": 2} and args.scale_rewards == "group" and args.eval_every == 10
    assert "task_config" in demo.BEFORE_KEYS and "scale_rewards" in demo.OBLR_OPTIONS
    with pytest.raises(SystemExit):  # GRPO takes none of OBLR-PO's options
        demo.parse_args(["--trainer", "grpo", "--scale_rewards", "group"])
