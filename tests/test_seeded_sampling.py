"""Seeded sampling gives the text plain sampling gives with that seed, whatever is drafted.

The token at output position t is drawn from the target's p_t with a uniform keyed on (seed, t) alone; verification
of deterministic children accepts the child equal to that token. An oracle that proposes plain sampling's own text
(behind a wrong sibling at every level) makes every step accept several tokens, so a draw keyed on anything but the
position (the step, the node) shows up as a different text.
"""

from __future__ import annotations

import pytest
import torch

from selfspec.decoding import speculative_generate
from selfspec.errors import SelfspecError
from selfspec.heads import create_drafter
from selfspec.sampling import SamplingConfig, StepDraws, position_uniform

from .helpers import CORE_FAMILIES, PROMPT, DrawnDrafter, OracleDrafter, make_tiny_target, without_eos

SEEDED = SamplingConfig(temperature=0.8, top_k=20, top_p=0.9)


def plain(target, budget: int, seed: int) -> tuple[int, ...]:
    return speculative_generate(
        target, create_drafter("none", target), torch.tensor(PROMPT), budget, SEEDED, seed=seed
    )[0]


@pytest.mark.parametrize("kernels", ["stock", "fast"])
@pytest.mark.parametrize("family", CORE_FAMILIES)
def test_an_oracle_of_the_seeded_text_emits_it_in_long_steps(family, kernels):
    target = without_eos(make_tiny_target(family, path=kernels))
    for seed in (0, 3):
        expected = plain(target, 24, seed)
        drafter = OracleDrafter(target, PROMPT + list(expected), depth=4, decoys=True)
        tokens, stats = speculative_generate(target, drafter, torch.tensor(PROMPT), 24, SEEDED, seed=seed, pace=False)
        assert tokens == expected, f"{family}/{kernels} seed {seed}"
        assert max(stats.accepted_lengths) == 5 and stats.target_forwards <= 24 // 5 + 1  # 4 accepted + 1 a step


def test_seeds_give_different_texts_and_the_same_seed_the_same_text():
    target = without_eos(make_tiny_target("llama"))
    texts = {plain(target, 16, seed) for seed in range(6)}
    assert len(texts) >= 5  # at T = 0.8 the seed matters
    assert plain(target, 16, 4) == plain(target, 16, 4)
    assert plain(target, 16, 4)[:7] == plain(target, 7, 4)  # the budget does not move earlier tokens


def test_a_draw_keyed_on_the_step_is_caught(monkeypatch):
    # The planted bug: every token a step emits uses the step's first uniform.
    target = without_eos(make_tiny_target("llama"))
    expected = [plain(target, 24, seed) for seed in range(4)]
    monkeypatch.setattr(StepDraws, "uniform", lambda self, depth: position_uniform(self.seed, self.position))
    differs = 0
    for seed in range(4):
        drafter = OracleDrafter(target, PROMPT + list(expected[seed]), depth=4, decoys=True)
        tokens, _ = speculative_generate(target, drafter, torch.tensor(PROMPT), 24, SEEDED, seed=seed, pace=False)
        differs += tokens != expected[seed]
    assert differs >= 3


def test_drawn_children_are_seeded_but_not_tied_to_the_position():
    # Children drawn from q keep the r < p/q rule: a fresh drafter with the same seed repeats its text.
    target = without_eos(make_tiny_target("llama"))
    runs = [
        speculative_generate(target, DrawnDrafter(target), torch.tensor(PROMPT), 16, SEEDED, seed=2, pace=False)[0]
        for _ in range(2)
    ]
    assert runs[0] == runs[1] and len(runs[0]) == 16


@pytest.mark.parametrize("seed", [None, 1.5, "7", True])
def test_a_seed_that_is_not_an_integer_is_a_clear_error(seed):
    target = make_tiny_target("llama")
    with pytest.raises(SelfspecError, match="seed must be an integer"):
        speculative_generate(target, create_drafter("none", target), torch.tensor(PROMPT), 4, SEEDED, seed=seed)
