"""Same behaviour, bit for bit: train the tiny model in every mode with the package of a git ref A and of the working
tree B, and check that both log identical metrics (the lr scale among them), form identical norms and advantages (every
call of ``compute_advantages``, in order) and end with identical parameters (``torch.equal``).

The modes: ``one_backward`` True/False x ``snr_lr`` on/off x every baseline of ``oblr_trl.estimators.BASELINES`` x
full fine-tuning/LoRA (gradient checkpointing on, TRL's default); then for both paths two micro-batches per step
(gradient accumulation), one completion per SNR sample, and no checkpointing (``one_backward`` in one chunk per
micro-batch); ``one_backward=True`` in chunks of one group (``path_choice.fitting_chunk`` patched to "none fits", as
``tests/test_one_backward.py`` does); the logit proxy's weights. Fixed seeds, a few steps, fp32 on the CPU, a reward
with spread and some unscorable (None) completions. Each tree trains in its own process, whose ``oblr_trl`` is that
tree's (``PYTHONPATH``; checked); A is checked out with ``git worktree add`` into a temp folder.

    python benchmarks/same_behaviour.py                       # A = main, B = the working tree
    python benchmarks/same_behaviour.py --ref f4cf685 --steps 3
    python benchmarks/same_behaviour.py --modes ob-snr        # only modes whose name contains this text
    python benchmarks/same_behaviour.py --save /tmp/a.pt      # only the working tree's results, saved
    python benchmarks/same_behaviour.py --against /tmp/a.pt   # the working tree against saved results

Exit status 0 when every mode matches, 1 otherwise (each difference printed). Timing entries of the log
(``*runtime*``, ``*per_second*``, ``step_time``) are not compared.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIMING = ("runtime", "per_second", "step_time")


def modes(baselines: list[str]) -> dict[str, dict]:
    """Mode name -> its settings (config overrides; ``lora``; ``chunked``: one group per one_backward chunk)."""
    out = {}
    for ob in (True, False):
        path = "ob" if ob else "two"
        for snr in (True, False):
            for baseline in baselines:
                for lora in (False, True):
                    name = f"{path}-{'snr' if snr else 'nosnr'}-{baseline}-{'lora' if lora else 'full'}"
                    out[name] = dict(config=dict(one_backward=ob, snr_lr=snr, baseline=baseline), lora=lora)
        # two micro-batches of whole groups per step (re-split from TRL's shuffle under one_backward)
        out[f"{path}-accumulate"] = dict(config=dict(one_backward=ob, gradient_accumulation_steps=2))
        out[f"{path}-unit-completion"] = dict(config=dict(one_backward=ob, snr_sample_unit="completion"))
        out[f"{path}-no-checkpointing"] = dict(config=dict(one_backward=ob, gradient_checkpointing=False))
    for snr in (True, False):
        out[f"ob-chunked-{'snr' if snr else 'nosnr'}"] = dict(config=dict(one_backward=True, snr_lr=snr), chunked=True)
    out["two-logit-proxy"] = dict(config=dict(one_backward=False, snr_lr=True, grad_norm_estimator="logit"))
    return out


def reward(completions, **kwargs):
    """Spread inside groups ('1' and '2' counted), None for every seventh completion (unscorable)."""
    return [None if i % 7 == 3 else float(c[0]["content"].count("1") + c[0]["content"].count("2"))
            for i, c in enumerate(completions)]


def train_one(spec: dict, steps: int, out_dir: str):
    """One mode's run: its log (timings left out) and final parameters."""
    import torch
    from datasets import Dataset
    from transformers import PrinterCallback

    import oblr_trl.trainer as trainer_module
    from oblr_trl import OBLRPOConfig, OBLRPOTrainer
    from oblr_trl.demo.tiny import build_model, build_tokenizer

    rules = chunk_rules()

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0)
    if spec.get("lora"):
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                           lora_dropout=0.0, task_type="CAUSAL_LM"))
    fitting, advantages, seen = rules.fitting_chunk, trainer_module.compute_advantages, {"norms": [], "adv": []}
    if spec.get("chunked"):
        rules.fitting_chunk = lambda shape: (0, float("inf"))

    def recorded(rewards, lengths, sq_norms, **kwargs):  # every call's norms and advantages, as the trainer formed them
        result = advantages(rewards, lengths, sq_norms, **kwargs)
        seen["norms"].append(None if sq_norms is None else sq_norms.detach().clone())
        seen["adv"].append(result.values.detach().clone())
        return result

    trainer_module.compute_advantages = recorded
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{i} + {i % 3}"}]} for i in range(64)])
    args = OBLRPOConfig(output_dir=out_dir, per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
                        max_steps=steps, logging_steps=1, report_to="none", use_cpu=True, learning_rate=0.1,
                        save_strategy="no", seed=0, data_seed=0, disable_tqdm=True, bf16=False,
                        **spec["config"])
    try:
        trainer = OBLRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[reward], args=args,
                                train_dataset=dataset)
        trainer.remove_callback(PrinterCallback)  # the log is compared, not printed
        trainer.train()
    finally:
        rules.fitting_chunk, trainer_module.compute_advantages = fitting, advantages
    log = [{k: v for k, v in h.items() if not any(t in k for t in TIMING)} for h in trainer.state.log_history]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    plan = getattr(trainer, "route", None) or getattr(trainer, "one_backward_plan", None)  # a ref before the route
    return {"log": log, "params": params, "one_backward": trainer.uses_one_backward,
            "chunk": getattr(plan, "chunk_rows", None), "norms": seen["norms"], "advantages": seen["adv"]}


def chunk_rules():
    """The module whose ``fitting_chunk`` the default calls: ``oblr_trl.path_choice``, or before it existed
    ``oblr_trl.cost_model`` (so a ref from before the move compares too)."""
    import importlib

    try:
        return importlib.import_module("oblr_trl.path_choice")
    except ModuleNotFoundError:
        return importlib.import_module("oblr_trl.cost_model")


def child(out: str, steps: int, wanted: str, root: str) -> None:
    """Run every mode with the ``oblr_trl`` on ``PYTHONPATH`` (which must lie under ``root``) into ``out``."""
    import logging

    import torch

    import oblr_trl
    from oblr_trl.estimators import BASELINES

    where = Path(oblr_trl.__file__).resolve()
    if Path(root).resolve() not in where.parents:
        sys.exit(f"oblr_trl imported from {where}, not from {root}")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in modes(sorted(BASELINES)).items():
            if wanted in name:
                results[name] = train_one(spec, steps, tmp)
                print(f"  {name}: trained ({len(results[name]['log'])} log entries)", flush=True)
    torch.save({"package": str(where), "results": results}, out)


def run_tree(label: str, root: Path, out: Path, args) -> None:
    print(f"{label}: {root}", flush=True)
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, __file__, "--child", str(out), "--steps", str(args.steps), "--modes", args.modes,
                    "--root", str(root)], env=env, check=True, cwd=tempfile.gettempdir())


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def same_tensors(a: list | None, b: list | None) -> bool:
    """Both lists hold the same tensors (``torch.equal``; NaN where NaN) in the same order, or the same ``None``s."""
    import torch

    if a is None or b is None or len(a) != len(b):
        return a is None and b is None
    return all(x is None and y is None or x is not None and y is not None and x.shape == y.shape and x.dtype == y.dtype
               and torch.equal(torch.nan_to_num(x, nan=0.0), torch.nan_to_num(y, nan=0.0))
               and torch.equal(x.isnan(), y.isnan()) for x, y in zip(a, b))


def compare(a: dict, b: dict) -> list[str]:
    """Every difference between the two trees' results, one line each."""
    import torch

    problems = [f"{m}: only in {'A' if m in a else 'B'}" for m in sorted(set(a) ^ set(b))]
    for m in sorted(set(a) & set(b)):
        ra, rb = a[m], b[m]
        if ra["one_backward"] != rb["one_backward"]:
            problems.append(f"{m}: one_backward {ra['one_backward']} vs {rb['one_backward']}")
        if len(ra["log"]) != len(rb["log"]):
            problems.append(f"{m}: {len(ra['log'])} log entries vs {len(rb['log'])}")
        for i, (ha, hb) in enumerate(zip(ra["log"], rb["log"])):
            for key in sorted(set(ha) | set(hb)):
                if not same(ha.get(key), hb.get(key)):
                    problems.append(f"{m}: log[{i}][{key}] {ha.get(key)!r} vs {hb.get(key)!r}")
        if ra["params"].keys() != rb["params"].keys():
            problems.append(f"{m}: different parameter names")
        for key in ("norms", "advantages"):  # every call of compute_advantages, in order
            if not same_tensors(ra.get(key), rb.get(key)):
                problems.append(f"{m}: {key} differ")
        for n in ra["params"].keys() & rb["params"].keys():
            if not torch.equal(ra["params"][n], rb["params"][n]):
                problems.append(f"{m}: parameter {n} differs (max |diff| "
                                f"{(ra['params'][n] - rb['params'][n]).abs().max().item():.3g})")
    return problems


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ref", default="main", help="git ref A, checked out into a temp worktree (default: main)")
    p.add_argument("--tree", default=str(REPO), help="the working tree B (default: this checkout)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per mode (default: 3)")
    p.add_argument("--modes", default="", help="only modes whose name contains this text (default: all)")
    p.add_argument("--save", help="run only the working tree and save its results to this file")
    p.add_argument("--against", help="compare the working tree with results saved by --save (no git ref)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.steps, args.modes, args.root)
        return 0
    import torch

    if args.save:
        run_tree("B (working tree)", Path(args.tree), Path(args.save), args)
        return 0
    if args.against:
        with tempfile.TemporaryDirectory() as tmp:
            run_tree("B (working tree)", Path(args.tree), Path(tmp) / "b.pt", args)
            b = torch.load(Path(tmp) / "b.pt", weights_only=False)["results"]
        return report(torch.load(args.against, weights_only=False)["results"], b, args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        tree_a = Path(tmp) / "a"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(tree_a), args.ref], check=True)
        try:
            sha = subprocess.run(["git", "-C", str(tree_a), "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True, check=True).stdout.strip()
            run_tree(f"A ({args.ref} = {sha})", tree_a, Path(tmp) / "a.pt", args)
            run_tree("B (working tree)", Path(args.tree), Path(tmp) / "b.pt", args)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree_a)], check=True)
        a = torch.load(Path(tmp) / "a.pt", weights_only=False)["results"]
        b = torch.load(Path(tmp) / "b.pt", weights_only=False)["results"]
    return report(a, b, args.steps)


def report(a: dict, b: dict, steps: int) -> int:
    """Prints each mode's verdict and every difference; the exit status (1: something differs)."""
    problems = compare(a, b)
    for m in sorted(a):
        print(f"{m:32s} one_backward={a[m]['one_backward']!s:5s} chunk_rows={a[m]['chunk']} steps={steps} "
              f"{'differs' if any(x.startswith(m + ':') for x in problems) else 'identical'}")
    print("\n".join(problems) or f"All {len(a)} modes: identical logged metrics, norms, advantages and parameters "
          "(torch.equal).")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
