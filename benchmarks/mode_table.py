"""One table from step_cost.py's result files: per (model, C, device, checkpointing), GRPO : two passes : one_backward
for the update's time and peak memory, the figures the default-mode rule is chosen from.

    python benchmarks/mode_table.py results/gpu/step_cost_gpu_*.json --out results/step_cost_modes.md

Every ratio is to GRPO's loss pass (forward+backward) under the same checkpointing setting, taken from the same run;
``one_backward`` is also given against GRPO checkpointed when it runs without (what turning checkpointing off for it
costs). Rows whose measurement failed (out of memory) say so.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from harness import fmt, md_table

NAN = float("nan")


def _t(row, key):
    return row["times"].get(key, NAN)


def _m(row, key):
    v = (row.get("memory") or {}).get(key) or {}
    return v.get("peak_bytes", NAN)


def _ratio(a, b):
    return a / b if a == a and b == b and b else NAN


def _failed(row, key):
    return any(s.startswith(key + ":") and "out of memory" in s for s in row.get("skipped", []))


def mode_rows(result: dict) -> list[list[str]]:
    """Table rows of one step_cost result: one per configuration and checkpointing setting measured."""
    m = result["machine"]
    where = f"{m['device']}, {m['date'][:16].replace('T', ' ')} UTC"
    out = []
    for row in result["rows"]:
        two = "update_group" if any(k.startswith("update_group") for k in row["times"]) else "update"
        for ckpt in ("", "_ckpt"):
            g, tp, ob = "fwdbwd" + ckpt, two + ckpt, "update_one_backward" + ckpt
            if g not in row["times"] and not _failed(row, g):
                continue

            def cell(value, key, base_ok=True):
                return "OOM" if _failed(row, key) else ("n/a" if not base_ok else fmt(value))

            g_oom = _failed(row, g)
            ob_vs_ckpt = ""
            if not ckpt and "fwdbwd_ckpt" in row["times"]:
                ob_vs_ckpt = (f"{fmt(_ratio(_t(row, ob), _t(row, 'fwdbwd_ckpt')))} / "
                              f"{fmt(_ratio(_m(row, ob), _m(row, 'fwdbwd_ckpt')))}")
                if _failed(row, ob):
                    ob_vs_ckpt = "OOM"
            out.append([row["size"], row["completion"], row["batch"], where, "on" if ckpt else "off",
                        "OOM" if g_oom else fmt(_t(row, g), ".3f"),
                        "OOM" if g_oom else fmt(_m(row, g) / 2**20, ".0f"),
                        cell(_ratio(_t(row, tp), _t(row, g)), tp, not g_oom),
                        cell(_ratio(_t(row, ob), _t(row, g)), ob, not g_oom),
                        cell(_ratio(_m(row, tp), _m(row, g)), tp, not g_oom),
                        cell(_ratio(_m(row, ob), _m(row, g)), ob, not g_oom), ob_vs_ckpt])
    return out


HEADERS = ["model", "C", "seqs", "device, date", "checkpointing", "GRPO s", "GRPO peak MB", "time two-pass / GRPO",
           "time one_backward / GRPO", "mem two-pass / GRPO", "mem one_backward / GRPO",
           "one_backward without ckpt / GRPO with ckpt (time / mem)"]


def render(results: list[dict]) -> str:
    rows = [r for res in results for r in mode_rows(res)]
    commands = sorted({res.get("command", "?") for res in results})
    return "\n".join(["# Update cost by mode: GRPO : two passes : one_backward", "",
                      "Ratios to GRPO's loss pass (forward+backward of the batch) under the same checkpointing "
                      "setting, from the same run; `OOM`: that measurement ran out of device memory. Two passes = the "
                      "group norms pass then the loss pass; one_backward = `OBLRPOConfig(one_backward=True)`'s update. "
                      "Peak memory: `torch.cuda.max_memory_allocated` above what was allocated before the call "
                      "(CUDA), or the peak RSS of a fresh process (CPU). From: " + "; ".join(f"`{c}`" for c in commands),
                      ""] + md_table(HEADERS, rows) + [""])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    results = [json.loads(f.read_text()) for f in args.files]
    args.out.write_text(render(results))
    print(f"wrote {args.out} ({sum(len(mode_rows(r)) for r in results)} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
