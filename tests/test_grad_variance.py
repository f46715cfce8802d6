"""benchmarks/grad_variance.py: the logit-proxy weights it scores each completion with, the methods' advantages from
them, and the rank correlation it reports, each against a brute-force reference."""

import importlib.util
import itertools
from pathlib import Path

import pytest
import torch

SPEC = importlib.util.spec_from_file_location(
    "grad_variance", Path(__file__).resolve().parents[1] / "benchmarks" / "grad_variance.py"
)
grad_variance = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(grad_variance)


def brute_spearman(a, b):
    """Pearson correlation of average ranks, ranks counted by comparisons (ties share the mean of their positions)."""

    def ranks(x):
        return [sum(y < v for y in x) + (sum(y == v for y in x) - 1) / 2 for v in x]

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def test_spearman_matches_the_rank_formula_and_handles_ties():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(9, generator=g), torch.randn(9, generator=g)
    d = a.argsort().argsort().double() - b.argsort().argsort().double()
    assert grad_variance.spearman(a, b) == pytest.approx(1 - 6 * float((d**2).sum()) / (9 * 80), abs=1e-12)
    assert grad_variance.spearman(a, a.exp()) == pytest.approx(1.0)
    assert grad_variance.spearman(a, -a) == pytest.approx(-1.0)
    tied_a = torch.tensor([1.0, 2.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    tied_b = torch.tensor([0.3, 0.1, 0.4, 0.4, 0.2, 0.9, 0.5])
    assert grad_variance.spearman(tied_a, tied_b) == pytest.approx(brute_spearman(tied_a.tolist(), tied_b.tolist()))
    assert grad_variance.spearman(torch.ones(5), a[:5]) is None  # a constant has no ranking
    assert grad_variance.spearman(a[:2], b[:2]) is None


def test_completion_score_returns_the_score_and_its_logit_proxy():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=37, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    params = [p for p in model.parameters() if p.requires_grad]
    prompt, completion = [3, 5, 7, 11], [13, 2, 29]
    score, proxy = grad_variance.completion_score(model, params, prompt, completion)

    ids = torch.tensor([prompt + completion])
    probs = torch.softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double(), -1)
    expected_proxy = sum(1 - 2 * probs[t, tok] + (probs[t] ** 2).sum() for t, tok in enumerate(completion))
    assert proxy == pytest.approx(float(expected_proxy), rel=1e-5)

    logp = sum(torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 + t], -1)[tok]
               for t, tok in enumerate(completion))
    grads = torch.autograd.grad(logp, params)
    torch.testing.assert_close(score, torch.cat([g.reshape(-1) for g in grads]).double(), rtol=1e-5, atol=1e-6)


def test_logit_methods_are_the_weighted_baseline_with_proxy_weights():
    g = torch.Generator().manual_seed(1)
    K, G = 3, 4
    r = torch.randint(0, 2, (K, G), generator=g).double()
    w, lengths, proxy = (torch.rand(K, G, generator=g, dtype=torch.float64) + 0.1 for _ in range(3))
    for method, loo in (("logit", False), ("logit_loo", True)):
        got = grad_variance.advantages(method, r, w, lengths, proxy)
        for k, i in itertools.product(range(K), range(G)):
            others = [j for j in range(G) if j != i] if loo else list(range(G))
            b = sum(proxy[k, j] * r[k, j] for j in others) / sum(proxy[k, j] for j in others)
            assert float(got[k, i]) == pytest.approx(float(r[k, i] - b))
    assert "logit_loo" in grad_variance.METHODS and "logit" in grad_variance.LABELS


# benchmarks/variance_long.py (issue 49): the per-group variance shares, their buckets, the paired hierarchical
# bootstrap and the resume rule, on synthetic records whose group estimates are known vectors.
LONG_SPEC = importlib.util.spec_from_file_location(
    "variance_long", Path(__file__).resolve().parents[1] / "benchmarks" / "variance_long.py"
)
variance_long = importlib.util.module_from_spec(LONG_SPEC)
LONG_SPEC.loader.exec_module(variance_long)


def test_bucket_label_is_half_open_and_refuses_values_outside():
    edges = [0, 64, 128, float("inf")]
    assert variance_long.bucket_label(0, edges) == "0-64"
    assert variance_long.bucket_label(63.9, edges) == "0-64"
    assert variance_long.bucket_label(64, edges) == "64-128"
    assert variance_long.bucket_label(1e6, edges, "x") == ">=128x"
    assert variance_long.bucket_order(edges, "x") == ["0-64x", "64-128x", ">=128x"]
    with pytest.raises(ValueError, match="outside the buckets"):
        variance_long.bucket_label(-1, edges)


def test_group_contributions_are_scaled_squared_deviations_and_average_to_tr_cov():
    g = torch.Generator().manual_seed(2)
    vectors = torch.randn(6, 11, generator=g, dtype=torch.float64)
    got = variance_long.group_contributions(vectors @ vectors.T)
    for k in range(6):
        expected = 6 / 5 * float(((vectors[k] - vectors.mean(0)) ** 2).sum())
        assert float(got[k]) == pytest.approx(expected)
    assert float(got.mean()) == pytest.approx(grad_variance.gram_stats(vectors @ vectors.T)[0])
    idx = torch.tensor([3, 3, 0, 5, 1, 3])
    resampled = vectors[idx]
    brute = [6 / 5 * float(((resampled[k] - resampled.mean(0)) ** 2).sum()) for k in range(6)]
    assert variance_long.group_contributions(vectors @ vectors.T, idx).tolist() == pytest.approx(brute)


def synthetic_records(n_prompts, K=8, G=4, dim=5, seed=0, long_factor=0.5):
    """Records whose group estimates are explicit vectors: every method is RLOO's noise times a factor, except the
    headline method, whose noise is scaled by ``long_factor`` in long groups (mean length >= 128) only. Half the
    groups are long with norm spread 20x, half short with spread 1.5x; group 0 of every prompt has equal rewards."""
    g = torch.Generator().manual_seed(seed)
    records, vectors = [], []
    for j in range(n_prompts):
        mean = torch.randn(dim, generator=g, dtype=torch.float64)
        noise = torch.randn(K, dim, generator=g, dtype=torch.float64)
        long = torch.tensor([k % 2 == 1 for k in range(K)])
        per_method = {}
        for m in variance_long.METHODS:
            scale = torch.ones(K, 1, dtype=torch.float64) * (1.3 if m == "grpo" else 1.0)
            if m == variance_long.HEADLINE:
                scale[long] = long_factor
            per_method[m] = mean + noise * scale
        lengths = [[200] * G if long[k] else [40] * G for k in range(K)]
        w = [None if k == 0 else ([1.0] * (G - 1) + [20.0] if long[k] else [1.0] * (G - 1) + [1.5]) for k in range(K)]
        records.append(dict(K=K, G=G, lengths=lengths, w_exact=w,
                            gram={m: (v @ v.T).tolist() for m, v in per_method.items()}))
        vectors.append(per_method)
    return records, vectors


def test_bucket_table_ratios_match_brute_force_and_find_the_regime():
    records, vectors = synthetic_records(12)
    table = variance_long.bucket_table(records, 0, bootstrap=300, seed=0, min_prompts=3, min_groups=10)
    for bucket, wanted_long in (("0-32", None), ("32-64", False), (">=128", True)):
        if bucket == "0-32":
            assert bucket not in table
            continue
        num = den = 0.0
        for rec, vec in zip(records, vectors):
            for k in range(rec["K"]):
                if (rec["lengths"][k][0] >= 128) == wanted_long:
                    for m, acc in ((variance_long.HEADLINE, "num"), ("rloo", "den")):
                        v = vec[m]
                        c = rec["K"] / (rec["K"] - 1) * float(((v[k] - v.mean(0)) ** 2).sum())
                        num, den = (num + c, den) if acc == "num" else (num, den + c)
        assert table[bucket]["ratio"][variance_long.HEADLINE] == pytest.approx(num / den)
        assert table[bucket]["groups"] == 12 * 4 and table[bucket]["prompts"] == 12
    lo, hi = table[">=128"]["ci"][variance_long.HEADLINE]
    assert hi < 1.0 and lo <= table[">=128"]["ratio"][variance_long.HEADLINE] <= hi  # the regime where it pays
    assert table["32-64"]["ratio"][variance_long.HEADLINE] > 0.85  # elsewhere little gain (the mean moves a bit)
    assert table["all groups"]["groups"] == 12 * 8
    spread = variance_long.bucket_table(records, 1, bootstrap=50, seed=0, min_prompts=3, min_groups=10)
    assert spread[variance_long.EQUAL]["groups"] == 12 and spread["16-32x"]["groups"] == 12 * 4
    assert spread["1-4x"]["groups"] == 12 * 3


def test_small_buckets_get_no_interval_and_the_headline_skips_them():
    records, _ = synthetic_records(2)
    table = variance_long.bucket_table(records, 0, bootstrap=50, seed=0, min_prompts=3, min_groups=10)
    assert all(row["ci"][m] is None for row in table.values() for m in variance_long.METHODS)
    assert variance_long.headline({"length": table}) is None
    records, _ = synthetic_records(12, long_factor=0.5)
    tables = {"length": variance_long.bucket_table(records, 0, 200, 0, 3, 10),
              "spread": variance_long.bucket_table(records, 1, 200, 0, 3, 10)}
    best = variance_long.headline(tables)
    assert best["bucket"] in (">=128", "16-32x") and best["reduction"] > 0.5
    assert best["reduction_ci"][0] <= best["reduction"] <= best["reduction_ci"][1]


def test_a_prompt_is_done_when_its_record_exists(tmp_path):
    assert variance_long.pending(tmp_path, 4) == [0, 1, 2, 3]
    variance_long.record_path(tmp_path, 2).write_text("{}")
    variance_long.record_path(tmp_path, 2).with_suffix(".tmp").write_text("{}")
    variance_long.record_path(tmp_path, 0).with_suffix(".tmp").write_text("{}")  # interrupted while writing
    assert variance_long.pending(tmp_path, 4) == [0, 1, 3]
    assert variance_long.load_records(tmp_path) == [{}]


def test_render_marks_a_partial_run_and_names_the_headline(tmp_path):
    records, _ = synthetic_records(12)
    for i, rec in enumerate(records):
        rec.update(index=i, max_new_tokens=256, seconds=1.0, peak_rss_gb=1.0, ended=[[True] * rec["G"]] * rec["K"],
                   rewards=[[0.0] * rec["G"]] * rec["K"])
    args = variance_long.parse_args(["--prompts", "24", "--bootstrap", "100", "--records", str(tmp_path)])
    text = variance_long.render(records, args)
    assert "PARTIAL" in text and "12 of 24 planned prompts" in text
    assert "| >=128 | 48 | 12 |" in text and "1 (reference)" in text
    best = variance_long.headline({"length": variance_long.bucket_table(records, 0, 100, 0, 3, 10)})
    assert f"**{100 * best['reduction']:+.0f}%" in text and "'>=128' of the" in text
    args.prompts = 12
    assert "PARTIAL" not in variance_long.render(records, args)


def test_render_names_the_measuring_machine_from_the_records_and_repeats_itself(tmp_path, monkeypatch):
    """--render_only on another machine, at another time, writes the same file: the machine and the dates are the
    records', never the renderer's."""
    records, _ = synthetic_records(4)
    for i, rec in enumerate(records):
        rec.update(index=i, max_new_tokens=256, seconds=60.0, peak_rss_gb=1.0, ended=[[True] * rec["G"]] * rec["K"],
                   rewards=[[0.0] * rec["G"]] * rec["K"], host="measurer (Linux, 2 CPUs)",
                   measured=f"2026-01-0{1 + i // 2} 10:00 UTC")
    args = variance_long.parse_args(["--prompts", "4", "--bootstrap", "20", "--records", str(tmp_path)])
    monkeypatch.setattr(variance_long, "host", lambda *a, **k: "renderer (Other, 64 CPUs)")
    monkeypatch.setattr(variance_long, "utc_now", lambda *a, **k: "2030-12-31 23:59 UTC")
    text = variance_long.render(records, args)
    assert "measured on measurer (Linux, 2 CPUs) from 2026-01-01 to 2026-01-02: 4 min for 4 prompts" in text
    assert "renderer" not in text and "2030" not in text
    monkeypatch.setattr(variance_long, "utc_now", lambda *a, **k: "2031-01-01 00:00 UTC")
    assert variance_long.render(records, args) == text
    del records[0]["host"], records[0]["measured"]
    assert variance_long.measured_on(records) == ("measured on a machine the record does not name; measurer (Linux, "
                                                  "2 CPUs) from 2026-01-01 to 2026-01-02 (1 records undated)")
