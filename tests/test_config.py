"""`OBLRPOConfig`: validation at construction (naming the option and the allowed values) and `upgrade_config`."""

import dataclasses
import re

import pytest
from trl import GRPOConfig

from helpers import common_args
from oblr_trl import OBLRPOConfig
from oblr_trl.config import upgrade_config
from oblr_trl.loss_terms import LOSS_TYPES


def test_config_errors_name_the_option():
    with pytest.raises(ValueError, match="baseline.*allowed values"):
        OBLRPOConfig(**common_args(), baseline="median")
    with pytest.raises(ValueError, match="grad_norm_estimator"):
        OBLRPOConfig(**common_args(), grad_norm_estimator="approx")
    with pytest.raises(ValueError, match="loss_type"):
        OBLRPOConfig(**common_args(), loss_type="ppo")
    with pytest.raises(ValueError, match="scale_rewards"):
        OBLRPOConfig(**common_args(), scale_rewards="group")
    with pytest.raises(ValueError, match="multi_objective_aggregation"):
        OBLRPOConfig(**common_args(), multi_objective_aggregation="normalize_then_sum")
    with pytest.raises(ValueError, match="lr_scale_min"):
        OBLRPOConfig(**common_args(), lr_scale_min=1.5)
    with pytest.raises(ValueError, match="snr_sample_unit"):
        OBLRPOConfig(**common_args(), snr_sample_unit="token")
    with pytest.warns(UserWarning, match="num_iterations"):
        OBLRPOConfig(**common_args(), num_iterations=2)
    config = OBLRPOConfig(**common_args())
    assert (config.scale_rewards, config.beta, config.num_iterations, config.leave_one_out) == ("none", 0.0, 1, True)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_trl_loss_type_is_accepted(loss_type):
    assert OBLRPOConfig(**common_args(loss_type=loss_type)).loss_type == loss_type


def test_entropy_bonus_warns_that_the_snr_is_approximate():
    with pytest.warns(UserWarning, match="entropy bonus"):
        OBLRPOConfig(**common_args(entropy_coef=0.01))


def test_upgrade_keeps_every_grpo_option():
    grpo = GRPOConfig(**common_args(learning_rate=3e-3, num_generations=8, per_device_train_batch_size=16,
                                    scale_rewards="none", steps_per_generation=2, temperature=0.7))
    oblr = upgrade_config(grpo)
    for f in dataclasses.fields(GRPOConfig):
        if f.init:
            assert getattr(oblr, f.name) == getattr(grpo, f.name), f.name
    assert upgrade_config(oblr) is oblr
    with pytest.warns(UserWarning, match="scale_rewards='none'"):
        assert upgrade_config(GRPOConfig(**common_args())).scale_rewards == "none"


def test_default_lr_is_grpo_s_default_in_the_calibrated_mode():
    """learning_rate means what it means to GRPO (snr_lr_mode="calibrated", the default): so its default is GRPO's."""
    fields = {f.name: f.default for f in dataclasses.fields(OBLRPOConfig)}
    grpo_default = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}["learning_rate"]
    assert fields["learning_rate"] == grpo_default == 1e-6 and fields["snr_lr_mode"] == "calibrated"
    args = {k: v for k, v in common_args().items() if k != "learning_rate"}
    assert OBLRPOConfig(**args).learning_rate == grpo_default  # what a user who sets none gets


def test_an_unknown_snr_lr_mode_is_refused_naming_the_option_and_the_allowed_values():
    with pytest.raises(ValueError, match=re.escape("OBLRPOConfig.snr_lr_mode='eta' is not allowed; allowed values: "
                                                  "['calibrated', 'eta_max']")):
        OBLRPOConfig(**common_args(), snr_lr_mode="eta")
    assert OBLRPOConfig(**common_args(), snr_lr_mode="eta_max").snr_lr_mode == "eta_max"


def test_trl_default_batch_sizes_the_snr_step_by_completion_with_a_warning():
    """TRL's defaults (8 completions per step, 8 per prompt: one prompt) keep a sized step: 'auto' -> 'completion'."""
    with pytest.warns(UserWarning, match="1 prompt.*per_device_train_batch_size.*num_generations"):
        config = OBLRPOConfig(output_dir="/tmp/oblr-test", use_cpu=True, report_to="none")
    assert (config.per_device_train_batch_size, config.num_generations) == (8, 8)  # TRL's, inherited
    assert config.snr_sample_unit == "completion"
    # the drop-in path: a GRPOConfig with TRL's defaults, upgraded by OBLRPOTrainer
    with pytest.warns(UserWarning, match="1 prompt"):
        assert upgrade_config(GRPOConfig(output_dir="/tmp/oblr-test", use_cpu=True, report_to="none")
                              ).snr_sample_unit == "completion"


def test_a_config_with_two_prompts_per_step_counts_prompts():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        config = OBLRPOConfig(**common_args(per_device_train_batch_size=2 * common_args()["num_generations"]))
    assert config.snr_sample_unit == "group"
    assert OBLRPOConfig(**common_args(gradient_accumulation_steps=2, per_device_train_batch_size=common_args()[
        "num_generations"])).snr_sample_unit == "group"


def test_a_step_the_snr_cannot_size_is_refused_at_construction():
    one_prompt = common_args(per_device_train_batch_size=common_args()["num_generations"])
    with pytest.raises(ValueError, match="snr_sample_unit='group' needs >= 2 prompts.*per_device_train_batch_size"):
        OBLRPOConfig(**one_prompt, snr_sample_unit="group")
    assert OBLRPOConfig(**one_prompt, snr_sample_unit="group", snr_lr=False).snr_sample_unit == "group"
    assert OBLRPOConfig(**one_prompt, snr_sample_unit="completion").snr_sample_unit == "completion"


def test_a_negative_learning_rate_is_refused_at_construction():
    with pytest.raises(ValueError, match="learning_rate=-0.001 must be >= 0"):
        OBLRPOConfig(**common_args(learning_rate=-1e-3))


@pytest.mark.parametrize("option, value, message", [
    ("snr_lr", "false", "snr_lr='false' must be a bool, not a str (pass snr_lr=False, not a string)"),
    ("leave_one_out", "True", "leave_one_out='True' must be a bool, not a str (pass leave_one_out=True"),
    ("one_backward", "no", "one_backward='no' must be a bool or None, not a str (pass one_backward=False"),
    ("one_backward", 1, "one_backward=1 must be a bool or None, not an int"),
    ("snr_window", "10", "snr_window='10' must be an int, not a str"),
    ("snr_window", 10.0, "snr_window=10.0 must be an int, not a float"),
    ("lr_scale_min", "0.1", "lr_scale_min='0.1' must be a number, not a str"),
    ("snr_ema", True, "snr_ema=True must be a number, not a bool"),
    ("weight_clip", "10", "weight_clip='10' must be a number or None, not a str"),
])
def test_options_of_the_wrong_type_are_refused_naming_them(option, value, message):
    """issue 46: a string "false" is truthy, so `snr_lr="false"` acted as True; and `snr_window="10"` was reported as
    `snr_window=10 must be an integer`. Our options refuse any value of the wrong type, naming it with its quotes."""
    with pytest.raises(ValueError, match=re.escape(f"OBLRPOConfig.{message}")):
        OBLRPOConfig(**common_args(), **{option: value})


def test_snr_window_of_the_window_estimator_is_shown_with_its_quotes():
    from oblr_trl.snr_formulas import check_estimator

    with pytest.raises(ValueError, match=re.escape("snr_window='10' must be an integer")):
        check_estimator("window", 0.9, "10")


def test_a_grpo_config_keeps_its_lr_which_means_what_it_meant():
    """A GRPOConfig's lr is kept, and under the default calibrated mode it is the lr GRPO would apply: no warning
    about it (the one about scale_rewards stays)."""
    import warnings as w

    with w.catch_warnings(record=True) as caught:
        w.simplefilter("always")
        upgraded = upgrade_config(GRPOConfig(**{**common_args(), "learning_rate": 3e-6}))
    assert upgraded.learning_rate == 3e-6 and upgraded.snr_lr_mode == "calibrated"
    assert not [c for c in caught if "learning_rate" in str(c.message) or "eta_max" in str(c.message)]
