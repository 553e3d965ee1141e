"""The decoding loop's pacer: drafting that emits tokens more slowly than plain decoding would is paused, with a
back-off that doubles while probes keep failing; pausing never changes what is emitted."""

from __future__ import annotations

import time

import pytest
import torch

from selfspec.cost import CostCurve
from selfspec.decoding import speculative_generate
from selfspec.heads import register_drafter, unregister_drafter
from selfspec.pacing import DraftPacer, Pacing

from .helpers import PROMPT, RandomDrafter, hf_greedy, make_tiny_target, without_eos

CURVE = CostCurve((1, 2, 16), (1.0, 1.0, 2.0), source="test")


def drafting_steps(pacer: DraftPacer, count: int, step_s: float, emitted: int) -> list[bool]:
    """`count` loop steps on 2-node trees (forward 0.1 s, drafting 0.02 s); True where the pacer let the drafter
    draft."""
    asked = []
    for _ in range(count):
        drafted = pacer.should_draft()
        asked.append(drafted)
        if drafted:
            pacer.record(2, emitted, step_s, forward_s=0.1, draft_s=0.02)
        else:
            pacer.record(1, 1, 0.1, forward_s=0.1, draft_s=0.0)
    return asked


def test_drafting_that_does_not_pay_is_paused_in_proportion_to_what_it_lost():
    assert DraftPacer.PROBE_SHARE == 0.02  # the step counts below follow from it
    pacer = DraftPacer(CURVE, Pacing())
    # 0.15 s a step for 1.2 tokens: 0.125 s a token; a plain step would cost ~0.13 s here (0.15 - 0.02 - 0.1 + 0.1).
    assert all(drafting_steps(pacer, 8, step_s=0.15, emitted=1.2))
    # 0.15 s a step for 1 token. Before any plain step is measured the window is judged against the estimate
    # (0.13 s): it lost 0.08 s, a ceil(0.08 / (0.02 x 0.13)) = 31-step pause. Against plain steps then measured at
    # 0.1 s a window loses 4 x 0.05 s = 2 plain steps, so it pauses 2 / 0.02 = 100 steps: probing costs 2% of the time.
    asked = drafting_steps(pacer, 4 + 31 + 4 + 100 + 1, step_s=0.15, emitted=1)
    assert asked == [True] * 4 + [False] * 31 + [True] * 4 + [False] * 100 + [True]
    assert pacer.paused_steps == 131 and pacer.plain_s == pytest.approx(0.1)
    # A cheap drafter that just missed (0.101 s for 1 token) pauses only MIN_PAUSE steps; a costly one at most
    # MAX_PAUSE.
    cheap = DraftPacer(CURVE, Pacing())
    cheap.plain_s = 0.1
    assert drafting_steps(cheap, 4 + 5, step_s=0.101, emitted=1) == [True] * 4 + [False] * 4 + [True]
    costly = DraftPacer(CURVE, Pacing())
    costly.plain_s = 0.1
    drafting_steps(costly, 4, step_s=1.0, emitted=1)
    assert costly._pause_left == DraftPacer.MAX_PAUSE
    # A window that pays leaves drafting on.
    assert all(drafting_steps(cheap, 8, step_s=0.15, emitted=2))


def test_the_schedule_carries_over_to_the_drafters_next_request():
    record = Pacing()  # the drafter's, held beside it across requests
    pacer = DraftPacer(CURVE, record)
    pacer.plain_s = 0.1
    drafting_steps(pacer, 4 + 60, step_s=0.15, emitted=1)  # a 100-step pause, 40 of it left
    pacer.remember()
    assert record.pause_left == 40
    following = DraftPacer(CURVE, record)  # the next request goes on with what was left
    assert drafting_steps(following, 40 + 1, step_s=0.15, emitted=1) == [False] * 40 + [True]
    DraftPacer(CURVE, record, enabled=False).remember()  # an unpaced request leaves the schedule alone
    assert record.pause_left == 40


def test_a_disabled_pacer_never_pauses():
    pacer = DraftPacer(CURVE, Pacing(), enabled=False)
    assert all(drafting_steps(pacer, 40, step_s=1.0, emitted=1)) and pacer.paused_steps == 0


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


class SelfPacedSlowDrafter(SlowRandomDrafter):
    """Registered with paces_itself=True below."""


def test_the_loop_leaves_a_self_paced_drafter_alone():
    register_drafter("self-paced-slow", paces_itself=True)(SelfPacedSlowDrafter)
    try:
        target = without_eos(make_tiny_target("llama"))
        drafter, record = SelfPacedSlowDrafter(target), Pacing()
        tokens, stats = speculative_generate(target, drafter, torch.tensor(PROMPT), 24, pacing=record)
        assert list(tokens) == hf_greedy(target, PROMPT, 24, eos=-1)
        assert stats.paused_steps == 0 and record.pause_left == 0
    finally:
        unregister_drafter("self-paced-slow")


def test_the_record_beside_the_drafter_carries_a_pause_to_its_next_request():
    target = without_eos(make_tiny_target("llama"))
    drafter, record = SlowRandomDrafter(target), Pacing()  # as SelfSpec holds them: the record beside the drafter
    _, first = speculative_generate(target, drafter, torch.tensor(PROMPT), 24, pacing=record)
    assert first.paused_steps > 0 and record.pause_left > 0  # the pause outlasted the request
    attributes = dict(vars(drafter))
    _, second = speculative_generate(target, drafter, torch.tensor(PROMPT), 24, pacing=record)
    assert second.paused_steps == second.target_forwards and set(second.tree_sizes) == {1}  # still paused
    assert vars(drafter).keys() == attributes.keys() and not hasattr(drafter, "pacing")  # nothing written on it
    _, fresh = speculative_generate(target, drafter, torch.tensor(PROMPT), 24)  # no record: nothing carried over
    assert fresh.tree_sizes[0] > 1
