"""Drafters used only by tests: they exercise the loop's extremes (all accepted, nothing accepted, branching)."""

from __future__ import annotations

import torch

from selfspec.cost import load_cost_curve
from selfspec.heads.base import DraftRequest, Drafter, Observation
from selfspec.tree_attention import DraftTree


class _ContextDrafter(Drafter):
    def __init__(self, target):
        super().__init__(target, load_cost_curve("cpu", target.name))
        self.context: list[int] = []

    def reset(self) -> None:
        self.context = []

    def observe(self, observation: Observation) -> None:
        self.context.extend(observation.new_tokens)


class OracleDrafter(_ContextDrafter):
    """Knows the target's greedy continuation; proposes it as a chain (all accepted), optionally with a wrong
    sibling placed *before* each right child, so accepted nodes are not contiguous in the layout."""

    def __init__(self, target, full_sequence: list[int], depth: int = 4, decoys: bool = False):
        super().__init__(target)
        self.full, self.depth, self.decoys = full_sequence, depth, decoys

    def propose(self, request: DraftRequest) -> DraftTree:
        position = len(self.context)
        future = self.full[position : position + min(self.depth, request.max_depth)]
        if not self.decoys:
            return DraftTree.from_paths(request.root_token, [future])
        tokens, parents, parent = [request.root_token], [-1], 0
        vocab = self.target.vocab_size
        for token in future:
            tokens += [(token + 1) % vocab, token]  # decoy first, then the right token
            parents += [parent, parent]
            parent = len(tokens) - 1
        return DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents))


class RandomDrafter(_ContextDrafter):
    """Random tokens in a tree of `width` x `depth`: (almost) nothing is accepted."""

    def __init__(self, target, width: int = 2, depth: int = 3, seed: int = 0):
        super().__init__(target)
        self.width, self.depth = width, depth
        self.rng = torch.Generator().manual_seed(seed)

    def propose(self, request: DraftRequest) -> DraftTree:
        depth = min(self.depth, request.max_depth)
        paths = [torch.randint(0, self.target.vocab_size, (depth,), generator=self.rng).tolist() for _ in range(self.width)]
        return DraftTree.from_paths(request.root_token, paths if depth > 0 else [])


class DrawnDrafter(_ContextDrafter):
    """Children *drawn* from a draft distribution q (the target's own distribution at a higher temperature, mixed
    with noise): exercises multi-candidate rejection sampling. Deterministic children when `drawn` is False."""

    def __init__(self, target, width: int = 2, depth: int = 2, drawn: bool = True, without_replacement: bool = False):
        super().__init__(target)
        self.width, self.depth, self.drawn, self.without_replacement = width, depth, drawn, without_replacement

    def _draft_dist(self, context: list[int]) -> torch.Tensor:
        logits = self.target.model(torch.tensor([context])).logits[0, -1].float()
        return 0.7 * torch.softmax(logits / 1.5, -1) + 0.3 / logits.shape[-1]

    def propose(self, request: DraftRequest) -> DraftTree:
        tokens, parents, dists = [request.root_token], [-1], []
        frontier = [(0, self.context)]
        for _ in range(min(self.depth, request.max_depth)):
            next_frontier = []
            for node, context in frontier:
                q = self._draft_dist(context)
                while len(dists) <= node:
                    dists.append(None)
                dists[node] = q
                if self.drawn:
                    picks = torch.multinomial(q, self.width, replacement=not self.without_replacement, generator=request.generator)
                else:
                    picks = torch.topk(q, self.width).indices
                for token in picks.tolist():
                    tokens.append(token)
                    parents.append(node)
                    next_frontier.append((len(tokens) - 1, context + [token]))
            frontier = next_frontier[:1]  # expand only the first child of each level
        vocab = self.target.vocab_size
        table = torch.stack([d if d is not None else torch.full((vocab,), 1.0 / vocab) for d in dists + [None] * (len(tokens) - len(dists))])
        return DraftTree(
            tokens=torch.tensor(tokens),
            parents=torch.tensor(parents),
            draft_probs=table if self.drawn else None,
            without_replacement=self.without_replacement,
        )
