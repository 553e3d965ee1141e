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
    # [1, 1, n, prefix_len + n] additive: 0 = visible, dtype min = hidden. None for a chain: plain causal attention,
    # which the model builds itself and runs on the same kernels as ordinary decoding.
    attention_mask: torch.Tensor | None


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


def build_tree_inputs(tree: DraftTree, prefix_len: int, dtype: torch.dtype, device: torch.device | str) -> TreeInputs:
    """Every node sees the cached prefix, its ancestors and itself; positions are prefix_len + depth."""
    n = tree.size
    depths = torch.tensor(tree.depth_list, dtype=torch.long, device=device)
    mask = None
    if tree.parent_list != tuple(range(-1, n - 1)):  # a real tree, not a chain
        visible = ancestor_matrix(tree, device)  # [n, n]
        # Rows padded to a multiple of 16 elements: fused attention kernels want aligned mask strides and would
        # otherwise copy the mask into a padded buffer on every call.
        width = prefix_len + n
        storage = torch.zeros(n, -(-width // 16) * 16, dtype=dtype, device=device)
        mask = storage[:, :width]
        mask[:, prefix_len:].masked_fill_(~visible, torch.finfo(dtype).min)
        mask = mask.view(1, 1, n, width)
    return TreeInputs(
        input_ids=tree.tokens.to(device).view(1, n),
        position_ids=(prefix_len + depths).view(1, n),
        attention_mask=mask,
    )


def causal_block_mask(cached: int, new: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[1, 1, new, cached + new] additive: each new position sees the cache, the new ones before it and itself."""
    mask = torch.zeros(new, cached + new, dtype=dtype, device=device)
    if new > 1:  # one new token sees everything: nothing to hide (a plain decoding step, every step)
        future = torch.ones(new, new, dtype=torch.bool, device=device).triu(1)
        mask[:, cached:].masked_fill_(future, torch.finfo(dtype).min)
    return mask.view(1, 1, new, cached + new)
