"""OBLRPOTrainer on the embedded tiny model: the lr it applies, its advantages, and its per-sample SNR terms."""

import copy
import logging
import math

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from helpers import DATASET, TOKENIZER, assert_finite_everywhere, common_args, length_reward, logged, train
from oblr_trl import OBLRPOConfig, OBLRPOTrainer, gradient_weighted_baseline, step_scale_from_contributions
from oblr_trl.demo.tiny import build_model
from oblr_trl.loss_terms import loss_coefficients
from reference import per_sample_grads

Recorder = OBLRPOTrainer  # helpers.train records every trainer it builds


def test_lr_is_scheduled_lr_times_logged_scale():
    trainer, probe = train(Recorder, OBLRPOConfig(**common_args(max_steps=3, gradient_accumulation_steps=2)))
    scales, scheduled = logged(trainer, "oblr/lr_scale"), logged(trainer, "learning_rate")
    factors = logged(trainer, "oblr/snr_factor")
    assert len(scales) == 3 and len(probe.applied) == 3 and len(factors) == 3
    for t, (applied, scale, lr) in enumerate(zip(probe.applied, scales, scheduled)):
        # the default snr_lr_mode="calibrated": its first 10 steps apply the scheduled lr (f > 0) while f_ref is measured
        assert scale == (1.0 if factors[t] > 0 else 0.0)
        assert 0.0 <= factors[t] <= 1.0 and 0.0 <= scale <= 2.0
        assert applied == pytest.approx(lr * scale, rel=1e-9, abs=1e-15)
    assert scales[0] == 1.0  # the first step applies the scheduled lr exactly
    assert logged(trainer, "oblr/eta_max") == pytest.approx(
        [lr / (sum(factors[: t + 1]) / (t + 1)) for t, lr in enumerate(scheduled)], rel=1e-12)
    for current, from_scheduler in probe.after:  # restored: the scheduler never compounds the scale
        assert current == pytest.approx(from_scheduler)
    assert any(0 < f < 1 for f in factors)
    # the noise scale B = 1/SNR in prompts, logged beside the SNR, and the factor is N / (N + B)
    noise_scales, snrs = logged(trainer, "oblr/noise_scale"), logged(trainer, "oblr/snr")
    n = logged(trainer, "oblr/num_samples")
    assert len(noise_scales) == 3 and all(math.isfinite(b) and b >= 0 for b in noise_scales)
    assert noise_scales == pytest.approx([1 / snr for snr in snrs], rel=1e-9)
    assert factors == pytest.approx([k / (k + b) for k, b in zip(n, noise_scales)], rel=1e-9)


def test_step_terms_match_per_sample_autograd():
    """sum_q ||H_q||^2 and ||G||^2 of one step, recomputed from per-sample autograd gradients u_i (float64 sums).

    In float32 (bf16=False), as the reference: under the CPU's default bf16 autocast the terms carry bf16 rounding
    (~1e-3), which the scale's cancellation n/(n-1) (1 - sum||H_q||^2/||G||^2) amplifies ~7x here, and whose size
    depends on the CPU's bf16 matmul kernel (AMX or AVX512-BF16): an exactness test cannot be one there."""
    args = OBLRPOConfig(**common_args(max_steps=1, gradient_accumulation_steps=2, max_grad_norm=1e9, bf16=False),
                        one_backward=False, snr_estimator="per_step")  # this step's own factor, as expected below
    model = build_model(TOKENIZER)
    reference_model = copy.deepcopy(model)  # the parameters the step's gradient was taken at
    trainer, _ = train(Recorder, args, model=model)
    total = None
    groups = {}
    for mb in trainer.micro_batches:
        ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], 1)
        att = torch.cat([mb["prompt_mask"], mb["completion_mask"]], 1)
        grads = per_sample_grads(reference_model, ids, att, mb["completion_mask"], temperature=args.temperature)
        coeffs = loss_coefficients(
            args.loss_type, mb["completion_mask"], accumulation_steps=2, num_processes=1, steps_per_generation=2,
            max_completion_length=args.max_completion_length, num_items_in_batch=mb["num_items_in_batch"],
        ) * mb["advantages"]
        for g, a, unit in zip(grads, coeffs, (mb["oblr_row"] // 4).tolist()):
            h = a.double() * g.double()
            total = h if total is None else total + h
            groups[unit] = h if unit not in groups else groups[unit] + h
    assert logged(trainer, "oblr/num_samples") == [len(groups)] == [4]  # 16 completions in the step, groups of 4
    assert logged(trainer, "grad_norm")[0] == pytest.approx(float(total.norm()), rel=1e-5)
    expected = step_scale_from_contributions(sum(float(h @ h) for h in groups.values()), float(total @ total), 4)
    assert logged(trainer, "oblr/snr_factor")[0] == pytest.approx(float(expected), rel=1e-5)  # measured: 2.5e-7
    assert 0 < float(expected) < 1


def test_advantages_use_the_gradient_weighted_leave_one_out_baseline():
    trainer, _ = train(Recorder, OBLRPOConfig(**common_args(max_steps=1), one_backward=False))
    gen = trainer.generations[0]
    weights = torch.diagonal(gen["oblr_gram"].reshape(-1, 4, 4), dim1=1, dim2=2).reshape(-1)
    rewards = gen["rewards"].sum(1)
    expected = rewards - gradient_weighted_baseline(rewards, weights, 4, leave_one_out=True)[0]
    torch.testing.assert_close(gen["advantages"], expected)
    assert not torch.allclose(expected, rewards - rewards.view(-1, 4).mean(1).repeat_interleave(4))


@pytest.mark.parametrize("scale_rewards", ["none", "group"])
def test_mean_baseline_without_snr_reproduces_grpo(scale_rewards):
    kwargs = common_args(max_steps=2, scale_rewards=scale_rewards)
    oblr, oblr_probe = train(Recorder, OBLRPOConfig(**kwargs, baseline="mean", leave_one_out=False, snr_lr=False))

    grpo, grpo_probe = train(GRPOTrainer, GRPOConfig(**kwargs))
    for ours, theirs in zip(oblr.generations, grpo.generations):
        torch.testing.assert_close(ours["advantages"], theirs["advantages"], rtol=0, atol=0)
    assert oblr_probe.applied == grpo_probe.applied
    for (name, p), q in zip(oblr.model.named_parameters(), grpo.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


# ------------------------------------------------------------------------------------------ degenerate data
def test_none_and_nan_rewards(caplog):
    calls = {"n": 0}

    def flaky_reward(completions, **kwargs):
        calls["n"] += 1
        out = [float(len(c[0]["content"]) % 3) for c in completions]
        out[0], out[1] = None, float("nan")
        out[5] = float("inf")
        return out

    with caplog.at_level(logging.WARNING):
        trainer, _ = train(Recorder, OBLRPOConfig(**common_args(max_steps=2)), reward=flaky_reward)
    assert_finite_everywhere(trainer)
    gen = trainer.generations[0]
    assert gen["advantages"][[0, 1, 5]].abs().sum() == 0  # unscorable: advantage 0
    assert logged(trainer, "oblr/unscorable")[0] == 3
    assert "no reward" in caplog.text and "inf" in caplog.text


def test_a_reward_none_for_every_sample_is_named_not_blamed_on_noise(caplog):
    with caplog.at_level(logging.WARNING):
        trainer, _ = train(Recorder, OBLRPOConfig(**common_args(max_steps=2)),
                           reward=lambda completions, **k: [None] * len(completions))
    assert logged(trainer, "oblr/lr_scale") == [0.0, 0.0]  # no step moves
    assert "each reward function returned None" in caplog.text and "check that the reward functions" in caplog.text
    assert "noise dominates" not in caplog.text


def test_a_dataset_without_prompt_column_fails_at_construction():
    from datasets import Dataset

    with pytest.raises(ValueError, match="`prompt` column.*question"):
        OBLRPOTrainer(model=build_model(TOKENIZER), processing_class=TOKENIZER, reward_funcs=[length_reward],
                      args=OBLRPOConfig(**common_args()), train_dataset=Dataset.from_list([{"question": "1 + 1"}] * 8))


def test_a_missing_model_path_fails_naming_it(tmp_path):
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(ValueError, match=f"{missing} does not exist"):
        OBLRPOTrainer(model=missing, reward_funcs=[length_reward], args=OBLRPOConfig(**common_args()),
                      train_dataset=DATASET)


def test_identical_rewards_give_zero_advantages_and_zero_step(caplog):
    with caplog.at_level(logging.WARNING):
        trainer, probe = train(Recorder, OBLRPOConfig(**common_args(max_steps=2)), reward=lambda completions, **k: [1.0] * len(completions))
    assert_finite_everywhere(trainer)
    assert all(g["advantages"].abs().max() == 0 for g in trainer.generations)
    assert logged(trainer, "oblr/lr_scale") == [0.0, 0.0]  # no signal: G = 0
    assert logged(trainer, "oblr/skipped_fraction") == [1.0, 1.0]
    assert logged(trainer, "oblr/noise_scale") == []  # no signal: unbounded, so not logged (never inf or NaN)
    assert "gradient was exactly 0" in caplog.text and "noise dominates" not in caplog.text


def test_empty_completions_and_zero_gradients(caplog):
    model = build_model(TOKENIZER)
    with torch.no_grad():  # make eos the only likely first token: every completion is empty
        model.lm_head.weight[TOKENIZER.eos_token_id] *= 0
        model.model.norm.weight.fill_(1.0)
    eos_bias = torch.nn.Parameter(torch.full((len(TOKENIZER),), -1e4))
    eos_bias.data[TOKENIZER.eos_token_id] = 1e4
    model.lm_head.bias = eos_bias  # the head now always says eos; its gradient is 0 at p(eos) = 1
    with caplog.at_level(logging.WARNING):
        trainer, probe = train(Recorder, OBLRPOConfig(**common_args(max_steps=1), one_backward=False), model=model)
    assert_finite_everywhere(trainer)
    gen = trainer.generations[0]
    assert (gen["completion_mask"].sum(1) == 1).all()  # an empty completion: eos alone
    assert (gen["completion_ids"][:, 0] == TOKENIZER.eos_token_id).all()
    assert gen["oblr_gram"].abs().max() == 0
    assert logged(trainer, "oblr/fallback_samples")[0] == len(gen["advantages"])  # every sample
    assert "fell back" in caplog.text


def test_a_step_with_one_sample_leaves_the_lr_unscaled(caplog):
    """One group per step: the SNR is undefined (N < 2). The lr is left as scheduled, warned, and no NaN is logged.
    (`OBLRPOConfig` refuses snr_sample_unit='group' with one prompt per step at construction; the trainer's guard is
    for a config changed afterwards.)"""
    config = OBLRPOConfig(**common_args(max_steps=2, per_device_train_batch_size=4), snr_sample_unit="completion")
    config.snr_sample_unit = "group"  # past the construction-time check
    with caplog.at_level(logging.WARNING):
        trainer, probe = train(Recorder, config)
    assert logged(trainer, "oblr/num_samples") == [1.0, 1.0]
    assert logged(trainer, "oblr/lr_scale") == [1.0, 1.0]
    assert logged(trainer, "oblr/snr") == []
    assert probe.applied == logged(trainer, "learning_rate")
    assert "the SNR needs 2" in caplog.text


def test_logit_proxy_weights_the_baseline_from_one_forward(monkeypatch):
    """grad_norm_estimator='logit' with snr_lr=False: no norms pass; the baseline is weighted by verl's proxy,
    recomputed here from the model's logits one completion at a time."""
    def no_norms(*args, **kwargs):
        raise AssertionError("a norms pass ran")

    monkeypatch.setattr("oblr_trl.one_backward.per_sequence_grads", no_norms)
    monkeypatch.setattr("oblr_trl.norm_passes.per_sequence_grad_inner_products", no_norms)
    model = build_model(TOKENIZER)
    reference_model = copy.deepcopy(model)
    trainer, _ = train(Recorder, OBLRPOConfig(**common_args(max_steps=1), grad_norm_estimator="logit", snr_lr=False),
                       model=model)
    gen = trainer.generations[0]
    proxy = []
    for i in range(len(gen["advantages"])):
        ids = torch.cat([gen["prompt_ids"][i], gen["completion_ids"][i]])[None]
        att = torch.cat([gen["prompt_mask"][i], gen["completion_mask"][i]])[None]
        with torch.no_grad():
            logits = reference_model(input_ids=ids, attention_mask=att).logits[0].double()
        length = gen["completion_ids"].shape[1]
        probs = torch.softmax(logits[-length - 1 : -1] / trainer.args.temperature, -1)
        p_token = probs.gather(-1, gen["completion_ids"][i][:, None])[:, 0]
        terms = 1 - 2 * p_token + (probs * probs).sum(-1)
        proxy.append(float((terms * gen["completion_mask"][i]).sum()))
    proxy = torch.tensor(proxy)
    rewards = gen["rewards"].sum(1)
    expected = rewards - gradient_weighted_baseline(rewards, proxy, 4, leave_one_out=True)[0]
    torch.testing.assert_close(gen["advantages"], expected.float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gen["oblr_proxy"], proxy.float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("one_backward", [False, True], ids=["two-passes", "one-backward"])
def test_training_leaves_no_autograd_graph_alive(one_backward):
    """Memory stays flat over steps: no step's graph outlives it (the norms pass once leaked each step's graph and
    factors through its hooks, and ``make demo`` grew to ~21 GB)."""
    import gc

    def graph_tensors():
        gc.collect()
        return sum(1 for o in gc.get_objects() if torch.is_tensor(o) and o.grad_fn is not None)

    before = graph_tensors()
    trainer, _ = train(OBLRPOTrainer, OBLRPOConfig(**common_args(max_steps=3), one_backward=one_backward))
    assert trainer.uses_one_backward == one_backward
    assert graph_tensors() == before
