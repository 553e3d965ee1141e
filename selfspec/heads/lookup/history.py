"""`history`: zero parameters; copies continuations out of the requests this drafter served before.

Prompt lookup (`ngram`) sees only the current request. A deployment answers many similar ones: replies open and
close alike, code repeats its idioms, a prompt quotes what an earlier reply wrote. This drafter keeps the prompts and
outputs of its earlier requests (the newest `max_tokens` of them: ~1 MB at the default 65,536, see
`PackedTokenIndex`) in an n-gram index and, at each step, copies what
followed the longest n-gram (at least `min_ngram` tokens: across unrelated text a one-token match predicts little)
that ends the current request; the most recent occurrences first, one branch per distinct next token. This is the
idea of SuffixDecoding (Oliaro et al., 2024), over an n-gram index rather than a suffix tree.

A request joins the history when the next one starts (`reset`), so the first request of a process drafts nothing.
Draft length follows the cost curve and the running acceptance estimate, as `ngram`'s does; `auto` asks it beside
`ngram` and the heads, and credits it only with the accepted tokens no other source proposed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...cost import CostCurve
from ...errors import SelfspecError
from ...models import Target
from ..base import register_drafter
from .ngram import Matches, NgramDrafter, NgramOptions
from .packed_index import PackedTokenIndex


@dataclass(frozen=True)
class HistoryOptions(NgramOptions):
    drafter: ClassVar[str] = "history"
    max_ngram: int = 6
    min_ngram: int = 2
    prior_acceptance: float = 0.3  # earlier requests predict this one less often than its own context does
    max_tokens: int = 65536  # tokens of earlier requests kept (the newest); the index: 4 + 12 bytes a token per n

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_tokens < 1:
            raise SelfspecError(f"history: max_tokens must be >= 1, got {self.max_tokens}")


@register_drafter("history", options=HistoryOptions)
class HistoryDrafter(NgramDrafter):
    def __init__(self, target: Target, cost_curve: CostCurve, options: HistoryOptions = HistoryOptions()):
        self.max_tokens = options.max_tokens
        self.request_tokens: list[int] = []
        self.history = PackedTokenIndex(tuple(range(options.max_ngram, options.min_ngram - 1, -1)))
        super().__init__(target, cost_curve, options)

    def reset(self) -> None:
        """The request just served joins the history; each length's acceptance estimate starts again from its prior
        (NgramDrafter.reset_estimates)."""
        self._remember(self.request_tokens)
        self.request_tokens = []
        self.reset_estimates()

    def _remember(self, tokens: list[int]) -> None:
        if not tokens:
            return
        if len(self.history) + len(tokens) > self.max_tokens:
            # Re-index the newest three quarters of the cap: a rebuild now and then, not one per request.
            kept = (self.history.tokens.tolist() + tokens)[-(self.max_tokens * 3 // 4 or 1) :]
            self.history.clear()  # in place: drafters that share it (share_history) keep sharing it
            self.history.extend(kept)
            return
        self.history.extend(tokens)

    def share_history(self, other: "HistoryDrafter") -> None:
        """Draft from `other`'s history, and add this drafter's requests to it: one history for the slots of a batch
        (selfspec.batch), as one `SelfSpec` has one, held once and capped once."""
        self.history = other.history

    @property
    def context(self) -> list[int]:
        return self.request_tokens

    def _append(self, tokens: tuple[int, ...]) -> None:
        self.request_tokens.extend(tokens)

    def _candidates(self, depth: int) -> Matches:
        return self.history.continuations(self.request_tokens, depth, self.max_candidates)
