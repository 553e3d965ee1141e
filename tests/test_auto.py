"""`auto`: merging the sources' trees, the per-source acceptance estimates, skipping sources that do not pay, and
each source's own view of a step whose accepted path came from another source."""

from __future__ import annotations

import json

import pytest
import torch

from selfspec.cost import CostCurve
from selfspec.decoding import speculative_generate
from selfspec.errors import SelfspecError
from selfspec.heads import artifacts, create_drafter, register_drafter, unregister_drafter
from selfspec.heads.auto import MIN_HELDOUT_TAU, SourceRates, merge_trees, select_nodes
from selfspec.heads.auto.drafter import EXPLORE_AFTER
from selfspec.heads.auto.rates import RANKS
from selfspec.heads.paced import Paced, PlainStep
from selfspec.tree_attention import DraftTree

from .helpers import (
    FLAT,
    PROMPT,
    OracleDrafter,
    hf_greedy,
    make_tiny_target,
    random_dflash_dir,
    random_eagle_dir,
    without_eos,
)


def tree(root: int, paths: list[list[int]]) -> DraftTree:
    return DraftTree.from_paths(root, paths)


def rates(**by_source: float) -> dict[str, SourceRates]:
    """Sources whose every node is accepted with the given chance (a strong prior, nothing observed)."""
    out = {}
    for name, chance in by_source.items():
        estimate = SourceRates(prior_weight=1e6, max_depth=8)
        estimate.PRIOR = (chance, chance, chance)
        out[name] = estimate
    return out


def test_shared_prefixes_merge_and_a_node_keeps_its_best_score():
    trees = {"a": tree(7, [[1, 2, 3]]), "b": tree(7, [[1, 2, 4], [5]])}
    paths, scores, node_paths = merge_trees(7, trees, rates(a=0.9, b=0.5))
    assert paths == [(1,), (1, 2), (1, 2, 3), (1, 2, 4), (5,)]  # 1 -> 2 proposed twice, one path
    expected = {(1,): 0.9, (1, 2): 0.81, (1, 2, 3): 0.729, (1, 2, 4): 0.125, (5,): 0.5}
    assert scores == pytest.approx([expected[path] for path in paths])
    assert node_paths["b"] == [(), (1,), (1, 2), (1, 2, 4), (5,)]
    with pytest.raises(SelfspecError, match="source 'a' rooted its tree at 3"):
        merge_trees(7, {"a": tree(3, [[1]])}, rates(a=0.5))


def test_duplicate_tokens_from_two_sources_become_one_node():
    trees = {"a": tree(7, [[1], [2]]), "b": tree(7, [[2], [1]])}
    paths, scores, _ = merge_trees(7, trees, rates(a=0.6, b=0.3))
    assert paths == [(1,), (2,)] and scores == pytest.approx([0.6, 0.6])


def test_the_budget_keeps_the_best_nodes_and_their_parents():
    trees = {"a": tree(7, [[1, 2, 3, 4]]), "b": tree(7, [[9], [8]])}
    paths, scores, _ = merge_trees(7, trees, rates(a=0.95, b=0.3))
    # A curve on which each node costs 0.5 of a step: nodes with a chance above ~1/3 pay, at most 4 nodes.
    curve = CostCurve((1, 2, 3, 4, 5, 6, 7), (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0), source="test")
    kept = select_nodes(paths, scores, curve, max_nodes=4)
    assert kept == [(1,), (1, 2), (1, 2, 3)]  # the max_nodes cap (root included) cuts the deepest first
    kept = select_nodes(paths, scores, FLAT, max_nodes=64)
    assert set(kept) == set(paths)
    for path in kept:  # closed under parents, parents listed first
        assert len(path) == 1 or kept.index(path[:-1]) < kept.index(path)


def test_acceptance_estimates_follow_the_accept_history():
    estimate = SourceRates(prior_weight=2.0, max_depth=8)
    assert estimate.rate(1, 0) == pytest.approx(0.5) and estimate.rate(1, 1) == pytest.approx(0.15)
    for accepted in [True] * 8:
        estimate.record(1, 0, accepted)
    for accepted in [False] * 8:
        estimate.record(1, 1, accepted)
        estimate.record(2, 0, accepted)
    assert estimate.rate(1, 0) == pytest.approx((8 + 1.0) / (8 + 2))
    assert estimate.rate(1, 1) == pytest.approx(0.3 / 10)
    assert estimate.rate(2, 0) == pytest.approx(2 * 0.9 / 10)  # its prior: the estimate a level up, (8 + 1) / 10
    assert estimate.rate(1, 5) == estimate.rate(1, 2)  # ranks past the second share one estimate


def test_a_depth_no_tree_reached_starts_from_the_one_above():
    """A source whose first two levels were always accepted in this request is trusted a level deeper (else a tree cut
    at the unknown depth never learns that a verbatim match holds to its end), one level at a time; what earlier
    requests learnt at that depth, where they tried it, comes first."""
    lifetime = SourceRates(prior_weight=2.0, max_depth=8)
    request = SourceRates(prior_weight=2.0, max_depth=8, prior=lifetime)
    for _ in range(10):
        request.record(1, 0, True)
        request.record(2, 0, True)
    assert request.rate(3, 0) == pytest.approx(request.rate(2, 0)) and request.rate(3, 0) > 0.95
    assert request.rate(4, 0) == pytest.approx(0.5)  # a level at a time: its level above was not tried either
    assert request.rate(1, 1) == pytest.approx(0.15)  # no sibling of that rank tried anywhere
    for _ in range(6):
        lifetime.record(3, 0, False)  # an earlier request's record at depth 3
    assert request.rate(3, 0) == pytest.approx(lifetime.rate(3, 0)) and request.rate(3, 0) < 0.3
    fresh = SourceRates(prior_weight=2.0, max_depth=8, prior=lifetime)  # the next request starts from the record
    assert fresh.rate(2, 0) == pytest.approx(lifetime.rate(2, 0)) and fresh.rate(3, 0) < 0.3


def test_a_source_left_out_of_the_merged_tree_gets_its_first_node_tried_now_and_then():
    """A source's estimates learn only from its verified nodes: one whose proposals keep being left out has its
    first-ranked node added after EXPLORE_AFTER such steps, then after twice as many each time; a node of its own kept
    on its score starts the wait over. (Without it two lookups alone decoded as `none` after one rejected node.)"""
    auto = create_drafter("auto:sources=ngram+history", without_eos(make_tiny_target("llama")))
    trees = {"ngram": tree(7, [[3, 4], [5]]), "history": DraftTree.root_only(7)}
    _, _, node_paths = merge_trees(7, trees, auto.rates)
    tried = [step for step in range(1, 40) if auto._explored(trees, node_paths, {()}) == [(3,)]]
    assert tried == [EXPLORE_AFTER, 3 * EXPLORE_AFTER, 7 * EXPLORE_AFTER]
    assert auto._explored(trees, node_paths, {(), (3,)}) == []  # kept on its score: the wait starts over
    assert [auto._explored(trees, node_paths, {()}) for _ in range(EXPLORE_AFTER)][-1] == [(3,)]


def test_a_request_starts_from_the_sources_record_over_earlier_requests():
    lifetime = SourceRates(prior_weight=2.0, max_depth=8)
    first = SourceRates(prior_weight=2.0, max_depth=8, prior=lifetime)
    assert first.rate(1, 0) == pytest.approx(0.5)  # no record yet: the fixed prior
    for _ in range(20):
        first.record(1, 0, False)
    assert lifetime.rate(1, 0) == pytest.approx(1.0 / 22)  # every request's record reaches the lifetime one
    second = SourceRates(prior_weight=2.0, max_depth=8, prior=lifetime)  # the next request: nothing of its own yet
    assert second.rate(1, 0) == pytest.approx(lifetime.rate(1, 0)) and second.rate(1, 1) == pytest.approx(0.15)
    second.record(1, 0, True)
    assert second.rate(1, 0) == pytest.approx((1 + 2 * lifetime.rate(1, 0)) / 3)


def test_each_source_is_paced_on_the_plain_step_auto_measures():
    """The sources' wrappers share auto's one plain-step estimate; auto measures it around the merged trees."""
    target = without_eos(make_tiny_target("llama"))
    auto = create_drafter("auto:sources=ngram+history", target)
    assert all(isinstance(source, Paced) for source in auto.sources.values())
    assert all(source.plain_step is auto.plain_step and not source.measures_plain_step for source in auto.parts())
    assert isinstance(auto.plain_step, PlainStep) and auto.plain_step.seconds is None
    speculative_generate(target, auto, torch.tensor(PROMPT), 12)
    assert auto.plain_step.seconds > 0


class _Oracle(OracleDrafter):
    full: list[int] = []

    def __init__(self, target, cost_curve, options=None):
        super().__init__(target, self.full)
        self.cost_curve = cost_curve


@pytest.fixture
def oracle_source():
    register_drafter("oracle-source")(_Oracle)
    yield _Oracle
    unregister_drafter("oracle-source")


def test_sources_keep_their_own_state_when_another_source_wins(tmp_path, oracle_source):
    """An oracle source knows the continuation; the EAGLE head is random: the accepted paths come from the oracle's
    tree. EAGLE still reads every committed pair (its cache stays in step with the text), and its own view of each
    step holds only what its own tree had accepted."""
    target = without_eos(make_tiny_target("llama"))
    prompt = PROMPT
    reference = hf_greedy(target, prompt, 24, eos=-1)
    oracle_source.full = list(prompt) + reference
    auto = create_drafter("auto:sources=oracle-source+eagle", target, random_eagle_dir(target, tmp_path / "h"))
    auto.cost_curve = FLAT
    assert auto.sources["eagle"].cost_curve is FLAT  # the curve reaches the sources
    seen = {name: [] for name in auto.sources}
    for name, source in auto.sources.items():
        observe = source.drafter.observe  # the source itself, inside its pacing

        def spy(observation, name=name, observe=observe):
            seen[name].append(observation)
            observe(observation)

        source.drafter.observe = spy
    tokens, stats = speculative_generate(target, auto, torch.tensor(prompt), 24, pace=False)
    assert list(tokens) == reference
    for observations in seen.values():
        committed = [t for observation in observations[1:] for t in observation.new_tokens]
        assert committed == list(tokens[: len(committed)])  # every source saw every committed token
        for own in observations[1:]:  # its own tree, and the part of the accepted path that lay in it
            assert own.accepted_path[0] == 0 and all(i < own.tree.size for i in own.accepted_path)
            assert own.accepted_tokens == own.new_tokens[: len(own.accepted_tokens)]
    eagle = auto.sources["eagle"].drafter
    eagle.propose(type("R", (), {"root_token": tokens[-1], "max_depth": 2, "sampling": None, "generator": None})())
    # Its cache holds a pair for every position the loop reported (the last step is never observed: the loop ends).
    assert eagle.position == len(prompt) - 1 + len(tokens) - stats.accepted_lengths[-1]
    assert max(stats.accepted_lengths) > 2 and auto.stats().accepted_by_source["oracle-source"] > 10
    eagle_views = seen["eagle"][1:]
    assert sum(len(view.accepted_tokens) for view in eagle_views) == auto.stats().accepted_by_source["eagle"]
    assert auto.stats().accepted_by_source["eagle"] < auto.stats().accepted_by_source["oracle-source"]


class _Twin(_Oracle):
    """A second oracle: the same trees as the first."""


def _earnings(auto) -> dict[str, list[float]]:
    """Spy on what each source's pacing is credited with, step by step."""
    credits = {name: [] for name in auto.sources}
    for name, source in auto.sources.items():

        def observe(observation, earned=None, name=name, observe=source.observe):
            if observation.tree is not None:
                credits[name].append(earned)
            observe(observation, earned)

        source.observe = observe
    return credits


def test_a_source_earns_only_the_accepted_tokens_no_other_source_proposed(tmp_path, oracle_source):
    register_drafter("oracle-twin")(_Twin)
    try:
        target = without_eos(make_tiny_target("llama"))
        reference = hf_greedy(target, PROMPT, 24, eos=-1)
        _Oracle.full = list(PROMPT) + reference
        twins = create_drafter("auto:sources=oracle-source+oracle-twin", target)
        twins.cost_curve = FLAT
        earned = _earnings(twins)
        tokens, stats = speculative_generate(target, twins, torch.tensor(PROMPT), 24)
        assert list(tokens) == reference and max(stats.accepted_lengths) > 2
        # Either twin alone would have proposed every accepted token: neither adds anything to the other.
        assert earned["oracle-source"] and not any(sum(credits) for credits in earned.values())
        with_eagle = create_drafter(
            "auto:sources=oracle-source+eagle", target, random_eagle_dir(target, tmp_path / "h")
        )
        with_eagle.cost_curve = FLAT
        earned = _earnings(with_eagle)
        tokens, _ = speculative_generate(target, with_eagle, torch.tensor(PROMPT), 24)
        assert list(tokens) == reference and sum(earned["oracle-source"]) > 10  # a random head finds none of them
    finally:
        unregister_drafter("oracle-twin")


def test_bad_sources_are_one_line_errors(tmp_path):
    target = make_tiny_target("llama")
    with pytest.raises(SelfspecError, match="unknown drafter 'nope'"):
        create_drafter("auto:sources=ngram+nope", target)
    with pytest.raises(SelfspecError, match="distinct drafters other than auto and none"):
        create_drafter("auto:sources=ngram+ngram", target)
    with pytest.raises(SelfspecError, match="holds 'eagle' heads, which is not among the sources ngram"):
        create_drafter("auto:sources=ngram", target, random_eagle_dir(target, tmp_path / "h"))
    with pytest.raises(SelfspecError, match="holds no drafter's heads"):
        create_drafter("auto", target, tmp_path)
    assert list(create_drafter("auto", target).sources) == [
        "ngram",
        "history",
    ]  # no heads for this model: the lookups alone


@pytest.mark.parametrize("heldout, joins", [(1.1, False), (1.5, True), (None, True)])
def test_default_sources_leave_out_heads_that_drafted_little_on_held_out_prompts(tmp_path, monkeypatch, heldout, joins):
    target = make_tiny_target("llama")
    monkeypatch.setattr(artifacts, "SHIPPED_DIR", tmp_path)
    heads = random_eagle_dir(target, tmp_path / "eagle-tiny")
    if heldout is not None:
        (heads / artifacts.REPORT).write_text(json.dumps({"heldout": {"mean_accepted_length": heldout}}))
    auto = create_drafter("auto", target)
    assert ("eagle" in auto.sources) == joins
    if not joins:
        assert auto.stats().left_out["eagle"] == f"held-out mean accepted length 1.10 < {MIN_HELDOUT_TAU}"
        assert "eagle left out (held-out mean accepted length 1.10" in auto.stats().contributions()
    named = create_drafter("auto:sources=ngram+eagle", target)  # sources named outright join whatever the report
    assert list(named.sources) == ["ngram", "eagle"] and named.sources["eagle"].stats().heldout_tau == heldout


def test_dflash_joins_auto_only_when_asked(tmp_path, monkeypatch):
    target = make_tiny_target("llama")
    monkeypatch.setattr(artifacts, "SHIPPED_DIR", tmp_path)
    heads = random_dflash_dir(target, tmp_path / "dflash-tiny")
    (heads / artifacts.REPORT).write_text(json.dumps({"heldout": {"mean_accepted_length": 2.0}}))
    assert "dflash" not in create_drafter("auto", target).sources  # shipped, and well above MIN_HELDOUT_TAU
    assert list(create_drafter("auto", target, heads).sources) == ["ngram", "history", "dflash"]
    assert list(create_drafter("auto:sources=ngram+dflash", target).sources) == ["ngram", "dflash"]
    assert list(create_drafter("auto:sources=ngram+history", target).sources) == ["ngram", "history"]


def test_unpaced_requests_ask_every_source_at_every_step():
    target = without_eos(make_tiny_target("llama"))
    auto = create_drafter("auto:sources=ngram", target)
    lookup = auto.sources["ngram"]  # its pacing, kept by auto across requests
    lookup.pause_left = 1000  # as if lookup had been failing for a long while
    asked = []
    propose = lookup.drafter.propose
    lookup.drafter.propose = lambda request: asked.append(request) or propose(request)
    speculative_generate(target, auto, torch.tensor(PROMPT), 12, pace=False)
    assert len(asked) >= 6 and lookup.pause_left == 1000 and lookup.enabled
    before = len(asked)
    speculative_generate(target, auto, torch.tensor(PROMPT), 12)  # paced: the skip holds
    assert len(asked) == before and lookup.pause_left < 1000


def test_what_auto_keeps_across_requests_is_bounded():
    estimate = SourceRates(prior_weight=2.0, max_depth=3)
    with pytest.raises(ValueError, match="depth 4"):  # no tree of max_depth + 1 nodes holds a node that deep
        estimate.record(4, 0, True)
    target = without_eos(make_tiny_target("llama"))
    auto = create_drafter("auto:sources=ngram+history,max_nodes=6", target)
    auto.cost_curve = FLAT
    for start in range(6):
        # Unpaced: on a model this small a lookup's own time is a few per cent of a plain step, and pacing may rest it.
        speculative_generate(target, auto, torch.tensor(PROMPT[start:] + PROMPT), 16, pace=False)
    assert sum(auto.stats().accepted_by_source.values()) > 0  # the sources drafted, and their rates were recorded
    for lifetime in auto.lifetime_rates.values():
        assert lifetime.max_depth == 5 and len(lifetime.tries) <= 5 * RANKS
