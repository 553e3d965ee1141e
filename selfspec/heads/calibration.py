"""A drafter's running estimate of how much of what it drafts the target accepts: it sizes the drafter's trees on the
cost curve (down to no draft at all where drafting would not pay). Per request, and the drafter's own: it holds one.
Whether the drafter's own time pays is another question, `Paced`'s (paced.py)."""

from __future__ import annotations


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
