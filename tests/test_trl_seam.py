"""TRL drift: every GRPOTrainer method OBLR-PO overrides or reproduces is the one whose source we read (the table in
tests/seam_table.py), and a changed one fails here by name; oblr_trl/seam_table.py's sequence_inputs forms the loss's
inputs as TRL's _compute_loss does."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from trl import GRPOTrainer

import seam_table
from oblr_trl import OBLRPOTrainer
from oblr_trl.trl_seam import sequence_inputs


def test_no_trl_seam_has_changed():
    problems = seam_table.drift()
    assert not problems, "TRL changed under OBLR-PO:\n" + "\n".join(problems)


def test_every_override_of_grpo_trainer_is_a_listed_seam():
    """A new override of a GRPOTrainer method without a row in SEAMS (its why and what to re-check) fails here."""
    overridden = {name for name, value in vars(OBLRPOTrainer).items()
                  if inspect.isfunction(value) and hasattr(GRPOTrainer, name)}
    assert overridden, "OBLRPOTrainer overrides nothing?"
    assert overridden <= {seam.name for seam in seam_table.SEAMS}, overridden - {s.name for s in seam_table.SEAMS}


def test_the_hash_is_of_the_dedented_source():
    fn = GRPOTrainer._compute_loss
    import hashlib

    expected = hashlib.sha256(textwrap.dedent(inspect.getsource(fn)).encode()).hexdigest()[:16]
    assert seam_table.source_hash(fn) == expected
    assert len({seam.sha for seam in seam_table.SEAMS if seam.sha}) == sum(1 for s in seam_table.SEAMS if s.sha)


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
    problems = seam_table.drift()
    assert len(problems) == 1
    assert problems[0].startswith("GRPOTrainer._compute_loss changed in this TRL")
    assert "tests/test_loss_terms.py" in problems[0] and "re-check" in problems[0]


def test_a_moved_or_removed_method_fails_naming_it(monkeypatch):
    class Moved(GRPOTrainer):
        def training_step(self, *args, **kwargs):  # TRL moving it to a subclass/base: a new owner
            return super().training_step(*args, **kwargs)

    moved = seam_table.drift(trainer_cls=Moved)
    assert len(moved) == 1 and moved[0].startswith("Moved.training_step is now defined by")
    monkeypatch.delattr(GRPOTrainer, "_compute_loss")
    gone = seam_table.drift()
    assert len(gone) == 1 and gone[0].startswith("GRPOTrainer._compute_loss is gone")


def test_transformers_methods_are_checked_for_their_owner():
    unhashed = [seam for seam in seam_table.SEAMS if seam.sha is None]
    assert unhashed and all(seam.owner.startswith("transformers.") for seam in unhashed)


@pytest.mark.parametrize("seam", seam_table.SEAMS, ids=lambda s: s.name)
def test_every_seam_says_why_and_what_to_recheck(seam):
    assert seam.why and seam.recheck and seam.owner.endswith("." + seam.name)


def test_the_hash_printer_prints_each_seams_recorded_hash():
    """``python tests/seam_table.py`` prints what to paste after a re-check: on the pinned TRL, each recorded hash."""
    out = subprocess.run([sys.executable, seam_table.__file__], capture_output=True, text=True, timeout=300, check=True,
                         cwd=Path(seam_table.__file__).parent.parent)
    rows = [line.split() for line in out.stdout.splitlines()]
    assert [row[:2] for row in rows] == [[seam.name, seam.owner] for seam in seam_table.SEAMS]
    assert [row[2] for row, seam in zip(rows, seam_table.SEAMS) if seam.sha] == [
        seam.sha for seam in seam_table.SEAMS if seam.sha]


@pytest.mark.parametrize("tools", [False, True])
def test_sequence_inputs_are_prompt_then_completion_and_the_loss_mask_leaves_out_tool_tokens(tools):
    """The rows the norms passes and one_backward read: prompt then completion ids and masks side by side, and the
    completion tokens that enter TRL's loss (``completion_mask * tool_mask`` when the batch has tool calls)."""
    batch = {"prompt_ids": torch.tensor([[0, 5, 6], [7, 8, 9]]), "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
             "completion_ids": torch.tensor([[1, 2], [3, 4]]), "completion_mask": torch.tensor([[1, 1], [1, 0]])}
    if tools:
        batch["tool_mask"] = torch.tensor([[0, 1], [1, 1]])
    ids, attention, mask = sequence_inputs(batch)
    assert ids.tolist() == [[0, 5, 6, 1, 2], [7, 8, 9, 3, 4]]
    assert attention.tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert mask.tolist() == ([[0, 1], [1, 0]] if tools else [[1, 1], [1, 0]])
