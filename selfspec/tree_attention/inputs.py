"""A draft tree turned into model inputs: token ids, positions and the 4D additive tree-attention mask."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import DraftTree


@dataclass(frozen=True)
class TreeInputs:
    """What one target forward over a tree needs, on the model's device."""

    input_ids: torch.Tensor  # [1, n] long
    position_ids: torch.Tensor  # [1, n] long: prefix_len + depth
    attention_mask: torch.Tensor  # [1, 1, n, prefix_len + n] additive: 0 = visible, dtype min = hidden
    prefix_len: int  # tokens already in the KV cache


def ancestor_matrix(tree: DraftTree, device: torch.device | str = "cpu") -> torch.Tensor:
    """[n, n] bool: entry (i, j) is True when node j is node i itself or one of its ancestors.

    Built by pointer jumping, one vectorised step per tree level, no loop over nodes.
    """
    n = tree.size
    parent_of = tree.parents.to(device).clamp(min=0)  # the root points at itself
    rows = torch.arange(n, device=device)
    visible = torch.eye(n, dtype=torch.bool, device=device)
    ancestor = rows
    for _ in range(tree.max_depth):
        ancestor = parent_of[ancestor]
        visible[rows, ancestor] = True
    return visible


def build_tree_inputs(
    tree: DraftTree, prefix_len: int, dtype: torch.dtype, device: torch.device | str
) -> TreeInputs:
    """Every node sees the cached prefix, its ancestors and itself; positions are prefix_len + depth."""
    n = tree.size
    visible = ancestor_matrix(tree, device)  # [n, n]
    mask = torch.zeros(n, prefix_len + n, dtype=dtype, device=device)
    mask[:, prefix_len:].masked_fill_(~visible, torch.finfo(dtype).min)
    depths = torch.tensor(tree.depth_list, dtype=torch.long, device=device)
    return TreeInputs(
        input_ids=tree.tokens.to(device).view(1, n),
        position_ids=(prefix_len + depths).view(1, n),
        attention_mask=mask.view(1, 1, n, prefix_len + n),
        prefix_len=prefix_len,
    )
