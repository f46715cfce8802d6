"""The pages speak to users, and quote the results files: every figure a page quotes from a results file is checked
here against that file (or generated from it, `benchmarks/update_readme.py`), the newest measurement of a thing with
its device and date; and no page carries issue numbers or the words of the workshop that made the package."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"


def read(path: Path) -> str:
    """The page's text, wrapped lines joined (a figure may straddle a line break) and glossary links read as their
    words (a term linked at its first use: tests/test_docs_glossary.py)."""
    text = re.sub(r"\[([^\]]*)\]\((?:docs/)?glossary\.md#[\w-]*\)", r"\1", path.read_text())
    return " ".join(text.split())


def span(values, fmt: str = ".1f") -> str:
    low, high = min(values), max(values)
    return f"{low:{fmt}}-{high:{fmt}}"


# ------------------------------------------------------------------------------------------- words for users
# The pages speak of the product to its users: no issue numbers, nor the words of the workshop that made it (who ran
# what, on which borrowed machine, beside which other jobs, with how much time left). History is the CHANGELOG's.
WORKSHOP_WORDS = re.compile(
    r"(?<![A-Za-z])issues?[ _#]*\d+|\bissue's\b|\blent\b|\bthe lead\b|\bsessions?\b|carry=|\btime (was )?left\b"
    r"|\bhad left\b|\bother (jobs?|agents?)\b|\bbusy (2-core |CPU )?(machine|cores)|\bloaded (2-core )?machine\b"
    r"|\bsandbox\b|\bquiet (2-core )?machine\b|\bshared with other\b|\bhelper (sessions?|agents?)\b"
    r"|\bCPU budget\b|\bmore than its budget\b|\bCPU-hours budgeted\b|\bthis \d+-core (machine|CPU)\b|\bnohup\b"
    r"|\(`?GUIDE`?\)|\bafter 0 demo steps\b|^#+ step\d+:|\bshared/paper\b", re.I | re.M)
# A CHANGELOG heading names the change for a user, not the round of work that made it.
HEADING_WORDS = re.compile(r"\bthe house\b|\bown room\b|\bstage \d\b|\b(first|second|third|fourth|fifth) pass\b",
                           re.I)
NOTEBOOKS = ROOT / "notebooks"


def user_pages() -> list[Path]:
    """README.md, the docs' pages (the changelog page aside: it is the CHANGELOG), the benchmarks' study pages and the
    results files they show (their titles and texts are written by the scripts: a word caught here is fixed there),
    and the notebook: its cells' source (`oblrpo_walkthrough.py`) and the notebook as committed, outputs included."""
    return [README, *(p for p in sorted(DOCS.glob("*.md")) if p.name != "changelog.md"),
            *sorted((ROOT / "benchmarks").glob("*.md")), *sorted(RESULTS.glob("*.md")),
            *sorted(NOTEBOOKS.glob("*.ipynb")), *(p for p in sorted(NOTEBOOKS.glob("*.py")) if p.name[0] != "_")]


def notebook_text(path: Path) -> str:
    """A notebook's cells (markdown, code and text outputs) one line per source line, as a reader sees them."""
    lines = []
    for cell in json.loads(path.read_text())["cells"]:
        lines += "".join(cell["source"]).splitlines()
        for out in cell.get("outputs", []):
            lines += "".join(out.get("text", []) or out.get("data", {}).get("text/plain", [])).splitlines()
    return "\n".join(lines)


def workshop_words(path: Path) -> list[str]:
    text = notebook_text(path) if path.suffix == ".ipynb" else path.read_text()
    return [f"{path.relative_to(ROOT)}:{i}: {m.group(0)!r}" for i, line in enumerate(text.splitlines(), 1)
            for m in WORKSHOP_WORDS.finditer(line)]


def test_the_words_test_reads_the_results_files_the_notebook_and_the_study_pages_too():
    pages = user_pages()
    assert RESULTS / "lr_window.md" in pages and ROOT / "benchmarks" / "lr_window.md" in pages
    assert NOTEBOOKS / "oblrpo_walkthrough.ipynb" in pages and NOTEBOOKS / "oblrpo_walkthrough.py" in pages
    assert "OBLRPOTrainer" in notebook_text(NOTEBOOKS / "oblrpo_walkthrough.ipynb")


def test_the_pages_speak_to_users_without_issue_numbers_or_workshop_words():
    found = [hit for path in user_pages() for hit in workshop_words(path)]
    assert found == [], "words for us, not for users (say it for a user, or move the history to CHANGELOG.md):\n" + \
        "\n".join(found)


def test_the_changelog_s_headings_name_changes_not_rounds_of_work():
    headings = [(i, line) for i, line in enumerate((ROOT / "CHANGELOG.md").read_text().splitlines(), 1)
                if line.startswith("#")]
    assert len(headings) >= 3
    found = [f"CHANGELOG.md:{i}: {m.group(0)!r} in {line!r}" for i, line in headings
             for m in [*WORKSHOP_WORDS.finditer(line), *HEADING_WORDS.finditer(line)]]
    assert found == [], "a heading for us, not for users:\n" + "\n".join(found)


@pytest.mark.parametrize("text", ["see issue 58", "Issue 49's rule", "on a lent GPU", 'with carry=[".whl"]',
                                  "the lead measured", "this session had left", "beside other jobs",
                                  "on the 2-core sandbox", "2 busy CPU cores", "they were produced before issue 30",
                                  "blocked by the CPU budget", "more than its budget of 8", "on this 2-core machine",
                                  "OMP_NUM_THREADS=1 nohup nice -n 10 python x.py", "results:cost_counts_before_issue47",
                                  "its meaning and remedy (`GUIDE`)", "## start: smollm2 after 0 demo steps",
                                  "## step15: smollm2 after 15 demo steps", "the note in `shared/paper/estimators.md`"])
def test_the_words_test_catches_workshop_words(text):
    assert WORKSHOP_WORDS.search(text)


@pytest.mark.parametrize("text", ["the demo's helpers", "a 2-core CPU at load average 5", "on this task",
                                  "the issue tracker", "lentils, relentless", "against a budget of 774-824 MB",
                                  "## smollm2, after 15 demo steps", "a 2-core CPU, 1 torch thread"])
def test_the_words_test_leaves_plain_words_alone(text):
    assert not WORKSHOP_WORDS.search(text)


@pytest.mark.parametrize("text", ["### Changed (the house, third pass)", "### Added (prompts per step, stage 1)",
                                  "### Changed (the demo in its own room)"])
def test_the_headings_test_catches_rounds_of_work(text):
    assert HEADING_WORDS.search(text)


# ------------------------------------------------------------------------------------------- the GPU's cost
def gpu_run() -> dict:
    return json.loads((RESULTS / "bench_gpu_nvidia_h100_80gb_hbm3.json").read_text())


def gpu_update_ratios() -> tuple[list[float], list[float], float]:
    """The newest GPU run (an H100, 2026-11-27): the default's update time against GRPO's on every row that ran it
    (the memory-tight row aside: its own figure), on those under checkpointing, and the whole RL step's ratio."""
    run = gpu_run()
    rows = [r for r in run["update"] if r["kind"] != "tight" and "auto" in r["modes"] and "grpo" in r["modes"]]
    ratio = [r["modes"]["auto"]["seconds"] / r["modes"]["grpo"]["seconds"] for r in rows]
    step = run["rl"]["modes"]
    return ratio, [x for x, r in zip(ratio, rows) if r["ckpt"]], step["auto"]["seconds"] / step["grpo"]["seconds"]


def test_the_gpu_cost_is_stated_once_on_performance_and_the_front_pages_link_to_it():
    """The update's ratios come from a run that timed its modes one after another (identical paths 1.20x and 1.82x):
    Performance states them once, beside that drift; the front pages quote only the whole RL step and link there."""
    every, ckpt, step = gpu_update_ratios()
    assert gpu_run()["machine"]["date"].startswith("2026-11-27")
    perf = read(DOCS / "performance.md")
    assert f"{min(every):.2f}x" in perf and f"{max(every):.2f}x" in perf and f"**{step:.2f}x** GRPO's" in perf
    assert "identical paths timed 1.20x and 1.82x" in perf
    # the H100 run is described once: it ran the memory-aware default (its own section says so)
    assert "an H100 run (2026-11-27) with the memory-aware default" in perf and "The memory-aware default" in perf
    assert not re.search(r"H100[^.]*before the memory-aware default", perf)
    for path in [README, DOCS / "evidence.md", DOCS / "index.md"]:
        text = read(path)
        assert f"{step:.2f}x GRPO's time" in text and "H100" in text, path.name
        assert "performance.md" in text, path.name
        for quoted in re.findall(r"\b(\d\.\d+)-(\d\.\d+)x\b", text):  # no range of the update's ratios
            assert not {f"{x:.1f}" for x in every} & set(quoted), f"{path.name}: restates the update's range {quoted}"
    assert "2026-11-27" in read(README) and "2026-11-27" in read(DOCS / "evidence.md")


# ------------------------------------------------------------------------------------------- the counted cost
def counted_summary():
    spec = importlib.util.spec_from_file_location("cost_counts_for_docs", ROOT / "benchmarks" / "cost_counts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    res = json.loads((RESULTS / "cost_counts_full.json").read_text())
    verdicts, whole = [], []
    for r in res["rows"]:
        v, x = r["modes"]["auto_gpu"], module.ratios(r, "auto_gpu")
        verdicts.append(module.verdict(r, "auto_gpu", v["ran"], *x))
        if v["ran"] == f"one_backward/{r['batch']}":
            whole.append((x, verdicts[-1]))
    return verdicts, whole


def test_performance_quotes_the_full_count_as_its_results_file_has_it():
    verdicts, whole = counted_summary()
    text = read(DOCS / "performance.md")
    assert f"meets every target in {verdicts.count('yes')} of {len(verdicts)}" in text
    assert f"{verdicts.count('yes')} of {len(verdicts)} configurations" in read(RESULTS / "cost_counts_full.md") or \
        f"| auto_gpu | {verdicts.count('yes')} of {len(verdicts)} |" in (RESULTS / "cost_counts_full.md").read_text()
    met = sum(v == "yes" for _, v in whole)
    assert f"runs `one_backward` whole in {len(whole)} of them" in text and f"{met} of the {len(whole)} meet" in text
    assert f"{span([x[0] for x, _ in whole], '.2f')}x GRPO's FLOPs" in text
    assert f"{span([x[2] for x, _ in whole], '.2f')}x its operator calls" in text
    missed = [x[1] for x, v in whole if v != "yes"]
    assert f"The other {len(missed)} miss the bytes target" in text
    assert f"{min(missed):.1f}-{max(missed):.1f}x GRPO's peak bytes" in text
    assert "every one within the targets" not in text


# ------------------------------------------------------------------------------------------- the demo
DEMO_PAGES = [README, DOCS / "demos.md", DOCS / "quickstart.md", ROOT / "Makefile", ROOT / "examples" / "demo.py",
              ROOT / "examples" / "recipes" / "README.md", ROOT / "benchmarks" / "demo_seeds.md"]


def demo_seeds() -> list[dict]:
    return json.loads((RESULTS / "demo_seeds_smollm2.json").read_text())["runs"]


def test_make_demo_s_time_is_the_newest_measurement_everywhere():
    demos = read(DOCS / "demos.md")
    assert "`make demo` from a fresh checkout took **11.8 min**" in demos and "2026-11-27" in demos
    for path in [README, DOCS / "quickstart.md", ROOT / "Makefile", ROOT / "examples" / "demo.py",
                 ROOT / "benchmarks" / "demo_seeds.md"]:
        text = read(path)
        assert "11.8 min" in text and "2026-11-27" in text, path.name
        assert not re.search(r"(about|~) ?10 min|12\.5 min", text), f"{path.name}: an older estimate of make demo's time"


def test_each_figure_of_the_demo_is_the_same_on_every_page():
    """The demo's seconds per step, peak memory, accuracy and zero steps: stated once (The demos) or generated (the
    seeds' table), and every other page either quotes that figure or links to it."""
    runs = demo_seeds()
    table_span = f"{min(r['seconds_per_step'] for r in runs):.0f}-{max(r['seconds_per_step'] for r in runs):.0f}"
    profiled = "22-40"  # The demos, "Time and memory": the profiled run's RL steps
    demos = read(DOCS / "demos.md")
    assert f"({profiled} s a step)" in demos and f"({table_span} s per step)" in demos
    assert "maximum RSS 10.0 GB" in demos
    # the notebook's peak: its builder's docstring, where the run that made the committed outputs is described
    notebook_peak = float(re.search(r"(\d+\.\d) GB peak", read(NOTEBOOKS / "_build_walkthrough.py")).group(1))
    for path in DEMO_PAGES:
        text = read(path)
        for low, high in re.findall(r"\b(\d+)-(\d+) s (?:a|per) step\b", text):
            assert f"{low}-{high}" in (profiled, table_span), f"{path.name}: {low}-{high} s a step"
        assert not re.search(r"\b\d+ s (?:a|per) step\b", text.replace(profiled, "").replace(table_span, "")), \
            f"{path.name}: a single s/step figure of its own"
        for gb in re.findall(r"(?:peak|RSS|memory)[^.]{0,40}?~?\b(\d+(?:\.\d)?) GB|(\d+(?:\.\d)?) GB (?:of memory )?(?:at its )?peak",
                             text):
            value = float(next(g for g in gb if g))
            assert value in (10.0, notebook_peak), f"{path.name}: the demo's peak memory as {value} GB"
    # accuracy: the seeds' greedy results, and no other "before -> after" of make demo
    after = sorted(round(100 * r["accuracy_after"]) for r in runs)
    assert f"from 50% to {after[0]}-{after[-1]}% greedy" in read(README)
    assert "to " + " / ".join(f"{a}%" for a in sorted(round(100 * r["accuracy_after"]) for r in runs)) in demos
    assert not re.search(r"50% → \d+%", demos)
    # steps at lr scale 0 under make demo's setting
    zero = [r["steps_with_lr_scale_0"] for r in runs]
    assert bool(re.search(r"\bno step (?:ran )?at lr scale 0", demos, re.I)) == (sum(zero) == 0)
    assert "run B above, seed 0: lr scale 0 on 3 of its 15 steps" in read(ROOT / "benchmarks" / "demo_seeds.md")


def test_the_lr_scale_means_on_logged_metrics_are_the_demo_seeds():
    row = next(line for line in (DOCS / "metrics.md").read_text().splitlines()
               if line.startswith("| `oblr/lr_scale_mean` |"))
    for name in ("demo_seeds_smollm2", "demo_seeds"):
        runs = json.loads((RESULTS / f"{name}.json").read_text())["runs"]
        assert span([r["mean_lr_scale"] for r in runs], ".2f") in row, name
    snr = [r["mean_snr"] for r in json.loads((RESULTS / "demo_seeds_smollm2.json").read_text())["runs"]]
    assert f"{min(snr):.2f}-{max(snr):.2f}" in (DOCS / "metrics.md").read_text()


# ------------------------------------------------------------------------------------------- the paper on Home
def test_home_summarises_the_paper_with_its_authors_link_and_our_verdict():
    from oblr_trl.card import PAPER

    home = read(DOCS / "index.md")
    authors = re.search(r"author\s*=\s*\{([^}]*)\}", PAPER["citation"]).group(1).split(" and ")
    assert "## The paper" in (DOCS / "index.md").read_text()
    assert ", ".join(authors[:-1]) + " and " + authors[-1] in home
    assert "https://arxiv.org/abs/2511.23310" in home and "**The claim.**" in home
    verdict = re.search(r"\*\*Our verdict\.\*\*(.*?)(?: - |\n|## )", home + "\n").group(1)
    assert "beat GRPO at its best learning rate" in verdict and "8 prompts" in verdict
    assert "beat GRPO at its best" in read(DOCS / "evidence.md")  # the same verdict as Evidence's


# ------------------------------------------------------------------------------------------- stated once, linked
def outside_blocks(text: str) -> str:
    return re.sub(r"(?s)<!-- (results|generated):[\w.-]+:begin -->.*?<!-- \1:[\w.-]+:end -->", "", text)


def test_the_snr_factor_s_figures_are_stated_once_in_choosing_the_learning_rate():
    """The factor f at N prompts per step, and how far the step moves between two N, are measured in one table
    (How it works, "Choosing the learning rate"); Evidence links there and restates none of them."""
    evidence = " ".join(line for line in outside_blocks((DOCS / "evidence.md").read_text()).splitlines()
                        if not line.startswith("!["))  # an image's alt text: a lr, not a factor
    assert "how-it-works.md#choosing-the-learning-rate" in evidence
    for sentence in re.split(r"(?<=\.) ", evidence):
        if re.search(r"\bfactor\b", sentence):
            assert not re.search(r"\b0\.\d+\b|\b\d(?:\.\d)?(?:-\d(?:\.\d)?)?x (?:larger|smaller)\b", sentence), sentence


def test_home_and_evidence_agree_on_the_baseline_s_variance():
    home, evidence = read(DOCS / "index.md"), read(DOCS / "evidence.md")
    assert "does not measurably beat RLOO" in evidence
    assert "lower-variance" not in home and "ties RLOO's" in home


# ------------------------------------------------------------------------------------------- the CPU quick run
def test_the_cpu_quick_runs_figures_are_its_results_files():
    """Performance and the step-cost study quote the quick run's headline as `results/step_cost.json` has it."""
    run = json.loads((RESULTS / "step_cost.json").read_text())
    headline, date = run["headline"], run["machine"]["date"][:10]

    def x(key: str) -> str:
        return f"{headline[key]:.2f}x"

    perf = read(DOCS / "performance.md")
    assert f"`make bench` (`benchmarks/step_cost.py --quick --threads 1`), {date}" in perf
    assert (f"**The whole RL step: {x('step_default_vs_grpo')} GRPO's time at {x('step_peak_mem_default_vs_grpo')} "
            "its peak RSS.**") in perf
    assert (f"exact norms pass costs {x('norms_vs_fwdbwd')} a forward+backward, the update alone "
            f"{x('update_vs_grpo')}; two passes cost {x('step_two_pass_vs_grpo')} the step") in perf
    study = read(ROOT / "benchmarks" / "step_cost.md")
    assert f"--quick --threads 1`, {date}" in study
    for figure in (f"norms pass costs {x('norms_vs_fwdbwd')} a forward+backward",
                   f"is {x('norms_vs_loop')} faster than the per-sequence loop",
                   f"the update costs {x('update_one_backward_vs_grpo')} GRPO's loss pass with `one_backward` "
                   f"(two passes {x('update_two_pass_vs_grpo')})",
                   f"at {x('peak_mem_one_backward_vs_grpo')} its peak memory without checkpointing and "
                   f"{x('peak_mem_one_backward_ckpt_vs_grpo_ckpt')} with both checkpointed",
                   f"default mode costs {x('step_default_vs_grpo')} GRPO's at {x('step_peak_mem_default_vs_grpo')}",
                   f"`one_backward=True` {x('step_one_backward_vs_grpo')}, two passes {x('step_two_pass_vs_grpo')}"):
        assert figure in study, figure
