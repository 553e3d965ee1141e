"""Whether drafting pays, on this machine: one wrapper, `Paced`, around a drafter (or around each source of `auto`).

A `Paced` drafter owns the pause rule (`PauseRule`) and reads one estimate of the time of a plain target step
(`PlainStep`). Over windows of the steps it asked its drafter for a tree, it weighs the drafter's own time (its
propose and its observe, in plain target steps) against the tokens the drafter earned (the drafted tokens the target
accepted; for a source of `auto`, those no other source proposed). A window that cost more than it earned pauses
drafting (root-only trees, without asking the drafter) for as many steps as keep that loss within a small share of the
time. What verifying a bigger tree costs is the cost curve's: every drafter sizes its trees on it (a head by its
calibrated scores, prompt lookup by its acceptance estimate), so pacing prices only what the curve cannot see, the
drafting itself (`Drafter.drafting_seconds`: what the clock measured, unless the drafter knows better). A lookup
costs nothing to speak of and is never paused; a layer-skip draft that costs as much as a plain step never pays and is
paused for long stretches (its draft time is this wrapper's input, not a rule of its own). Where B requests share each
target step (the batch engine), a drafter's time delays all B: it is weighed B times (`share_steps`).

Who holds what. Whoever keeps a drafter across requests keeps `paced(drafter)` (SelfSpec; the bench through it), so a
pause and the plain-step estimate carry over to its next request; `speculative_generate` given a bare drafter paces it
for that one request (`request_pacing`). `auto` wraps each of its sources and measures the one plain-step estimate they
share. Requests and observations carry nothing of it, and a drafter never knows it is paced. Pausing never changes what
is emitted: pacing only moves speed.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Iterator

from ..cost import CostCurve
from ..tree_attention import DraftTree
from .base import Drafter, DrafterStats, DraftRequest, Observation


@dataclass(frozen=True)
class PauseRule:
    """How long to stop drafting that lost time: a probe of `window` asked steps that lost `lost` plain target steps
    pauses drafting for as many steps as keep the loss within `share` of the time the pause and the probe take
    together (each step takes at least a plain step's time), so a drafter that never pays costs about `share` of plain
    decoding's speed, one that missed cheaply is asked again at once, and one that costs nothing is never paused."""

    window: int = 4
    share: float = 0.02
    max_pause: int = 1024

    def pause(self, lost: float) -> int:
        """Steps to pause after a window that lost `lost` plain target steps (0 if it lost none or next to none)."""
        if lost <= 0:
            return 0
        return min(self.max_pause, max(0, math.ceil(lost / self.share) - self.window))


PAUSE_RULE = PauseRule()


class PlainStep:
    """The time of one plain target step (one node verified) on this machine and path: a running mean, over verified
    steps, of the time from a tree's proposal to its observation (the target's forward, the verification, the commit)
    scaled down to one node by the cost curve (a batch's step by its time ratio: CostCurve.step_cost). A property of the
    machine, not of a request: it is kept across them."""

    DECAY = 0.8  # weight of the older steps

    def __init__(self) -> None:
        self.seconds: float | None = None  # None until a step was measured
        self._proposed_at: float | None = None

    def proposed(self) -> None:
        """A tree was just handed to the loop: its verification starts."""
        self._proposed_at = time.perf_counter()

    def observed(self, tree_size: int, curve: CostCurve) -> None:
        """The tree handed over last (of `tree_size` nodes) was verified and committed."""
        if self._proposed_at is None:
            return
        sample = (time.perf_counter() - self._proposed_at) / curve.step_cost(tree_size)
        self.seconds = sample if self.seconds is None else self.DECAY * self.seconds + (1 - self.DECAY) * sample
        self._proposed_at = None

    def forget_step(self) -> None:
        """A request ended after a proposal that was never observed (its last step)."""
        self._proposed_at = None


class Paced(Drafter):
    """`drafter`, paused while its drafting does not pay (the module docstring says how). `plain_step`: an estimate
    someone else measures (auto's, shared by its sources); None: its own, measured around its drafter's proposals.
    `enabled` False (an unpaced request: `request_pacing`) asks the drafter at every step and leaves the pause alone."""

    def __init__(self, drafter: Drafter, plain_step: PlainStep | None = None, rule: PauseRule = PAUSE_RULE):
        self.drafter, self.rule = drafter, rule
        self.measures_plain_step = plain_step is None
        self.plain_step = PlainStep() if plain_step is None else plain_step
        self.enabled = True
        self.requests = 1  # requests whose steps its drafting delays (the batch engine's: share_steps)
        self.pause_left = 0  # steps of the current pause still to come; carried to the next request
        self.paused_steps = 0  # over the wrapper's life (DrafterStats.paused_steps)
        self._asked = False  # the drafter proposed the step's tree (not a pause)
        self._own_s = 0.0  # the drafter's time in the current step: its propose, then its observe
        self._window_cost = self._window_earned = 0.0  # plain target steps, over the window's asked steps
        self._window_steps = 0

    # The drafter's face, unchanged: the loop and the faces see the wrapped drafter's name, layers, target and curve.
    name = property(lambda self: self.drafter.name)  # type: ignore[assignment]
    hidden_layers = property(lambda self: self.drafter.hidden_layers)  # type: ignore[assignment]
    target = property(lambda self: self.drafter.target)
    options = property(lambda self: self.drafter.options)

    @property
    def cost_curve(self) -> CostCurve:
        return self.drafter.cost_curve

    @cost_curve.setter
    def cost_curve(self, curve: CostCurve) -> None:
        self.drafter.cost_curve = curve

    def describe(self) -> str:
        return self.drafter.describe()

    def stats(self) -> DrafterStats:
        return replace(self.drafter.stats(), paused_steps=self.paused_steps)

    def reset(self) -> None:
        """A new request: the window starts afresh; the pause and the plain-step estimate carry over."""
        self.drafter.reset()
        self._asked, self._own_s = False, 0.0
        self._window_cost = self._window_earned = 0.0
        self._window_steps = 0
        if self.measures_plain_step:
            self.plain_step.forget_step()

    def propose(self, request: DraftRequest) -> DraftTree:
        self._asked = not (self.enabled and self.pause_left > 0)
        if self._asked:
            start = time.perf_counter()
            tree = self.drafter.propose(request)
            self._own_s = time.perf_counter() - start
        else:
            self.pause_left -= 1
            self.paused_steps += 1
            tree = DraftTree.root_only(request.root_token)
        if self.measures_plain_step:
            self.plain_step.proposed()
        return tree

    def observe(self, observation: Observation, earned: int | None = None) -> None:
        """`earned`: the step's tokens to credit the drafter with (auto: those no other source proposed); None: the
        drafted tokens the target accepted."""
        if self.measures_plain_step and observation.tree is not None:
            self.plain_step.observed(observation.tree.size, self.cost_curve)
        start = time.perf_counter()
        self.drafter.observe(observation)
        own_s, asked = self.drafter.drafting_seconds(self._own_s + time.perf_counter() - start), self._asked
        self._asked, self._own_s = False, 0.0
        if observation.tree is None or not asked or not self.enabled or self.plain_step.seconds is None:
            return  # the prefill, a paused step, an unpaced request, or no plain step to weigh it against yet
        self._window_cost += own_s * self.requests / self.plain_step.seconds
        self._window_earned += len(observation.accepted_path) - 1 if earned is None else earned
        self._window_steps += 1
        if self._window_steps == self.rule.window:
            self.pause_left = self.rule.pause(self._window_cost - self._window_earned)
            self._window_cost = self._window_earned = 0.0
            self._window_steps = 0


def _wrappers(drafter: Drafter) -> list[Paced]:
    """The Paced wrappers a drafter runs through: itself, or a composite drafter's sources."""
    return [part for part in (drafter, *drafter.parts()) if isinstance(part, Paced)]


def paced(drafter: Drafter) -> Drafter:
    """`drafter` with its pacing, to keep across requests: itself where it is paced already (a Paced drafter, or a
    composite one whose sources are), else wrapped."""
    return drafter if _wrappers(drafter) else Paced(drafter)


def share_steps(drafter: Drafter, requests: int) -> None:
    """The drafter's request is verified in steps shared by `requests` requests (the batch engine's): its drafting
    delays every one of them, so a plain step's worth of it costs `requests` tokens, not one."""
    for wrapper in _wrappers(drafter):
        wrapper.requests = requests


@contextmanager
def request_pacing(drafter: Drafter, pace: bool) -> Iterator[Drafter]:
    """The drafter one request runs. `pace`: paced as it is kept (or, for a bare drafter, by a wrapper of its own for
    this request alone); False: every wrapper it runs through asks at every step, and its pause is left as it was."""
    wrappers = _wrappers(drafter)
    if pace and not wrappers:
        yield Paced(drafter)
        return
    before = [wrapper.enabled for wrapper in wrappers]
    for wrapper in wrappers:
        wrapper.enabled = pace
    try:
        yield drafter
    finally:
        for wrapper, enabled in zip(wrappers, before, strict=True):
            wrapper.enabled = enabled
