"""The PEFT sweep: every tuner type PEFT registers, LoRA on MoE expert banks and on quantized bases, on tiny models.

Each case is exact against per-row autograd, refused by name, or not applicable to a causal LM trained by
GRPOTrainer (with the reason), never silently wrong; the cases and their verdicts are ``studies/peft_sweep.py``'s.
Writes ``benchmarks/results/peft_sweep.{md,json}`` (the Supported models page shows the table);
``tests/grad_norms/test_peft_sweep.py`` runs the sweep and checks the committed table against it.

    python benchmarks/peft_sweep.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from studies.peft_sweep import document, moe_sweep, quantized_sweep, sweep, to_json

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"  # tests/fingerprint.py, the bit-for-bit model state the verdicts compare


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "results" / "peft_sweep"),
                        help="the results' path, without its suffix (.md and .json are written)")
    args = parser.parse_args(argv)
    path = os.environ.get("PYTHONPATH", "")
    if importlib.util.find_spec("fingerprint") is None and str(TESTS) not in path.split(os.pathsep):
        # tests/ is not on the path (it is under pytest): run again with it there, as arch_sweep.py runs its rows
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), path) if p)}
        return subprocess.run([sys.executable, __file__, *(sys.argv[1:] if argv is None else argv)], env=env).returncode
    results, moe, quantized = sweep(), moe_sweep(), quantized_sweep()
    with open(args.out + ".json", "w") as f:
        json.dump(to_json(results, moe, quantized), f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(document(results, moe, quantized))
    print(document(results, moe, quantized))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
