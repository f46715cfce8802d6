"""Which question wording lets SmolLM2-135M-Instruct answer chain_sum as asked? Greedy accuracy per wording.

For each wording, 64 held-out chain_sum problems (two one-digit terms, seed 12345) through the chat template, greedy,
16 new tokens, scored by reasoning-gym's verifier two ways: on the reply's first line (what the demo's reward and
held-out accuracy use: the model must answer with the number) and on the last number in the reply (what the model
"knows", whatever the form). The gap is what RL on the first-line reward can gain by teaching the form.

    python benchmarks/demo_prompts.py          # about 1.5 min on 1 CPU thread
"""

from __future__ import annotations

import argparse
import re
import time

import reasoning_gym as rg
import torch

from oblr_trl.demo import load_reference_model


def expr(e):
    return e["metadata"]["expression"]


WORDINGS = {
    "reasoning-gym's own": lambda e: [{"role": "user", "content": e["question"]}],
    "What is X? Reply with only the number.": lambda e: [
        {"role": "user", "content": f"What is {expr(e)}? Reply with only the number."}],
    "system: calculator; user: X =": lambda e: [
        {"role": "system", "content": "You are a calculator. Reply with only the number, nothing else."},
        {"role": "user", "content": f"{expr(e)} ="}],
    "What is X?": lambda e: [{"role": "user", "content": f"What is {expr(e)}?"}],
    "reasoning-gym's + Reply with only the number.": lambda e: [
        {"role": "user", "content": e["question"] + " Reply with only the number."}],
}


def main(argv=None):
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    torch.set_num_threads(1)
    model, tok = load_reference_model("smollm2")
    model.eval()
    problems = list(rg.create_dataset("chain_sum", size=64, seed=12345, min_terms=2, max_terms=2, min_digits=1,
                                      max_digits=1))
    score = rg.create_dataset("chain_sum", size=1, seed=0).score_answer
    print("| wording | first-line accuracy | last-number accuracy | example replies |\n|---|---|---|---|")
    for name, wording in WORDINGS.items():
        start = time.time()
        inputs = tok.apply_chat_template([wording(e) for e in problems], add_generation_prompt=True, tokenize=True,
                                         return_dict=True, padding=True, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
        texts = tok.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        first = [t.strip().splitlines()[0] if t.strip() else "" for t in texts]
        last = [(re.findall(r"-?\d+", t) or [""])[-1] for t in texts]
        acc_first = sum(score(a, e) for a, e in zip(first, problems)) / len(problems)
        acc_last = sum(score(a, e) for a, e in zip(last, problems)) / len(problems)
        examples = "; ".join(f"{expr(e)} -> {t.strip()[:40]!r}" for e, t in list(zip(problems, texts))[:2])
        print(f"| {name} | {acc_first:.0%} | {acc_last:.0%} | {examples} | ({time.time() - start:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
