"""`auto`'s options and the drafter: each step, ask the sources, merge, keep what pays; after it, each source
observes its own view of the step."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...cost import CostCurve
from ...errors import SelfspecError
from ...models import Target
from ...tree_attention import DraftTree
from ..base import Drafter, DrafterStats, DraftRequest, Observation, register_drafter
from ..paced import Paced, PauseRule, PlainStep
from .merging import merge_trees, own_accepted_path, select_nodes, tree_of
from .rates import SourceRates
from .sources import earned_tokens, load_sources, proposers

# A source whose proposals the merged tree keeps leaving out gets its first node verified after this many such steps,
# the wait doubling after each such try up to EXPLORE_MAX (AutoDrafter._explored).
EXPLORE_AFTER = 4
EXPLORE_MAX = 64
# How a source that does not pay is paused: a quarter of a drafter alone's share (PauseRule), so such a source costs
# about 0.5% of the merged steps' speed, not 2%. Beside prompt lookup the default sources' heads mostly lose on a small
# CPU (an asked EAGLE proposal took 5.6-6.5 ms: its catch-up over the tokens committed since it last drafted and a head
# forward for each level of its tree; a Medusa proposal 1.2 ms; steps 4.5 ms): `auto` at 0.005 against 0.02, the default
# model on the compiled path, 2-core Zen 5, one process, interleaved, 128 tokens a prompt, every output plain
# decoding's: 1.055x against 1.022x `none` (MT-bench and HumanEval, 8 each), 1.044x against 1.007x (MT-bench, HumanEval
# and ShareGPT, 6 each), 1.101x against 1.091x (ShareGPT and HumanEval, 8 each; 0.01: 1.108x); on q4 1.101x against
# 1.064x. A drafter alone keeps 0.02: eagle, medusa and dflash alone came out the same at 0.005 (within 1%).
SOURCE_PAUSE_RULE = PauseRule(share=0.005)


@dataclass(frozen=True)
class AutoOptions:
    # e.g. ngram+eagle; None: the default sources (sources.DEFAULT_SOURCES: the lookups, ngram and history, and the
    # trained heads found for the model that drafted enough on held-out prompts)
    sources: tuple[str, ...] | None = None
    max_nodes: int = 48  # the merged tree's node budget (the cost curve usually picks fewer)
    prior_weight: float = 2.0  # pseudo-observations behind each acceptance estimate's prior

    def __post_init__(self) -> None:
        if self.sources is not None:
            names = (self.sources,) if isinstance(self.sources, str) else tuple(self.sources)
            if not names or len(set(names)) != len(names) or "auto" in names or "none" in names:
                raise SelfspecError(
                    f"auto: sources must be distinct drafters other than auto and none, got {'+'.join(names)}"
                )
            object.__setattr__(self, "sources", names)
        if self.max_nodes < 2:
            raise SelfspecError("auto: max_nodes must be >= 2")
        if self.prior_weight <= 0:
            raise SelfspecError("auto: prior_weight must be > 0")


@dataclass(frozen=True)
class _Proposal:
    """One asked source's part in the step."""

    tree: DraftTree  # root only where its pacing skipped it this step
    merged: list[int]  # the source's node index -> the merged tree's node index (-1 where pruned)


@register_drafter("auto", options=AutoOptions, composite=True)
class AutoDrafter(Drafter):
    """One tree a step from its sources (the package docstring says how); `sources` are drafters it loaded. Each
    source is paced on its own (a `Paced` wrapper, on the plain-step estimate `auto` measures for them all), so a free
    source keeps drafting while a costly one rests; `auto` as a whole is never paused (`parts`)."""

    def __init__(
        self,
        target: Target,
        cost_curve: CostCurve,
        options: AutoOptions,
        sources: dict[str, Drafter],
        left_out: dict[str, str] | None = None,
    ):
        super().__init__(target, cost_curve, options)
        if not sources:
            raise SelfspecError("auto: no source drafter could be loaded")
        self.plain_step = PlainStep()  # measured around the merged trees, read by every source's pacing
        self.sources = {name: Paced(source, self.plain_step, SOURCE_PAUSE_RULE) for name, source in sources.items()}
        self.hidden_layers = tuple(sorted({layer for source in sources.values() for layer in source.hidden_layers}))
        self.accepted_by_source: dict[str, int] = {name: 0 for name in sources}  # over the drafter's life
        self.left_out = dict(left_out or {})  # default sources not loaded, and why
        # The acceptance estimates start afresh each request, from the source's record over the earlier ones (bounded:
        # see SourceRates). Whether a source pays is its wrapper's (Paced).
        self.max_depth = options.max_nodes - 1  # of the merged tree, so of any node a source gets verified
        self.lifetime_rates = {name: SourceRates(options.prior_weight, self.max_depth) for name in sources}
        self.reset()

    @classmethod
    def load(cls, target: Target, heads_dir: Path | None, cost_curve: CostCurve, options: AutoOptions) -> "AutoDrafter":
        """The sources, each with its default options (sources.load_sources: which join, and where `heads_dir` goes)."""
        sources, left_out = load_sources(target, heads_dir, cost_curve, options.sources)
        return cls(target, cost_curve, options, sources, left_out)

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
        self.rates = {
            name: SourceRates(self.options.prior_weight, self.max_depth, self.lifetime_rates[name])
            for name in self.sources
        }
        self.proposals: dict[str, _Proposal] = {}
        self.left_out_steps = {name: 0 for name in self.sources}  # steps in a row its proposal was left out
        self.explore_every = {name: EXPLORE_AFTER for name in self.sources}

    def parts(self) -> tuple[Drafter, ...]:
        return tuple(self.sources.values())

    def stats(self) -> DrafterStats:
        """Accepted draft tokens by source over the drafter's life, and the default sources left out."""
        return DrafterStats(accepted_by_source=dict(self.accepted_by_source), left_out=dict(self.left_out))

    def propose(self, request: DraftRequest) -> DraftTree:
        self.proposals = {}
        self.plain_step.forget_step()
        if request.max_depth <= 0:
            return DraftTree.root_only(request.root_token)
        trees = {name: source.propose(request) for name, source in self.sources.items()}
        paths, scores, node_paths = merge_trees(request.root_token, trees, self.rates)
        kept = [()] + select_nodes(paths, scores, self.cost_curve, self.options.max_nodes)
        kept += self._explored(trees, node_paths, set(kept))
        index_of = {path: i for i, path in enumerate(kept)}
        for name, tree in trees.items():
            self.proposals[name] = _Proposal(tree, [index_of.get(path, -1) for path in node_paths[name]])
        self.plain_step.proposed()
        return tree_of(request.root_token, kept)

    def _explored(self, trees: dict[str, DraftTree], node_paths: dict[str, list], kept: set) -> list:
        """The first nodes of sources whose proposals have been left out of the merged tree for their wait (the paths
        to add to it). A source's estimates are learnt only from its nodes that get verified, so one rejected first node
        in a cheap-to-verify-nothing moment could keep it out for the rest of the request (two lookups alone then
        decoded as `none` does); a node of its own kept on its score ends the wait."""
        added = []
        for name, tree in trees.items():
            if tree.size == 1:
                continue
            own = node_paths[name]
            if any(path in kept for path in own[1:]):
                self.left_out_steps[name], self.explore_every[name] = 0, EXPLORE_AFTER
                continue
            self.left_out_steps[name] += 1
            if self.left_out_steps[name] >= self.explore_every[name]:
                first = own[tree.children(0)[0]]  # the child of the root it ranks first
                if first not in kept:
                    added.append(first)
                    kept.add(first)
                self.left_out_steps[name] = 0
                self.explore_every[name] = min(EXPLORE_MAX, 2 * self.explore_every[name])
        return added

    def observe(self, observation: Observation) -> None:
        """Every source observes the step with its own tree and the part of the accepted path that lay in it (the
        tokens and hidden states are what was committed); a source not asked this step, with a root-only tree. Each
        source's pacing is credited with what it earned: the accepted tokens no other source proposed."""
        if observation.tree is None:  # the prefill
            for source in self.sources.values():
                source.observe(observation)
            return
        self.plain_step.observed(observation.tree.size, self.cost_curve)
        accepted = set(observation.accepted_path)
        proposed_by = proposers(proposal.merged for proposal in self.proposals.values())
        # the root-only tree every source not asked observes: the step's own where it was one (a paused step), made
        # once a step otherwise
        root = observation.tree if observation.tree.size == 1 else None
        for name, source in self.sources.items():
            proposal, earned = self.proposals.get(name), 0
            if proposal is None:
                if root is None:
                    root = DraftTree.root_only(observation.tree.token_list[0])
                tree, own_path = root, (0,)
            else:
                tree, own_path = proposal.tree, own_accepted_path(proposal.tree, proposal.merged, accepted)
                self.accepted_by_source[name] += len(own_path) - 1
                self._learn(name, proposal, own_path)
                earned = earned_tokens(accepted, proposal.merged, proposed_by)
            source.observe(Observation(observation.new_tokens, observation.hidden, tree, own_path), earned=earned)
        self.proposals = {}

    def _learn(self, name: str, proposal: _Proposal, own_path: tuple[int, ...]) -> None:
        """Each node of the source's tree whose parent was accepted was tried: count it, and whether it was accepted
        (only nodes that made it into the verified tree could be)."""
        tree, rates, on_path = proposal.tree, self.rates[name], set(own_path)
        for parent in own_path:
            for rank, child in enumerate(tree.children(parent)):
                if proposal.merged[child] >= 0:
                    rates.record(tree.depth_list[child], rank, child in on_path)
