"""The draft tree as data.

Node 0 is the root: the last committed token, whose KV is not cached yet. Every other node is a drafted token whose
parent comes earlier in the layout (parents[i] < i), so a single forward pass in layout order is causal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from ..errors import SelfspecError


@dataclass(frozen=True)
class DraftTree:
    """A tree of candidate continuations.

    `draft_probs`, when given, says the children of node i were *drawn* from the distribution in row i (multi-candidate
    rejection sampling); when None, children were chosen deterministically (e.g. a head's top-k) and are tried in
    layout order. `without_replacement` says sibling draws excluded the earlier siblings' tokens.
    """

    tokens: torch.Tensor  # [n] long; tokens[0] is the root (last committed token)
    parents: torch.Tensor  # [n] long; parents[0] == -1, 0 <= parents[i] < i for i > 0
    draft_probs: torch.Tensor | None = None  # [n, V] float; row i: distribution node i's children were drawn from
    without_replacement: bool = False
    # Host copies, computed once per tree: the verifier walks them and the mask builder needs the depth bound.
    parent_list: tuple[int, ...] = field(init=False, repr=False, compare=False)
    depth_list: tuple[int, ...] = field(init=False, repr=False, compare=False)
    child_lists: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # A drafter's tree is a public contract: break it and the error says how, under `python -O` too.
        if self.tokens.dim() != 1 or self.tokens.shape != self.parents.shape or self.tokens.numel() == 0:
            raise SelfspecError(
                f"a DraftTree needs tokens and parents of one shape [n], n >= 1; got "
                f"{tuple(self.tokens.shape)} and {tuple(self.parents.shape)}"
            )
        parent_list = tuple(int(p) for p in self.parents.tolist())
        if parent_list[0] != -1:
            raise SelfspecError(f"DraftTree node 0 must be the root (parent -1), got parent {parent_list[0]}")
        bad = next((i for i, p in enumerate(parent_list) if i > 0 and not 0 <= p < i), None)
        if bad is not None:
            raise SelfspecError(f"DraftTree parents[{bad}] = {parent_list[bad]}: a node's parent must come before it")
        if self.draft_probs is not None and (
            self.draft_probs.dim() != 2 or self.draft_probs.shape[0] != len(parent_list)
        ):
            raise SelfspecError(
                f"DraftTree draft_probs must be [n, V] with n = {len(parent_list)}, got {tuple(self.draft_probs.shape)}"
            )
        depth_list = [0] * len(parent_list)
        child_lists: list[list[int]] = [[] for _ in parent_list]
        for i in range(1, len(parent_list)):
            depth_list[i] = depth_list[parent_list[i]] + 1
            child_lists[parent_list[i]].append(i)
        object.__setattr__(self, "parent_list", parent_list)
        object.__setattr__(self, "depth_list", tuple(depth_list))
        object.__setattr__(self, "child_lists", tuple(tuple(c) for c in child_lists))

    @cached_property
    def token_list(self) -> list[int]:
        """Host copy of `tokens` (one sync, once per tree)."""
        return self.tokens.tolist()

    @property
    def size(self) -> int:
        return len(self.parent_list)

    @property
    def max_depth(self) -> int:
        return max(self.depth_list)

    def children(self, node: int) -> tuple[int, ...]:
        """Children of `node`, in layout order (the order the verifier tries them)."""
        return self.child_lists[node]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to `node`, inclusive."""
        path = [node]
        while path[-1] != 0:
            path.append(self.parent_list[path[-1]])
        return path[::-1]

    def pruned(self, max_depth: int) -> "DraftTree":
        """The same tree without nodes deeper than `max_depth` (the loop's token and context budget)."""
        if self.max_depth <= max_depth:
            return self
        keep = [i for i, d in enumerate(self.depth_list) if d <= max_depth]
        # Dropping only deep nodes keeps every kept node's ancestors, and the layout order is preserved.
        new_index = {old: new for new, old in enumerate(keep)}
        parents = [-1] + [new_index[self.parent_list[i]] for i in keep[1:]]
        keep_t = torch.tensor(keep, device=self.tokens.device)
        return DraftTree(
            tokens=self.tokens[keep_t],
            parents=torch.tensor(parents, dtype=torch.long),
            draft_probs=None if self.draft_probs is None else self.draft_probs[keep_t.to(self.draft_probs.device)],
            without_replacement=self.without_replacement,
        )

    @staticmethod
    def root_only(root_token: int) -> "DraftTree":
        return DraftTree(tokens=torch.tensor([root_token]), parents=torch.tensor([-1]))

    @staticmethod
    def from_paths(root_token: int, paths: list[list[int]]) -> "DraftTree":
        """A trie of token paths below the root (shared prefixes merged), nodes in first-seen order."""
        tokens, parents = [root_token], [-1]
        node_of: dict[tuple[int, ...], int] = {(): 0}
        for path in paths:
            for depth in range(1, len(path) + 1):
                key = tuple(path[:depth])
                if key not in node_of:
                    node_of[key] = len(tokens)
                    tokens.append(path[depth - 1])
                    parents.append(node_of[key[:-1]])
        return DraftTree(tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents))
