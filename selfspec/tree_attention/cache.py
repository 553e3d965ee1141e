"""KV-cache compaction: after verification the cache must hold exactly the committed prefix plus the accepted path."""

from __future__ import annotations

import abc

import torch
from transformers import Cache
from transformers.cache_utils import DynamicSlidingWindowLayer


class CompactsInPlace(abc.ABC):
    """A cache layer that keeps its positions in storage of its own and compacts or trims them there (the fast path's
    selfspec.execution.InPlaceLayer), rather than by replacing its `keys` and `values` tensors."""

    @abc.abstractmethod
    def keep(self, base: int, offsets: torch.Tensor) -> None:
        """Keep positions [0, base) and then base + offsets (ascending), packed together from `base` on."""

    @abc.abstractmethod
    def truncate(self, length: int) -> None:
        """Keep the first `length` positions."""


def compact_cache(cache: Cache, n_nodes: int, accepted_path: tuple[int, ...]) -> None:
    """Drop the KV of rejected tree nodes from every layer of `cache`.

    The last `n_nodes` cached positions of each layer hold the tree in layout order. Accepted nodes are generally
    not contiguous (a second child may win), so gather them; a chain prefix (0, 1, ..., k-1) only needs a trim.
    """
    kept = len(accepted_path)
    is_chain_prefix = accepted_path == tuple(range(kept))
    if is_chain_prefix and kept == n_nodes:
        return  # every node kept where it is (a plain step's root, a whole chain accepted)
    offsets = None
    for layer in cache.layers:
        if isinstance(layer, CompactsInPlace):
            stored = layer.get_seq_length()  # its keys are views made when read
        elif not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue  # layers that share another layer's KV hold nothing of their own
        else:
            stored = layer.keys.shape[-2]
        if not stored:
            continue
        base = stored - n_nodes  # where the tree starts in this layer's storage
        if base < 0:
            raise RuntimeError(f"the cache holds {stored} positions, fewer than the {n_nodes}-node tree just forwarded")
        if isinstance(layer, CompactsInPlace):
            if is_chain_prefix:
                layer.truncate(base + kept)
            else:
                if offsets is None:
                    offsets = torch.tensor(accepted_path, device=layer.device)
                layer.keep(base, offsets)
        elif is_chain_prefix:
            layer.keys = layer.keys[..., : base + kept, :]
            layer.values = layer.values[..., : base + kept, :]
        else:
            keep = torch.cat(
                [
                    torch.arange(base, device=layer.keys.device),
                    base + torch.tensor(accepted_path, device=layer.keys.device),
                ]
            )
            layer.keys = layer.keys.index_select(-2, keep)
            layer.values = layer.values.index_select(-2, keep)
        if isinstance(layer, DynamicSlidingWindowLayer):  # they count the positions they have seen
            layer.cumulative_length -= n_nodes - kept


def trim_cache(cache: Cache, length: int) -> None:
    """Keep the first `length` positions of every layer that holds any (a drafter's own cache after a proposal)."""
    for layer in cache.layers:
        if isinstance(layer, CompactsInPlace):
            layer.truncate(length)
        elif getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]
