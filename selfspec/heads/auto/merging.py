"""`auto`'s trees: the sources' trees merged into one trie over token paths, the nodes that pay kept, and the way
back from the verified tree to each source's own."""

from __future__ import annotations

import torch

from ...cost import CostCurve
from ...errors import SelfspecError
from ...tree_attention import DraftTree
from .rates import SourceRates

Path = tuple[int, ...]  # a node as its tokens below the root; the root is ()


def merge_trees(
    root_token: int, trees: dict[str, DraftTree], rates: dict[str, SourceRates]
) -> tuple[list[Path], list[float], dict[str, list[Path]]]:
    """The union of the sources' trees as token paths below the root, each path's best score over the sources that
    proposed it, and per source the path of each of its nodes (root = ()). Paths in first-seen order."""
    paths: list[Path] = []
    scores: dict[Path, float] = {}
    node_paths: dict[str, list[Path]] = {}
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


def select_nodes(paths: list[Path], scores: list[float], curve: CostCurve, max_nodes: int) -> list[Path]:
    """The best nodes by score, as many as pay on the cost curve, in an order where parents come first. A child never
    scores above its parent, and ties go to the shallower node, so the kept set is closed under taking parents."""
    order = sorted(range(len(paths)), key=lambda i: (-scores[i], len(paths[i]), i))
    gains = [scores[i] for i in order[: max_nodes - 1]]
    size = curve.best_size(gains)[0]
    return [paths[i] for i in order[: size - 1]]


def tree_of(root_token: int, node_paths: list[Path]) -> DraftTree:
    """The tree whose node i is `node_paths[i]` (the root, (), first; parents before children)."""
    index_of = {path: i for i, path in enumerate(node_paths)}
    tokens = [root_token] + [path[-1] for path in node_paths[1:]]
    parents = [-1] + [index_of[path[:-1]] for path in node_paths[1:]]
    return DraftTree(tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long))


def own_accepted_path(tree: DraftTree, merged: list[int], accepted: set[int]) -> tuple[int, ...]:
    """The part of the verified tree's accepted path that lay in a source's own `tree`, as nodes of that tree (root
    first): `merged` maps each of its nodes to the verified tree's (-1 where it was not kept), `accepted` holds the
    verified tree's accepted nodes."""
    path = [0]
    while True:
        nxt = next((child for child in tree.children(path[-1]) if merged[child] in accepted), None)
        if nxt is None:
            return tuple(path)
        path.append(nxt)
