"""Whether drafting pays, on this machine: the one owner of pacing decisions.

- `PauseRule`: how long to stop drafting that lost time against plain decoding (one rule for the loop and for `auto`).
- `DraftPacer`: the decoding loop's pacing of a whole drafter, one request at a time.
- `SourcePacing`: `auto`'s pacing of each of its sources, by the same rule.
- `DraftCost`: what one draft forward costs in plain target steps, for a drafter that times its forwards (layerskip),
  and the verdict that it can never pay (`dormant`).
- `AcceptanceCalibration`: a drafter's running estimate of how much of what it drafts the target accepts, which sizes
  its trees (down to no draft at all when drafting does not pay). Unlike the rest it is per request, and the drafter's
  own: it holds one.
- `Pacing`: everything above that outlives a request, as one record per drafter (and per source of a composite
  drafter).

Who holds what. The state that carries from one request to the next lives in a `Pacing` record held beside the
drafter by whoever keeps the drafter (the `SelfSpec` object, the bench runner), never on the drafter: the caller passes
it to `speculative_generate(..., pacing=...)` (without one a request starts from a fresh record). The loop hands the
same record to the drafter in every `DraftRequest` and `Observation` (`.pacing`); that is the whole interface. A
drafter reads its verdicts there (`paced`: may it skip drafting for cost; `dormant`; for `auto`, `source(name).ask()`)
and adds the timings only it can take (`draft_cost.drafted`, a source's `earned`); it keeps no reference to it. A
composite drafter hands each source that source's own record (`source(name)`), in the source's request and
observation. Whether the loop paces a drafter at all is declared when it is registered (`paces_itself=True`: `ngram`,
`history`, `auto`).

Pausing or shrinking drafts never changes what is emitted: pacing only moves speed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .cost import CostCurve


@dataclass(frozen=True)
class PauseRule:
    """When drafting does not pay on this machine, for how long to stop it (`DraftPacer` for a whole drafter,
    `SourcePacing` for each source of `auto`): a probe of `window` drafting steps that lost time against plain
    decoding pauses drafting for as many steps as keep the loss within `share` of the time the pause and the probe
    take together, so a drafter that never pays costs about `share` of plain decoding's speed, and one that missed
    cheaply is asked again soon."""

    window: int = 4
    share: float = 0.02
    max_pause: int = 1024

    def pause(self, lost_steps: float, min_pause: int = 0) -> int:
        """Steps to pause after a window that lost `lost_steps` plain target steps (0 if it lost nothing)."""
        if lost_steps <= 0:
            return 0
        return min(self.max_pause, max(min_pause, math.ceil(lost_steps / self.share)))


PAUSE_RULE = PauseRule()


class DraftPacer:
    """Stops asking the drafter for trees while drafting does not pay, on this machine.

    Every PROBE_STEPS drafting steps it compares their wall time with what plain decoding would have taken for the
    tokens they emitted (a plain step measured on steps that verified the root alone; estimated until then from the
    drafting steps themselves, the verification forward scaled down by the cost curve). A window that lost time
    pauses drafting for as many steps as keep that loss within PROBE_SHARE of the time the pause and the probe take
    together (at least MIN_PAUSE, at most MAX_PAUSE): a cheap drafter that missed a few times (prompt lookup) is
    asked again soon, an expensive one (layer-skip) rarely, and a drafter that never pays costs at most about
    PROBE_SHARE of the time. What is left of a pause carries over to the drafter's next request (`remember`, into its
    `Pacing` record), so that bound holds across short requests too; an unpaced request (`enabled` False) neither
    pauses nor touches the record.
    """

    PROBE_STEPS = PAUSE_RULE.window
    PROBE_SHARE = PAUSE_RULE.share
    MIN_PAUSE = 4
    MAX_PAUSE = PAUSE_RULE.max_pause
    _PLAIN_DECAY = 0.7  # weight of the older plain-step timings in the running estimate

    def __init__(self, curve: CostCurve, record: Pacing, enabled: bool = True):
        self.curve = curve
        self._record = record
        self.enabled = enabled
        self.plain_s: float | None = None  # one plain step, measured
        self.paused_steps = 0
        self._pause_left = record.pause_left if enabled else 0
        self._window_s = self._window_tokens = 0.0
        self._window_plain_s = 0.0  # the same steps' plain-step estimates, summed
        self._window_steps = 0

    def remember(self) -> None:
        """Leave what is left of the pause in the drafter's record, for its next request."""
        if self.enabled:
            self._record.pause_left = self._pause_left

    def should_draft(self) -> bool:
        if self._pause_left > 0:
            self._pause_left -= 1
            self.paused_steps += 1
            return False
        return True

    def record(self, tree_size: int, emitted: int, step_s: float, forward_s: float, draft_s: float) -> None:
        if tree_size <= 1:
            plain = step_s - draft_s
            self.plain_s = (
                plain if self.plain_s is None else self._PLAIN_DECAY * self.plain_s + (1 - self._PLAIN_DECAY) * plain
            )
            return
        if not self.enabled:
            return
        self._window_s += step_s
        self._window_tokens += emitted
        self._window_plain_s += step_s - draft_s - forward_s + forward_s / self.curve.cost(tree_size)
        self._window_steps += 1
        if self._window_steps < self.PROBE_STEPS:
            return
        plain_s = self.plain_s if self.plain_s is not None else self._window_plain_s / self._window_steps
        lost_s = self._window_s - self._window_tokens * plain_s  # versus plain decoding of the same tokens
        if lost_s > 0:
            self._pause_left = PAUSE_RULE.pause(lost_s / plain_s, self.MIN_PAUSE)
        self._window_s = self._window_tokens = self._window_plain_s = 0.0
        self._window_steps = 0


class SourcePacing:
    """Whether a source pays, by the rule the decoding loop applies to a whole drafter (PAUSE_RULE): over windows of
    asked steps, the source's drafting time in plain target steps against the tokens it earned: the accepted tokens no
    other asked source proposed (what the tree would have lacked without it; a token two sources proposed would have
    been there anyway). A window that cost more than it earned skips the source for as many steps as keep that loss
    within the rule's share of the time; a source that costs next to nothing (prompt lookup) is skipped a step at
    most. What is left of a skip carries over to the next request."""

    def __init__(self) -> None:
        self.skip_left = 0
        self.tokens = self.cost = 0.0
        self.steps = 0

    def new_request(self) -> None:
        self.tokens = self.cost = 0.0
        self.steps = 0

    def ask(self) -> bool:
        if self.skip_left > 0:
            self.skip_left -= 1
            return False
        return True

    def record(self, tokens: float, cost: float) -> None:
        self.tokens += tokens
        self.cost += cost
        self.steps += 1
        if self.steps < PAUSE_RULE.window:
            return
        self.skip_left = PAUSE_RULE.pause(self.cost - self.tokens)
        self.tokens = self.cost = 0.0
        self.steps = 0


class DraftCost:
    """What one draft token costs on this machine and path, in plain target steps: running means of the drafter's
    one-token forwards (seconds, `drafted`: the drafter times them) and of the target's plain step (its verification
    forward scaled down by the cost curve, `verified`: the loop reports it). A property of the machine, not of a
    request: it is kept across requests, in the drafter's `Pacing` record."""

    MIN_SAMPLES = 4  # one-token draft forwards timed before any verdict
    DECAY = 0.8  # weight of the older timings

    def __init__(self) -> None:
        self.draft_s: float | None = None
        self.plain_s: float | None = None
        self.samples = 0

    @classmethod
    def _mean(cls, old: float | None, new: float) -> float:
        return new if old is None else cls.DECAY * old + (1 - cls.DECAY) * new

    def drafted(self, seconds: float, forwards: int) -> None:
        if forwards > 0:
            self.draft_s = self._mean(self.draft_s, seconds / forwards)
            self.samples += forwards

    def verified(self, forward_s: float, relative_cost: float) -> None:
        if forward_s > 0:
            self.plain_s = self._mean(self.plain_s, forward_s / relative_cost)

    @property
    def steps_per_token(self) -> float | None:
        """One draft forward in plain target steps; None until measured."""
        if self.draft_s is None or self.plain_s is None or self.samples < self.MIN_SAMPLES:
            return None
        return self.draft_s / self.plain_s

    @property
    def dormant(self) -> bool:
        """A draft forward costs a plain step or more: even a token that is always accepted does not pay for it."""
        cost = self.steps_per_token
        return cost is not None and cost >= 1.0


class AcceptanceCalibration:
    """A drafter's running estimate of the share of its drafting the target accepts, over the recent steps of one
    request: `factor` = accepted / expected (decayed sums), starting from `prior` with the weight of `weight` expected
    tokens. Two uses, one rule:

    - a head's calibration (prior 1): `expected` is what its own scores promised (`proposed`), so `factor` scales its
      node gains before a tree is sized, and an overconfident head proposes smaller trees, down to none;
    - prompt lookup's acceptance rate (prior `prior_acceptance`): `expected` counts the drafted tokens tried (those
      accepted and the first one rejected), so `factor` is the chance a drafted token is accepted.

    Steps without a draft carry no evidence: they drift the factor back toward the prior, so drafting can start again
    after a bad stretch instead of staying off for good."""

    DECAY = 0.9  # weight of history per drafted step
    RECOVERY = 0.05  # per step without a draft, the share of the gap to the prior closed

    def __init__(self, prior: float = 1.0, weight: float = 2.0) -> None:
        self.prior, self.weight = prior, weight
        self.reset()

    def reset(self) -> None:
        self.accepted, self.expected = self.prior * self.weight, self.weight
        self.pending = 0.0  # expected accepted tokens of the tree just proposed (`proposed`)

    @property
    def factor(self) -> float:
        return self.accepted / self.expected

    def scaled(self, gains: list[float]) -> list[float]:
        """Gains as calibrated acceptance chances (at most 1 each)."""
        factor = self.factor
        return [min(1.0, gain * factor) for gain in gains]

    def proposed(self, gains: list[float]) -> None:
        """The uncalibrated gains of the nodes just proposed."""
        self.pending = sum(gains)

    def verified(self, accepted: int) -> None:
        """A verified step: `accepted` draft tokens of the tree last `proposed` (a step that proposed none drifts)."""
        if self.pending > 0:
            self.record(accepted, self.pending)
        else:
            self.drift()
        self.pending = 0.0

    def record(self, accepted: float, expected: float) -> None:
        """A drafted step: `accepted` tokens of the `expected` ones."""
        self.accepted = self.DECAY * self.accepted + accepted
        self.expected = self.DECAY * self.expected + expected

    def drift(self) -> None:
        """A step without a draft: close RECOVERY of the gap to the prior."""
        self.accepted += self.RECOVERY * (self.prior * self.expected - self.accepted)


class Pacing:
    """Pacing's record of one drafter, or of one source of a composite drafter, across its requests (the module
    docstring says who holds it and who reads what). Its size is fixed: one `SourcePacing` and one `DraftCost`, and
    one record per source of a composite drafter."""

    def __init__(self) -> None:
        self.paced = True  # this request lets drafting be skipped for cost (speculative_generate's `pace`)
        self.pause_left = 0  # steps of the loop's pause left (DraftPacer), carried to the drafter's next request
        self.skips = SourcePacing()  # as a source of a composite drafter: whether that drafter asks it (`ask`)
        self.draft_cost = DraftCost()  # its draft forwards against a plain step, if it times them (layerskip)
        self.plain_step_s = 0.0  # the step just verified: its forward scaled down to one plain step; 0 = unknown
        self.sources: dict[str, Pacing] = {}  # a composite drafter's sources, by name

    def new_request(self, paced: bool) -> None:
        """The loop, as a request starts (and, through it, every source's record)."""
        self.paced, self.plain_step_s = paced, 0.0
        self.skips.new_request()
        for record in self.sources.values():
            record.new_request(paced)

    def source(self, name: str) -> "Pacing":
        """The record of a composite drafter's source `name` (made on first use), to hand to that source."""
        if name not in self.sources:
            self.sources[name] = Pacing()
            self.sources[name].paced = self.paced
        return self.sources[name]

    def verified(self, forward_s: float, relative_cost: float) -> None:
        """The loop, after each verified step: the target's forward (seconds) and its cost relative to a plain step."""
        self.plain_step_s = forward_s / relative_cost if forward_s > 0 else 0.0
        self.draft_cost.verified(forward_s, relative_cost)
        for record in self.sources.values():
            record.verified(forward_s, relative_cost)

    @property
    def dormant(self) -> bool:
        """Drafting can never pay (DraftCost.dormant), and this request lets it be skipped."""
        return self.paced and self.draft_cost.dormant

    def ask(self) -> bool:
        """As a source: whether the composite drafter asks it this step (always, in an unpaced request)."""
        return not self.paced or self.skips.ask()

    def earned(self, tokens: float, draft_s: float) -> None:
        """As a source asked this step: the tokens it earned and its drafting time (seconds), judged by SourcePacing in
        plain target steps (only in a paced request, once the step's plain step is known)."""
        if self.paced and self.plain_step_s > 0:
            self.skips.record(tokens, draft_s / self.plain_step_s)
