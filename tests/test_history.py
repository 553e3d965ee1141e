"""`history`: copies continuations out of the requests the drafter served before, never out of the current one."""

from __future__ import annotations

import pytest
import torch

from selfspec.decoding import speculative_generate
from selfspec.errors import SelfspecError
from selfspec.heads import create_drafter
from selfspec.heads.base import DraftRequest, Observation
from selfspec.heads.lookup.ngram import TokenIndex
from selfspec.heads.lookup.packed_index import PackedTokenIndex
from selfspec.sampling import SamplingConfig

from .helpers import FLAT, PROMPT, hf_greedy, make_tiny_target, without_eos


def served(*requests: list[int], **options):
    """A history drafter that has served `requests` (each seen as a prefill) and started a new, empty one."""
    drafter = create_drafter("history", make_tiny_target("llama"), **options)
    drafter.cost_curve = FLAT
    for tokens in requests:
        drafter.reset()
        drafter.observe(Observation(tuple(tokens), {}))
    drafter.reset()
    return drafter


def paths_of(drafter, context: list[int], root: int, depth: int = 4) -> list[list[int]]:
    drafter.observe(Observation(tuple(context), {}))
    tree = drafter.propose(DraftRequest(root, depth, SamplingConfig(), None))
    return [
        [tree.token_list[i] for i in tree.path_to(leaf)][1:] for leaf in range(tree.size) if not tree.children(leaf)
    ]


def test_copies_what_followed_in_an_earlier_request():
    drafter = served([1, 2, 3, 4, 5, 6, 7], [9, 2, 3, 8, 8, 8])
    # The current request ends in (2, 3): the newest earlier occurrence is followed by 8 8 8, the older by 4 5 6 7.
    assert paths_of(drafter, [11, 12, 2, 3], root=3) == [[8, 8, 8], [4, 5, 6, 7]]


def test_the_first_request_and_the_current_one_are_not_looked_up():
    drafter = served()
    # A repeat inside the request itself is prompt lookup's to copy (`ngram`): here there is no history at all.
    assert paths_of(drafter, [1, 2, 3, 4, 1, 2, 3], root=3) == [[]]


def test_a_single_token_match_drafts_nothing_by_default():
    assert paths_of(served([5, 6, 7, 8]), [1, 2, 3, 7], root=7) == [[]]
    assert paths_of(served([5, 6, 7, 8], min_ngram=1), [1, 2, 3, 7], root=7) == [[8]]


def test_history_keeps_the_newest_tokens_within_its_cap():
    drafter = served([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], max_tokens=8)
    assert drafter.history.tokens.tolist() == [7, 8, 9, 10, 11, 12]  # past the cap of 8: the newest 3/4 of it kept
    assert paths_of(drafter, [0, 10, 11], root=11) == [[12]]
    drafter.reset()
    assert paths_of(drafter, [0, 1, 2], root=2) == [[]]  # the oldest request was dropped


def test_bad_options_are_one_line_errors():
    target = make_tiny_target("llama")
    with pytest.raises(SelfspecError, match="history: max_tokens must be >= 1"):
        create_drafter("history:max_tokens=0", target)
    with pytest.raises(SelfspecError, match="history sizes need 1 <= min_ngram <= max_ngram"):
        create_drafter("history:min_ngram=3,max_ngram=2", target)


def test_a_repeated_request_is_drafted_from_the_first_and_output_is_unchanged():
    target = without_eos(make_tiny_target("llama"))
    drafter = create_drafter("history", target)
    drafter.cost_curve = FLAT
    reference = hf_greedy(target, PROMPT, 24, eos=-1)
    first, first_stats = speculative_generate(target, drafter, torch.tensor(PROMPT), 24)
    again, stats = speculative_generate(target, drafter, torch.tensor(PROMPT), 24)
    assert list(first) == list(again) == reference
    assert max(first_stats.tree_sizes) == 1  # nothing served before
    assert stats.target_forwards < len(reference) // 2  # the second copies the first's reply


def test_the_packed_index_answers_as_the_dict_index_does():
    # The history's index (sorted hashes) against prompt lookup's (a dict of tuples) on the same token stream, fed a
    # request at a time, from many contexts: the same continuations in the same order.
    generator = torch.Generator().manual_seed(0)
    sizes = (4, 3, 2, 1)
    packed, reference = PackedTokenIndex(sizes), TokenIndex(sizes)
    for _ in range(12):
        request = torch.randint(
            0, 9, (int(torch.randint(1, 40, (1,), generator=generator)),), generator=generator
        ).tolist()
        packed.extend(request)
        reference.extend(request)
        for _ in range(20):
            context = torch.randint(
                0, 9, (int(torch.randint(1, 6, (1,), generator=generator)),), generator=generator
            ).tolist()
            for depth, paths in ((3, 2), (5, 4), (0, 3)):
                assert packed.continuations(context, depth, paths) == reference.continuations(context, depth, paths)
    assert packed.nbytes <= 16 * len(packed) * (len(sizes) + 1)


def test_packed_index_hash_collisions_are_not_matches(monkeypatch):
    import selfspec.heads.lookup.packed_index as packed_module

    monkeypatch.setattr(
        packed_module, "_MULTIPLIER", packed_module.np.uint64(0)
    )  # every n-gram hashes to its last token
    index = packed_module.PackedTokenIndex((3,))
    index.extend([1, 2, 3, 9, 4, 5, 3, 7])
    assert index.continuations([4, 5, 3], 2, 3).paths == [[7]]  # (2, 3) ... shares the hash of (5, 3) only
