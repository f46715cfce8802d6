"""benchmarks/update_readme.py: the README's result blocks are the generated tables, never hand-typed copies."""

import importlib.util
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "update_readme", Path(__file__).resolve().parents[1] / "benchmarks" / "update_readme.py"
)


def load(tmp_path, monkeypatch):
    module = importlib.util.module_from_spec(SPEC)
    SPEC.loader.exec_module(module)
    monkeypatch.setattr(module, "HERE", tmp_path)
    monkeypatch.setattr(module, "READMES", [tmp_path / "README.md"])
    (tmp_path / "results").mkdir()
    return module


def test_blocks_are_replaced_by_the_generated_tables(tmp_path, monkeypatch):
    module = load(tmp_path, monkeypatch)
    (tmp_path / "results" / "demo.md").write_text("# Title\n\n## Section\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    (tmp_path / "README.md").write_text(
        "intro\n<!-- results:demo:begin -->\nstale | 9 |\n<!-- results:demo:end -->\noutro\n"
    )
    assert module.main() == 0
    text = (tmp_path / "README.md").read_text()
    assert "stale" not in text and "| 1 | 2 |" in text and "#### Section" in text and "# Title" not in text
    assert text.startswith("intro\n") and text.endswith("<!-- results:demo:end -->\noutro\n")
    assert module.main() == 0 and (tmp_path / "README.md").read_text() == text  # idempotent


def test_the_docs_pages_are_written_too_and_updated_is_the_pure_rewrite(tmp_path):
    module = importlib.util.module_from_spec(SPEC)
    SPEC.loader.exec_module(module)
    root = Path(__file__).resolve().parents[1]
    assert {root / "docs" / "performance.md", root / "docs" / "evidence.md", root / "README.md"} <= set(module.READMES)
    readme = _bench_module("harness.readme")
    (tmp_path / "x.md").write_text("# X\n\n| 1 |\n")
    text = "a\n<!-- results:x:begin -->\nold\n<!-- results:x:end -->\n"
    assert readme.updated(text, tmp_path / "docs", tmp_path) == (
        "a\n<!-- results:x:begin -->\n_Generated from `../x.md` by `python benchmarks/update_readme.py`._\n\n| 1 |\n"
        "<!-- results:x:end -->\n")


def test_a_missing_result_file_is_an_error(tmp_path, monkeypatch):
    module = load(tmp_path, monkeypatch)
    (tmp_path / "README.md").write_text("<!-- results:absent:begin -->\n<!-- results:absent:end -->\n")
    with pytest.raises(FileNotFoundError, match="absent"):
        module.main()


def _bench_module(name):
    return importlib.import_module(name)  # benchmarks/ is on the tests' path (setup.cfg's pythonpath)


def test_time_interleaved_calls_in_turn_and_returns_warm_up_outputs():
    harness = _bench_module("harness")
    calls = []
    fns = {"a": lambda: calls.append("a") or "A", "b": lambda: calls.append("b") or "B"}
    times, outputs = harness.time_interleaved(fns, ["a", "b"], repeats=2, budget_s=1e9, log=lambda m: None)
    assert calls == ["a", "b"] * 3  # a warm-up round, then two timed rounds, interleaved
    assert outputs == {"a": "A", "b": "B"} and set(times) == {"a", "b"} and all(t >= 0 for t in times.values())


def test_time_interleaved_stops_at_the_budget_with_the_warm_up_as_measurement():
    harness = _bench_module("harness")
    calls = []
    times, _ = harness.time_interleaved({"a": lambda: calls.append(1)}, ["a"], repeats=5, budget_s=0.0,
                                        log=lambda m: None)
    assert len(calls) == 1 and set(times) == {"a"}


def test_md_table_and_fmt():
    harness = _bench_module("harness")
    assert harness.md_table(["x", "y"], [[1, "b"]]) == ["| x | y |", "|---|---|", "| 1 | b |"]
    assert harness.fmt(float("nan")) == "n/a" and harness.fmt(None) == "n/a" and harness.fmt(1.234) == "1.23"


def _row(size, times, mem, skipped=()):
    return dict(size=size, completion=512, batch=8, times=times, skipped=list(skipped),
                memory={k: dict(peak_bytes=v) for k, v in mem.items()})


def test_mode_table_ratios_per_checkpointing_setting_and_oom():
    mode_table = _bench_module("mode_table")
    machine = dict(device="GPU", date="2026-11-23T01:46:50+00:00")
    ok = _row("m", dict(fwdbwd=1.0, update_group=3.0, update_one_backward=2.0, fwdbwd_ckpt=2.0,
                        update_group_ckpt=5.0, update_one_backward_ckpt=3.0),
              dict(fwdbwd=100, update_group=110, update_one_backward=120, fwdbwd_ckpt=10, update_group_ckpt=20,
                   update_one_backward_ckpt=40))
    oom = _row("m", dict(fwdbwd=float("nan"), fwdbwd_ckpt=1.0, update_group_ckpt=2.0, update_one_backward_ckpt=4.0),
               dict(fwdbwd_ckpt=10, update_group_ckpt=15, update_one_backward_ckpt=30),
               skipped=["fwdbwd: out of memory: ...", "update_group: out of memory: ...",
                        "update_one_backward: out of memory: ..."])
    rows = mode_table.mode_rows(dict(machine=machine, rows=[ok, oom]))
    off, on, oom_off, oom_on = rows
    assert off[4:] == ["off", "1.000", "0", "3.00", "2.00", "1.10", "1.20", "1.00 / 12.00"]
    assert on[4:11] == ["on", "2.000", "0", "2.50", "1.50", "2.00", "4.00"]
    assert oom_off[5] == "OOM" and oom_off[8] == "OOM" and oom_off[11] == "OOM"
    assert oom_on[7:11] == ["2.00", "4.00", "1.50", "3.00"]
    assert "2026-11-23 01:46 UTC" in off[3]


BLOCK_PEAK = """
from harness.memory import peak_rss, peak_rss_gb
with peak_rss() as peak:
    block = bytearray(b"\\x01") * (200 * 2**20)  # 200 MB, written
    del block
print(peak["peak_bytes"], peak_rss_gb(), peak["method"])
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_the_one_rss_reader_sees_this_process_and_a_block_s_peak():
    """A block's peak is read in a fresh process, as the benchmarks read it (their memory workers). In the test
    process, grown over a thousand tests, the kernel may take back more of its pages during the block than the block
    adds (under memory pressure, from other jobs): the peak above the entry's RSS read 0 once."""
    import os
    import subprocess
    import sys

    memory = _bench_module("harness.memory")
    assert memory.status_kb("VmRSS") > 1000 and memory.rss_gb(os.getpid()) > 0.001
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert memory.rss_gb(gone.pid) == 0.0  # a finished process has no RSS
    benchmarks = str(Path(memory.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (benchmarks, os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-c", BLOCK_PEAK], capture_output=True, text=True, env=env, check=True)
    peak_bytes, peak_gb, method = done.stdout.split(maxsplit=2)
    assert int(peak_bytes) > 150 * 2**20 and "RSS" in method
    assert float(peak_gb) >= 0.15 and memory.meminfo_gb("MemTotal") > 0.1


def test_the_runner_log_is_kept_in_runner_json_and_continued(tmp_path, capsys):
    import json

    log_module = _bench_module("harness.log")
    log = log_module.RunnerLog(tmp_path / "runs")
    log("start")
    again = log_module.RunnerLog(tmp_path / "runs")  # a restarted runner goes on with the same log
    again("end")
    lines = json.loads((tmp_path / "runs" / "runner.json").read_text())["log"]
    assert [line.split(" UTC ", 1)[1] for line in lines] == ["start", "end"] and again.lines == lines
    assert capsys.readouterr().out.splitlines() == lines


def test_a_block_with_columns_shows_those_columns_of_its_wide_tables_and_names_the_whole_file(tmp_path):
    readme = _bench_module("harness.readme")
    (tmp_path / "x.md").write_text("# X\n\n| a | b | c |\n|---|---|---|\n| 1 | 2 | 3 |\n\n| a | d |\n|---|---|\n| 4 | 5 |\n")
    text = '<!-- results:x:begin columns="c; a" -->\n<!-- results:x:end -->\n'
    out = readme.updated(text, tmp_path, tmp_path)
    assert "| c | a |\n| --- | --- |\n| 3 | 1 |\n\n_2 of its 3 columns; every column: `x.md`._" in out
    assert "| a | d |\n|---|---|\n| 4 | 5 |" in out  # a table without every named column stays whole
    assert readme.updated(out, tmp_path, tmp_path) == out
