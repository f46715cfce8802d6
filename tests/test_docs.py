"""Docs that cannot rot (issue 57): every option, logged metric and warning has its entry in docs/; the README's and the
docs' code blocks run (on the tiny model); the generated tables are current; `make docs` builds strictly; the README
stays short."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
SPEC = importlib.util.spec_from_file_location("docs_generate", DOCS / "generate.py")
generate = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(generate)


def code_blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", path.read_text(), re.S | re.M)


# ------------------------------------------------------------------------------------------- the options
def test_every_option_grpoconfig_lacks_has_help_and_its_row_and_detail_on_the_configuration_page():
    from trl import GRPOConfig

    from oblr_trl import OBLRPOConfig

    own, redeclared = generate.config_fields()
    lacking = {f.name for f in dataclasses.fields(OBLRPOConfig)} - {f.name for f in dataclasses.fields(GRPOConfig)}
    assert {f.name for f in own} == lacking and {"baseline", "snr_lr", "one_backward"} <= lacking
    assert {"learning_rate", "scale_rewards"} <= {f.name for f in redeclared}
    page = generate.render((DOCS / "configuration.md").read_text())
    for f in own + redeclared:
        assert len(generate.field_help(f)) > 20, f.name
        assert f"| [`{f.name}`](#{f.name}) |" in page, f"{f.name}: no row on the Configuration page"
        assert f"### `{f.name}`\n" in page, f"{f.name}: no detail on the Configuration page"  # its slug: the name
        assert generate.escape(generate.field_help(f)) in page


def test_the_config_docstring_describes_the_same_options_the_help_does():
    """The field help is the source of the Configuration page; the class docstring (the API reference) says more about
    some options, and must name the same ones: no option missing there, none left there after it went."""
    from oblr_trl import OBLRPOConfig

    params = OBLRPOConfig.__doc__.split("Parameters:")[1]
    named = set(re.findall(r"^ {8}(\w+) \(`", params, re.M))
    assert named == {f.name for f in generate.config_fields()[0]}


def test_an_option_without_help_fails_the_configuration_page():
    @dataclasses.dataclass
    class Config:
        documented: int = dataclasses.field(default=1, metadata={"help": "An option with its help."})
        silent: int = 2

    documented, silent = dataclasses.fields(Config)
    assert generate.field_help(documented) == "An option with its help."
    with pytest.raises(ValueError, match="silent has no help"):
        generate.option_row(silent)


def test_the_one_line_summary_is_the_first_sentence_cut_where_long():
    assert generate.summary("Steps pooled by X (default 10). Ignored by the others.") == "Steps pooled by X (default 10)"
    long = "What the estimate counts as one sample: " + "a clause, " * 20 + "and more."
    assert generate.summary(long) == "What the estimate counts as one sample"
    assert generate.summary("Cap it at e.g. 10 x its median. Then more.") == "Cap it at e.g. 10 x its median"
    assert generate.escape("w_i = |o_i| * 2 <x> {n}") == r"w\_i = \|o\_i\| \* 2 &lt;x\> \{n\}"


# ------------------------------------------------------------------------------------------- the metrics
def test_the_metric_finder_reads_the_package_s_conventions():
    source = ('def batch_metrics(x):\n    return {"a": 1.0, "b": 2.0}\n'
              'def size():\n    metrics = {"c": 1.0, **other()}\n    metrics["d"] = 2.0\n    return metrics\n'
              'KEYS = ["oblr/e", "not a metric", "oblr/ f"]\n'
              'def text():\n    """See oblr/g in a docstring."""\n    return {"h": 0}\n')
    assert generate.metric_names_in(source) == {"a", "b", "c", "d", "e"}


def test_every_logged_oblr_metric_has_its_row_on_the_metrics_page_and_no_row_is_stale():
    logged, documented = generate.logged_metrics(), generate.documented_metrics()
    assert {"lr_scale", "snr", "lr", "lr_mean", "baseline_mean", "unscorable"} <= logged  # the finder finds them
    assert logged - documented == set(), f"oblr/ metrics without a row in docs/metrics.md: {sorted(logged - documented)}"
    assert documented - logged == set(), f"rows in docs/metrics.md for metrics not logged: {sorted(documented - logged)}"
    rows = [line for line in (DOCS / "metrics.md").read_text().splitlines() if line.startswith("| `oblr/")]
    for row in rows:  # metric | what it is | what a healthy run shows: both filled
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert len(cells) == 3 and all(len(c) > 20 for c in cells[1:]), row


@pytest.mark.slow
def test_the_metric_finder_finds_every_metric_a_training_run_logs():
    """The finder's conventions checked against what the trainer really logs: two steps on the tiny model."""
    from helpers import common_args, train

    from oblr_trl import OBLRPOConfig, OBLRPOTrainer

    trainer, _ = train(OBLRPOTrainer, OBLRPOConfig(**common_args(weight_clip=10.0)))
    keys = {k.removeprefix("oblr/") for h in trainer.state.log_history for k in h if k.startswith("oblr/")}
    assert {"lr_scale", "snr", "baseline_mean"} <= keys
    assert keys <= generate.logged_metrics(), f"logged but not found in the code: {sorted(keys - generate.logged_metrics())}"


# ------------------------------------------------------------------------------------------- the warnings
def test_every_warning_of_advice_has_its_meaning_remedy_and_troubleshooting_entry():
    from oblr_trl.advice import GUIDE, WARNINGS

    assert set(GUIDE) == set(WARNINGS), f"warnings without a GUIDE entry: {sorted(set(WARNINGS) - set(GUIDE))}"
    page = generate.render((DOCS / "troubleshooting.md").read_text())
    for key in WARNINGS:
        assert len(GUIDE[key].meaning) > 40 and len(GUIDE[key].remedy) > 20, key
        assert f"### `{key}`\n" in page, f"{key}: no Troubleshooting entry"  # its slug, on the site and GitHub: the key
        assert generate.escape(generate.warning_text(WARNINGS[key])) in page


def test_a_new_warning_without_its_guide_fails_the_troubleshooting_page(monkeypatch):
    from oblr_trl import advice

    monkeypatch.setitem(advice.WARNINGS, "brand_new", "Something new happened: {n} times.")
    with pytest.raises(ValueError, match="brand_new"):
        generate.troubleshooting()
    monkeypatch.setitem(advice.GUIDE, "brand_new", advice.Guide("It means this, at length enough.", "Do that."))
    assert "> Something new happened: \\{n\\} times." in generate.troubleshooting()


def test_the_pages_carry_their_generated_parts_committed_and_current():
    """The generated parts are in the committed pages (the repository's web view shows them whole), and equal to
    what the code generates now: a new option, warning or CHANGELOG entry fails here until
    `python docs/generate.py` (or `make docs`) rewrites them."""
    for page, name in [("configuration.md", "config"), ("troubleshooting.md", "warnings"), ("changelog.md", "changelog")]:
        text = (DOCS / page).read_text()
        assert f"<!-- generated:{name}:begin -->" in text and f"<!-- generated:{name}:end -->" in text, page
        assert len(text.split(f"<!-- generated:{name}:begin -->")[1].split("<!-- generated")[0]) > 500, page
    assert generate.stale_pages() == [], "stale generated parts: run python docs/generate.py (or make docs)"


def test_a_stale_or_unknown_generated_part_is_found(tmp_path, monkeypatch):
    page = "# T\n\n<!-- generated:changelog:begin -->\nold text\n<!-- generated:changelog:end -->\n\nafter\n"
    rendered = generate.render(page)
    assert "old text" not in rendered and "## [Unreleased]" in rendered and rendered.endswith("\n\nafter\n")
    assert generate.render(rendered) == rendered  # idempotent
    for name in generate.PAGES:
        (tmp_path / name).write_text(generate.render((DOCS / name).read_text()))
    assert generate.stale_pages(tmp_path) == []
    (tmp_path / "changelog.md").write_text(page)
    assert generate.stale_pages(tmp_path) == ["changelog.md"]
    with pytest.raises(ValueError, match="unknown docs block"):
        generate.render("<!-- generated:nothing:begin -->\n<!-- generated:nothing:end -->")


def markdown_pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]


def page_headings(text: str) -> list[str]:
    """The text of each Markdown heading outside fenced code."""
    found, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            found.append(line.split(" ", 1)[1].strip())
    return found


def github_slug(heading: str) -> str:
    """A heading's anchor on GitHub's web view: its text (code spans and links as their text), lowercased, without
    punctuation but hyphens and underscores, each space a hyphen (runs of hyphens are not collapsed, unlike the
    site's toc, whose strict build checks the site's side)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def github_anchors(text: str) -> set[str]:
    found, seen = set(re.findall(r'<a id="([^"]+)"', text)), {}
    for heading in page_headings(text):
        slug = github_slug(heading)
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def test_no_heading_carries_an_attribute_list():
    """`{#anchor}` after a heading is the site's syntax only: GitHub's web view shows it as text. A heading's anchor
    is its slug (or an `<a id>` line before it), generated parts included."""
    for path in markdown_pages():
        text = generate.render(path.read_text()) if path.parent == DOCS else path.read_text()
        bad = [h for h in page_headings(text) if re.search(r"\{\s*:?\s*[#.]", h)]
        assert bad == [], f"{path.relative_to(ROOT)}: headings with an attribute list {bad}"


def test_every_anchor_a_page_links_to_exists_on_github_s_web_view():
    """Every `page.md#anchor` link between the README, the docs and the study pages finds its heading on GitHub too
    (`make docs` checks the site). The API reference's anchors are mkdocstrings', on the site only."""
    checked, broken = 0, []
    for path in markdown_pages():
        text = path.read_text()
        for match in re.finditer(r"\]\(([^)\s#]*)#([^)\s]+)\)", text):
            target = (path.parent / match.group(1)).resolve() if match.group(1) else path
            if target.suffix != ".md" or target == DOCS / "api.md":
                continue
            checked += 1
            text_of_target = generate.render(target.read_text()) if target.parent == DOCS else target.read_text()
            if match.group(2) not in github_anchors(text_of_target):
                broken.append(f"{path.relative_to(ROOT)}: {match.group(1)}#{match.group(2)}")
    assert broken == [] and checked > 50, broken


@pytest.mark.parametrize("heading,anchor", [
    ("`few_samples`", "few_samples"), ("GRPOConfig options with OBLR-PO's own default",
                                       "grpoconfig-options-with-oblr-pos-own-default"),
    ("A - b", "a---b"), ("See [the table](x.md)", "see-the-table"), ("On an H100", "on-an-h100"),
])
def test_github_slug(heading, anchor):
    assert github_slug(heading) == anchor


def test_figures_resolve_in_the_repository_and_on_the_site():
    """A page links a figure by its path in the repository (../benchmarks/results/NAME.png, which exists); the
    site's build rewrites it to figures/NAME.png, which docs/hooks.py serves."""
    found = []
    for path in [README, *DOCS.glob("*.md"), *(ROOT / "benchmarks").glob("*.md")]:
        for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", path.read_text()):
            found.append(link)
            assert not link.startswith("http") and (path.parent / link).resolve().exists(), f"{path.name}: {link}"
            if path.parent == DOCS:
                assert link.startswith("../benchmarks/results/"), f"{path.name}: {link}"
    assert len(found) >= 3
    assert generate.site_figures("![x](../benchmarks/results/lr_window.png)") == "![x](figures/lr_window.png)"


# ------------------------------------------------------------------------------------------- the generated tables
def test_the_docs_result_blocks_are_the_generated_tables_and_the_support_table_is_on_the_models_page():
    from harness.readme import BLOCK, updated  # benchmarks/ is on the tests' path (setup.cfg's pythonpath)
    found = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        found += [m.group("name") for m in BLOCK.finditer(text)]
        assert updated(text, DOCS) == text, f"{page.name}: a result block differs from its table; run " \
                                             "python benchmarks/update_readme.py"
    assert {"demo_seeds_smollm2", "cost_counts", "step_cost", "bench_gpu_nvidia_h200", "paper_n_when"} <= set(found)
    studies = " ".join(p.read_text() for p in (ROOT / "benchmarks").glob("*.md"))  # what Evidence points to
    assert all(f"<!-- results:{name}:begin -->" in studies for name in ("ablation_when", "when_to_use",
                                                                          "ablation_baseline", "prompts_per_step"))
    update_readme = importlib.util.module_from_spec(
        importlib.util.spec_from_file_location("update_readme", ROOT / "benchmarks" / "update_readme.py"))
    update_readme.__spec__.loader.exec_module(update_readme)
    assert set(DOCS.glob("*.md")) <= set(update_readme.READMES)  # `make bench` & co. rewrite the docs' blocks
    models = (DOCS / "models.md").read_text()
    assert "<!-- support:begin -->" in models and "| Qwen3 | exact |" in models
    import support_table  # benchmarks/support_table.py (benchmarks/ is on the tests' path)

    assert "docs/models.md" in support_table.__doc__
    assert not re.search(r"<!-- (results:\w+|support):begin -->", README.read_text())  # the README holds none now


# ------------------------------------------------------------------------------------------- the code blocks run
def _python_blocks():
    out = []
    for path in [README, DOCS / "quickstart.md", DOCS / "how-it-works.md", DOCS / "models.md"]:
        for i, block in enumerate(code_blocks(path, "python")):
            marks = [pytest.mark.slow] if ".train()" in block else []
            out.append(pytest.param(path.name, block, marks=marks, id=f"{path.name}-{i}"))
    return out


SWAP_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"  # the swap snippet's model: the tests run the tiny model in its place


def swap_snippet(path: Path) -> str:
    return next(b for b in code_blocks(path, "python") if "OBLRPOTrainer(" in b and "trainer.train()" in b)


def test_the_readme_and_the_quick_start_have_the_swap_snippet():
    """The same block in both, with settings a GRPO user would run: at least 8 prompts per step, said in a comment;
    the project's defaults called ours; an expected time on a named GPU."""
    snippet = swap_snippet(README)
    assert swap_snippet(DOCS / "quickstart.md") == snippet
    args = dict(re.findall(r"^\s+(\w+)=([\w.\-]+),", snippet, re.M))
    prompts = int(args["per_device_train_batch_size"]) * int(args["gradient_accumulation_steps"]) \
        // int(args["num_generations"])  # TRL 1.16, one GPU
    assert prompts >= 8 and f"= {prompts} prompts per step" in snippet
    assert "paper defaults" not in snippet and "project defaults" in snippet
    assert re.search(r"H100 80GB: about [\d.-]+ h \(estimated, not measured\)", snippet)


def test_the_swap_snippets_reward_scores_deepmath_s_answer_format():
    """The snippet's own reward function on rows written in `trl-lib/DeepMath-103K`'s format (a conversational
    `prompt`, the final answer as bare LaTeX in `solution`; written here, not downloaded): a right `\\boxed{}` answer
    scores 1 in every form of answer, a wrong one 0, and no row is skipped (None). TRL's `accuracy_reward` given the
    bare solutions does not: math-verify parses `\\dfrac{1}{2}` as nothing and `2\\sqrt{2}` as 2."""
    pytest.importorskip("math_verify")
    from trl.rewards import accuracy_reward

    source = re.search(r"^def math_reward\(.*?\n(?=\S)", swap_snippet(README), re.S | re.M).group(0)
    namespace = {"accuracy_reward": accuracy_reward}
    exec(source, namespace)
    rows = [  # (the row's solution, a right completion, a wrong completion)
        ("0", r"The cube roots differ by about 2/(3x^{2/3}), so the limit is \(\boxed{0}\).", r"\(\boxed{1}\)"),
        (r"\dfrac{1}{2}", r"Hence the probability is $\boxed{\frac{1}{2}}$.", r"$\boxed{\frac{1}{3}}$"),
        (r"2\sqrt{2}", r"The distance is \boxed{2\sqrt{2}}.", r"The distance is \boxed{2}."),
        (r"e^{-2}", r"So the limit equals \boxed{\frac{1}{e^{2}}}.", r"\boxed{e^{2}}"),
        (r"\infty", r"The series diverges: \boxed{\infty}", r"\boxed{0}"),
        ("12", r"Counting the cases gives \boxed{12}.", r"\boxed{13}"),
    ]
    solutions = [s for s, _, _ in rows]

    def completions(i):
        return [[{"role": "assistant", "content": row[i]}] for row in rows]

    assert namespace["math_reward"](completions(1), solutions) == [1.0] * len(rows)
    assert namespace["math_reward"](completions(2), solutions) == [0.0] * len(rows)
    bare = accuracy_reward(completions(1), solutions), accuracy_reward(completions(2), solutions)
    assert bare != ([1.0] * len(rows), [0.0] * len(rows))  # why the snippet puts the solutions in $...$


@pytest.fixture
def tiny_world(tmp_path, monkeypatch):
    """What the docs' snippets name, on the tiny model: `model`, a batch (`input_ids`, `attention_mask`,
    `completion_mask`), the swap's dataset and model id, and an `OBLRPOConfig` that trains one short step."""
    import datasets

    import oblr_trl
    from oblr_trl.demo.tiny import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    model_dir = tmp_path / "tiny-model"
    build_model(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    rows = [{"prompt": [{"role": "user", "content": f"{i} + {i}"}], "solution": str(2 * i)} for i in range(16)]

    def load_dataset(name, split=None, **kwargs):
        assert name == "trl-lib/DeepMath-103K" and split == "train"
        return Dataset.from_list(rows)

    class OneStep(oblr_trl.OBLRPOConfig):  # the snippet's own values, then the tiny run's size and place
        def __init__(self, **kwargs):
            kwargs.update(output_dir=str(tmp_path / kwargs["output_dir"]), max_steps=1, max_completion_length=4,
                          use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True)
            super().__init__(**kwargs)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(oblr_trl, "OBLRPOConfig", OneStep)
    torch.manual_seed(0)
    input_ids = torch.randint(4, tokenizer.vocab_size, (3, 10))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = 0  # one left-padded row
    completion_mask = torch.ones(3, 4, dtype=torch.long)  # the last 4 positions, one completion ending early
    completion_mask[2, 3:] = 0
    return dict(model=build_model(tokenizer), input_ids=input_ids, attention_mask=attention_mask,
                completion_mask=completion_mask, model_dir=str(model_dir))


@pytest.mark.parametrize("page, block", _python_blocks())
def test_the_python_blocks_of_the_readme_and_the_docs_run_on_the_tiny_model(page, block, tiny_world):
    if SWAP_MODEL in block:
        block = block.replace(repr(SWAP_MODEL).replace("'", '"'), repr(tiny_world["model_dir"]))
    namespace = {k: v for k, v in tiny_world.items() if k != "model_dir"}
    exec(compile(block, f"<{page}>", "exec"), namespace)
    if "trainer" in namespace:  # the swap trained its one step, with OBLR-PO's metrics
        history = namespace["trainer"].state.log_history
        assert namespace["trainer"].state.global_step == 1 and any("oblr/lr_scale" in h for h in history)
    if "w" in namespace:
        assert namespace["w"].shape == (3,) and bool((namespace["w"] > 0).all())


def test_every_make_target_the_readme_and_the_docs_name_exists():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    named = set()
    for path in [README, *DOCS.glob("*.md")]:
        for block in code_blocks(path, "bash"):
            named |= set(re.findall(r"^make ([\w-]+)", block, re.M))
        named |= set(re.findall(r"`make ([\w-]+)", path.read_text()))
    assert {"demo", "test", "docs", "demo-tiny"} <= named
    assert named <= targets, f"make targets named in the docs that the Makefile lacks: {sorted(named - targets)}"


# ------------------------------------------------------------------------------------------- the README and the build
def test_the_readme_is_short_and_links_only_to_pages_that_exist():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    for title in ["## Install", "## Two commands", "## Swap GRPOTrainer for OBLRPOTrainer", "## When to use it",
                  "## What is supported", "## Documentation"]:
        assert f"\n{title}\n" in text, title
    when = text.split("## When to use it\n")[1].split("\n## ")[0].strip().splitlines()
    assert len(when) <= 5 and "beat GRPO" in " ".join(when) and "window" in " ".join(when)
    links = re.findall(r"\]\(((?!https?:)[^)#]+)(?:#[^)]*)?\)", text)
    assert links and all((ROOT / link).exists() for link in links), [link for link in links if not (ROOT / link).exists()]
    nav = (ROOT / "mkdocs.yml").read_text()
    assert all(f": {Path(link).name}" in nav for link in links if link.startswith("docs/"))


def test_make_docs_builds_strictly_from_the_docs_extra_and_ci_runs_it_after_the_tests(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    lines = subprocess.run(["make", "--no-print-directory", "-n", "docs", f"VENV={tmp_path / 'venv'}"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60, env=env, check=True).stdout.splitlines()
    assert any(line.endswith('pip install -q -e ".[docs]"') for line in lines)
    assert lines[-1].endswith("mkdocs build --strict --site-dir site")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci.index("make test") < ci.index("make docs")
    extras = (ROOT / "setup.cfg").read_text().split("docs =")[1].split("\n#")[0]
    assert all(name in extras for name in ("mkdocs", "mkdocs-material", "mkdocstrings[python]"))


def test_make_docs_check_installs_its_browser_and_client_then_opens_the_built_site(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    lines = subprocess.run(["make", "--no-print-directory", "-n", "docs-check", f"VENV={tmp_path / 'venv'}",
                            f"CHROMIUM={tmp_path / 'no-chromium'}"], cwd=ROOT, capture_output=True, text=True,
                           timeout=60, env=env, check=True).stdout.splitlines()
    text = "\n".join(lines)
    assert "mkdocs build --strict --site-dir site" in text and "apt-get install -y -q chromium" in text
    assert any(line.endswith('pip install -q -e ".[docs-check]"') for line in lines)
    assert lines[-1].endswith("tests/test_docs_site.py") and "OBLR_DOCS_SITE=site" in lines[-1]
    extras = (ROOT / "setup.cfg").read_text().split("docs-check =")[1].split("\n#")[0]
    assert "playwright" in extras and "mkdocs-material" in extras


@pytest.mark.slow
def test_the_docs_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stderr[-4000:]
    config = (tmp_path / "site" / "configuration.html").read_text()
    assert 'id="max_extra_memory_gib"' in config or "max_extra_memory_gib" not in generate.config_reference()
    assert all(f'id="{f.name}"' in config for f in generate.config_fields()[0])
    assert (tmp_path / "site" / "figures" / "lr_window.png").exists()
    assert "per_sequence_grad_sq_norms" in (tmp_path / "site" / "api.html").read_text()
    evidence = (tmp_path / "site" / "evidence.html").read_text()
    assert 'src="figures/lr_window.png"' in evidence and 'src="../benchmarks/results' not in evidence
    index = (tmp_path / "site" / "index.html").read_text()  # plain .html links: it navigates from file://
    assert 'href="quickstart.html"' in index and (tmp_path / "site" / "search" / "search_index.js").exists()
    check_built_site(tmp_path / "site")


def check_built_site(site: Path):
    """What a reader offline meets, read from the built HTML (tests/test_docs_site.py opens it in Chromium): every
    script and stylesheet a page loads is the site's own; the API reference shows no raw Sphinx role and links its
    cross-references; lists are lists; the formulas are marked for KaTeX, which the site carries."""
    pages = sorted(p for p in site.glob("*.html") if p.name != "404.html")
    for page in pages:
        html = page.read_text()
        external = re.findall(r'<(?:script[^>]*src|link[^>]*href)="((?:https?:)?//[^"]+)"', html)
        external = [url for url in external if "stylesheet" in html.split(url)[0][-200:] or ".js" in url]
        assert external == [], f"{page.name} loads {external}: not offline"
        literal_items = re.findall(r"<p>(?:(?!</p>).)*\n\s*(?:[-*+]|\d+\.) \S", html, re.S)
        assert literal_items == [], f"{page.name}: a list run into a paragraph: {literal_items[0][:200]!r}"
    api = (site / "api.html").read_text()
    assert not re.search(r":(?:func|class|meth|mod|attr|data|exc|obj):", api)
    assert api.count('class="autorefs autorefs-internal"') >= 10
    items = len(re.findall(r"^ *(?:[-*+]|\d+\.) ", (ROOT / "CHANGELOG.md").read_text(), re.M))
    nested = len(re.findall(r"^ {2,}(?:[-*+]|\d+\.) ", (ROOT / "CHANGELOG.md").read_text(), re.M))
    changelog = (site / "changelog.html").read_text().split("<article", 1)[1]
    assert nested > 0 and changelog.count("<li>") >= items and nested_items(changelog) >= nested  # nested by 2 spaces


def nested_items(html: str) -> int:
    """The list items of ``html`` inside another list's item."""
    depth, count = 0, 0
    for tag in re.findall(r"</?(?:ul|ol|li)\b", html):
        if tag in ("<ul", "<ol"):
            depth += 1
        elif tag in ("</ul", "</ol"):
            depth -= 1
        elif tag == "<li" and depth >= 2:
            count += 1
    return count
    for name in ("index.html", "how-it-works.html", "glossary.html"):
        assert 'class="arithmatex"' in (site / name).read_text(), name
    assert "katex.min.js" in index_scripts(site) and (site / "javascripts" / "katex" / "fonts").is_dir()
    assert "iframe-worker-shim.js" in index_scripts(site) and "unpkg.com" not in (site / "index.html").read_text()


def index_scripts(site: Path) -> str:
    return " ".join(re.findall(r'<script src="([^"]+)"', (site / "index.html").read_text()))


# ------------------------------------------------------------------------------------------- the site's rendering
def render_site_markdown(markdown: str) -> str:
    """A page's Markdown as the site renders it (hooks.py's rewriting, then mkdocs.yml's extensions)."""
    import markdown as md

    text = generate.site_tables(generate.site_lists(markdown))
    return md.markdown(text, extensions=["admonition", "attr_list", "tables", "pymdownx.superfences"])


def test_a_list_nested_by_two_spaces_is_nested_on_the_site():
    page = ("Intro.\n\n- **One**: text\n  more text\n  - *a*: sub\n    more\n  - *b*: sub\n\n  A paragraph of one.\n"
            "- **Two**\n    - four-space sub\n\n```python\nx = 1\n  - not a list\n```\n")
    html = render_site_markdown(page)
    assert html.count("<ul>") == 3 and html.count("<li>") == 5, html
    assert re.search(r"<li><em>a</em>: sub\s+more</li>", html) and "A paragraph of one." in html.split("<em>b</em>")[1]
    assert "\n  - not a list\n" in generate.site_lists(page) and "<pre" in html  # fenced code untouched
    assert generate.site_lists(generate.site_lists(page)) == generate.site_lists(page)
    # an item right after a paragraph of its list (not the item's own) starts an item, as on GitHub
    after = render_site_markdown("- one\n  - sub\n\n  Para.\n- two\n")
    assert after.count("<li>") == 3 and "- two" not in after


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_no_page_runs_a_list_into_a_paragraph_on_the_site(page):
    html = render_site_markdown(generate.render(page.read_text()))
    found = re.findall(r"<p>(?:(?!</p>).)*\n\s*(?:[-*+]|\d+\.) \S", html, re.S)
    assert found == [], f"{page.name}: {found[0][-300:]!r}"


def test_a_wide_table_is_turned_on_the_site_and_long_words_may_wrap():
    head = "| model | " + " | ".join(f"m{i}" for i in range(14)) + " |"
    rows = [f"| {name} | " + " | ".join(str(i) for i in range(14)) + " |" for name in ("tiny", "small")]
    table = "\n".join([head, "|" + "---|" * 15, *rows])
    turned = generate.site_tables(table).splitlines()
    assert turned[0] == "| model | tiny | small |" and turned[2] == "| m0 | 0 | 0 |" and len(turned) == 16
    narrow = "| a | b |\n|---|---|\n| model.layers.0.self_attn | `keep.this.code_span` and [x](glossary.md#snr_factor) |"
    out = generate.site_tables(narrow)
    assert "model.<wbr>layers.<wbr>0.<wbr>self_<wbr>attn" in out and "`keep.this.code_span`" in out
    assert "[x](glossary.md#snr_factor)" in out and generate.site_tables("| a |\n|---|\n| b |") == "| a |\n|---|\n| b |"
    html = render_site_markdown(generate.site_tables(table))
    assert html.count("<tr>") == 15


def test_a_table_s_long_code_spans_break_only_between_their_parts():
    html = ("<p><code>oblr/lr_scale_mean</code></p><table><tr><td><code>oblr/lr_scale_mean</code> <code>ema</code> "
            '<code>snr_estimator="ema_soft"</code></td></tr></table>')
    out = generate.site_table_code(html)
    assert out.startswith("<p><code>oblr/lr_scale_mean</code></p>")  # outside tables: as it was
    assert "<code>oblr/<wbr>lr_<wbr>scale_<wbr>mean</code> <code>ema</code>" in out
    assert '<code>snr_<wbr>estimator=<wbr>"ema_<wbr>soft"</code>' in out
    assert "word-break: normal" in (DOCS / "stylesheets" / "extra.css").read_text()


def test_the_api_reference_s_sphinx_roles_become_cross_references():
    griffe = pytest.importorskip("griffe")
    spec = importlib.util.spec_from_file_location("api_roles", DOCS / "api_roles.py")
    api_roles = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(api_roles)
    package = griffe.load("oblr_trl", search_paths=[str(ROOT)], extensions=griffe.load_extensions(api_roles.SphinxRoles))
    choice = package["path_choice"]
    assert api_roles.resolve(choice, package, "choose_within") == "oblr_trl.path_choice.choose_within"
    assert api_roles.resolve(choice, package, ".one_backward") == "oblr_trl.one_backward"
    assert api_roles.resolve(choice, package, "Route.at_generation") == "oblr_trl.path_choice.Route.at_generation"
    assert api_roles.resolve(choice, package, "no_such_thing") is None
    raw, objects = [], 0
    for obj in api_roles._walk(package):
        if obj.docstring is not None:
            objects += 1
            raw += [f"{obj.path}: {m.group(0)}" for m in api_roles.ROLE.finditer(obj.docstring.value)]
    assert objects > 100 and raw == []
    assert '<autoref identifier="oblr_trl.path_choice.choose_within" optional><code>choose_within()</code></autoref>' \
        in choice.docstring.value
    assert api_roles.render(choice, package, ":data:`NOT_THERE`") == "`NOT_THERE`"


def test_the_site_is_offline_and_searches_option_names():
    """mkdocs.yml: the iframe-worker shim and KaTeX come from docs/ (Material's offline plugin would load the shim from
    a CDN, and the theme its fonts), and search splits words as option and metric names need."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)
    assert config["theme"]["font"] is False
    local = [*config["extra"]["polyfills"], *config["extra_javascript"], *config["extra_css"]]
    assert any("iframe-worker" in path for path in config["extra"]["polyfills"])
    assert all(not path.startswith(("http:", "https:", "//")) and (DOCS / path).exists() for path in local), local
    assert "pymdownx.arithmatex" in str(config["markdown_extensions"])
    search = next(p["search"] for p in config["plugins"] if isinstance(p, dict) and "search" in p)
    words = [w for w in re.split(search["separator"], "Set oblr/lr_mean, noise_scale and OBLRPOConfig.snr_estimator.")
             if w]
    assert {"lr_mean", "noise_scale", "snr_estimator", "oblr"} <= set(words), words


# ------------------------------------------------------------------------------------------- the release
def test_the_changelog_dates_the_release_of_this_version_under_an_unreleased_section():
    """Keep a Changelog: `## [Unreleased]` first (later work goes there), then each release dated, the newest this
    package's version (setup.cfg reads it from `oblr_trl.__version__`); a release's groups are Keep a Changelog's
    own, each once, and it stays short enough to read."""
    import configparser

    import oblr_trl

    text = (ROOT / "CHANGELOG.md").read_text()
    sections = re.findall(r"^## (.+)$", text, re.M)
    assert sections[0] == "[Unreleased]", sections[:2]
    assert re.fullmatch(rf"\[{re.escape(oblr_trl.__version__)}\] - \d{{4}}-\d{{2}}-\d{{2}}", sections[1]), sections[1]
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    assert config["metadata"]["version"].strip() == "attr: oblr_trl.__version__"
    groups = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
    for release in re.split(r"^## ", text, flags=re.M)[2:]:
        headings = re.findall(r"^### (.+)$", release, re.M)
        assert set(headings) <= groups and len(headings) == len(set(headings)), headings
        assert len(release.split()) <= 2000, f"{release.splitlines()[0]}: {len(release.split())} words"
    assert "Added" in re.findall(r"^### (.+)$", re.split(r"^## ", text, flags=re.M)[2], re.M)
