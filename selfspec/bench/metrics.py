"""Benchmark arithmetic on run records: pure functions, tested on hand-made step logs.

Definitions:
- tau (mean accepted length): tokens emitted per target forward, the target's own token included (>= 1).
- acceptance rate: accepted draft tokens over drafted nodes, on steps that drafted anything.
- speed-up against X: X's total wall time over this method's, on the same prompts with the same token counts
  (greedy outputs are identical, so this equals the ratio of tokens/s).
- ceiling: tau over the mean verification cost of the trees used, from the machine's cost curve: the speed-up
  against plain decoding if drafting and bookkeeping were free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable


@dataclass(frozen=True)
class RunRecord:
    """One method on one prompt."""

    method: str
    dataset: str
    category: str
    prompt_id: str
    new_tokens: int
    wall_s: float
    target_forwards: int  # verification forwards, prefill excluded
    accepted_lengths: tuple[int, ...]  # per step; empty for peers that do not expose steps
    tree_sizes: tuple[int, ...]  # per step, root included; empty for peers
    token_ids: tuple[int, ...]
    peak_mem_mb: float
    accepted_by_source: tuple[tuple[str, int], ...] = ()  # a composite drafter's accepted draft tokens per source
    draft_s: float | None = None  # selfspec drafters: the drafter's share of the steps (GenerationStats); None for HF
    verify_s: float | None = None  # selfspec drafters: the tree forwards and their verification
    path: str = ""  # selfspec drafters: the execution path the run was on ("" for HF, which runs stock)


def tau(records: Iterable[RunRecord]) -> float:
    records = list(records)
    return sum(r.new_tokens for r in records) / max(1, sum(r.target_forwards for r in records))


def acceptance_rate(records: Iterable[RunRecord]) -> float | None:
    """Accepted draft tokens over drafted nodes, on steps that drafted anything (None for HF peers)."""
    records = list(records)
    if all(not r.tree_sizes for r in records):
        return None
    accepted = sum(
        length - 1 for r in records for length, size in zip(r.accepted_lengths, r.tree_sizes, strict=True) if size > 1
    )
    drafted = sum(size - 1 for r in records for size in r.tree_sizes if size > 1)
    return accepted / drafted if drafted else 0.0


def tokens_per_s(records: Iterable[RunRecord]) -> float:
    records = list(records)
    wall = sum(r.wall_s for r in records)
    return sum(r.new_tokens for r in records) / wall if wall > 0 else 0.0


def speedup(records: Iterable[RunRecord], baseline: Iterable[RunRecord]) -> float | None:
    """Baseline time over this method's time for the same tokens: both measured as throughput on the same prompts."""
    mine, theirs = tokens_per_s(records), tokens_per_s(baseline)
    return mine / theirs if theirs > 0 else None


def greedy_match_rate(records: Iterable[RunRecord], reference: dict[str, tuple[int, ...]]) -> float:
    records = list(records)
    matches = sum(1 for r in records if r.token_ids == reference.get(r.prompt_id))
    return matches / max(1, len(records))


def cost_ceiling(records: Iterable[RunRecord], cost: Callable[[int], float]) -> float | None:
    """Tokens emitted over the summed relative cost of the verified trees (None without a step log)."""
    emitted = spent = 0.0
    for record in records:
        emitted += sum(record.accepted_lengths)
        spent += sum(cost(size) for size in record.tree_sizes)
    return emitted / spent if spent > 0 else None


def mean_tree_size(records: Iterable[RunRecord]) -> float | None:
    sizes = [size for r in records for size in r.tree_sizes]
    return sum(sizes) / len(sizes) if sizes else None


def accepted_by_source(records: Iterable[RunRecord]) -> dict[str, int] | None:
    """A composite drafter's accepted draft tokens per source, summed (None for drafters without sources). A token two
    sources proposed counts for both."""
    totals: dict[str, int] = {}
    for record in records:
        for name, count in record.accepted_by_source:
            totals[name] = totals.get(name, 0) + count
    return totals or None


def time_share(records: Iterable[RunRecord], part: str) -> float | None:
    """The share of the wall time spent in `part` ("draft_s" or "verify_s"); None where a record did not time it."""
    records = list(records)
    seconds = [getattr(r, part) for r in records]
    wall = sum(r.wall_s for r in records)
    return sum(seconds) / wall if None not in seconds and wall > 0 else None


def accepted_draft_tokens(records: Iterable[RunRecord]) -> int:
    """Draft tokens the verifier accepted (each step's own token left out)."""
    return sum(length - 1 for r in records for length in r.accepted_lengths)
