"""Sampling stays lossless: the first two generated tokens follow the target's own distribution.

Each sample runs the real loop (prefill, tree mask, target forward, verifier, cache compaction, a second step when
the first emitted only one token). The expected joint distribution comes from plain full forwards of the target
with the same temperature / top-k / top-p. A verifier that forgets to remove rejected mass must fail the test.
"""

from __future__ import annotations

import pytest

import selfspec.tree_attention.verifier as verify_module
from selfspec.sampling import StepDraws, position_uniform

from .helpers import BigramTreeDrafter, chi_square_p_value, chi_target, expected_joint, sample_joint

SAMPLES = 30_000


@pytest.fixture(scope="module")
def target():
    return chi_target()


@pytest.mark.parametrize(
    "drawn, without_replacement",
    [(False, False), (True, False), (True, True)],
    ids=["deterministic-children", "drawn-with-replacement", "drawn-without-replacement"],
)
def test_sampled_pairs_follow_target_distribution(target, drawn, without_replacement):
    expected = expected_joint(target)
    assert (expected > 1e-9).sum() >= 12, "the test distribution should have real spread"
    counts = sample_joint(target, BigramTreeDrafter(target, drawn, without_replacement), SAMPLES)
    p_value = chi_square_p_value(counts, expected)
    assert p_value > 1e-3, f"sampled distribution differs from the target's (chi-square p = {p_value:.2e})"


@pytest.mark.parametrize("drawn", [False, True], ids=["deterministic-children", "drawn"])
def test_broken_verifier_is_caught(target, monkeypatch, drawn):
    if drawn:
        # The classic bug: after a rejection, keep drawing from the full p instead of the residual.
        monkeypatch.setattr(verify_module, "_renormalise", lambda residual, fallback: fallback)
    else:
        # The uniform keyed on the step instead of the output position: the tokens one step emits share it.
        monkeypatch.setattr(StepDraws, "uniform", lambda self, depth: position_uniform(self.seed, self.position))
    counts = sample_joint(target, BigramTreeDrafter(target, drawn), 20_000)
    p_value = chi_square_p_value(counts, expected_joint(target))
    assert p_value < 1e-6, f"a broken verifier went unnoticed (p = {p_value:.2e})"
