"""Re-score a finished real-model run on a large held-out set: the ablation's final, powered measurement.

A run's own held-out set (100 problems, every 10 steps) measures one arm with a standard error of ~5 points, and the
difference of two arms on it carries ~4-5 points of pure measurement noise: at that size no number of seeds a CPU can
afford detects a 5-point difference. This scores the saved model (``<run>/model``, a LoRA adapter on
SmolLM2-135M-Instruct) greedily on ``--size`` *distinct* problems of the held-out seed that occur nowhere among the
run's training problems (its seed's ``--num_train`` generated problems), and writes ``<run>/large_eval.json``: the
accuracy, each problem's score (so differences can also be paired per problem), and how the set was built. Every arm
of one seed is scored on the same problems.

    python benchmarks/large_eval.py outputs/ablation/GRPO_lr0.0005/seed0
    python benchmarks/large_eval.py --base --seed 0 --output outputs/ablation/large_before_seed0.json   # before RL
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

# The ablation's task (ablation.py TASK_ARGS) and the demo's smollm2 preset (examples/demo.py PRESETS): training
# problems per seed, the held-out seed, the reply length. A run made otherwise is refused (check_run).
TASK, TASK_CONFIG, TEMPLATE = "chain_sum", {"max_digits": 2}, "chain_sum"
NUM_TRAIN, EVAL_SEED, MAX_NEW_TOKENS = 1000, 12345, 12


def first_distinct(questions: list[str], size: int) -> list[int]:
    """Indices of the first `size` distinct entries of `questions`, in order (fewer when they run out)."""
    first: dict[str, int] = {}
    for i, q in enumerate(questions):
        first.setdefault(q, i)
        if len(first) == size:
            break
    return list(first.values())


def large_held_out(seed: int, size: int, pool: int = 5000, num_train: int = NUM_TRAIN, eval_seed: int = EVAL_SEED):
    """The large held-out set of training seed `seed`: `size` distinct problems of held-out seed `eval_seed` (drawn
    from `pool` generated ones) none of whose questions is among that seed's `num_train` training problems."""
    from oblr_trl.demo.tasks import PROMPT_TEMPLATES, make_dataset, without_questions_of

    template = PROMPT_TEMPLATES[TEMPLATE]
    held = make_dataset(TASK, size=pool, seed=eval_seed, prompt_template=template, **TASK_CONFIG)
    train = make_dataset(TASK, size=num_train, seed=seed, prompt_template=template, **TASK_CONFIG)
    unseen = without_questions_of(held, train)
    chosen = first_distinct([p[-1]["content"] for p in unseen["prompt"]], size)
    if len(chosen) < size:
        raise ValueError(f"large_held_out: only {len(chosen)} distinct unseen problems among {pool}; raise --pool.")
    return unseen.select(chosen)


def check_run(run_dir: Path) -> None:
    """Refuse a run trained on another task, wording or reply length than the large set is built for (its scores
    would not be comparable), naming what differs."""
    from oblr_trl.demo.tasks import PROMPT_TEMPLATES

    summary = json.loads((run_dir / "summary.json").read_text())
    task = json.loads((run_dir / "model" / "oblr_task.json").read_text())
    want = dict(task=TASK, task_config=TASK_CONFIG, prompt_template=PROMPT_TEMPLATES[TEMPLATE],
                max_new_tokens=MAX_NEW_TOKENS, eval_seed=EVAL_SEED)
    have = dict(task=task["task"], task_config=summary.get("task_config"), prompt_template=task["prompt_template"],
                max_new_tokens=task["max_new_tokens"], eval_seed=task["eval_seed"])
    differ = {k: (have[k], want[k]) for k in want if have[k] != want[k]}
    if differ:
        raise SystemExit(f"large_eval.py: {run_dir} was not run on the ablation's task; (its, expected): {differ}. "
                         "Edit TASK, TASK_CONFIG, TEMPLATE, MAX_NEW_TOKENS or EVAL_SEED to match.")


def questions_digest(dataset) -> str:
    """A short hash of the set's questions in order: two results are paired per problem only when it matches."""
    return hashlib.sha256("\n".join(p[-1]["content"] for p in dataset["prompt"]).encode()).hexdigest()[:16]


def load_model(run_dir: Path | None):
    """SmolLM2-135M-Instruct (the package's offline copy), with the run's LoRA adapter merged when `run_dir` is
    given."""
    from oblr_trl.demo import load_reference_model

    model, tokenizer = load_reference_model("smollm2")
    if run_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(run_dir / "model")).merge_and_unload()
    return model, tokenizer


def score(model, tokenizer, dataset) -> dict:
    """Greedy accuracy (exact answers) and per-problem scores on `dataset`, with the time taken."""
    from oblr_trl.demo.tasks import evaluate_held_out

    t = time.time()
    result = evaluate_held_out(model, tokenizer, dataset, max_new_tokens=MAX_NEW_TOKENS)
    return dict(accuracy=result.accuracy, scores=[round(s, 4) for s in result.scores],
                seconds=round(time.time() - t, 1))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, nargs="?", help="a finished examples/demo.py run (its model/ folder)")
    parser.add_argument("--base", action="store_true", help="score the model before RL instead (needs --seed)")
    parser.add_argument("--seed", type=int, default=None, help="training seed (default: the run's summary.json)")
    parser.add_argument("--size", type=int, default=500)
    parser.add_argument("--pool", type=int, default=5000)
    parser.add_argument("--output", type=Path, default=None, help="default <run_dir>/large_eval.json")
    args = parser.parse_args()
    if args.base == (args.run_dir is not None):
        parser.error("give a run_dir, or --base with --seed and --output")
    if args.base and (args.seed is None or args.output is None):
        parser.error("--base needs --seed and --output")
    import torch

    torch.set_num_threads(1)
    if args.run_dir is not None:
        check_run(args.run_dir)
    seed = args.seed if args.seed is not None else json.loads((args.run_dir / "summary.json").read_text())["seed"]
    dataset = large_held_out(seed, args.size, args.pool)
    output = args.output or args.run_dir / "large_eval.json"
    digest = questions_digest(dataset)
    same = [p for p in output.parent.glob("large_before_seed*.json") if args.base and p != output
            and json.loads(p.read_text())["digest"] == digest]
    if same:  # nearby seeds share their problems, and so their large set: the model before RL scored it already
        scored = {k: v for k, v in json.loads(same[0].read_text()).items() if k in ("accuracy", "scores", "seconds")}
        result = dict(seed=seed, size=len(dataset), pool=args.pool, num_train=NUM_TRAIN, eval_seed=EVAL_SEED,
                      digest=digest, reused_from=same[0].name, **scored)
    else:
        model, tokenizer = load_model(None if args.base else args.run_dir)
        result = dict(seed=seed, size=len(dataset), pool=args.pool, num_train=NUM_TRAIN, eval_seed=EVAL_SEED,
                      digest=digest, **score(model, tokenizer, dataset))
    tmp = output.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(output)  # atomic: a half-written file never counts as done
    print(f"{output}: greedy {result['accuracy']:.1%} on {result['size']} problems ({result['seconds']:.0f}s)")


if __name__ == "__main__":
    main()
