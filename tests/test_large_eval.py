"""benchmarks/large_eval.py: the large held-out set is distinct, unseen in training, deterministic per seed."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = str(Path(__file__).resolve().parents[1] / "benchmarks")


@pytest.fixture(scope="module")
def le():
    return importlib.import_module("large_eval")


def test_first_distinct_keeps_order_and_drops_repeats(le):
    pool = ["a", "b", "a", "c", "d", "b", "e"]
    assert le.first_distinct(pool, 10) == [0, 1, 3, 4, 6]
    assert le.first_distinct(pool, 2) == [0, 1]
    assert le.first_distinct([], 3) == []


def test_a_run_on_another_task_is_refused_naming_what_differs(le, tmp_path):
    import json

    from oblr_trl.demo.tasks import PROMPT_TEMPLATES

    (tmp_path / "model").mkdir()
    (tmp_path / "summary.json").write_text(json.dumps(dict(task_config={"max_digits": 1}, seed=0)))
    (tmp_path / "model" / "oblr_task.json").write_text(json.dumps(dict(
        task=le.TASK, prompt_template=PROMPT_TEMPLATES[le.TEMPLATE], max_new_tokens=le.MAX_NEW_TOKENS,
        eval_seed=le.EVAL_SEED)))
    with pytest.raises(SystemExit, match=r"task_config.*max_digits.: 1"):
        le.check_run(tmp_path)
    (tmp_path / "summary.json").write_text(json.dumps(dict(task_config=le.TASK_CONFIG, seed=0)))
    le.check_run(tmp_path)  # the ablation's own settings pass


def test_large_held_out_is_unseen_by_its_seed_and_the_same_for_every_arm(le):
    pytest.importorskip("reasoning_gym")
    from oblr_trl.demo.tasks import PROMPT_TEMPLATES, make_dataset

    held = le.large_held_out(seed=1, size=300, pool=2000)
    questions = [p[-1]["content"] for p in held["prompt"]]
    train = make_dataset(le.TASK, size=le.NUM_TRAIN, seed=1, prompt_template=PROMPT_TEMPLATES[le.TEMPLATE],
                         **le.TASK_CONFIG)
    assert len(set(questions)) == 300 and not set(questions) & {p[-1]["content"] for p in train["prompt"]}
    assert le.questions_digest(held) == le.questions_digest(le.large_held_out(seed=1, size=300, pool=2000))
    # reasoning-gym's problem i of seed s is drawn with seed s + i: nearby seeds share their problems (and so their
    # large set), distant ones do not
    assert le.questions_digest(held) != le.questions_digest(le.large_held_out(seed=100_000, size=300, pool=2000))
    with pytest.raises(ValueError, match="raise --pool"):
        le.large_held_out(seed=1, size=300, pool=100)


def test_a_seed_whose_large_set_was_scored_before_rl_reuses_that_score(le, tmp_path):
    pytest.importorskip("reasoning_gym")
    import json
    import subprocess

    digest = le.questions_digest(le.large_held_out(seed=0, size=50, pool=1000))
    (tmp_path / "large_before_seed0.json").write_text(json.dumps(dict(seed=0, digest=digest, accuracy=0.25,
                                                                      scores=[1.0] * 50, seconds=9.0)))
    out = tmp_path / "large_before_seed1.json"
    proc = subprocess.run([sys.executable, str(Path(BENCH) / "large_eval.py"), "--base", "--seed", "1", "--size", "50",
                           "--pool", "1000", "--output", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())  # seeds 0 and 1 train on nearly the same problems: the same large set
    assert result["seed"] == 1 and result["digest"] == digest and result["accuracy"] == 0.25
    assert result["reused_from"] == "large_before_seed0.json"
