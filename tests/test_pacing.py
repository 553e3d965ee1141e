"""The decoding loop's pacer: drafting that emits tokens more slowly than plain decoding would is paused, with a
back-off that doubles while probes keep failing; pausing never changes what is emitted."""

from __future__ import annotations

import time

import torch

from selfspec.cost import CostCurve
from selfspec.decoding import DraftPacer, speculative_generate

from .helpers import PROMPT, RandomDrafter, hf_greedy, make_tiny_target, without_eos

CURVE = CostCurve((1, 2, 16), (1.0, 1.0, 2.0), source="test")


class _Timed:
    cost_curve = CURVE
    pacing = None


def drafting_steps(pacer: DraftPacer, count: int, step_s: float, emitted: int) -> list[bool]:
    """`count` loop steps on 2-node trees (forward 0.1 s, drafting 0.02 s); True where the pacer let the drafter draft."""
    asked = []
    for _ in range(count):
        drafted = pacer.should_draft()
        asked.append(drafted)
        if drafted:
            pacer.record(2, emitted, step_s, forward_s=0.1, draft_s=0.02)
        else:
            pacer.record(1, 1, 0.1, forward_s=0.1, draft_s=0.0)
    return asked


def test_drafting_that_does_not_pay_is_paused_with_a_doubling_back_off():
    pacer = DraftPacer(_Timed())
    # 0.15 s a step for 1.2 tokens: 0.125 s a token; a plain step would cost ~0.13 s here (0.15 - 0.02 - 0.1 + 0.1).
    assert all(drafting_steps(pacer, 8, step_s=0.15, emitted=1.2))
    # 0.15 s a step for 1 token, against plain steps measured at 0.1 s: paused after each 4-step probe, 8, 16, 32.
    asked = drafting_steps(pacer, 4 + 8 + 4 + 16 + 4, step_s=0.15, emitted=1)
    assert asked == [True] * 4 + [False] * 8 + [True] * 4 + [False] * 16 + [True] * 4
    assert pacer.paused_steps == 24 and pacer.plain_s == 0.1
    # After the 32-step pause, a probe that pays (0.15 s for 2 tokens) halves the back-off (64 -> 32); two more
    # paying windows bring it to 8, where the next failing probe pauses for 8 steps again.
    assert drafting_steps(pacer, 32 + 4, step_s=0.15, emitted=2) == [False] * 32 + [True] * 4
    assert pacer._next_pause == 32
    assert all(drafting_steps(pacer, 8, step_s=0.15, emitted=2)) and pacer._next_pause == 8
    assert drafting_steps(pacer, 4 + 9, step_s=0.15, emitted=1) == [True] * 4 + [False] * 8 + [True]


def test_the_schedule_carries_over_to_the_drafters_next_request():
    drafter = _Timed()
    pacer = DraftPacer(drafter)
    drafting_steps(pacer, 4 + 8 + 4 + 3, step_s=0.15, emitted=1)  # two failed probes: 13 of a 16-step pause left
    pacer.remember(drafter)
    assert drafter.pacing == (13, 32)
    following = DraftPacer(drafter)  # the next request: half the pause left, then the 32-step pause if it fails again
    assert drafting_steps(following, 6 + 4 + 1, step_s=0.15, emitted=1) == [False] * 6 + [True] * 4 + [False]
    assert following._pause_left == 31
    DraftPacer(drafter, enabled=False).remember(drafter)  # an unpaced request leaves the schedule alone
    assert drafter.pacing == (13, 32)


def test_a_disabled_pacer_never_pauses():
    pacer = DraftPacer(_Timed(), enabled=False)
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
