"""`ngram` (prompt lookup): zero parameters; copies continuations of the latest n-gram out of the context.

The context's n-grams are indexed incrementally (n = min_ngram..max_ngram, `TokenIndex`), so a lookup is a dict
access. The continuations that follow the most recent matches of the longest matching n-gram become the paths of a
trie. Draft length follows the machine's cost curve and a running estimate of how often drafted tokens are accepted,
kept for each length of the n-gram matched: on held-out ShareGPT prompts a draft's first token was accepted 21-22% of
the time after a 1-gram match, 51-57% after a 2-gram, 50-67% after a 3-gram and 79-83% after a 4-gram (one request at a
time and four at once; 1-grams were 78% of the drafts alone), so one estimate for all of them drafted long chains on
weak matches and short ones on strong matches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ...cost import CostCurve
from ...errors import SelfspecError
from ...models import Target
from ...tree_attention import DraftTree
from ..base import Drafter, DraftRequest, Observation, register_drafter
from ..calibration import AcceptanceCalibration

_PRIOR_WEIGHT = 4.0  # drafted tokens the prior acceptance estimate is worth


@dataclass(frozen=True)
class NgramOptions:
    drafter: ClassVar[str] = "ngram"  # whose options these are (in error messages)
    max_ngram: int = 4  # longest n-gram looked up (longer matches first)
    min_ngram: int = 1
    max_candidates: int = 3  # continuations (tree branches) per step
    max_draft: int = 16  # longest continuation
    prior_acceptance: float = 0.6  # the acceptance estimate a request starts from (until `learn_prior` has learned one)
    # each request's estimate for a length of match starts from what this drafter's earlier requests accepted after
    # matches of that length (their totals, with `prior_acceptance` worth _PRIOR_WEIGHT tokens among them)
    learn_prior: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise SelfspecError(
                f"{self.drafter} sizes need 1 <= min_ngram <= max_ngram, got {self.min_ngram}..{self.max_ngram}"
            )
        if self.max_candidates < 1 or self.max_draft < 1:
            raise SelfspecError(f"{self.drafter}: max_candidates and max_draft must be >= 1")
        if not 0.0 <= self.prior_acceptance <= 1.0:
            raise SelfspecError(f"{self.drafter}: prior_acceptance must lie in [0, 1], got {self.prior_acceptance}")


class TokenIndex:
    """Tokens with an index of their n-grams (n in `sizes`): n-gram -> the positions right after its occurrences,
    oldest first."""

    def __init__(self, sizes: tuple[int, ...]):
        self.sizes = sizes  # longest first
        self.tokens: list[int] = []
        self.index: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens) -> None:
        for token in tokens:
            end = len(self.tokens)
            for n in self.sizes:
                if end >= n:
                    self.index.setdefault(tuple(self.tokens[end - n : end]), []).append(end)
            self.tokens.append(token)

    def continuations(self, context: list[int], depth: int, max_paths: int) -> Matches:
        """Up to `max_paths` continuations (at most `depth` tokens) of the longest n-gram that ends `context`, one per
        distinct next token, the most recent occurrences first; then those of shorter n-grams for other next tokens
        (longer matches predict better than the shorter ones after them)."""
        matches = Matches()
        seen_first: set[int] = set()
        for n in self.sizes:
            if len(context) < n:
                continue
            for start in reversed(self.index.get(tuple(context[-n:]), ())):
                path = self.tokens[start : start + depth]
                if path and path[0] not in seen_first:  # one branch per distinct next token
                    seen_first.add(path[0])
                    matches.add(n, path)
                    if len(matches.paths) == max_paths:
                        return matches
        return matches


@dataclass
class Matches:
    """What a lookup found: the paths (continuations) and the length of the n-gram the first one followed (0: none)."""

    paths: list[list[int]] = field(default_factory=list)
    length: int = 0

    def add(self, n: int, path: list[int]) -> None:
        self.length = self.length or n
        self.paths.append(path)


@register_drafter("ngram", options=NgramOptions)
class NgramDrafter(Drafter):
    def __init__(self, target: Target, cost_curve: CostCurve, options: NgramOptions = NgramOptions()):
        super().__init__(target, cost_curve, options)
        self.ngram_sizes = tuple(range(options.max_ngram, options.min_ngram - 1, -1))  # longest first
        self.max_candidates = options.max_candidates
        self.max_draft = options.max_draft
        # The chance a drafted token is accepted, for each length of the n-gram matched: accepted tokens over those
        # tried (AcceptanceCalibration)
        self.acceptance_estimates = {
            n: AcceptanceCalibration(options.prior_acceptance, _PRIOR_WEIGHT) for n in self.ngram_sizes
        }
        # accepted and tried drafted tokens after each length of match, over every request this drafter served
        self.lifetime = {n: [0.0, 0.0] for n in self.ngram_sizes}
        self.matched = self.ngram_sizes[0]  # the length of the n-gram the latest lookup matched
        self._undrafted: tuple[int, ...] = ()  # match lengths whose drafting did not pay at the latest step (observe)
        self.reset()

    def reset(self) -> None:
        self.lookup = TokenIndex(self.ngram_sizes)  # the request's tokens so far, indexed
        self.reset_estimates()

    def reset_estimates(self) -> None:
        """Every length's estimate starts again from its prior: what the earlier requests accepted after matches of
        that length (`learn_prior`; a 1-gram's drafts were accepted 21-22% of the time on held-out prompts, a 4-gram's
        79-83%), else `prior_acceptance`. Drifting goes back to it too."""
        for length, estimate in self.acceptance_estimates.items():
            if self.options.learn_prior:
                accepted, tried = self.lifetime[length]
                prior = self.options.prior_acceptance
                estimate.prior = (accepted + prior * _PRIOR_WEIGHT) / (tried + _PRIOR_WEIGHT)
            estimate.reset()

    @property
    def context(self) -> list[int]:
        """The request's tokens so far (prompt and output)."""
        return self.lookup.tokens

    @property
    def acceptance(self) -> float:
        """The chance a token drafted after a match of the latest lookup's length is accepted."""
        return self.acceptance_estimates[self.matched].factor

    def _append(self, tokens: tuple[int, ...]) -> None:
        self.lookup.extend(tokens)

    def _candidates(self, depth: int) -> Matches:
        return self.lookup.continuations(self.context, depth, self.max_candidates)

    def propose(self, request: DraftRequest) -> DraftTree:
        best = max(estimate.factor for estimate in self.acceptance_estimates.values())
        longest = min(self.max_draft, request.max_depth)
        reach = self.cost_curve.best_chain_length(best, longest) if longest > 0 else 0
        if reach == 0:  # no length of match pays now: no lookup (`auto` asks `history` for each request every step)
            self._undrafted = tuple(self.acceptance_estimates)
            return DraftTree.root_only(request.root_token)
        found = self._candidates(reach)
        if not found.paths:
            return DraftTree.root_only(request.root_token)
        self.matched = found.length
        depth = self.cost_curve.best_chain_length(self.acceptance, reach)
        if depth == 0:  # a match, but drafting after one of its length does not pay now
            self._undrafted = (self.matched,)
            return DraftTree.root_only(request.root_token)
        paths = [path[:depth] for path in found.paths]
        # Extra branches only while they are nearly free on this machine's cost curve.
        node_budget = self.cost_curve.largest_size_within(self.cost_curve.cost(len(paths[0]) + 1) * 1.05)
        tree = DraftTree.from_paths(request.root_token, paths)
        while tree.size > node_budget and len(paths) > 1:
            paths.pop()
            tree = DraftTree.from_paths(request.root_token, paths)
        return tree

    def drafting_seconds(self, measured: float) -> float:
        """None to speak of: a lookup is a dict access (microseconds), so the clock around it shows the machine's stalls
        (a preemption, a garbage collection), not its cost; pausing it for those would only miss the stretches it
        copies. Its draft length already follows its measured acceptance on the cost curve (0 where it would not
        pay)."""
        return 0.0

    def observe(self, observation: Observation) -> None:
        if observation.tree is not None and observation.tree.size > 1:
            accepted = len(observation.accepted_path) - 1
            tried = accepted + (0 if observation.reached_leaf else 1)
            self.acceptance_estimates[self.matched].record(accepted, tried)
            self.lifetime[self.matched][0] += accepted
            self.lifetime[self.matched][1] += tried
        elif observation.tree is not None:
            # Drafting that did not pay is no evidence: those lengths' estimates drift back toward the prior. Otherwise
            # one bad stretch below break-even would switch drafting off for good (a chain of 0 is never measured).
            for length in self._undrafted:
                self.acceptance_estimates[length].drift()
        self._undrafted = ()
        self._append(observation.new_tokens)
