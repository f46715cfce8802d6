"""TRL drift: every GRPOTrainer method OBLR-PO overrides or reproduces is the one whose source we read
(`oblr_trl.trl_seam`), and a changed one fails here by name."""

from __future__ import annotations

import inspect
import textwrap

import pytest
from trl import GRPOTrainer

from oblr_trl import OBLRPOTrainer, trl_seam


def test_no_trl_seam_has_changed():
    problems = trl_seam.drift()
    assert not problems, "TRL changed under OBLR-PO:\n" + "\n".join(problems)


def test_every_override_of_grpo_trainer_is_a_listed_seam():
    """A new override of a GRPOTrainer method without a row in SEAMS (its why and what to re-check) fails here."""
    overridden = {name for name, value in vars(OBLRPOTrainer).items()
                  if inspect.isfunction(value) and hasattr(GRPOTrainer, name)}
    assert overridden, "OBLRPOTrainer overrides nothing?"
    assert overridden <= {seam.name for seam in trl_seam.SEAMS}, overridden - {s.name for s in trl_seam.SEAMS}


def test_the_hash_is_of_the_dedented_source():
    fn = GRPOTrainer._compute_loss
    import hashlib

    expected = hashlib.sha256(textwrap.dedent(inspect.getsource(fn)).encode()).hexdigest()[:16]
    assert trl_seam.source_hash(fn) == expected
    assert len({seam.sha for seam in trl_seam.SEAMS if seam.sha}) == sum(1 for s in trl_seam.SEAMS if s.sha)


def test_a_changed_method_fails_naming_it_and_what_to_recheck(monkeypatch):
    """Stand in for a TRL upgrade: `_compute_loss` with one line more. The check names the method and the re-check."""
    original = GRPOTrainer._compute_loss
    namespace = {}
    source = textwrap.dedent(inspect.getsource(original)).rstrip() + "\n    # a TRL upgrade: one line more\n"
    exec(compile(source.replace("def _compute_loss", "def _changed_compute_loss", 1), "<trl-upgrade>", "exec"),
         original.__globals__, namespace)
    changed = namespace["_changed_compute_loss"]
    changed.__module__, changed.__qualname__ = original.__module__, original.__qualname__
    monkeypatch.setattr(inspect, "getsource", lambda obj, _real=inspect.getsource: (
        source if obj is changed else _real(obj)))
    monkeypatch.setattr(GRPOTrainer, "_compute_loss", changed)
    problems = trl_seam.drift()
    assert len(problems) == 1
    assert problems[0].startswith("GRPOTrainer._compute_loss changed in this TRL")
    assert "tests/test_loss_terms.py" in problems[0] and "re-check" in problems[0]


def test_a_moved_or_removed_method_fails_naming_it(monkeypatch):
    class Moved(GRPOTrainer):
        def training_step(self, *args, **kwargs):  # TRL moving it to a subclass/base: a new owner
            return super().training_step(*args, **kwargs)

    moved = trl_seam.drift(trainer_cls=Moved)
    assert len(moved) == 1 and moved[0].startswith("Moved.training_step is now defined by")
    monkeypatch.delattr(GRPOTrainer, "_compute_loss")
    gone = trl_seam.drift()
    assert len(gone) == 1 and gone[0].startswith("GRPOTrainer._compute_loss is gone")


def test_transformers_methods_are_checked_for_their_owner():
    unhashed = [seam for seam in trl_seam.SEAMS if seam.sha is None]
    assert unhashed and all(seam.owner.startswith("transformers.") for seam in unhashed)


@pytest.mark.parametrize("seam", trl_seam.SEAMS, ids=lambda s: s.name)
def test_every_seam_says_why_and_what_to_recheck(seam):
    assert seam.why and seam.recheck and seam.owner.endswith("." + seam.name)
