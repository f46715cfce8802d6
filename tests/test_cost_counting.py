"""benchmarks/studies/counting.py and cost_counts.py: the counters give known counts on known operators, and Shapes counts
what the real tensors would."""

import contextlib
import json

import torch
from torch.utils.flop_counter import FlopCounterMode

from helpers import BENCHMARKS, load_benchmark

load = load_benchmark
from studies import counting  # noqa: E402


def matmul_step(x, w):
    y = torch.nn.functional.linear(x, w)
    loss = torch.logsumexp(y, -1).sum()
    loss.backward()
    return loss


def test_counters_on_a_known_matmul_and_backward():
    x, w = torch.randn(8, 64, 32), torch.randn(128, 32, requires_grad=True)
    flops, live, ops = FlopCounterMode(display=False), counting.LiveBytes(), counting.OpCounter()
    with flops, live, ops:
        matmul_step(x, w)
    assert flops.get_total_flops() == 2 * (2 * 8 * 64 * 32 * 128)  # forward, and the weight gradient only
    assert ops.calls["aten.mm"] == 2 and ops.total > 2
    logits = 8 * 64 * 128 * 4
    assert 2 * logits <= live.peak <= 5 * logits  # logits-sized temporaries only, never the weights (made before)


def test_op_counter_counts_views_apart():
    x = torch.randn(4, 6)
    with counting.OpCounter() as ops:
        y = x.view(2, 12).transpose(0, 1)  # two views
        y.sum()
    assert ops.views == 2 and ops.total == 3 and ops.calls["aten.sum"] == 1


def test_live_bytes_follows_frees_and_autograd_saves():
    x = torch.randn(1 << 16, requires_grad=True)
    with counting.LiveBytes() as live:
        a = x.exp()
        b = a.exp()  # exp saves its output: a and b stay alive through the graph
        del a
        assert live.live == 2 * x.nbytes
        s = b.sum()
        del b, s  # the graph goes with them
        assert live.live == 0
    assert 2 * x.nbytes <= live.peak <= 2 * x.nbytes + 64  # and the scalar sum


def test_live_bytes_does_not_count_views_of_tensors_made_before():
    """A weight's ``detach()`` or ``t()`` (the engine reads the LM head so) is the weight, not an operator output:
    it was counted as a new storage of the head's size."""
    w = torch.randn(256, 256)
    with counting.LiveBytes() as live:
        views = [w.detach(), w.t(), w.view(-1)[:10]]
        assert live.live == 0
        y = w.t() * 2  # a new storage
        assert live.live == w.nbytes
        del views, y
    assert live.peak == w.nbytes


def test_shapes_counts_what_real_tensors_count():
    """The same step on real tensors and under Shapes (as phantoms): equal FLOPs, operator calls and peak bytes."""
    x, w = torch.randn(8, 300, 64), torch.randn(4096, 64)
    counts = []
    for phantom in (False, True):
        shapes = counting.Shapes(big=1 << 14)
        with shapes if phantom else contextlib.nullcontext():
            weight = torch.nn.Parameter(shapes.phantom(w) if phantom else w.clone())
            flops, live, ops = FlopCounterMode(display=False), counting.LiveBytes(), counting.OpCounter()
            with flops, live, ops:
                loss = matmul_step(x, weight)
            counts.append((flops.get_total_flops(), ops.total, live.peak))
            assert isinstance(weight.grad, counting.Phantom) == phantom
            assert torch.isfinite(loss)  # small outputs are real (filled), so Python can branch on them
    assert counts[0] == counts[1]


def test_phantoms_have_a_data_pointer_per_storage():
    """A phantom's ``data_ptr`` stands for its storage: two tensors differ, a view or a detached alias shares it (the
    norms' algebra groups the layers that read one input by it; 0 for all would group every layer's inputs)."""
    shapes = counting.Shapes(big=1 << 10)
    with shapes:
        a, b = shapes.phantom(torch.empty(4, 512)), shapes.phantom(torch.empty(4, 512))
        assert a.data_ptr() != b.data_ptr()
        assert a.detach().data_ptr() == a.data_ptr() and a[1:].data_ptr() == a.data_ptr() + 512 * 4


def test_shapes_indexes_with_a_real_boolean_mask():
    shapes = counting.Shapes(big=16)
    with shapes:
        x = shapes.phantom(torch.empty(10, 4))
        mask = torch.arange(10) % 3 == 0
        assert tuple(x[mask].shape) == (4, 4)


def test_extrapolation_and_flop_model():
    cost = load("cost_counts")
    assert cost.at_depth(10.0, 13.0, depth=28) == 10.0 + 27 * 3.0
    grpo = cost.predict("Qwen3-0.6B", 2, "grpo", 8, 256, lora=False, ckpt=False)
    lora = cost.predict("Qwen3-0.6B", 2, "grpo", 8, 256, lora=True, ckpt=False)
    assert lora < grpo < cost.predict("Qwen3-0.6B", 2, "two_passes", 8, 256, lora=False, ckpt=False)


def test_the_tables_model_column_uses_the_shape_the_trainer_describes():
    """cost_counts.py's 'model' column and the trainer's default read the same Shape of the same model: the table
    verifies the function training runs."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from oblr_trl.path_choice import describe

    cost = load("cost_counts")
    config = Qwen3Config(**cost.WIDTHS["Qwen3-0.6B"], num_hidden_layers=2, tie_word_embeddings=False)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    got = describe(model, 8, cost.PROMPT, 256, 4, True, cost.GROUP)
    assert got == cost.shape_of("Qwen3-0.6B", 2, 8, 256, lora=False, ckpt=True, tied=False)
    model.lm_head.weight = model.model.embed_tokens.weight
    assert describe(model, 8, cost.PROMPT, 256, 4, True, cost.GROUP).tied


def test_repredict_recomputes_the_model_columns_and_keeps_the_counts():
    """``--repredict``: the model's columns of a written result from the model as it is now, for the path each mode
    ran (``replay/8`` here); the counts untouched, and the table says so."""
    cost = load("cost_counts")
    cfg = dict(width="Qwen3-0.6B", batch=8, completion=256, tied=True, lora=False, ckpt=True)
    counted = dict(flops=1.0, peak_bytes=2.0, ops=3.0, per_layer_flops=1.0, rest_flops=1.0, predicted_flops=-1.0,
                   predicted_bytes=-1.0)
    res = dict(machine=dict(date="then", torch="t", transformers="x", trl="y"), command="cmd", rows=[
        dict(cfg, modes={"grpo": dict(counted, ran="grpo"), "replay": dict(counted, ran="replay/8")})])
    out = cost.repredict(res)
    replay = out["rows"][0]["modes"]["replay"]
    assert replay["flops"] == 1.0 and replay["peak_bytes"] == 2.0
    for what in ("flops", "bytes"):
        assert replay[f"predicted_{what}"] == cost.at_depth(*(cost.predict(
            "Qwen3-0.6B", n, "replay", 8, 256, False, True, True, what, 8) for n in (1, 2)))
    assert "computed again" in cost.render(out)


def test_verdict_names_each_missed_target_and_the_path_that_costs_it():
    """The tables' 'meets targets' column: ``yes`` within every target, else each ratio over its target and why."""
    cost = load("cost_counts")
    full = dict(lora=False, ckpt=False, batch=8)
    assert cost.verdict(full, "one_backward", "one_backward/8", 1.05, 0.7, 1.2) == "yes"
    # issue 56's targets: operator calls within 1.25x GRPO's, host syncs within GRPO's + 2
    assert cost.verdict(full, "one_backward", "one_backward/8", 1.05, 0.7, 1.26).startswith("no: calls 1.26x")
    assert cost.verdict(full, "one_backward", "one_backward/8", 1.05, 0.7, 1.2, 2) == "yes"
    assert "host syncs GRPO's +3" in cost.verdict(full, "one_backward", "one_backward/8", 1.05, 0.7, 1.2, 3)
    two = cost.verdict(full, "two_passes", "two_passes/8", 1.79, 1.0, 2.33)
    assert two == "no: FLOPs 1.79x, calls 2.33x; the norms pass is a second forward and backward"
    auto = cost.verdict(full, "auto", "two_passes/8", 1.79, 1.0, 1.0)
    assert auto.endswith("no one_backward chunk fits the byte target")
    ckpt = dict(full, ckpt=True)
    assert "replayed" in cost.verdict(ckpt, "replay", "replay/8", 1.49, 0.9, 1.0)
    assert cost.verdict(ckpt, "one_backward", "one_backward/8", 1.0, 1.74, 1.0).startswith(
        "no: bytes 1.74x; each row's per-layer factors kept")
    assert "chunks of 2 rows" in cost.verdict(full, "one_backward", "one_backward/2", 1.0, 1.0, 1.6)
    lora = dict(full, lora=True)  # LoRA's FLOP target is tighter (1.05x) than full fine-tuning's (1.3x)
    assert cost.verdict(lora, "one_backward", "one_backward/8", 1.1, 1.0, 1.0).startswith("no: FLOPs 1.10x; the norms'")
    assert cost.verdict(full, "one_backward", "one_backward/8", 1.1, 1.0, 1.0) == "yes"


def test_rerender_rewrites_the_table_from_the_json_without_counting(tmp_path):
    cost = load("cost_counts")
    cfg = dict(width="Qwen3-0.6B", batch=8, completion=256, tied=True, lora=False, ckpt=False)
    counted = dict(flops=1.0, peak_bytes=1.0, ops=1.0, per_layer_flops=1.0, rest_flops=1.0, predicted_flops=1.0,
                   predicted_bytes=1.0)
    res = dict(machine=dict(date="then", torch="t", transformers="x", trl="y"), command="cmd", rows=[
        dict(cfg, modes={"grpo": dict(counted, ran="grpo"),
                         "two_passes": dict(counted, flops=2.0, ops=2.0, ran="two_passes/8")})])
    (tmp_path / "c.json").write_text(json.dumps(res))
    assert cost.main(["--rerender", "--out", str(tmp_path), "--stem", "c"]) == 0
    md = (tmp_path / "c.md").read_text()
    assert "no: FLOPs 2.00x, calls 2.00x; the norms pass is a second forward and backward" in md
    assert json.loads((tmp_path / "c.json").read_text())["rows"] == res["rows"]


def test_host_syncs_counts_scalar_reads_and_device_to_host_copies():
    """``counting.HostSyncs`` (issue 56): ``.item()``/``bool()`` (a scalar read), value-sized outputs (``nonzero``),
    and ``.tolist()``/``.cpu()`` (a device-to-host copy on a GPU, no dispatch on a CPU), each once; a plain product
    none. The methods are restored afterwards."""
    from studies.counting import HostSyncs

    x = torch.arange(6.0)
    tolist = torch.Tensor.tolist
    with HostSyncs() as syncs:
        (x @ x).item()
        bool(x.sum() > 0)
        x.nonzero()
        x.tolist()
        x.cpu()
        x * 2
    assert syncs.total == 5 and syncs.calls["Tensor.tolist"] == 1 and syncs.calls["aten.nonzero"] == 1
    assert torch.Tensor.tolist is tolist


def test_the_summary_counts_each_modes_configurations_meeting_the_targets_and_each_ratios_range():
    cost = load("cost_counts")
    counted = dict(flops=1.0, peak_bytes=1.0, ops=100.0, syncs=9, per_layer_flops=1.0, rest_flops=1.0,
                   predicted_flops=1.0, predicted_bytes=1.0)
    rows = [dict(width="w", batch=8, completion=c, tied=True, lora=False, ckpt=False,
                 modes={"grpo": dict(counted, ran="grpo"),
                        "one_backward": dict(counted, ops=ops, syncs=syncs, ran="one_backward/8")})
            for c, ops, syncs in ((256, 120.0, 6), (512, 130.0, 12))]
    table = "\n".join(cost.summary(dict(rows=rows)))
    assert "| one_backward | 1 of 2 | 1.00x | 1.00x | 1.20x to 1.30x | -3 to +3 | 0, 0, 1, 1 |" in table
    assert "two_passes" not in table  # a mode not counted has no row


def test_each_counted_mode_runs_the_path_it_is_named_for():
    """``replay`` replays and ``auto_gpu`` keeps the factors on a simulated 80 GiB GPU, whatever the counting machine's
    own memory (the CPU's default reads the host's: a replay column that silently ran the host's choice was caught
    on 2026-11-28)."""
    cost = load("cost_counts")
    for mode, ran in [("replay", "replay/"), ("auto_gpu", "one_backward/"), ("one_backward", "one_backward/")]:
        row = cost.count_step("Qwen3-0.6B", 1, True, mode, 8, 64, False, True)
        assert row["ran"].startswith(ran), (mode, row["ran"])
