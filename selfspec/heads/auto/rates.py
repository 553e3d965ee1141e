"""`auto`'s acceptance estimates, per source: P(a node at depth d, sibling rank r, is accepted | its parent was)."""

from __future__ import annotations

RANKS = 3  # sibling ranks told apart in the estimates: first child, second child, the rest


class SourceRates:
    """One source's running acceptance estimates: P(a node at depth d, sibling rank r, is accepted | its parent
    was), from the nodes of its trees whose parent the verifier accepted. Each estimate starts from a prior mean worth
    `prior_weight` observations: the source's estimate over all its earlier requests (`prior`) where that record has
    tried the depth; else, where this record has tried the depth above, its estimate there; else the earlier
    requests' estimate, or a fixed guess by sibling rank. A depth no tree has reached yet thus starts from the one
    above it: a merged tree that is cut where the estimates are unknown would never learn that a source's long drafts
    (a verbatim lookup) are accepted to their end (a prompt where `ngram` alone took 15 steps for 128 tokens and `auto`
    46, its trees held at two levels whose every node was accepted).

    Only nodes of a verified tree are recorded, and a tree of `max_nodes` nodes is at most `max_nodes - 1` deep, so
    the estimates hold at most `max_depth` x RANKS entries whatever the number of requests (`record` refuses a deeper
    node): the lifetime estimates `auto` keeps across requests stay that size."""

    PRIOR = (0.5, 0.15, 0.05)  # by sibling rank

    def __init__(self, prior_weight: float, max_depth: int, prior: "SourceRates | None" = None):
        self.prior_weight = prior_weight
        self.max_depth = max_depth
        self.prior = prior
        self.hits: dict[tuple[int, int], float] = {}
        self.tries: dict[tuple[int, int], float] = {}

    def rate(self, depth: int, rank: int) -> float:
        key = (depth, min(rank, RANKS - 1))
        return (self.hits.get(key, 0.0) + self._prior_mean(*key) * self.prior_weight) / (
            self.tries.get(key, 0.0) + self.prior_weight
        )

    def _prior_mean(self, depth: int, rank: int) -> float:
        """What the estimate at (depth, rank) starts from (the class docstring)."""
        if self.prior is not None and (depth, rank) in self.prior.tries:
            return self.prior.rate(depth, rank)
        if depth > 1 and (depth - 1, rank) in self.tries:
            return self.rate(depth - 1, rank)
        return self.PRIOR[rank] if self.prior is None else self.prior.rate(depth, rank)

    def record(self, depth: int, rank: int, accepted: bool) -> None:
        if not 1 <= depth <= self.max_depth:
            raise ValueError(f"auto: a node at depth {depth} cannot have been verified (1..{self.max_depth})")
        key = (depth, min(rank, RANKS - 1))
        self.tries[key] = self.tries.get(key, 0.0) + 1.0
        self.hits[key] = self.hits.get(key, 0.0) + float(accepted)
        if self.prior is not None:
            self.prior.record(depth, rank, accepted)
