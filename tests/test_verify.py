"""The verifier on hand-written trees and logits (no model involved)."""

from __future__ import annotations

import torch

from selfspec.sampling import SamplingConfig
from selfspec.tree_attention import DraftTree, verify

V = 10
GREEDY = SamplingConfig()


def logits_with_argmax(rows: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(rows), V)
    for node, token in enumerate(rows):
        logits[node, token] = 5.0
    return logits


def tree(tokens, parents, **kw) -> DraftTree:
    return DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents), **kw)


def test_greedy_walks_matching_children_and_emits_bonus():
    t = tree([9, 3, 4, 5], [-1, 0, 1, 2])  # chain 3, 4, 5
    result = verify(t, logits_with_argmax([3, 4, 5, 6]), GREEDY)
    assert result.accepted_path == (0, 1, 2, 3) and result.accepted_tokens == (3, 4, 5)
    assert result.next_token == 6 and result.is_bonus and result.emitted == (3, 4, 5, 6)


def test_greedy_recovers_at_first_mismatch_and_picks_second_child():
    # root -> [7, 3]; 3 -> [1, 4]
    t = tree([9, 7, 3, 1, 4], [-1, 0, 0, 2, 2])
    result = verify(t, logits_with_argmax([3, 0, 8, 0, 0]), GREEDY)
    assert result.accepted_path == (0, 2) and result.accepted_tokens == (3,)
    assert result.next_token == 8 and not result.is_bonus


def test_greedy_root_only_emits_argmax():
    result = verify(tree([9], [-1]), logits_with_argmax([2]), GREEDY)
    assert result.emitted == (2,) and result.accepted_path == (0,)


def test_out_of_vocabulary_child_never_accepted():
    t = tree([9, V + 3, 2], [-1, 0, 0])
    assert verify(t, logits_with_argmax([2, 0, 0]), GREEDY).accepted_path == (0, 2)
    sampled = verify(t, logits_with_argmax([2, 0, 0]) * 10, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
    assert sampled.accepted_path == (0, 2)


def test_sampling_certain_target_accepts_and_rejects_deterministically():
    # p is (numerically) one-hot: the right child is always accepted, a wrong one always rejected.
    t = tree([9, 1, 4], [-1, 0, 0])
    logits = logits_with_argmax([4, 0, 7]) * 100
    for seed in range(20):
        result = verify(t, logits, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(seed))
        assert result.accepted_path == (0, 2) and result.next_token == 7


def test_drawn_children_with_q_equal_p_always_accept():
    probs = torch.softmax(torch.randn(3, V, generator=torch.Generator().manual_seed(1)), -1)
    t = tree([9, 4, 6], [-1, 0, 1], draft_probs=probs.clone())
    for seed in range(50):
        result = verify(t, probs.log(), SamplingConfig(temperature=1.0), torch.Generator().manual_seed(seed))
        assert result.accepted_path == (0, 1, 2)  # r < p/q = 1 always


def test_top_k_one_makes_sampling_greedy():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    argmax = logits.argmax(-1).tolist()
    t = tree([9, argmax[0], argmax[1], 0], [-1, 0, 1, 2])
    result = verify(t, logits, SamplingConfig(temperature=0.7, top_k=1), torch.Generator().manual_seed(0))
    assert result.accepted_tokens[:2] == (argmax[0], argmax[1])
