"""Layers recognised by what they compute (oblr_trl/grad_norms/rules/recognition.py: norms and a scaled embedding
whose class names say nothing), one layer at a time against per-sample autograd (Opacus's ``run_test``:
tests/reference.py ``module_sq_norms``); a norm fed a second input is not taken."""

import pytest

from reference import D, hidden, token_ids, assert_rule_matches_per_sample_autograd


def _transformers_layers():
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm, Gemma3TextScaledWordEmbedding
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    from transformers.models.phi3.modeling_phi3 import Phi3RMSNorm

    return {
        "Phi3RMSNorm": (lambda: Phi3RMSNorm(D), hidden),
        "Olmo2RMSNorm": (lambda: Olmo2RMSNorm(D), hidden),
        "GemmaRMSNorm (1 + w)": (lambda: GemmaRMSNorm(D), hidden),
        "Gemma3RMSNorm (1 + w)": (lambda: Gemma3RMSNorm(D), hidden),
        "CohereLayerNorm": (lambda: CohereLayerNorm(D), hidden),
        "Gemma3TextScaledWordEmbedding": (lambda: Gemma3TextScaledWordEmbedding(20, D, padding_idx=0, embed_scale=3.5),
                                          token_ids),
    }


LAYERS = {
    **_transformers_layers(),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_rule_matches_per_sample_autograd(name):
    assert_rule_matches_per_sample_autograd(*LAYERS[name])


def test_gated_norms_take_the_per_row_path_not_the_plain_rms_rule():
    """MambaRMSNormGated(x, gate) normalises x * silu(gate): the RMSNorm rule, fed x alone, was wrong by 1.3-19x."""
    from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated

    from oblr_trl.grad_norms.coverage import how_handled

    assert how_handled(MambaRMSNormGated(8, group_size=8)) == "per-row"
