"""The ablation's design: its arms, their lrs, its contrasts and the lr window's grid, and where a cell's runs live
(``benchmarks/ablation.py`` runs it; ``benchmarks/lr_window.py`` tabulates the window from the same records)."""

from __future__ import annotations

import argparse
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2]

# The ablation's SNR arms ran with learning_rate = eta_max (the paper's reading): pinned, so they mean what they meant.
ETA_MAX = ["--snr_lr_mode", "eta_max"]
CALIBRATED = "OBLR-PO-calibrated"
# arm -> (examples/demo.py flags, whether its lr is eta_max, --eta_multiple x L: OBLR-PO's SNR step, paper's reading)
ARMS: dict[str, tuple[list[str], bool]] = {
    "GRPO": (["--trainer", "grpo", "--micro_batch", "16"], False),
    "RLOO": (["--baseline", "mean", "--snr_lr", "false", "--micro_batch", "16"], False),
    "baseline-only": (["--snr_lr", "false"], False),
    "SNR-only": (["--baseline", "mean", "--leave_one_out", "false", "--scale_rewards", "group", *ETA_MAX], True),
    "OBLR-PO": (ETA_MAX, True),
    "OBLR-PO-per_step": (["--snr_estimator", "per_step", *ETA_MAX], True),
    # learning_rate as GRPO's (snr_lr_mode="calibrated", the default since the ablation ran): lrs on GRPO's grid
    CALIBRATED: (["--snr_lr_mode", "calibrated"], False),
}
SNR_ARMS = [arm for arm, (_, snr) in ARMS.items() if snr]  # lr = eta_max
ABLATION_ARMS = [arm for arm in ARMS if arm != CALIBRATED]  # the ablation's own (the calibrated arm: the lr window)
REFERENCE = "GRPO"
# The task variant: chain_sum sums of two numbers of one or two digits. The demo's one-digit sums start at 50% greedy
# and reach ~70% within 15 steps (benchmarks/results/demo_seeds_smollm2.md): no headroom over 40 steps. This one
# starts at 22% greedy, 3% sampled on 100 problems (measured 2026-11-24), and a reply "37 + 58 = 95" needs ~10
# tokens, hence 12. Its one-digit sums (a quarter of the problems) give a first reward to learn the reply's form from.
TASK_ARGS = ["--task_config", '{"max_digits": 2}', "--max_completion_length", "12"]
# label -> summary key (<key>_before / <key>_after): the runs' own 100 problems (greedy; 4 samples at T=1), and the
# large unseen set of large_eval.py (greedy), the one the power is sized on
METRICS = {"greedy": "accuracy", "sampled": "sampled_accuracy", "large": "large_accuracy"}
TITLES = {"greedy": "greedy (100)", "sampled": "sampled (100)", "large": "greedy (large set)"}
PRIMARY = "large"
RECORDS = BENCHMARKS / "results" / "ablation_runs"
LONG_TAG = "_long"  # the folder and record suffix of a long run's cell
POWER_SEEDS_WHY = ("added on 2026-11-27 because, with seeds 0-4 in, SNR-only vs GRPO and OBLR-PO vs GRPO were the "
                   "contrasts short of 80% power to detect 5 points, at 6 seeds needed at their observed spread; the "
                   "rule looked at the spread only, and the added seed is reported whatever it shows")
HISTORY_KEYS = ("step", "reward", "oblr/lr_scale", "oblr/snr", "oblr/lr", "learning_rate", "oblr/snr_factor", "oblr/lr_mean",
                "oblr/eta_max")
# (what it measures, arm, minus arm): every arm against GRPO, then each ingredient alone, the rest held fixed
CONTRASTS = [
    ("RLOO vs GRPO", "RLOO", "GRPO"),
    ("baseline-only vs GRPO", "baseline-only", "GRPO"),
    ("SNR-only vs GRPO", "SNR-only", "GRPO"),
    ("OBLR-PO vs GRPO", "OBLR-PO", "GRPO"),
    ("OBLR-PO-per_step vs GRPO", "OBLR-PO-per_step", "GRPO"),
    ("the gradient-weighted baseline (baseline-only - RLOO: same lr, no SNR step)", "baseline-only", "RLOO"),
    ("the SNR step on GRPO's advantages (SNR-only - GRPO)", "SNR-only", "GRPO"),
    ("the SNR step on OBLR-PO's baseline (OBLR-PO - baseline-only)", "OBLR-PO", "baseline-only"),
    ("the paper's per-step SNR instead of ema_soft (OBLR-PO-per_step - OBLR-PO)", "OBLR-PO-per_step", "OBLR-PO"),
]
POWER_GOAL = 0.8  # a contrast is "powered" when its paired t-test would detect delta points this often
BASELINE_CONTRAST = CONTRASTS[5][0]  # the gradient-weighted baseline against RLOO's, same lr, no SNR step
INGREDIENTS = [name for name, _, _ in CONTRASTS[5:]]  # each half alone, the rest held fixed


# The lr window (issue 49): each arm's held-out accuracy after --window_steps steps over a grid of lrs ~3x apart, as
# multiples of its lr in the design (L, or eta_max for an SNR arm), from "learns too slowly" to "collapses". The
# grid holds the cells that exist: L/3, 10 L/3 and 10 L of the lr check and stability window, 0.3 eta_max of the eta
# check; a 40-step run at a constant lr (or under the SNR step, which looks only at past steps) is a 20-step run
# evaluated at step 20, so those runs serve. Opt-in (--window_seeds) so that the ablation's own tables are unchanged.
WINDOW_ARMS = ["GRPO", "RLOO", "OBLR-PO"]
WINDOW_MULTIPLES = [0.1, 1 / 3, 1.0, 10 / 3, 10.0, 100 / 3]  # of L, for the arms without an SNR step
WINDOW_ETA_MULTIPLES = [0.1, 0.3, 1.0, 10 / 3, 10.0, 100 / 3]  # of eta_max, for the SNR arms


# GRPO's lr against the calibrated arm's: the grid's 3.33x step between L and 10 L/3 cannot tell a 2x goal, so when the
# window holds the calibrated arm, it and GRPO also run their geometric midpoint (1.83x L).
FINE_MULTIPLE = (10 / 3) ** 0.5


def window_multiples(arm: str, arms: tuple[str, ...] | list[str] = ()) -> list[float]:
    """The lr window's multiples of an arm's lr (``WINDOW_ETA_MULTIPLES`` for an SNR arm), with ``FINE_MULTIPLE``
    for GRPO and the calibrated arm when `arms` (the window's) hold the calibrated arm."""
    grid = WINDOW_ETA_MULTIPLES if ARMS[arm][1] else WINDOW_MULTIPLES
    fine = CALIBRATED in arms and arm in (REFERENCE, CALIBRATED)
    return sorted([*grid, FINE_MULTIPLE]) if fine else grid

def lr_of(arm: str, grpo_lr: float, multiple: float = 1.0, *, eta: float) -> float:
    """An arm's lr in a round (GRPO's lr `grpo_lr` = L, the SNR arms' eta_max = `eta` x L), times `multiple`."""
    return float(f"{(eta if ARMS[arm][1] else 1.0) * grpo_lr * multiple:.3g}")

def check_multiples(args, arm: str) -> list[float]:
    """The lr check's multiples of a checked arm's lr: ``--eta_check_multiples`` for an SNR arm (of its eta_max),
    ``--lr_check_multiples`` for the others."""
    return args.eta_check_multiples if ARMS[arm][1] else args.lr_check_multiples

def micro_batch_of(arm: str) -> int | None:
    """The arm's ``--micro_batch`` in ARMS (None: the step's whole batch in one backward)."""
    flags = ARMS[arm][0]
    return int(flags[flags.index("--micro_batch") + 1]) if "--micro_batch" in flags else None

def run_dir_of(root: Path, arm: str, lr: float, seed: int, long: bool = False) -> Path:
    return root / f"{arm}_lr{lr:.3g}{LONG_TAG * long}" / f"seed{seed}"

def parse_cell(folder: str) -> tuple[str, float, bool]:
    """(arm, lr, long) of a cell's folder name (run_dir_of's)."""
    arm, rest = folder.rsplit("_lr", 1)
    return arm, float(rest.removesuffix(LONG_TAG)), rest.endswith(LONG_TAG)


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The runner's options; their defaults are the design (the arms, L, eta_max, the seeds, the checks).
    `description`: the --help text above them (``ablation.py``'s docstring)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", default=ABLATION_ARMS, choices=list(ARMS))
    parser.add_argument("--grpo_lr", type=float, default=1.5e-4,
                        help="GRPO's best lr on this task: the best mean on the large set of the lr check (the "
                             "tables warn when another lr of the check beats it)")
    parser.add_argument("--eta_multiple", type=float, default=20 / 3,
                        help="the SNR arms' eta_max as a multiple of L (20/3: 1e-3, the lr check's pick on every SNR "
                             "arm over 2, the README's earlier advice 'about twice GRPO's lr'); checked by the lr "
                             "check (--eta_check_multiples)")
    parser.add_argument("--earlier_grpo_lr", type=float, nargs="*", default=[5e-4],
                        help="earlier rounds' L, tabulated in their own section (never run again)")
    parser.add_argument("--earlier_eta_multiple", type=float, nargs="*", default=[2.0],
                        help="each earlier round's --eta_multiple, one per --earlier_grpo_lr")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--max_steps", type=int, default=40)
    parser.add_argument("--eval_every", type=int, default=10)
    parser.add_argument("--lr_check_arms", nargs="*", default=[REFERENCE, *SNR_ARMS], choices=list(ARMS),
                        help="arms also run at other multiples of their lr (is L, or eta_max, their best lr here?)")
    parser.add_argument("--lr_check_multiples", type=float, nargs="*", default=[1 / 3, 10 / 3],
                        help="the lr check's multiples of L, for the checked arms without an SNR step")
    parser.add_argument("--eta_check_multiples", type=float, nargs="*", default=[0.3],
                        help="the lr check's multiples of eta_max, for the checked SNR arms (0.3 of 20 L / 3: 2 L = "
                             "3e-4, the README's earlier advice)")
    parser.add_argument("--lr_check_seeds", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--lr_check_first", action="store_true",
                        help="launch the lr check before the ablation's runs (while it decides L)")
    parser.add_argument("--long_arms", nargs="*", default=["OBLR-PO", REFERENCE], choices=list(ARMS),
                        help="arms also run for --long_steps (does the shrinking SNR step stall a long run?)")
    parser.add_argument("--long_steps", type=int, default=120)
    parser.add_argument("--long_seeds", type=int, nargs="*", default=[0])
    parser.add_argument("--long_eval_every", type=int, default=20)
    parser.add_argument("--long_first", action="store_true",
                        help="launch the long runs before the rest (at a session's start, with --finish_by)")
    parser.add_argument("--stability_multiples", type=float, nargs="*", default=[10 / 3, 10.0],
                        help="multiples of each arm's lr (10/3: the earlier round's lrs, whose runs serve)")
    parser.add_argument("--stability_seeds", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--stability_steps", type=int, default=20,
                        help="steps of the stability runs (a collapse shows within them; half the ablation's cost)")
    parser.add_argument("--collapse_pts", type=float, default=10.0)
    parser.add_argument("--power_seeds", type=int, nargs="*", default=[5],
                        help="seeds run beyond --seeds for --power_arms only (full length, at their lr): "
                             + POWER_SEEDS_WHY.replace("%", "%%"))
    parser.add_argument("--power_arms", nargs="*", default=["GRPO", "SNR-only", "OBLR-PO"], choices=list(ARMS),
                        help="the arms of the contrasts that --power_seeds serve")
    parser.add_argument("--window_arms", nargs="*", default=WINDOW_ARMS, choices=list(ARMS),
                        help="arms of the lr window (issue 49; benchmarks/lr_window.py tabulates it)")
    parser.add_argument("--window_seeds", type=int, nargs="*", default=[],
                        help="seeds of the lr window's cells (WINDOW_MULTIPLES of each arm's lr; 0 1 2 to run it; "
                             "none by default, so that the ablation's tables do not list its cells as missing)")
    parser.add_argument("--window_steps", type=int, default=20, help="steps of the lr window's runs")
    parser.add_argument("--first_arms", nargs="*", default=[], choices=list(ARMS),
                        help="arms whose training runs launch before the others' (e.g. the SNR arms' stability "
                             "cells, while a default waits on them); the tables are unchanged")
    parser.add_argument("--first_lrs", type=float, nargs="*", default=[],
                        help="lrs whose training runs launch before the others', in this order (e.g. the lr window's "
                             "most informative cells first); the tables are unchanged")
    parser.add_argument("--no_large_eval", action="store_true",
                        help="train only: a trained run's large evaluation (large_eval.py) is left for a later call "
                             "without this flag (the lr window reads the runs' own 100 problems; the ablation's "
                             "tables list such a cell as missing until then)")
    parser.add_argument("--delta", type=float, default=5.0, help="the difference (points) the power is stated for")
    parser.add_argument("--parallel", type=int, default=2, help="real-model runs at a time on this machine")
    parser.add_argument("--min_free_gb", type=float, default=6.0)
    parser.add_argument("--margin_gb", type=float, default=1.0,
                        help="memory left free beside the expected peaks of the jobs running (PEAK_GB)")
    parser.add_argument("--stop_launching", default=None, help="HH:MM UTC after which no run is launched")
    parser.add_argument("--finish_by", default=None,
                        help="HH:MM UTC by which every run launched should have ended (the machine's session end): a "
                             "training run launches only if expected to end by then (MINUTES_PER_STEP, EVAL_MINUTES); "
                             "shorter runs further down the list may go instead")
    parser.add_argument("--poll_s", type=float, default=30)
    parser.add_argument("--run_dir", type=Path, default=Path("outputs/ablation"))
    parser.add_argument("--out", type=Path, default=BENCHMARKS / "results" / "ablation")
    parser.add_argument("--records", type=Path, default=RECORDS,
                        help="where each finished run's record is kept (committed; the tables are made from these)")
    parser.add_argument("--large_size", type=int, default=500,
                        help="distinct unseen held-out problems of each run's large evaluation (large_eval.py)")
    parser.add_argument("--no_run", action="store_true", help="only record and tabulate the runs that finished")
    parser.add_argument("demo_args", nargs="*", help="extra arguments for examples/demo.py (after --)")
    return parser
