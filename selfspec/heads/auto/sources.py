"""`auto`'s sources: which drafters join by default, loading them, and what each earned for its pacing."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from ...cost import CostCurve
from ...errors import SelfspecError
from ...models import Target
from ..artifacts import heads_kind
from ..base import Drafter, drafter_entry, drafter_names

# `history` (earlier requests' text) costs as little as lookup: in two in-process A/B benchmarks (16 prompts a set, T=0)
# it added 2.5% tokens/s on HumanEval and 0.6-1.0% over three sets. The artifact drafters join when they have heads
# here. `dflash` is not a default source: beside lookup, EAGLE and
# Medusa it raised auto's tau but lowered its tokens/s on every set in two benchmarks (its block forward costs more than
# the tokens only it finds); it joins when named (auto:sources=...) or given with --heads.
DEFAULT_SOURCES = ("ngram", "history", "eagle", "medusa")
# A default source with trained parts joins only if its training report measured at least this mean accepted length on
# held-out prompts (heads with no report join): a head that drafts little costs every step and crowds the tree.
MIN_HELDOUT_TAU = 1.3


def load_sources(
    target: Target, heads_dir: Path | None, cost_curve: CostCurve, named: tuple[str, ...] | None
) -> tuple[dict[str, Drafter], dict[str, str]]:
    """The sources (`named`, else DEFAULT_SOURCES), each loaded with its default options, and the default sources left
    out with why. `heads_dir` goes to the source of its kind (which joins the default sources); other artifact
    drafters read the heads shipped for the target. Without `named`, the artifact drafters that find no heads for the
    target, or whose heads' training report measured a held-out mean accepted length below MIN_HELDOUT_TAU, are left
    out."""
    names = list(named or DEFAULT_SOURCES)
    kind = None if heads_dir is None else heads_kind(heads_dir)
    if heads_dir is not None:
        if kind is None or kind == "auto" or kind not in drafter_names():
            raise SelfspecError(f"auto: '{heads_dir}' holds no drafter's heads or tuned data")
        if kind not in names:
            if named:
                raise SelfspecError(
                    f"auto: '{heads_dir}' holds '{kind}' heads, which is not among the sources "
                    f"{'+'.join(names)}: add it to sources"
                )
            names.append(kind)
    sources: dict[str, Drafter] = {}
    left_out: dict[str, str] = {}
    for name in names:
        entry = drafter_entry(name)
        own_heads = heads_dir if name == kind else None
        chosen = bool(named) or own_heads is not None or not entry.has_artifacts
        try:
            source = entry.drafter_cls.load(target, own_heads, cost_curve, entry.options_cls())
        except SelfspecError:
            if chosen:
                raise
            left_out[name] = "no heads for this model"
            continue
        heldout_tau = source.stats().heldout_tau
        if not chosen and heldout_tau is not None and heldout_tau < MIN_HELDOUT_TAU:
            left_out[name] = f"held-out mean accepted length {heldout_tau:.2f} < {MIN_HELDOUT_TAU}"
            continue
        sources[name] = source
    return sources, left_out


def proposers(merged_maps: Iterable[list[int]]) -> dict[int, int]:
    """Node of the verified tree -> how many of the asked sources proposed it; `merged_maps` holds, per source, its
    nodes' indices in the verified tree (-1 where not kept)."""
    counts: dict[int, int] = {}
    for merged in merged_maps:
        for node in set(merged) - {-1, 0}:
            counts[node] = counts.get(node, 0) + 1
    return counts


def earned_tokens(accepted: set[int], merged: list[int], proposed_by: dict[int, int]) -> int:
    """What a source earned in a step, for its pacing (`Paced`): what the tree would have lacked without it,
    the accepted nodes no other asked source proposed (a token two sources proposed would have been there anyway)."""
    return sum(1 for node in accepted.intersection(merged) if node > 0 and proposed_by[node] == 1)
