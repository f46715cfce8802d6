"""Importing the library has no global effects: no plotting library, no task library, no backend switch."""

import subprocess
import sys


def test_import_loads_neither_matplotlib_nor_reasoning_gym():
    code = ("import sys, oblr_trl; "
            "print(sorted(m for m in ('matplotlib', 'matplotlib.pyplot', 'reasoning_gym') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_star_import_is_the_trainer_and_the_demo_helpers_live_in_their_room():
    """`from oblr_trl import *`: trainer, config, estimators, registries, validate, norms API; no demo helper."""
    namespace = {}
    exec("from oblr_trl import *", namespace)
    assert {"OBLRPOTrainer", "OBLRPOConfig", "gradient_weighted_baseline", "snr_lr_scale", "BASELINES",
            "GRAD_NORM_ESTIMATORS", "SNR_ESTIMATORS", "register_baseline", "register_grad_norm_rule",
            "register_snr_estimator", "register_weight_estimator", "validate", "per_sequence_grad_sq_norms",
            "per_sequence_grad_inner_products"} <= set(namespace)
    assert not {"build_model", "make_dataset", "load_or_build_warm_model", "plot_training",
                "load_reference_model"} & set(namespace)
    from oblr_trl.demo import build_model, load_or_build_warm_model, make_dataset, make_reward_func  # noqa: F401


def test_load_reference_model_forwards_to_the_demo_room_and_moved_names_say_where_they_went():
    import pytest

    import oblr_trl
    import oblr_trl.demo

    assert oblr_trl.load_reference_model is oblr_trl.demo.load_reference_model
    with pytest.raises(AttributeError, match=r"oblr_trl.make_dataset moved to oblr_trl.demo .*"
                                             r"from oblr_trl.demo import make_dataset"):
        oblr_trl.make_dataset
    with pytest.raises(AttributeError, match=r"from oblr_trl.plotting import plot_training"):
        oblr_trl.plot_training
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        oblr_trl.no_such_name
    namespace = {}
    exec("from oblr_trl.plotting import plot_training; from oblr_trl.demo import make_dataset", namespace)
