"""The studies' draft-accuracy measures (selfspec/training/studies/draft_accuracy.py): the continuations are the
target's greedy ones and are cached, and chain accuracies are probabilities that never grow with the chain's length."""

from __future__ import annotations

import torch

from selfspec.heads import create_drafter
from selfspec.models import load_target
from selfspec.training.studies import draft_accuracy
from selfspec.training.studies.draft_accuracy import dflash_chain_accuracy, eagle_chain_accuracy, greedy_continuations

from .helpers import hf_greedy, random_dflash_head, random_eagle_dir


def test_continuations_are_the_targets_greedy_ones_and_are_cached(tiny_checkpoint, tmp_path, monkeypatch):
    target = load_target(str(tiny_checkpoint))
    sets = greedy_continuations(target, tmp_path, 1, 6)  # one prompt a set: the tiny model's context is short
    assert list(sets) == ["mtbench", "humaneval", "sharegpt"] and all(len(rows) == 1 for rows in sets.values())
    for sequence, prompt_length in (rows[0] for rows in sets.values()):
        prompt = sequence[:prompt_length].tolist()
        assert sequence[prompt_length:].tolist() == hf_greedy(target, prompt, 6)
    monkeypatch.setattr(draft_accuracy, "speculative_generate", None)  # a second call must not decode
    again = greedy_continuations(target, tmp_path, 1, 6)
    assert all(torch.equal(a[0], b[0]) for name in sets for a, b in zip(sets[name], again[name], strict=True))


def test_chain_accuracies_are_probabilities_that_shrink_with_depth(tiny_checkpoint, tmp_path):
    target = load_target(str(tiny_checkpoint))
    target.model.generation_config.eos_token_id = []  # no early stop: continuations long enough for every depth
    rows = [row for rows in greedy_continuations(target, tmp_path, 1, 12).values() for row in rows]
    eagle = create_drafter("eagle", target, random_eagle_dir(target, tmp_path / "eagle")).head.float()
    dflash = random_dflash_head(target, block_size=6).float()
    for chain in (eagle_chain_accuracy(target, eagle, eagle.config, rows), dflash_chain_accuracy(target, dflash, rows)):
        assert len(chain) == 3 and all(0 <= value <= 1 for value in chain) and chain == sorted(chain, reverse=True)
    short = [(rows[0][0][: rows[0][1] + 2], rows[0][1])]  # two continuation tokens: no room for a 4-token block
    assert dflash_chain_accuracy(target, dflash, short) == [0.0, 0.0, 0.0]
