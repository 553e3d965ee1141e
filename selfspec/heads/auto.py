"""`auto`: one tree merged from several drafters (its sources), weighted by what each has been accepting.

Every step each source that is paying its way proposes its own tree. The trees are merged into one trie over token
paths (a path two sources propose becomes one path). A node's score estimates its chance of being accepted: for a
source, the product down the path of that source's acceptance rates per depth and sibling rank, running estimates
from what the verifier accepted in this request; a node keeps the best score any source gave it. The best n nodes
(n from the cost curve in use: expected accepted tokens per unit of verification cost) are verified as one tree of
deterministic candidates, so the verifier's rules keep the output exactly the target's.

After the step every source observes the committed tokens and hidden states as usual, with its own tree and the
part of the accepted path that lay in its own tree, so its caches and statistics stay its own whichever source's
path won. A source whose earned tokens fall below its drafting time (in plain target steps) is skipped for a while,
in proportion to the time it lost (the loop's own rule, cost.PAUSE_RULE, applied per source, so the loop does not
pause `auto` as a whole: a free source such as prompt lookup keeps drafting while a costly head rests); skipped
sources still observe every step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..cost import CostCurve
from ..errors import SelfspecError
from ..models import Target
from ..pacing import SourcePacing
from ..tree_attention import DraftTree, VerifyResult
from .artifacts import heads_kind
from .base import DraftRequest, Drafter, DrafterStats, Observation, drafter_entry, drafter_names, register_drafter

# `history` (earlier requests' text) costs as little as lookup: in two in-process A/B benchmarks (16 prompts a set, T=0)
# it added 2.5% tokens/s on HumanEval and 0.6-1.0% over three sets. The artifact drafters join when they have heads
# here. `dflash` is not a default source: beside lookup, EAGLE and
# Medusa it raised auto's tau but lowered its tokens/s on every set in two benchmarks (its block forward costs more than
# the tokens only it finds); it joins when named (auto:sources=...) or given with --heads.
DEFAULT_SOURCES = ("ngram", "history", "eagle", "medusa")
# A default source with trained parts joins only if its training report measured at least this mean accepted length on
# held-out prompts (heads with no report join): a head that drafts little costs every step and crowds the tree.
MIN_HELDOUT_TAU = 1.3
_RANKS = 3  # sibling ranks told apart in the acceptance estimates: first child, second child, the rest


@dataclass(frozen=True)
class AutoOptions:
    sources: tuple[str, ...] | None = None  # e.g. ngram+eagle; None: ngram and every trained head found for the model
    max_nodes: int = 48  # the merged tree's node budget (the cost curve usually picks fewer)
    prior_weight: float = 2.0  # pseudo-observations behind each acceptance estimate's prior

    def __post_init__(self) -> None:
        if self.sources is not None:
            names = (self.sources,) if isinstance(self.sources, str) else tuple(self.sources)
            if not names or len(set(names)) != len(names) or "auto" in names or "none" in names:
                raise SelfspecError(f"auto: sources must be distinct drafters other than auto and none, got {'+'.join(names)}")
            object.__setattr__(self, "sources", names)
        if self.max_nodes < 2:
            raise SelfspecError("auto: max_nodes must be >= 2")
        if self.prior_weight <= 0:
            raise SelfspecError("auto: prior_weight must be > 0")


class SourceRates:
    """One source's running acceptance estimates: P(a node at depth d, sibling rank r, is accepted | its parent
    was), from the nodes of its trees whose parent the verifier accepted. A request's estimates start afresh, from a
    prior worth `prior_weight` observations: the source's estimates over all its earlier requests when it has any
    (`prior`), otherwise a fixed guess by sibling rank."""

    PRIOR = (0.5, 0.15, 0.05)  # by sibling rank

    def __init__(self, prior_weight: float, prior: "SourceRates | None" = None):
        self.prior_weight = prior_weight
        self.prior = prior
        self.hits: dict[tuple[int, int], float] = {}
        self.tries: dict[tuple[int, int], float] = {}

    def rate(self, depth: int, rank: int) -> float:
        key = (depth, min(rank, _RANKS - 1))
        prior = self.PRIOR[key[1]] if self.prior is None else self.prior.rate(depth, rank)
        return (self.hits.get(key, 0.0) + prior * self.prior_weight) / (self.tries.get(key, 0.0) + self.prior_weight)

    def record(self, depth: int, rank: int, accepted: bool) -> None:
        key = (depth, min(rank, _RANKS - 1))
        self.tries[key] = self.tries.get(key, 0.0) + 1.0
        self.hits[key] = self.hits.get(key, 0.0) + float(accepted)
        if self.prior is not None:
            self.prior.record(depth, rank, accepted)


@dataclass
class _Proposal:
    tree: DraftTree
    merged: list[int]  # the source's node index -> the merged tree's node index (-1 where pruned)
    seconds: float


def merge_trees(root_token: int, trees: dict[str, DraftTree], rates: dict[str, SourceRates]
                ) -> tuple[list[tuple[int, ...]], list[float], dict[str, list[tuple[int, ...]]]]:
    """The union of the sources' trees as token paths below the root, each path's best score over the sources that
    proposed it, and per source the path of each of its nodes (root = ()). Paths in first-seen order."""
    paths: list[tuple[int, ...]] = []
    scores: dict[tuple[int, ...], float] = {}
    node_paths: dict[str, list[tuple[int, ...]]] = {}
    for name, tree in trees.items():
        if tree.token_list[0] != root_token:
            raise SelfspecError(f"auto: source '{name}' rooted its tree at {tree.token_list[0]}, not at {root_token}")
        tokens, own_paths, own_scores = tree.token_list, [()], [1.0]
        rank_of = {child: rank for children in tree.child_lists for rank, child in enumerate(children)}
        for node in range(1, tree.size):
            parent, rank = tree.parent_list[node], rank_of[node]
            path = own_paths[parent] + (tokens[node],)
            own_paths.append(path)
            own_scores.append(own_scores[parent] * rates[name].rate(tree.depth_list[node], rank))
            if path not in scores:
                paths.append(path)
                scores[path] = own_scores[node]
            else:
                scores[path] = max(scores[path], own_scores[node])
        node_paths[name] = own_paths
    return paths, [scores[path] for path in paths], node_paths


def select_nodes(paths: list[tuple[int, ...]], scores: list[float], curve: CostCurve, max_nodes: int) -> list[tuple[int, ...]]:
    """The best nodes by score, as many as pay on the cost curve, in an order where parents come first. A child never
    scores above its parent, and ties go to the shallower node, so the kept set is closed under taking parents."""
    order = sorted(range(len(paths)), key=lambda i: (-scores[i], len(paths[i]), i))
    gains = [scores[i] for i in order[: max_nodes - 1]]
    size = curve.best_size(gains)[0]
    return [paths[i] for i in order[: size - 1]]


@register_drafter("auto", options=AutoOptions, composite=True)
class AutoDrafter(Drafter):
    paces_itself = True  # per source (SourcePacing)

    def __init__(self, target: Target, cost_curve: CostCurve, options: AutoOptions, sources: dict[str, Drafter]):
        super().__init__(target, cost_curve, options)
        if not sources:
            raise SelfspecError("auto: no source drafter could be loaded")
        self.sources = sources
        self.hidden_layers = tuple(sorted({layer for source in sources.values() for layer in source.hidden_layers}))
        self.accepted_by_source: dict[str, int] = {name: 0 for name in sources}  # over the drafter's life
        self.left_out: dict[str, str] = {}  # default sources not loaded, and why (set by load)
        # Whether each source pays is a property of the source on this machine more than of one request: the
        # schedule carries over (any skip left included); the acceptance estimates start afresh each request,
        # from the source's record over the earlier ones.
        self.source_pacing = {name: SourcePacing() for name in sources}
        self.lifetime_rates = {name: SourceRates(options.prior_weight) for name in sources}
        self.reset()

    @classmethod
    def load(cls, target: Target, heads_dir: Path | None, cost_curve: CostCurve, options: AutoOptions) -> "AutoDrafter":
        """Each source is loaded with its default options. `heads_dir` goes to the source of its kind (which joins
        the default sources); other artifact drafters read the heads shipped for the target. Without `sources`, the
        artifact drafters that find no heads for the target, or whose heads' training report measured a held-out mean
        accepted length below MIN_HELDOUT_TAU, are left out (`left_out` says why)."""
        names = list(options.sources or DEFAULT_SOURCES)
        kind = None if heads_dir is None else heads_kind(heads_dir)
        if heads_dir is not None:
            if kind is None or kind == "auto" or kind not in drafter_names():
                raise SelfspecError(f"auto: '{heads_dir}' holds no drafter's heads or tuned data")
            if kind not in names:
                if options.sources:
                    raise SelfspecError(f"auto: '{heads_dir}' holds '{kind}' heads, which is not among the sources "
                                        f"{'+'.join(names)}: add it to sources")
                names.append(kind)
        sources: dict[str, Drafter] = {}
        left_out: dict[str, str] = {}
        for name in names:
            entry = drafter_entry(name)
            own_heads = heads_dir if name == kind else None
            chosen = bool(options.sources) or own_heads is not None or not entry.has_artifacts
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
        drafter = cls(target, cost_curve, options, sources)
        drafter.left_out = left_out
        return drafter

    @property
    def cost_curve(self) -> CostCurve:
        return self._cost_curve

    @cost_curve.setter
    def cost_curve(self, curve: CostCurve) -> None:
        """The merged tree and every source's own tree are sized on the same curve."""
        self._cost_curve = curve
        for source in getattr(self, "sources", {}).values():
            source.cost_curve = curve

    def reset(self) -> None:
        for source in self.sources.values():
            source.reset()
        self.rates = {name: SourceRates(self.options.prior_weight, self.lifetime_rates[name]) for name in self.sources}
        for pacing in self.source_pacing.values():
            pacing.new_request()
        self.proposals: dict[str, _Proposal] = {}
        self.paced = True  # whether the last request let sources be skipped (DraftRequest.pace)
        self.tree_paths: list[tuple[int, ...]] = [()]  # the merged tree's node paths, root first

    def propose(self, request: DraftRequest) -> DraftTree:
        self.proposals = {}
        if request.max_depth <= 0:
            self.tree_paths = [()]
            return DraftTree.root_only(request.root_token)
        trees, seconds = {}, {}
        self.paced = request.pace
        for name, source in self.sources.items():
            if not request.pace or self.source_pacing[name].ask():
                start = time.perf_counter()
                trees[name] = source.propose(request)
                seconds[name] = time.perf_counter() - start
        paths, scores, node_paths = merge_trees(request.root_token, trees, self.rates)
        kept = select_nodes(paths, scores, self.cost_curve, self.options.max_nodes)
        self.tree_paths = [()] + kept
        index_of = {path: i for i, path in enumerate(self.tree_paths)}
        for name, tree in trees.items():
            merged = [index_of.get(path, -1) for path in node_paths[name]]
            self.proposals[name] = _Proposal(tree, merged, seconds[name])
        tokens = [request.root_token] + [path[-1] for path in kept]
        parents = [-1] + [index_of[path[:-1]] for path in kept]
        return DraftTree(tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long))

    def observe(self, observation: Observation) -> None:
        result = observation.result
        if result is None or observation.tree is None:  # the prefill (or a step the loop drafted nothing for)
            for name, source in self.sources.items():
                source.observe(self._unasked(observation) if result is not None else observation)
            self.proposals = {}
            return
        accepted = set(result.accepted_path)
        # One plain target step, in seconds: the verification forward scaled down by the cost curve.
        unit_s = observation.forward_s / self.cost_curve.cost(observation.tree.size) if observation.forward_s > 0 else 0.0
        proposers: dict[int, int] = {}  # merged node -> how many of the asked sources proposed it
        for proposal in self.proposals.values():
            for node in set(proposal.merged) - {-1, 0}:
                proposers[node] = proposers.get(node, 0) + 1
        for name, source in self.sources.items():
            proposal = self.proposals.get(name)
            if proposal is None:
                source.observe(self._unasked(observation))
                continue
            own = self._own_view(proposal, accepted, result, observation)
            own_tokens = len(own.result.accepted_tokens)
            self.accepted_by_source[name] += own_tokens
            self._learn(name, proposal, own.result.accepted_path)
            if unit_s > 0 and self.paced:
                # What the tree would have lacked without it: accepted nodes no other asked source proposed.
                earned = sum(1 for node in accepted.intersection(proposal.merged) if node > 0 and proposers[node] == 1)
                self.source_pacing[name].record(earned, proposal.seconds / unit_s)
            source.observe(own)
        self.proposals = {}

    def _own_view(self, proposal: _Proposal, accepted: set[int], result: VerifyResult, observation: Observation) -> Observation:
        """The step as the source would have seen it had its own tree been verified: the part of the accepted path
        that lay in its tree; the tokens, hidden states and the step's extra token are what was committed."""
        tree, path = proposal.tree, [0]
        while True:
            nxt = next((child for child in tree.children(path[-1]) if proposal.merged[child] in accepted), None)
            if nxt is None:
                break
            path.append(nxt)
        emitted = result.emitted
        own = VerifyResult(
            accepted_path=tuple(path),
            accepted_tokens=tuple(tree.token_list[i] for i in path[1:]),
            next_token=emitted[len(path) - 1] if len(path) - 1 < len(emitted) else emitted[-1],
            is_bonus=not tree.children(path[-1]),
        )
        return Observation(observation.new_tokens, observation.hidden, own, tree, observation.forward_s)

    @staticmethod
    def _unasked(observation: Observation) -> Observation:
        """A step in which the source proposed nothing: a root-only tree of its own, nothing of it accepted."""
        root = observation.tree.token_list[0] if observation.tree is not None else observation.new_tokens[0]
        nothing = VerifyResult(accepted_path=(0,), accepted_tokens=(), next_token=observation.new_tokens[0], is_bonus=True)
        return Observation(observation.new_tokens, observation.hidden, nothing, DraftTree.root_only(root), observation.forward_s)

    def _learn(self, name: str, proposal: _Proposal, own_path: tuple[int, ...]) -> None:
        """Each node of the source's tree whose parent was accepted was tried: count it, and whether it was accepted
        (only nodes that made it into the verified tree could be)."""
        tree, rates, on_path = proposal.tree, self.rates[name], set(own_path)
        for parent in own_path:
            for rank, child in enumerate(tree.children(parent)):
                if proposal.merged[child] >= 0:
                    rates.record(tree.depth_list[child], rank, child in on_path)

    def stats(self) -> DrafterStats:
        """Accepted draft tokens by source over the drafter's life, and the default sources left out."""
        return DrafterStats(accepted_by_source=dict(self.accepted_by_source), left_out=dict(self.left_out))
