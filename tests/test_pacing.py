"""Pacing (heads/paced.py): a `Paced` drafter pauses drafting whose own time costs more plain target steps than the
tokens it earns, in proportion to what it lost, carries the pause to its next request, leaves a free drafter alone,
and never changes what is emitted."""

from __future__ import annotations

import time

import pytest
import torch

import selfspec.heads.paced as paced_module
from selfspec.cost import CostCurve
from selfspec.decoding import speculative_generate
from selfspec.heads import create_drafter
from selfspec.heads.base import Drafter, DraftRequest, Observation
from selfspec.heads.paced import PAUSE_RULE, Paced, PlainStep, paced, request_pacing, share_steps
from selfspec.sampling import SamplingConfig
from selfspec.tree_attention import DraftTree

from .helpers import PROMPT, RandomDrafter, hf_greedy, make_tiny_target, without_eos

CURVE = CostCurve((1, 2, 16), (1.0, 1.0, 2.0), source="test")


def test_the_pause_keeps_the_loss_within_its_share_of_the_time():
    assert PAUSE_RULE.window == 4 and PAUSE_RULE.share == 0.02  # the step counts below follow from them
    # 1.21 plain steps lost: the pause and the probe together must take 1.21 / 0.02 = 60.5 steps: 4 probed, 57 paused.
    assert PAUSE_RULE.pause(1.21) == 57
    assert PAUSE_RULE.pause(0.05) == 0  # a cheap miss: 3 steps' worth, within the probe itself
    assert PAUSE_RULE.pause(0.0) == PAUSE_RULE.pause(-3.0) == 0  # paid its way
    assert PAUSE_RULE.pause(1000.0) == PAUSE_RULE.max_pause


class _Clock:
    """Stands in for time.perf_counter: the drafter and the 'loop' below advance it by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _TimedDrafter(Drafter):
    """Proposes a 2-node tree, taking `draft_s` of the clock."""

    def __init__(self, clock: _Clock, draft_s: float):
        super().__init__(target=None, cost_curve=CURVE)
        self.clock, self.draft_s = clock, draft_s

    def propose(self, request: DraftRequest) -> DraftTree:
        self.clock.now += self.draft_s
        return DraftTree.from_paths(request.root_token, [[7]])


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    clock = _Clock()
    monkeypatch.setattr(paced_module.time, "perf_counter", clock)
    return clock


def run_steps(drafter: Paced, clock: _Clock, count: int, accepted: int, verify_s: float = 0.1) -> list[bool]:
    """`count` steps of a loop whose verification takes `verify_s` a step (one plain step: the curve is flat up to 2
    nodes); `accepted` of each 2-node tree's drafted tokens accepted. True where the drafter drafted."""
    drafted = []
    for _ in range(count):
        tree = drafter.propose(DraftRequest(5, 8, SamplingConfig(), None))
        clock.now += verify_s
        path = (0, 1)[: 1 + (accepted if tree.size > 1 else 0)]
        drafter.observe(Observation((5,), {}, tree, path))
        drafted.append(tree.size > 1)
    return drafted


def test_drafting_that_does_not_pay_is_paused_in_proportion_to_what_it_lost(clock):
    # 0.0302 s of drafting a step against 0.1 s plain steps, nothing accepted: a window loses 4 x 0.302 = 1.208 plain
    # steps, so it and the pause take ceil(1.208 / 0.02) = 61 steps: a 57-step pause.
    slow = Paced(_TimedDrafter(clock, draft_s=0.0302))
    drafted = run_steps(slow, clock, 4 + 57 + 4, accepted=0)
    assert drafted == [True] * 4 + [False] * 57 + [True] * 4 and slow.pause_left == 57
    assert slow.plain_step.seconds == pytest.approx(0.1) and slow.stats().paused_steps == 57
    # The same drafting with a token accepted a step earns 4 against 1.2: never paused.
    paying = Paced(_TimedDrafter(clock, draft_s=0.0302))
    assert all(run_steps(paying, clock, 40, accepted=1))
    # A drafter that costs next to nothing (a lookup that keeps missing) is never paused either.
    free = Paced(_TimedDrafter(clock, draft_s=0.0001))
    assert all(run_steps(free, clock, 40, accepted=0)) and free.paused_steps == 0


def test_drafting_that_delays_several_requests_is_weighed_for_each(clock):
    """In the batch engine a drafter's time holds back every request of the step: 0.0102 s of drafting a step with
    one token in four accepted pays for one request (0.408 plain steps spent against 1 earned a window) and not for
    four (1.632 spent: paused ceil(0.632 / 0.02) - 4 = 28 steps)."""
    alone = Paced(_TimedDrafter(clock, draft_s=0.0102))
    shared = Paced(_TimedDrafter(clock, draft_s=0.0102))
    share_steps(shared, 4)
    for drafter in (alone, shared):
        for accepted in (1, 0, 0, 0):
            run_steps(drafter, clock, 1, accepted=accepted)
    assert alone.pause_left == 0 and shared.pause_left == 28


def test_the_pause_carries_over_to_the_next_request_and_an_unpaced_one_leaves_it(clock):
    drafter = Paced(_TimedDrafter(clock, draft_s=0.0302))
    run_steps(drafter, clock, 4 + 17, accepted=0)  # a 57-step pause, 40 of it left
    drafter.reset()  # the next request
    assert drafter.pause_left == 40 and drafter.plain_step.seconds == pytest.approx(0.1)
    drafter.enabled = False  # an unpaced request: asked at every step, the pause left as it was
    assert all(run_steps(drafter, clock, 12, accepted=0)) and drafter.pause_left == 40
    drafter.enabled = True
    assert run_steps(drafter, clock, 41, accepted=0) == [False] * 40 + [True]


def test_a_shared_plain_step_is_read_not_measured(clock):
    shared = PlainStep()
    source = Paced(_TimedDrafter(clock, draft_s=0.0302), plain_step=shared)
    assert all(run_steps(source, clock, 8, accepted=0))  # no plain step measured by its owner: nothing to weigh
    assert shared.seconds is None
    shared.seconds = 0.1
    assert run_steps(source, clock, 5, accepted=0) == [True] * 4 + [False]


class SlowRandomDrafter(RandomDrafter):
    """Random guesses, slowly: drafting never pays."""

    def propose(self, request):
        time.sleep(0.01)
        return super().propose(request)


def test_paused_drafting_emits_what_plain_decoding_does():
    target = without_eos(make_tiny_target("llama"))
    reference = hf_greedy(target, PROMPT, 48, eos=-1)
    drafter = SlowRandomDrafter(target)
    tokens, stats = speculative_generate(target, drafter, torch.tensor(PROMPT), 48)
    assert list(tokens) == reference
    assert stats.paused_steps >= 8 and stats.tree_sizes.count(1) >= stats.paused_steps
    _, unpaced = speculative_generate(target, SlowRandomDrafter(target), torch.tensor(PROMPT), 48, pace=False)
    assert unpaced.paused_steps == 0 and unpaced.tree_sizes.count(1) <= 1  # the last step: no budget left to draft


def test_the_stats_split_the_time_into_drafting_and_verifying():
    """GenerationStats' draft_s holds the drafter's proposals (here at least 10 ms each), verify_s the tree forwards;
    both lie inside the wall time, and the summary gives the shares."""
    target = without_eos(make_tiny_target("llama"))
    _, stats = speculative_generate(target, SlowRandomDrafter(target), torch.tensor(PROMPT), 24, pace=False)
    drafted = sum(1 for size in stats.tree_sizes if size > 1)
    assert drafted >= 20 and stats.draft_s >= 0.01 * drafted
    assert 0 < stats.verify_s and stats.draft_s + stats.verify_s <= stats.wall_s
    assert "of the time drafting" in stats.summary() and "verifying" in stats.summary()


def test_a_drafter_kept_paced_carries_its_pause_to_its_next_request():
    target = without_eos(make_tiny_target("llama"))
    drafter = SlowRandomDrafter(target)
    kept = paced(drafter)  # as SelfSpec keeps it across requests
    _, first = speculative_generate(target, kept, torch.tensor(PROMPT), 24)
    assert first.paused_steps > 0 and kept.pause_left > 0  # the pause outlasted the request
    attributes = dict(vars(drafter))
    _, second = speculative_generate(target, kept, torch.tensor(PROMPT), 24)
    assert second.paused_steps == second.target_forwards and set(second.tree_sizes) == {1}  # still paused
    assert vars(drafter).keys() == attributes.keys()  # nothing of pacing written on the drafter
    _, fresh = speculative_generate(target, drafter, torch.tensor(PROMPT), 24)  # bare: paced for this request alone
    assert fresh.tree_sizes[0] > 1


def test_a_composite_drafter_is_paced_source_by_source_never_whole():
    target = without_eos(make_tiny_target("llama"))
    auto = create_drafter("auto:sources=ngram+history", target)
    assert paced(auto) is auto and all(isinstance(source, Paced) for source in auto.parts())
    # a source that loses is paused four times as long as a drafter alone: about 0.5% of the time, not 2%
    assert all(source.rule.pause(1.21) == 238 for source in auto.parts()) and PAUSE_RULE.pause(1.21) == 57
    lone = create_drafter("ngram", target)
    assert isinstance(paced(lone), Paced) and paced(paced(lone)).drafter is lone  # wrapped once
    with request_pacing(auto, pace=False) as running:
        assert running is auto and not any(source.enabled for source in auto.parts())
    assert all(source.enabled for source in auto.parts())  # restored after the request


def test_a_lookup_is_never_paused_whatever_the_clock_shows(clock):
    """Prompt lookup's drafting costs nothing to speak of: a stall of the machine around it is not its cost."""
    lookup = create_drafter("ngram", make_tiny_target("llama"))
    stalled = _TimedDrafter(clock, draft_s=0.05)  # half a plain step a proposal, as a preempted process might see
    lookup.propose = stalled.propose
    assert all(run_steps(Paced(lookup), clock, 40, accepted=0))


def test_a_source_is_credited_only_with_what_its_keeper_says_it_earned(clock):
    """auto credits a source with the accepted tokens no other source proposed: accepted tokens it is not credited
    with do not pay for its drafting."""
    shared = PlainStep()
    shared.seconds = 0.1
    source = Paced(_TimedDrafter(clock, draft_s=0.0302), plain_step=shared)
    for _ in range(4):  # every drafted token accepted, none of them the source's alone
        tree = source.propose(DraftRequest(5, 8, SamplingConfig(), None))
        source.observe(Observation((5,), {}, tree, (0, 1)), earned=0)
    assert source.pause_left == 57
