"""What one norms pass costs next to GRPO's forward+backward, this checkout against others, in ONE process.

Each version's ``oblr_trl/grad_norms`` is imported under its own name (this checkout's as ``v_this``; each
``--against`` checkout's by its folder name) and runs on its own copy of the same model (same seed), so the versions
share the process, the machine's load and the hour. Every round runs, in a shuffled order of the versions, GRPO's
forward+backward (TRL's fused head, ``.backward()``), the version's ``per_sequence_grad_sq_norms`` and its
``one_backward`` update (``per_sequence_grads(..., materialize=True)``, the inner products, ``accumulate_grad``); the
ratios are each round's own (a version's call over the forward+backward run just before it), reported as medians with
their quartiles. Timed in process CPU time (one torch thread: what the process itself spent, which a shared machine's
other jobs barely move) and in wall time. Each version's norms are checked equal to this checkout's before timing.

It also times the bookkeeping every pass does before its forward: the model's state key (``plan.state_key``: one
walk of the modules) and ``coverage.check_once`` (the key, the grad mode; the checks only when the key changed).
With ``--memory N``, N rounds of peak memory too: each checkout's own ``step_cost.py --mem-worker`` (peak RSS of one
call in a fresh process, the checkout on ``PYTHONPATH``) for GRPO's forward+backward, the norms pass and the
``one_backward`` update, the checkouts in a shuffled order each round; the ratios are each round's own.
Nothing is asserted.

    python benchmarks/pass_overhead.py --against /path/to/old/checkout --configs tiny:64 small:256 --rounds 16
    python benchmarks/pass_overhead.py --against /path/to/old/checkout --configs small:256 --rounds 0 --memory 3
    python benchmarks/pass_overhead.py --against /path/to/old/checkout --configs small:256 --rounds 8 --spread

``--spread`` times a batch with more padding (completions of 1/8 to 8/8 of the length), as RL batches have; the
memory rounds keep step_cost.py's batch.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", nargs="*", default=[], type=Path, metavar="CHECKOUT",
                        help="other checkouts (their root, holding oblr_trl/grad_norms) to time beside this one")
    parser.add_argument("--configs", nargs="+", default=["tiny:64", "small:256"], metavar="SIZE:LENGTH",
                        help="step_cost.py's model sizes and completion lengths (batch 8, prompts of 32)")
    parser.add_argument("--rounds", type=int, default=16, help="timed rounds after two warm-up calls of each")
    parser.add_argument("--memory", type=int, default=0, metavar="N",
                        help="rounds of peak memory (fresh processes, each checkout's step_cost.py --mem-worker)")
    parser.add_argument("--spread", action="store_true",
                        help="completions of C/8, 2C/8, ..., C tokens (44%% of the completion positions are padding) "
                             "instead of step_cost.py's batch, where three of eight end early (17%%)")
    parser.add_argument("--out", type=Path, default=None, help="a JSON file for every round's times")
    return parser.parse_args(argv)


def load_version(name: str, folder: Path):
    """``folder`` (an ``oblr_trl/grad_norms`` package) imported as the top-level package ``name``: its modules import
    each other relatively, so they stay among themselves."""
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py", submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def quartiles(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return statistics.median(ordered), at(0.25), at(0.75)


def cpu_ms(fn, n: int) -> float:
    start = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - start) / n * 1e3


def bookkeeping(gn, model) -> dict:
    """Per-pass bookkeeping before the forward, in CPU milliseconds (300 calls each): the state key (absent before
    versions that key what they remember on the model's state) and ``coverage.check_once`` (which builds it)."""
    coverage = sys.modules[f"{gn.__name__}.coverage"]
    plan = sys.modules.get(f"{gn.__name__}.model") or sys.modules[f"{gn.__name__}.plan"]  # model.py holds it now
    coverage.check_once(model)
    found = dict(check_once=cpu_ms(lambda: coverage.check_once(model), 300))
    if hasattr(plan, "state_key"):
        found["state_key"] = cpu_ms(lambda: plan.state_key(model, model), 300)
    return found


def calls(gn, spec: str, completion: int, spread: bool = False) -> dict:
    import torch

    from studies.step_cost.calls import completion_logp_sum, load_model, make_batch

    model, _ = load_model(spec, torch.device("cpu"))
    ids, attention, completion_mask = make_batch(model.config.vocab_size, 8, 32, completion, "cpu")
    if spread:  # row r's completion ends after (r + 1) C / 8 tokens
        for row in range(8):
            completion_mask[row, (row + 1) * completion // 8 :] = 0
    scale = torch.linspace(-1.0, 1.0, ids.shape[0])

    def fwdbwd():
        completion_logp_sum(model, ids, attention, completion_mask).backward()
        model.zero_grad(set_to_none=True)

    def norms():
        return gn.per_sequence_grad_sq_norms(model, ids, attention, completion_mask)

    def update_one_backward():
        grads = gn.per_sequence_grads(model, ids, attention, completion_mask, materialize=True)
        grads.inner_products(1)
        grads.accumulate_grad(scale, group_size=8)
        model.zero_grad(set_to_none=True)

    return dict(fns=dict(fwdbwd=fwdbwd, norms=norms, update_one_backward=update_one_backward), model=model)


MEMORY_MODES = ("fwdbwd", "norms", "update_one_backward")


def checkout_peak(checkout: Path, spec: str, completion: int, mode: str) -> float:
    """Peak RSS (bytes) of one call of ``mode`` in a fresh process of ``checkout``'s own memory worker."""
    from studies.step_cost.workers import _subprocess_json

    command = [sys.executable, str(checkout / "benchmarks" / "step_cost.py"), "--mem-worker", spec, str(completion),
               "8", "32", mode, "--threads", "1"]
    found = _subprocess_json(command, env={"PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"},
                             cwd=checkout / "benchmarks")
    if "failed" in found:
        raise RuntimeError(f"{checkout}: the memory worker failed: {found['failed']}")
    return float(found["peak_bytes"])


def memory(checkouts: dict[str, Path], config: str, rounds: int) -> dict:
    """``rounds`` rounds of each checkout's peak RSS per mode, the checkouts shuffled each round; printed as each
    round's ratio over its own forward+backward, median (quartiles)."""
    spec, completion = config.split(":")
    peaks = {name: {mode: [] for mode in MEMORY_MODES} for name in checkouts}
    for r in range(rounds):
        order = list(checkouts)
        random.Random(1000 + r).shuffle(order)
        for name in order:
            for mode in MEMORY_MODES:
                peaks[name][mode].append(checkout_peak(checkouts[name], spec, int(completion), mode))
    print(f"\n{config}: peak RSS, {rounds} rounds of fresh processes")
    for name, by_mode in peaks.items():
        fb = statistics.median(by_mode["fwdbwd"]) / 2**20
        for mode in MEMORY_MODES[1:]:
            med, lo, hi = quartiles([a / b for a, b in zip(by_mode[mode], by_mode["fwdbwd"])])
            print(f"  peak {name:14s} {mode:20s} / fwdbwd: median {med:.3f} (quartiles {lo:.3f}-{hi:.3f}); "
                  f"fwdbwd {fb:.1f} MiB")
    return peaks


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    from harness import machine_info

    torch.set_num_threads(1)
    versions = {"v_this": HERE.parent / "oblr_trl" / "grad_norms"}
    versions.update({f"v_{p.resolve().name}".replace("-", "_").replace(".", "_"): p / "oblr_trl" / "grad_norms"
                     for p in args.against})
    modules = {name: load_version(name, folder) for name, folder in versions.items()}
    record = dict(machine=machine_info(1), versions={k: str(v) for k, v in versions.items()}, configs={})
    print(f"versions: {record['versions']}\nload average at start: {os.getloadavg()[0]:.2f}", flush=True)
    for config in (args.configs if args.rounds else []):  # --rounds 0: memory only
        spec, completion = config.split(":")
        runs = {name: calls(gn, spec, int(completion), args.spread) for name, gn in modules.items()}
        for run in runs.values():
            for fn in run["fns"].values():
                fn(), fn()
        reference = runs["v_this"]["fns"]["norms"]()
        for name, run in runs.items():
            got = run["fns"]["norms"]()
            assert torch.allclose(got, reference, rtol=1e-4), (name, got, reference)
        times = {name: {fn: dict(cpu=[], wall=[]) for fn in run["fns"]} for name, run in runs.items()}
        loads = []
        for r in range(args.rounds):
            order = list(runs)
            random.Random(r).shuffle(order)
            loads.append(os.getloadavg()[0])
            for name in order:
                for fn_name, fn in runs[name]["fns"].items():
                    wall, cpu = time.perf_counter(), time.process_time()
                    fn()
                    times[name][fn_name]["cpu"].append(time.process_time() - cpu)
                    times[name][fn_name]["wall"].append(time.perf_counter() - wall)
        books = {name: bookkeeping(modules[name], run["model"]) for name, run in runs.items()}
        record["configs"][config] = dict(times=times, load=loads, bookkeeping_ms=books)
        print(f"\n{config}: {args.rounds} rounds, load average {min(loads):.2f}-{max(loads):.2f} "
              f"(median {statistics.median(loads):.2f})")
        for clock in ("cpu", "wall"):
            for name in runs:
                t = times[name]
                fb = statistics.median(t["fwdbwd"][clock]) * 1e3
                for fn_name in ("norms", "update_one_backward"):
                    ratios = [a / b for a, b in zip(t[fn_name][clock], t["fwdbwd"][clock])]
                    med, lo, hi = quartiles(ratios)
                    print(f"  {clock:4s} {name:14s} {fn_name:20s} / fwdbwd: median {med:.3f} (quartiles {lo:.3f}-"
                          f"{hi:.3f}); fwdbwd {fb:.1f} ms")
        for name, book in books.items():
            print(f"  bookkeeping {name:14s} " + ", ".join(f"{k} {v:.3f} ms" for k, v in book.items()))
    if args.memory:
        checkouts = {"v_this": HERE.parent, **{name: folder.parent.parent for name, folder in versions.items()
                                               if name != "v_this"}}
        record["memory"] = {config: memory(checkouts, config, args.memory) for config in args.configs}
    if args.out:
        args.out.write_text(json.dumps(record, default=float))


if __name__ == "__main__":
    main()
