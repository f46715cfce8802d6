"""OBLRPOConfig(one_backward=True): norms and update from one forward/backward give what the two-pass default gives."""

import contextlib
import logging

import pytest
import torch

from oblr_trl import OBLRPOConfig
from oblr_trl.advantages import raised
from oblr_trl.demo.tiny import build_model
from helpers import DATASET, GROUP, TOKENIZER, common_args, logged, train
from oblr_trl import OBLRPOTrainer


def nan_for_some(completions, **kwargs):
    """Rewards with spread, and None for every fifth completion (unscorable)."""
    return [None if i % 5 == 0 else float(c[0]["content"].count("1")) for i, c in enumerate(completions)]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_one_backward_matches_two_passes(loss_type):
    # fp32 and SGD: parameters then differ as the gradients do (Adam would magnify float noise in near-zero entries)
    # the paper's lr reading: every step's lr scale is the SNR factor (the calibrated default applies 1 while it calibrates)
    kwargs = common_args(max_steps=3, loss_type=loss_type, max_grad_norm=1e9, bf16=False, optim="sgd", learning_rate=1.0,
                         snr_lr_mode="eta_max")
    two, _ = train(OBLRPOTrainer, OBLRPOConfig(**kwargs, one_backward=False))
    one, probe = train(OBLRPOTrainer, OBLRPOConfig(**kwargs, one_backward=True))
    assert one.uses_one_backward and not two.uses_one_backward
    assert "oblr_gram" not in one.generations[0]  # no norms pass at generation time
    for key in ("oblr/lr_scale", "oblr/snr", "oblr/baseline_mean", "grad_norm", "loss", "oblr/weight_spread"):
        a, b = logged(one, key), logged(two, key)
        assert len(a) == len(b) == 3, key
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6), key
    assert any(0 < s < 1 for s in logged(one, "oblr/lr_scale"))
    # the advantages the update used: the same rows (TRL shuffles the batch; the index undoes it)
    for mb_one, mb_two in zip(one.micro_batches, two.micro_batches):
        assert torch.equal(mb_one["completion_ids"][torch.argsort(mb_one["oblr_row"])],
                           mb_two["completion_ids"][torch.argsort(mb_two["oblr_row"])])
    for (name, p), q in zip(one.model.named_parameters(), two.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("accumulation", [dict(gradient_accumulation_steps=2),
                                          dict(gradient_accumulation_steps=2, steps_per_generation=1)],
                         ids=["one-generation-per-step", "one-generation-per-micro-batch"])
def test_one_backward_with_gradient_accumulation_matches_two_passes(accumulation):
    """With gradient accumulation each micro-batch holds whole groups (re-split from TRL's shuffle), the gradient
    accumulates over the micro-batches, and the step equals the two-pass default's."""
    kwargs = common_args(max_steps=2, max_grad_norm=1e9, bf16=False, optim="sgd", learning_rate=1.0, **accumulation)
    two, _ = train(OBLRPOTrainer, OBLRPOConfig(**kwargs, one_backward=False))
    one, _ = train(OBLRPOTrainer, OBLRPOConfig(**kwargs, one_backward=True))
    assert one.uses_one_backward and len(one.micro_batches) == 4
    for mb in one.micro_batches:  # whole groups of 4 in every micro-batch of 8
        assert torch.bincount(mb["oblr_row"] // 4).tolist().count(4) == 2
    assert logged(one, "oblr/num_samples") == logged(two, "oblr/num_samples") == [4.0, 4.0]
    for key in ("oblr/lr_scale", "oblr/snr", "grad_norm", "loss"):
        assert logged(one, key) == pytest.approx(logged(two, key), rel=1e-4, abs=1e-6), key
    for (name, p), q in zip(one.model.named_parameters(), two.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)


def test_one_backward_with_lora_updates_the_adapters_only():
    import peft  # an install requirement (setup.cfg): missing is a failure, not a skip
    kwargs = common_args(max_steps=2, max_grad_norm=1e9, bf16=False, optim="sgd", learning_rate=1.0)

    def lora_model():
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                 task_type="CAUSAL_LM")
        return peft.get_peft_model(build_model(TOKENIZER), config)

    kwargs["lr_scale_min"] = 0.5  # the adapters move even where the SNR is ~0
    two, _ = train(OBLRPOTrainer, OBLRPOConfig(**kwargs), model=lora_model())
    one, _ = train(OBLRPOTrainer, OBLRPOConfig(**kwargs, one_backward=True), model=lora_model())
    assert one.uses_one_backward
    assert logged(one, "oblr/lr_scale") == pytest.approx(logged(two, "oblr/lr_scale"), rel=1e-4, abs=1e-6)
    assert logged(one, "grad_norm") == pytest.approx(logged(two, "grad_norm"), rel=1e-4)
    base = build_model(TOKENIZER)
    moved = [n for n, p in one.model.named_parameters() if "lora_B" in n and p.abs().max() > 0]
    assert moved  # lora_B starts at zero: the update reached the adapters
    for name, p in one.model.get_base_model().named_parameters():
        if "lora_" not in name:  # the base weights are untouched
            torch.testing.assert_close(p, base.get_parameter(name.replace(".base_layer", "")), rtol=0, atol=0)
    for (name, p), q in zip(one.model.named_parameters(), two.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)


def test_one_backward_with_unscorable_completions_stays_finite(caplog):
    with caplog.at_level(logging.WARNING):
        trainer, _ = train(OBLRPOTrainer, OBLRPOConfig(**common_args(max_steps=2), one_backward=True), reward=nan_for_some)
    assert trainer.uses_one_backward
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert logged(trainer, "oblr/unscorable")[0] > 0
    assert "no reward" in caplog.text


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (dict(gradient_accumulation_steps=2, per_device_train_batch_size=6, num_generations=4, generation_batch_size=12),
         "per_device_train_batch_size=6 is not a multiple of num_generations=4"),
        (dict(steps_per_generation=2), "steps_per_generation=2 does not divide gradient_accumulation_steps=1"),
        (dict(num_iterations=2), "num_iterations=2"),
        (dict(top_entropy_quantile=0.5), "top_entropy_quantile"),
    ],
)
def test_one_backward_falls_back_to_two_passes_and_says_why(overrides, reason, caplog):
    with caplog.at_level(logging.WARNING):
        trainer, _ = train(OBLRPOTrainer, OBLRPOConfig(**common_args(max_steps=1, **overrides), one_backward=True))
    assert not trainer.uses_one_backward
    assert "falls back to two passes" in caplog.text and reason in caplog.text
    assert "oblr_gram" in trainer.generations[0]  # the norms pass ran
    assert len(logged(trainer, "oblr/lr_scale")) == 1


def test_one_backward_blockers_cover_what_cpu_tests_cannot_build():
    """fp16 (loss scaling), FSDP1, vLLM importance weights, Liger, an entropy bonus and a router auxiliary loss: the
    pure blockers function on the settings alone (the first four cannot be set up on this CPU)."""
    from types import SimpleNamespace

    from oblr_trl.path_choice import blockers as one_backward_blockers

    base = dict(num_iterations=1, beta=0.0, gradient_accumulation_steps=1, steps_per_generation=1, use_vllm=False,
                per_device_train_batch_size=8, num_generations=4,
                vllm_importance_sampling_correction=True, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
                use_liger_kernel=False, fp16=False, entropy_coef=0.0, use_adaptive_entropy=False)

    def blockers(fsdp1=False, aux_loss=False, **overrides):
        return one_backward_blockers(SimpleNamespace(**{**base, **overrides}), fsdp1=fsdp1, aux_loss=aux_loss)

    assert blockers() == []
    assert "fp16" in blockers(fp16=True)[0]
    assert "FSDP1" in blockers(fsdp1=True)[0]
    assert "vllm_importance_sampling_correction" in blockers(use_vllm=True)[0]
    assert blockers(use_vllm=True, vllm_importance_sampling_correction=False) == []
    assert "Liger" in blockers(use_liger_kernel=True)[0]
    assert "entropy bonus" in blockers(entropy_coef=0.01)[0]
    assert "entropy bonus" in blockers(use_adaptive_entropy=True)[0]
    assert "auxiliary loss" in blockers(aux_loss=True)[0]


# ------------------------------------------------------------------------------------- the automatic choice
@pytest.mark.parametrize("figure", [True, False], ids=["memory-aware-cpu", "no-memory-figure"])
def test_the_default_follows_the_cost_model(figure, monkeypatch, caplog):
    """The automatic choice is the cost model's for the model's and the batch's shapes, made at the first generation
    and logged with the predicted ratios: path_choice.choose_within the budget device_budget finds (on the CPU, the
    host's memory), or path_choice.choose (the ratio targets) on a device with no free-memory figure."""
    from oblr_trl import path_choice
    from oblr_trl.path_choice import describe

    budgets, real = [], path_choice.device_budget
    monkeypatch.setattr(path_choice, "device_budget", lambda *a, **k: budgets.append(real(*a, **k) if figure else None)
                        or budgets[-1])
    with caplog.at_level(logging.INFO, logger="oblr_trl.trainer"):
        trainer, _ = train(OBLRPOTrainer, OBLRPOConfig(**common_args(max_steps=1, gradient_checkpointing=False)))
    batch = trainer.generations[0]
    args = trainer.args
    shape = describe(trainer.model, args.per_device_train_batch_size, batch["prompt_ids"].shape[1],
                     trainer.max_completion_length, 2 if args.bf16 else 4, False, GROUP)
    assert shape.layers == trainer.model.config.num_hidden_layers and shape.vocab == trainer.model.config.vocab_size
    assert len(budgets) == 1 and (budgets[0] is not None) is figure
    choice = path_choice.choose_on_host(shape, budgets[0]) if figure else path_choice.choose(shape)
    assert trainer.args.one_backward is None and trainer.uses_one_backward is choice.one_backward
    assert trainer.route.chunk_rows == choice.chunk
    assert budgets[0] is None or budgets[0].host  # the CPU's host rule
    assert (f"{choice.flops_ratio:.2f}x GRPO's" if figure else f"{choice.flops_ratio:.2f}x the FLOPs") in caplog.text
    assert ("memory-aware" in caplog.text) is figure


@pytest.mark.parametrize("grpo_bytes, chunk", [(800, 8), (4, 4), (1, 0)],
                         ids=["micro-batch-fits", "one-group-per-chunk", "not-one-group"])
def test_the_default_chunks_by_the_cost_models_bytes(grpo_bytes, chunk, monkeypatch, caplog):
    """On a device with no free-memory figure the default runs the largest chunk of whole groups whose predicted peak
    is within 1.1x GRPO's under checkpointing: the whole micro-batch of 8 (2 groups of 4) where it fits, one group at a
    time where only one does, the two-pass path where not even one (the byte model replaced by one where a chunk of
    ``c`` rows costs ``c``)."""
    from oblr_trl import cost_model, path_choice

    monkeypatch.setattr(path_choice, "device_budget", lambda *args, **kwargs: None)

    def bytes_(shape, mode, chunk=0):
        return (chunk or shape.rows) if mode == "one_backward" else grpo_bytes

    monkeypatch.setattr(cost_model, "peak_bytes", bytes_)
    monkeypatch.setattr(cost_model, "flops", lambda shape, mode: 1.0)
    with caplog.at_level(logging.INFO, logger="oblr_trl.trainer"):
        trainer, _ = train(OBLRPOTrainer, OBLRPOConfig(**common_args(max_steps=2)))
    assert trainer.args.gradient_checkpointing  # TRL's default
    assert trainer.uses_one_backward is (chunk > 0) and trainer.route.chunk_rows == chunk
    assert ("oblr_gram" in trainer.generations[0]) is (chunk == 0)  # the norms pass ran only on the two-pass path
    expected = {8: "one forward/backward per micro-batch.", 4: "per chunk of 4 rows (1 groups)",
                0: "two passes (norms pass, then the loss pass)."}[chunk]
    assert expected in caplog.text
    assert len(logged(trainer, "oblr/lr_scale")) == 2


def test_the_default_takes_two_passes_where_one_backwards_flops_exceed_the_target(monkeypatch):
    from oblr_trl import cost_model

    monkeypatch.setattr(cost_model, "flops", lambda shape, mode: 1.31 if mode == "one_backward" else 1.0)
    trainer, _ = train(OBLRPOTrainer, OBLRPOConfig(**common_args(max_steps=1, gradient_checkpointing=False)))
    assert not trainer.uses_one_backward and "oblr_gram" in trainer.generations[0]


def test_each_chunks_factors_are_freed_before_the_next_chunks_forward(monkeypatch):
    """In chunks, the previous chunk's per-sequence gradients (every layer's factors) are gone when the next chunk's
    forward starts: otherwise two chunks' factors are held at the peak."""
    import gc
    import weakref

    import oblr_trl.one_backward as ob
    from oblr_trl import path_choice

    real, alive_at_call = ob.per_sequence_grads, []
    earlier: list[weakref.ref] = []

    def spy(*args, **kwargs):
        gc.collect()
        alive_at_call.append(sum(ref() is not None for ref in earlier))
        grads = real(*args, **kwargs)
        earlier.append(weakref.ref(grads))
        return grads

    monkeypatch.setattr(path_choice, "fitting_chunk", lambda shape, budget=None: (0, float("inf")))
    monkeypatch.setattr(ob, "per_sequence_grads", spy)
    trainer, _ = train(OBLRPOTrainer, OBLRPOConfig(**common_args(max_steps=1), one_backward=True))
    assert trainer.route.chunk_rows == GROUP and len(alive_at_call) == 2
    assert alive_at_call == [0, 0]


def test_the_two_pass_norms_pass_runs_in_the_cost_models_chunks(monkeypatch):
    """Two passes under checkpointing: the norms pass takes path_choice.norms_chunk's rows at a time (here 4 of 8)."""
    from oblr_trl import norm_passes, path_choice

    chunks = []
    real = norm_passes.norm_products

    def spy(*args, chunk, **kwargs):
        chunks.append(chunk)
        return real(*args, chunk=chunk, **kwargs)

    monkeypatch.setattr(path_choice, "norms_chunk", lambda shape, budget=None: GROUP)
    monkeypatch.setattr(norm_passes, "norm_products", spy)
    trainer, _ = train(OBLRPOTrainer, OBLRPOConfig(**common_args(max_steps=1), one_backward=False))
    assert trainer.args.gradient_checkpointing and chunks == [GROUP] < [trainer.args.per_device_train_batch_size]


def test_one_backward_true_under_checkpointing_runs_one_group_at_a_time_where_none_fits(monkeypatch):
    from oblr_trl import path_choice

    monkeypatch.setattr(path_choice, "fitting_chunk", lambda shape, budget=None: (0, float("inf")))
    trainer, _ = train(OBLRPOTrainer, OBLRPOConfig(**common_args(max_steps=1), one_backward=True))
    assert trainer.uses_one_backward and trainer.route.chunk_rows == GROUP


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo"])
def test_one_backward_in_chunks_matches_two_passes(loss_type, monkeypatch):
    """One group per chunk under checkpointing: the same advantages, SNR terms, gradient and step as the two-pass
    path (a token-mean loss's denominator spans the whole micro-batch, not the chunk)."""
    from oblr_trl import path_choice

    monkeypatch.setattr(path_choice, "fitting_chunk", lambda shape, budget=None: (0, float("inf")))
    # the paper's lr reading: every step's lr scale is the SNR factor (the calibrated default applies 1 while it calibrates)
    kwargs = common_args(max_steps=3, loss_type=loss_type, max_grad_norm=1e9, bf16=False, optim="sgd", learning_rate=1.0,
                         snr_lr_mode="eta_max")
    two, _ = train(OBLRPOTrainer, OBLRPOConfig(**kwargs, one_backward=False))
    one, _ = train(OBLRPOTrainer, OBLRPOConfig(**kwargs, one_backward=True))
    assert one.route.chunk_rows == GROUP < kwargs["per_device_train_batch_size"]
    for key in ("oblr/lr_scale", "oblr/snr", "oblr/baseline_mean", "grad_norm", "loss"):
        assert logged(one, key) == pytest.approx(logged(two, key), rel=1e-4, abs=1e-6), key
    for (name, p), q in zip(one.model.named_parameters(), two.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)


def test_one_backward_option_parses_as_a_three_way_flag():
    from trl import TrlParser

    parser = TrlParser((OBLRPOConfig,))
    for argv, expected in [([], None), (["--one_backward", "false"], False), (["--one_backward", "true"], True)]:
        (config,) = parser.parse_args_and_config(["--output_dir", "/tmp/x", "--use_cpu", "true", *argv])
        assert config.one_backward is expected, argv


def test_initial_choice_table():
    from oblr_trl.path_choice import initial_choice

    assert initial_choice(None, []) == (None, "")  # decided at the first generation, by the cost model
    assert initial_choice(True, [])[0] is True
    choice, why = initial_choice(True, ["beta=0.1 (a KL term in the loss)"])
    assert choice is False and "falls back" in why and "beta=0.1" in why
    assert initial_choice(None, ["fp16=True"])[0] is False


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_replayed_update_matches_per_row_autograd_under_checkpointing(tied):
    """one_backward replayed (under non-reentrant checkpointing, no per-layer factors kept): the streamed norms and
    within-unit products, and the update ``sum_i a_i u_i`` from the second backward of the pass's graph plus the head's
    usages, equal per-row autograd's in fp32 (rows with padding and an empty completion; a tied head counted once)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from oblr_trl.grad_norms import per_sequence_grads
    from oblr_trl.one_backward import replayed_update
    from reference import padded_batch, per_sample_grads, within_group_products

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied)
    model = Qwen3ForCausalLM(config).float().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, attention, mask = padded_batch(97)
    rows = per_sample_grads(model, ids, attention, mask)
    grads = per_sequence_grads(model, ids, attention, mask, stream_group_size=2, keep_graph=True)
    torch.testing.assert_close(grads.inner_products(2).double(), within_group_products(rows, 2), rtol=1e-5, atol=1e-9)
    a = torch.randn(ids.shape[0])
    replayed_update(grads, a, torch.zeros_like(a, dtype=torch.bool))
    got = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad]).double()
    expected = sum(ai * g.double() for ai, g in zip(a.tolist(), rows))
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-5


def force_replay(monkeypatch, rows: int = GROUP):
    """The default's choice replaced by one_backward replayed, ``rows`` per chunk."""
    from oblr_trl import path_choice

    real = path_choice.choose
    monkeypatch.setattr(path_choice, "device_budget", lambda *args, **kwargs: None)  # the ratio rule's choose

    def replay(shape, replay=True):
        return path_choice.Choice(True, rows, real(shape, replay).flops_ratio, 1.0, replay=True)

    monkeypatch.setattr(path_choice, "choose", replay)


def test_one_backward_replayed_under_bf16_updates_every_parameter(monkeypatch):
    """bf16 autocast (the second backward runs outside the autocast context: checkpointing recomputes under the
    forward's): every parameter moves, and nothing is NaN."""
    force_replay(monkeypatch, rows=8)
    model = build_model(TOKENIZER)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer, _ = train(OBLRPOTrainer, OBLRPOConfig(**common_args(max_steps=1, bf16=True)), model=model)
    assert trainer.route.replay and trainer.route.chunk_rows == 8
    for name, p in trainer.model.named_parameters():
        assert torch.isfinite(p).all() and not torch.equal(p, before[name]), name


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_one_backward_replayed_matches_two_passes(loss_type, monkeypatch, caplog):
    """The default under checkpointing where the kept factors do not fit: one_backward replayed (one group per chunk
    here), with the same advantages, SNR terms, gradient and step as the two-pass path."""
    force_replay(monkeypatch)
    # the paper's lr reading: every step's lr scale is the SNR factor (the calibrated default applies 1 while it calibrates)
    kwargs = common_args(max_steps=3, loss_type=loss_type, max_grad_norm=1e9, bf16=False, optim="sgd", learning_rate=1.0,
                         snr_lr_mode="eta_max")
    two, _ = train(OBLRPOTrainer, OBLRPOConfig(**kwargs, one_backward=False))
    with caplog.at_level(logging.INFO, logger="oblr_trl.trainer"):
        one, _ = train(OBLRPOTrainer, OBLRPOConfig(**kwargs))
    assert one.args.gradient_checkpointing and one.uses_one_backward and one.route.replay
    assert one.route.chunk_rows == GROUP and "oblr_gram" not in one.generations[0]
    assert "replayed by a second backward" in caplog.text
    for key in ("oblr/lr_scale", "oblr/snr", "oblr/baseline_mean", "grad_norm", "loss"):
        assert logged(one, key) == pytest.approx(logged(two, key), rel=1e-4, abs=1e-6), key
    for (name, p), q in zip(one.model.named_parameters(), two.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)
def _chunk_batch(rows=6, prompt=5):
    from reference import padded_batch

    ids, attention, completion_mask = padded_batch(len(TOKENIZER), batch=rows, prompt=prompt)
    return {"prompt_ids": ids[:, :prompt], "prompt_mask": attention[:, :prompt], "completion_ids": ids[:, prompt:],
            "completion_mask": completion_mask, "oblr_row": torch.arange(10, 10 + rows)}


@pytest.mark.parametrize("snr_unit", [2, 1, None], ids=["groups-of-2", "one-row", "no-snr"])
def test_chunk_norms_then_update_match_per_sample_autograd(snr_unit):
    """The stages of one_backward, without a trainer: each chunk's norms (its rows' ||u_i||^2), then, given a_i, the
    update -sum_i a_i u_i added to .grad, the SNR units' ||sum_{i in q} a_i u_i||^2 and ids, and the loss value,
    all as a loop of per-sample autograd gives them."""
    from oblr_trl import one_backward
    from reference import completion_logprob_sums, per_sample_grads

    model, batch = build_model(TOKENIZER), _chunk_batch()
    ids, attention, mask = (torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
                            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1), batch["completion_mask"])
    per_sample = torch.stack(per_sample_grads(model, ids, attention, mask, temperature=0.7)).double()
    a = torch.tensor([0.5, -1.25, 3.0, 0.0, -0.75, 2.0])
    loss, formed = 0.0, []
    for norms in one_backward.chunk_norms(model, batch, chunk=2, temperature=0.7, autocast=contextlib.nullcontext):
        rows = norms.rows
        torch.testing.assert_close(norms.sq_norms.double(), per_sample[rows].pow(2).sum(1), rtol=1e-4, atol=1e-6)
        assert not norms.unscorable.any() and raised(norms.found) == ()
        update = norms.update(a[rows], snr_unit=snr_unit)
        loss = loss + update.loss
        if snr_unit is None:
            assert update.units is None and update.unit_sq is None
        else:
            formed.append((update.units, update.unit_sq))
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    (-(completion_logprob_sums(model, ids, attention, mask, temperature=0.7) * a).sum()).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(ours[n], p.grad, rtol=1e-4, atol=1e-5, msg=n)  # |grad| up to ~20
    assert float(loss) == pytest.approx(float(-(a * mask.sum(-1)).sum()))
    if snr_unit is not None:
        units = torch.cat([u for u, _ in formed])
        assert units.tolist() == (torch.arange(10, 16)[::snr_unit] // snr_unit).tolist()
        h = (a.double()[:, None] * per_sample).reshape(6 // snr_unit, snr_unit, -1).sum(1)
        torch.testing.assert_close(torch.cat([s for _, s in formed]).double(), h.pow(2).sum(1), rtol=1e-4, atol=1e-6)


def test_chunk_norms_refuse_a_lost_or_repeated_update():
    """A chunk's update runs once, before the next chunk's forward: asking for the next chunk first, or updating
    twice, is refused (the update would be lost, or added twice)."""
    from oblr_trl import one_backward

    model, batch = build_model(TOKENIZER), _chunk_batch(rows=4)
    chunks = one_backward.chunk_norms(model, batch, chunk=2, temperature=1.0, autocast=contextlib.nullcontext)
    first = next(chunks)
    first.update(torch.ones(2), snr_unit=None)
    with pytest.raises(RuntimeError, match="has run already"):
        first.update(torch.ones(2), snr_unit=None)
    next(chunks)
    with pytest.raises(RuntimeError, match="was not applied"):
        next(chunks)


def test_the_automatic_choice_never_replays_under_reentrant_checkpointing(monkeypatch, caplog):
    """A reentrant layer runs under the norms pass's own checkpoint, whose graph a second backward cannot take the
    update from: where the rule would replay, the automatic choice takes one_backward unreplayed or two passes,
    says so, and trains with the same lr scales as two passes."""
    from oblr_trl import path_choice

    real = path_choice.choose
    monkeypatch.setattr(path_choice, "device_budget", lambda *args, **kwargs: None)  # the ratio rule's choose
    asked = []

    def replay_where_allowed(shape, replay=True):
        asked.append(replay)
        return path_choice.Choice(True, GROUP, 1.0, 1.0, replay=True) if replay else real(shape, replay)

    monkeypatch.setattr(path_choice, "choose", replay_where_allowed)
    kwargs = common_args(max_steps=2, bf16=False, gradient_checkpointing_kwargs={"use_reentrant": True})
    with caplog.at_level(logging.INFO, logger="oblr_trl.trainer"):
        one, _ = train(OBLRPOTrainer, OBLRPOConfig(**kwargs))
    assert asked == [False] and not one.route.replay
    assert "never replayed" in caplog.text
    two, _ = train(OBLRPOTrainer, OBLRPOConfig(**kwargs, one_backward=False))
    assert logged(one, "oblr/lr_scale") == pytest.approx(logged(two, "oblr/lr_scale"), rel=1e-4)


HEAD_ADAPTERS = {  # PEFT on the LM head (grad_norms/head_adapters.py)
    "trainable tokens, tied": (True, dict(target_modules=["q_proj"], trainable_token_indices=[5, 6, 7])),
    "LoRA on lm_head, tied": (True, dict(target_modules=["q_proj", "lm_head"], init_lora_weights="gaussian")),
    "LoRA on lm_head, untied": (False, dict(target_modules=["lm_head"], init_lora_weights="gaussian")),
}


@pytest.mark.parametrize("replayed", [False, True], ids=["kept factors", "replayed"])
@pytest.mark.parametrize("kind", list(HEAD_ADAPTERS))
def test_one_backwards_update_with_peft_on_the_head_matches_per_row_autograd(kind, replayed):
    """The update ``sum_i a_i u_i`` one_backward writes, from the kept factors (materialize) or replayed (a second
    backward of the pass's graph plus the head's usages), with the head's adapter among the usages: per-row
    autograd's, in fp32. (The trainer cannot run these in TRL 1.16: tests/integration/test_adapters_in_trainer.py.)"""
    import peft
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from oblr_trl.grad_norms import per_sequence_grads
    from oblr_trl.one_backward import replayed_update
    from reference import padded_batch, per_sample_grads

    tie, config = HEAD_ADAPTERS[kind]
    torch.manual_seed(0)
    base = Qwen3ForCausalLM(Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        tie_word_embeddings=tie))
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, **config)).train()
    model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.get_base_model().enable_input_require_grads()
    ids, attention, mask = padded_batch(97)
    rows = per_sample_grads(model, ids, attention, mask)
    a = torch.randn(ids.shape[0])
    if replayed:
        grads = per_sequence_grads(model, ids, attention, mask, stream_group_size=2, keep_graph=True)
        replayed_update(grads, a, torch.zeros_like(a, dtype=torch.bool))
    else:
        per_sequence_grads(model, ids, attention, mask, materialize=True).accumulate_grad(a)
    got = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad]).double()
    expected = sum(ai * g.double() for ai, g in zip(a.tolist(), rows))
    assert expected.norm() > 0 and ((got - expected).norm() / expected.norm()).item() <= 1e-5
