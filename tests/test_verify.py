"""The verifier on hand-written trees and logits (no model involved)."""

from __future__ import annotations

import torch

from selfspec.sampling import SamplingConfig, StepDraws, draw_token, logits_to_probs, position_uniform
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
    sampled = verify(t, logits_with_argmax([2, 0, 0]) * 10, SamplingConfig(temperature=1.0), StepDraws(seed=0))
    assert sampled.accepted_path == (0, 2)


def test_sampling_certain_target_accepts_and_rejects_deterministically():
    # p is (numerically) one-hot: the right child is always accepted, a wrong one always rejected.
    t = tree([9, 1, 4], [-1, 0, 0])
    logits = logits_with_argmax([4, 0, 7]) * 100
    for seed in range(20):
        result = verify(t, logits, SamplingConfig(temperature=1.0), StepDraws(seed=seed))
        assert result.accepted_path == (0, 2) and result.next_token == 7


def test_drawn_children_with_q_equal_p_always_accept():
    probs = torch.softmax(torch.randn(3, V, generator=torch.Generator().manual_seed(1)), -1)
    t = tree([9, 4, 6], [-1, 0, 1], draft_probs=probs.clone())
    for seed in range(50):
        result = verify(
            t, probs.log(), SamplingConfig(temperature=1.0), StepDraws(generator=torch.Generator().manual_seed(seed))
        )
        assert result.accepted_path == (0, 1, 2)  # r < p/q = 1 always


def test_top_k_one_makes_sampling_greedy():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    argmax = logits.argmax(-1).tolist()
    t = tree([9, argmax[0], argmax[1], 0], [-1, 0, 1, 2])
    result = verify(t, logits, SamplingConfig(temperature=0.7, top_k=1), StepDraws(seed=0))
    assert result.accepted_tokens[:2] == (argmax[0], argmax[1])


def test_deterministic_children_accept_the_position_keyed_draw():
    # The token after a depth-d node is the inverse-CDF draw of p at that node with the uniform of position + d:
    # the walk accepts the child equal to it, whichever other children the tree holds.
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(5))
    sampling = SamplingConfig(temperature=1.0)
    draws = StepDraws(seed=11, position=3)
    expected = [
        draw_token(logits_to_probs(logits[row], sampling), draws.uniform(depth)) for depth, row in enumerate([0, 1, 2])
    ]
    decoy = (expected[0] + 1) % V
    t = tree([9, decoy, expected[0], expected[1]], [-1, 0, 0, 2])
    node_logits = torch.stack([logits[0], logits[3], logits[1], logits[2]])  # the decoy's row is never read
    result = verify(t, node_logits, sampling, draws)
    assert result.accepted_path == (0, 2, 3) and result.emitted == tuple(expected)


def test_position_uniforms_are_keyed_on_seed_and_position_alone():
    assert position_uniform(3, 10) == StepDraws(seed=3, position=7).uniform(3) == StepDraws(3, 10).uniform(0)
    values = {position_uniform(seed, position) for seed in range(20) for position in range(50)}
    assert len(values) == 1000 and all(0.0 <= u < 1.0 for u in values)
    assert abs(sum(values) / len(values) - 0.5) < 0.03


def test_draw_token_is_the_inverse_cdf_and_never_draws_zero_mass():
    probs = torch.tensor([0.0, 0.25, 0.0, 0.5, 0.25])
    assert [draw_token(probs, u) for u in (0.0, 0.2499, 0.25, 0.7499, 0.75, 0.999999)] == [1, 1, 3, 3, 4, 4]
    assert draw_token(probs * 3, 0.5) == 3  # the mass need not be 1
