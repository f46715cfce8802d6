"""Score a checkpoint on held-out problems and write a markdown table.

* reasoning-gym: greedy accuracy (the share of exact answers: the verifier's full credit) and mean score (the
  verifier's mean score, partial credit included) on `--num_examples` held-out problems of `--task`, scored by the
  task's own verifier on the reply's final number (`oblr_trl.demo.tasks.evaluate_held_out`, the same extraction and
  verifier as the training reward). Problems come from
  `--seed` (default 1; training uses 0 and the tiny model's warm-up 10000, so they are disjoint).
* `--benchmarks gsm8k math500` (optional): greedy accuracy on GSM8K (openai/gsm8k, test) / MATH-500
  (HuggingFaceH4/MATH-500, test) by Hub name, scored with math-verify. Skipped with a message when math-verify is
  not installed or the Hub cannot be reached (e.g. `HF_HUB_OFFLINE=1`).

`--model` is a folder written by `save_model`/`save_pretrained` (a `checkpoint-N` folder too), a PEFT adapter folder
(the adapter is merged into its base model), or a Hub name. Without `--model`: the embedded tiny model as the demo and
`examples/oblrpo.py --model_name_or_path tiny` start from (same task, warm-up seed and steps), i.e. the score before any RL.
When `--model` is a local folder, the results also go to `<model>/eval_results.json` and into its model card
(`README.md`, the OBLR-PO section's "Held-out results"); `--no-update_card` leaves the folder alone.

    python examples/evaluate.py --model outputs/tiny_cpu --output outputs/tiny_cpu/eval.md
    python examples/evaluate.py                      # the embedded tiny model (warmed up, before any RL)
    python examples/evaluate.py --model Qwen3-4B-Base-OBLR-PO-DeepMath --benchmarks gsm8k math500 --max_new_tokens 1024
"""

import argparse
import os
import sys
import time

# name: (Hub dataset, config, split, question column, answer column)
BENCHMARKS = {
    "gsm8k": ("openai/gsm8k", "main", "test", "question", "answer"),
    "math500": ("HuggingFaceH4/MATH-500", None, "test", "problem", "answer"),
}


def make_parser() -> argparse.ArgumentParser:
    # imported here, not at the top: importing oblr_trl imports huggingface_hub, which reads HF_HUB_OFFLINE once
    from oblr_trl.demo.defaults import TINY_TASK, TINY_WARMUP_SEED, TINY_WARMUP_STEPS

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--model", default=None,
        help="Model folder (save_model / save_pretrained / checkpoint-N), PEFT adapter folder, or Hub name. "
        "Default: the embedded tiny model, warmed up as in the demo (the start before RL).",
    )
    parser.add_argument("--task", default=TINY_TASK, help="reasoning-gym task of the held-out problems.")
    parser.add_argument(
        "--prompt_template", default=None,
        help="Question wording, as examples/demo.py's: a str.format template over reasoning-gym's `question` and the "
        "entry's metadata (e.g. 'What is {expression}? Reply with only the number.'), or a task name for "
        "oblr_trl.demo.tasks.PROMPT_TEMPLATES[task]. Default: reasoning-gym's own wording.",
    )
    parser.add_argument("--num_examples", type=int, default=200, help="Held-out reasoning-gym problems.")
    parser.add_argument("--seed", type=int, default=1, help="Seed of the held-out problems (training uses 0).")
    parser.add_argument("--max_new_tokens", type=int, default=8, help="Greedy decoding budget (8 fits chain_sum).")
    parser.add_argument("--batch_size", type=int, default=64, help="Problems decoded together.")
    parser.add_argument(
        "--benchmarks", nargs="*", default=[], choices=sorted(BENCHMARKS), help="Hub math benchmarks (need network)."
    )
    parser.add_argument("--benchmark_limit", type=int, default=None, help="Score only the first N benchmark problems.")
    parser.add_argument("--output", default="eval.md", help="Markdown file the results table is written to.")
    parser.add_argument(
        "--update_card", action=argparse.BooleanOptionalAction, default=True,
        help="With a local --model folder: write eval_results.json there and add the results to its model card.",
    )
    tiny = parser.add_argument_group("embedded tiny model (no --model)")
    tiny.add_argument("--warmup_steps", type=int, default=TINY_WARMUP_STEPS, help="SFT warm-up steps (cached).")
    tiny.add_argument("--warm_seed", type=int, default=TINY_WARMUP_SEED, help="Seed of the SFT warm-up.")
    tiny.add_argument("--cache_dir", default=None, help="Warm-model cache; None: $OBLR_TRL_CACHE or ~/.cache/oblr_trl.")
    return parser


def parse_args(argv=None):
    return make_parser().parse_args(argv)


class ModelNotFound(SystemExit):
    """A one-line error for a --model that holds no model (raised as SystemExit: no traceback)."""

    def __init__(self, message: str):
        super().__init__(f"evaluate.py: error: {message}")


def load_model(path, args=None):
    """(model, tokenizer) and a display name: a model folder, a PEFT adapter folder (merged), a Hub name, or (path
    None) the embedded tiny model built exactly as the demo builds it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oblr_trl.demo.tiny import load_or_build_warm_model

    args = args if args is not None else parse_args([])
    if path is None:
        model = load_or_build_warm_model(
            args.task, cache_dir=args.cache_dir, seed=args.warm_seed, steps=args.warmup_steps
        )
        return model, f"embedded tiny Qwen3 (warmed up {args.warmup_steps} steps, before RL)"
    from oblr_trl.demo.reference_model import REFERENCE_MODELS, resolve_model_path

    if path.lower() in REFERENCE_MODELS or path.lower().startswith("smollm2"):  # e.g. smollm2, offline
        path = resolve_model_path(path)
    if not os.path.exists(path) and (os.path.isabs(path) or path.startswith(".") or path.count("/") > 1):
        raise ModelNotFound(f"{path} does not exist (a local folder was meant: a Hub name is `owner/name`).")
    is_adapter = os.path.isfile(os.path.join(path, "adapter_config.json"))
    if os.path.isdir(path) and not is_adapter and not os.path.isfile(os.path.join(path, "config.json")):
        checkpoints = sorted(p for p in os.listdir(path) if p.startswith("checkpoint-"))
        hint = f" (its checkpoints: {', '.join(checkpoints[-3:])})" if checkpoints else ""
        raise ModelNotFound(
            f"{path} holds no model: no config.json (a saved model) or adapter_config.json (a PEFT adapter){hint}. "
            "Pass the output_dir of a finished run, a checkpoint-N folder, or a Hub name."
        )
    try:
        if is_adapter:
            from peft import AutoPeftModelForCausalLM, PeftConfig

            model = AutoPeftModelForCausalLM.from_pretrained(path, dtype="auto").merge_and_unload()
            has_tokenizer = any(
                os.path.isfile(os.path.join(path, name)) for name in ("tokenizer.json", "tokenizer_config.json")
            )
            tokenizer_source = path if has_tokenizer else PeftConfig.from_pretrained(path).base_model_name_or_path
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
            tokenizer_source = path
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, padding_side="left")
    except OSError as error:  # not a folder and not reachable on the Hub (or offline)
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelNotFound(f"cannot load {path!r}: {first_line}") from None
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

    from oblr_trl.demo.tasks import PROMPT_TEMPLATES, evaluate_held_out, make_dataset

    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # the tiny model is slower with threads on a shared CPU
    start = time.time()
    (model, tokenizer), name = load_model(args.model, args)
    template = PROMPT_TEMPLATES.get(args.prompt_template, args.prompt_template)
    held_out = make_dataset(args.task, size=args.num_examples, seed=args.seed, prompt_template=template)
    scored = evaluate_held_out(
        model, tokenizer, held_out, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, task=args.task
    )
    # the eval_results.json rows (oblr_trl.card's contract): accuracy and problems, or why a benchmark was skipped
    wording = "" if template is None else f", asked as {template!r}"
    results = [{"benchmark": f"reasoning-gym {args.task} (seed {args.seed}{wording})", "accuracy": scored.accuracy,
                "mean_score": scored.mean_score, "problems": len(held_out)}]
    for benchmark in args.benchmarks:
        result = score_benchmark(model, tokenizer, benchmark, args)
        if isinstance(result, str):
            print(f"{benchmark}: {result}")
            results.append({"benchmark": benchmark, "skipped": result})
        else:
            results.append({"benchmark": benchmark, "accuracy": result[0], "problems": result[1]})
    rows = [(r["benchmark"], r["skipped"], "", "0") if "skipped" in r else
            (r["benchmark"], f"{r['accuracy']:.1%}", f"{r['mean_score']:.3f}" if "mean_score" in r else "",
             str(r["problems"])) for r in results]

    decoding = f"greedy, max_new_tokens={args.max_new_tokens}, answer: the reply's final number"
    table = [
        f"# Evaluation of {name}",
        "",
        f"Greedy decoding, max_new_tokens={args.max_new_tokens}. Accuracy: the share of exact answers (reasoning-gym: "
        "the verifier's full credit for the reply's final number, `oblr_trl.demo.tasks.extract_answer`; GSM8K/MATH-500: "
        "math-verify). Mean score: the verifier's mean score, partial credit included.",
        "",
        "| benchmark | accuracy (exact answers) | mean score | problems |",
        "|---|---|---|---|",
        *[f"| {b} | {a} | {m} | {n} |" for b, a, m, n in rows],
        "",
    ]
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        f.write("\n".join(table))
    print("\n".join(table))
    written = [args.output]
    if args.update_card and args.model is not None and os.path.isdir(args.model):
        from oblr_trl.demo.card import has_oblr_section, write_held_out_results

        written.append(write_held_out_results(args.model, {"model": name, "decoding": decoding, "results": results}))
        if has_oblr_section(args.model):
            written.append(os.path.join(args.model, "README.md") + " (its held-out results)")
        else:
            print(f"Note: {args.model} has no model card with an OBLR-PO section (README.md missing, or not written by "
                  "oblr-trl): no card was updated; the results are in eval_results.json.")
    print(f"Wrote {', '.join(written)} in {time.time() - start:.0f}s")
    return rows


if __name__ == "__main__":
    if not any(arg == "--model" or arg.startswith("--model=") for arg in sys.argv[1:]):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the embedded model: everything is built locally
    main(parse_args())
