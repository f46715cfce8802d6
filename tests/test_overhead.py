"""Issue 56: the overhead beyond FLOPs, counted on the CPU through ``training_step`` (``benchmarks/cost_counts.py``'s
counters on Qwen3-0.6B's real shapes, phantom tensors): OBLR-PO's default within 1.25x GRPO's operator calls and
GRPO's host syncs + 2, and the head's vocabulary chunks sized by the tokens."""


import pytest
import torch

from oblr_trl.grad_norms import factors

from helpers import load_benchmark

load = load_benchmark


def test_vocab_chunks_are_few_where_the_tokens_are_few_and_never_above_a_quarter_of_trls_tile():
    v = 151936
    for tokens in (1, 2048, 4096, 8192, 32768):
        chunk = factors.vocab_chunk(tokens, v)
        assert -(-v // chunk) <= -(-v // factors.VOCAB_CHUNK)  # never more chunks than VOCAB_CHUNK's (equal ones)
        if chunk > factors.VOCAB_CHUNK:  # larger only within a quarter of TRL's (min(tokens, 4096), V) logits tile
            assert tokens * chunk <= min(tokens, factors.HEAD_TILE_TOKENS) * v / factors.HEAD_TILE_SHARE * 1.0001
    assert -(-v // factors.vocab_chunk(2048, v)) == 4  # 4 chunks instead of 19 at 8 x 256 completion tokens
    assert factors.vocab_chunk(32768, v) == -(-v // -(-v // factors.VOCAB_CHUNK))  # long batches: as before
    assert factors.vocab_chunk(10, 40) == 40  # a small vocabulary: one chunk


@pytest.mark.parametrize("ckpt", [False, True], ids=["no-ckpt", "ckpt"])
def test_the_defaults_operator_calls_and_host_syncs_are_within_the_targets(ckpt):
    """Full fine-tuning, tied head, 8 x 256: the default as on a GPU (``auto_gpu``: one_backward) against GRPO, at
    1 and 2 layers extrapolated to 28 (the table's rows, whose full run is ``make bench-counts``)."""
    cost = load("cost_counts")
    import harness

    with harness.quiet():
        counts = {mode: [cost.count_step("Qwen3-0.6B", n, True, mode, 8, 256, False, ckpt) for n in (1, 2)]
                  for mode in ("grpo", "auto_gpu")}
    deep = {m: {k: cost.at_depth(c[0][k], c[1][k]) for k in ("ops", "syncs")} for m, c in counts.items()}
    assert counts["auto_gpu"][0]["ran"].startswith("one_backward/")
    assert deep["auto_gpu"]["ops"] <= cost.TARGETS["ops"] * deep["grpo"]["ops"]
    assert deep["auto_gpu"]["syncs"] <= deep["grpo"]["syncs"] + cost.TARGETS["syncs"]
    torch.set_num_threads(torch.get_num_threads())  # count_step set nothing global beyond its run
