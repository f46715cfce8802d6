"""Score a checkpoint on held-out problems and write a markdown table.

* reasoning-gym: greedy accuracy on `--num_examples` held-out problems of `--task`, scored by the task's own verifier
  (`oblr_trl.tasks.evaluate_accuracy`, the same extraction and verifier as the training reward). Problems come from
  `--seed` (default 1; training uses 0 and the tiny model's warm-up 10000, so they are disjoint).
* `--benchmarks gsm8k math500` (optional): greedy accuracy on GSM8K (openai/gsm8k, test) / MATH-500
  (HuggingFaceH4/MATH-500, test) by Hub name, scored with math-verify. Skipped with a message when math-verify is
  not installed or the Hub cannot be reached (e.g. `HF_HUB_OFFLINE=1`).

    python examples/evaluate.py --model outputs/tiny_cpu --output outputs/tiny_cpu/eval.md
    python examples/evaluate.py                      # the embedded tiny model (warmed up, before any RL)
    python examples/evaluate.py --model Qwen3-4B-Base-OBLR-PO-DeepMath --benchmarks gsm8k math500 --max_new_tokens 1024
"""

import argparse
import os
import time

# name: (Hub dataset, config, split, question column, answer column)
BENCHMARKS = {
    "gsm8k": ("openai/gsm8k", "main", "test", "question", "answer"),
    "math500": ("HuggingFaceH4/MATH-500", None, "test", "problem", "answer"),
}


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", default=None, help="Checkpoint directory or Hub name. Default: the embedded tiny model (warmed up)."
    )
    parser.add_argument("--task", default="chain_sum", help="reasoning-gym task of the held-out problems.")
    parser.add_argument("--num_examples", type=int, default=200, help="Held-out reasoning-gym problems.")
    parser.add_argument("--seed", type=int, default=1, help="Seed of the held-out problems (training uses 0).")
    parser.add_argument("--max_new_tokens", type=int, default=8, help="Greedy decoding budget (8 fits chain_sum).")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument(
        "--benchmarks", nargs="*", default=[], choices=sorted(BENCHMARKS), help="Hub math benchmarks (need network)."
    )
    parser.add_argument("--benchmark_limit", type=int, default=None, help="Score only the first N benchmark problems.")
    parser.add_argument("--output", default="eval.md", help="Markdown file the results table is written to.")
    return parser


def parse_args(argv=None):
    return make_parser().parse_args(argv)


def load_model(path):
    """A causal LM and its tokenizer from a directory/Hub name (PEFT adapters merged), or the embedded tiny model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oblr_trl.tiny import load_or_build_warm_model

    if path is None:
        return load_or_build_warm_model(), "embedded tiny Qwen3 (warmed up)"
    if os.path.exists(os.path.join(path, "adapter_config.json")):
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(path, dtype="auto").merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if torch.cuda.is_available():
        model.to("cuda")
    return (model, tokenizer), path


def score_benchmark(model, tokenizer, name, args):
    """(accuracy, number of problems) on a Hub benchmark with math-verify, or a string saying why it was skipped."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return "skipped: math-verify is not installed (pip install math-verify)"
    from datasets import load_dataset

    repo, config, split, question_col, answer_col = BENCHMARKS[name]
    try:
        data = load_dataset(repo, config, split=split)
    except Exception as error:  # offline, or the Hub unreachable: report, do not fail the other rows
        return f"skipped: cannot load {repo} ({type(error).__name__}; offline?)"
    if args.benchmark_limit:
        data = data.select(range(min(args.benchmark_limit, len(data))))
    correct = 0
    device = next(model.parameters()).device
    for start in range(0, len(data), args.batch_size):
        batch = data[start : start + args.batch_size]
        prompts = [
            [{"role": "user", "content": q + "\nPut the final answer in \\boxed{}."}] for q in batch[question_col]
        ]
        inputs = tokenizer.apply_chat_template(
            prompts, add_generation_prompt=True, tokenize=True, return_dict=True, padding=True, return_tensors="pt"
        ).to(device)
        output = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        for text, gold in zip(texts, batch[answer_col], strict=True):
            gold = gold.split("####")[-1].strip()  # GSM8K: the reasoning, then "#### answer"
            correct += bool(verify(parse(f"${gold}$"), parse(text)))
    return correct / len(data), len(data)


def main(args):
    import torch

    from oblr_trl.tasks import evaluate_accuracy, make_dataset

    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # the tiny model is slower with threads on a shared CPU
    start = time.time()
    (model, tokenizer), name = load_model(args.model)
    rows = []
    held_out = make_dataset(args.task, size=args.num_examples, seed=args.seed)
    accuracy = evaluate_accuracy(
        model, tokenizer, held_out, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, task=args.task
    )
    rows.append((f"reasoning-gym {args.task} (seed {args.seed})", f"{accuracy:.1%}", str(len(held_out))))
    for benchmark in args.benchmarks:
        result = score_benchmark(model, tokenizer, benchmark, args)
        if isinstance(result, str):
            print(f"{benchmark}: {result}")
            rows.append((benchmark, result, "0"))
        else:
            rows.append((benchmark, f"{result[0]:.1%}", str(result[1])))

    table = [
        f"# Evaluation of {name}",
        "",
        f"Greedy decoding, max_new_tokens={args.max_new_tokens}.",
        "",
        "| benchmark | accuracy | problems |",
        "|---|---|---|",
        *[f"| {b} | {a} | {n} |" for b, a, n in rows],
        "",
    ]
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        f.write("\n".join(table))
    print("\n".join(table))
    print(f"Wrote {args.output} in {time.time() - start:.0f}s")
    return rows


if __name__ == "__main__":
    args = parse_args()
    if args.model is None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built locally
    main(args)
