"""Every causal-LM class transformers can build tiny from its config class: exact, refused (by name), or neither.

For each ``model_type`` of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: its config class with small sizes
(the zoo's overrides where ``studies/zoo.py`` has the family, else hidden 32, 2 layers, vocabulary 48
set on whichever of the usual attribute names the config has), random weights, float32, eval mode. Then
``validate(model)`` (the static check and the probe) and, if it accepts, the per-sequence squared norms of a padded
batch of 4 against one ``torch.autograd.grad`` per row. Each architecture runs in its own process with a time limit,
so one that crashes or hangs is recorded, not fatal; finished rows are kept in the JSON and never run again.

Statuses: ``exact`` (max relative error < 1e-4), ``refused`` (``UnsupportedModulesError`` naming the module; the
first reason is shown), ``WRONG`` (accepted and off: the bug this table exists to catch), ``error`` (our code raised
something else), ``not built`` (the tiny config does not build or run here: a limit of this sweep, not a verdict).

    python benchmarks/arch_sweep.py                 # all, resumable; then python benchmarks/update_readme.py
    python benchmarks/arch_sweep.py --only mamba2 nemotron_h
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"  # the brute-force oracles (reference.py), for the child processes
OUT = HERE / "results" / "arch_sweep"
TINY = dict(vocab_size=48, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, pad_token_id=0, max_position_embeddings=64, head_dim=8, n_embd=32, n_layer=2,
            n_head=4, num_layers=2, d_model=32, num_heads=4)
MAX_PARAMS = 5_000_000
MEMORY_LIMIT = 6 << 30  # address space of one architecture's process: one that wants more is stopped, not the machine


def _limit_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def _shrink(config) -> None:
    for target in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        for key, value in TINY.items():
            if getattr(target, key, None) is not None:
                try:
                    setattr(target, key, value)
                except Exception:  # a read-only or derived attribute
                    pass


def build(model_type: str):
    import torch
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from studies import zoo

    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    for family, (config_name, zoo_model, _) in zoo.FAMILIES.items():
        if zoo_model == model_cls:
            return zoo.build(family), family
    config = getattr(transformers, CONFIG_MAPPING_NAMES[model_type])()
    _shrink(config)
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config).float().eval(), None


def one(model_type: str) -> dict:
    """The row of one architecture (run in a child process, with the tests' brute-force oracles, tests/reference.py,
    on its PYTHONPATH)."""
    import torch
    from reference import padded_batch, per_sample_sq_norms

    from oblr_trl import per_sequence_grad_sq_norms, validate
    from oblr_trl.grad_norms import UnsupportedModulesError

    torch.set_num_threads(1)
    row = {"model_type": model_type}
    try:
        model, family = build(model_type)
        row["class"], row["zoo"] = type(model).__name__, family
        row["params"] = sum(p.numel() for p in model.parameters())
        if row["params"] > MAX_PARAMS:
            return {**row, "status": "not built", "detail": f"tiny config still has {row['params']:,} parameters"}
        vocab = model.get_input_embeddings().num_embeddings
        ids, attention, mask = padded_batch(min(vocab, 48), batch=4)
        reference = per_sample_sq_norms(model, ids, attention, mask)
    except Exception as error:
        return {**row, "status": "not built", "detail": f"{type(error).__name__}: {error}"[:300]}
    try:
        validate(model)
        ours = per_sequence_grad_sq_norms(model, ids, attention, mask)
    except UnsupportedModulesError as error:
        first = error.modules[0]
        return {**row, "status": "refused", "detail": f"{first}"[:300], "refused_modules": len(error.modules)}
    except Exception as error:
        return {**row, "status": "error", "detail": f"{type(error).__name__}: {error}"[:300]}
    err = float(((ours.double() - reference).abs() / reference.clamp_min(1e-12)).max())
    return {**row, "status": "exact" if err < 1e-4 else "WRONG", "max_rel_error": err}


def table(rows: list[dict], header: str) -> str:
    order = {"WRONG": 0, "error": 1, "refused": 2, "exact": 3, "not built": 4}
    counts = {s: sum(r["status"] == s for r in rows) for s in order}
    lines = [header, "", "Counts: " + ", ".join(f"{s} {n}" for s, n in counts.items()) + f" (of {len(rows)}).", "",
             "| model_type | class | status | detail |", "|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (order[r["status"]], r["model_type"])):
        detail = (f"max rel. error {r['max_rel_error']:.1e}" if "max_rel_error" in r else r.get("detail", ""))
        detail = detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r['model_type']} | {r.get('class', '')} | {r['status']} | {detail} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="these model types (default: all)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=int, default=300, help="seconds per architecture")
    parser.add_argument("--fresh", action="store_true", help="run every row again")
    args = parser.parse_args(argv)
    if args.one:
        print("ROW " + json.dumps(one(args.one)), flush=True)
        return 0
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = OUT.with_suffix(".json")
    rows = {} if args.fresh or not path.exists() else {r["model_type"]: r for r in json.loads(path.read_text())}
    todo = [k for k in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) if (not args.only or k in args.only)]
    start = time.time()
    for i, key in enumerate(todo):
        if key in rows and not args.only:
            continue
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore",
               "PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)}
        try:
            done = subprocess.run([sys.executable, __file__, "--one", key], capture_output=True, text=True,
                                  timeout=args.timeout, env=env, preexec_fn=_limit_memory)
            found = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
            row = json.loads(found[-1]) if found else {
                "model_type": key, "status": "not built",
                "detail": f"the process ended with code {done.returncode}: {done.stderr.strip()[-200:]}"}
        except subprocess.TimeoutExpired:
            row = {"model_type": key, "status": "not built", "detail": f"over {args.timeout} s on this machine"}
        rows[key] = row
        print(f"[{i + 1}/{len(todo)}] {key}: {row['status']} {row.get('detail', row.get('max_rel_error', ''))}"[:200],
              flush=True)
        path.write_text(json.dumps(sorted(rows.values(), key=lambda r: r["model_type"]), indent=1))
    header = (f"# Every causal-LM architecture of transformers {transformers.__version__}, tiny and random\n\n"
              f"Generated by `python benchmarks/arch_sweep.py` ({time.strftime('%Y-%m-%d', time.gmtime())}; "
              f"{time.time() - start:.0f} s for the rows run this time). Each model type's config class with small "
              "sizes, a padded batch of 4: `validate` (static check and probe), then the per-sequence squared norms "
              "against one autograd.grad per row, float32. `not built`: the tiny config did not build or run here "
              "(a limit of this sweep, not a verdict on the family).")
    OUT.with_suffix(".md").write_text(table(list(rows.values()), header))
    print(f"Wrote {OUT.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
