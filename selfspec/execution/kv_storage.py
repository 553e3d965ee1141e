"""The fast path's KV cache layer: keys and values written in place into storage reserved ahead, instead of
concatenating every layer's whole cache at every step. Compaction after verification moves the accepted nodes within
that storage. Writers other than `update` (the compiled steps) use the public part: `storage`, `reserve`,
`mark_filled` and `length`; a batch that drops finished rows (the regeneration's engine) uses `select_rows`."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from ..tree_attention.cache import CompactsInPlace

MIN_CAPACITY = 256  # positions reserved at first; storage then doubles past what is needed


class WrittenInPlace:
    """What a cache layer offers a writer other than its own `update` (the compiled steps, compiled.py): `storage`,
    (keys, values) each [batch, kv_heads, capacity, head_dim] or None before the first write; `length`, the positions
    the next step's keys and values go after (every batch row's); `reserve(needed)`, room for `needed` positions
    (read `storage` after it: it may be replaced); `mark_filled(end)`, positions [0, end) written. Two layers keep
    it: one request's (InPlaceLayer) and the batch engine's, whose rows hold requests of other lengths
    (batch/cache.py)."""


class InPlaceLayer(DynamicLayer, CompactsInPlace, WrittenInPlace):
    """A full-attention cache layer whose keys and values live in storage reserved ahead (doubled when full): a step
    writes its positions in place, and `keys`/`values` are views of the filled prefix [0, length). Compaction
    (`keep`) and trimming (`truncate`) move or drop positions inside that storage."""

    _key_store: torch.Tensor | None = None  # [batch, kv_heads, capacity, head_dim]
    _value_store: torch.Tensor | None = None
    length = 0  # positions filled

    def __init__(self, store_dtype: torch.dtype | None = None, **kwargs):
        """store_dtype: the storage's dtype (None: the keys' own; the q4 path keeps float64, see attention.py)."""
        super().__init__(**kwargs)
        self.store_dtype = store_dtype

    # `keys` and `values` are views of the filled prefix made when read: a compiled step writes every layer in place
    # and nothing reads them until an eager forward does (making 60 views a step cost ~0.1 ms). Before the storage
    # exists they are what transformers' own code sets; after, the storage is the only way in.
    @property
    def keys(self) -> torch.Tensor | None:
        return self._keys if self._key_store is None else self._key_store[..., : self.length, :]

    @keys.setter
    def keys(self, keys: torch.Tensor | None) -> None:
        self._check_settable()
        self._keys = keys

    @property
    def values(self) -> torch.Tensor | None:
        return self._values if self._value_store is None else self._value_store[..., : self.length, :]

    @values.setter
    def values(self, values: torch.Tensor | None) -> None:
        self._check_settable()
        self._values = values

    def _check_settable(self) -> None:
        if self._key_store is not None:
            raise AttributeError("an in-place cache layer's keys and values are its storage's: write through update")

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def reset(self) -> None:
        self._key_store = self._value_store = None
        self.length = 0
        super().reset()

    @property
    def storage(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(key storage, value storage), each [batch, kv_heads, capacity, head_dim], or None before the first write.
        Positions from `length` on are free to write; `mark_filled` then takes them in."""
        if not self.is_initialized or self._key_store is None:
            return None
        return self._key_store, self._value_store

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._key_store = self._value_store = None
        self.length = 0
        super().lazy_initialization(key_states, value_states)

    def _reserve(self, needed: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        capacity = 0 if self._key_store is None else self._key_store.shape[-2]
        if needed <= capacity:
            return
        capacity = max(MIN_CAPACITY, 2 * needed)
        dtype = self.store_dtype or key_states.dtype
        key_store = key_states.new_empty(*key_states.shape[:-2], capacity, key_states.shape[-1], dtype=dtype)
        value_store = value_states.new_empty(*value_states.shape[:-2], capacity, value_states.shape[-1], dtype=dtype)
        if self.length:
            key_store[..., : self.length, :] = self.keys
            value_store[..., : self.length, :] = self.values
        self._key_store, self._value_store = key_store, value_store

    def reserve(self, needed: int) -> None:
        """Room for `needed` positions in `storage` (which must exist: after a first `update`). The storage may be
        replaced: read `storage` after this."""
        self._reserve(needed, self._key_store, self._value_store)

    def mark_filled(self, length: int) -> None:
        """Positions [0, length) of `storage` hold this layer's keys and values (a writer other than `update` wrote
        them in place); positions past `length` are outside the cache even if written."""
        self.length = length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        self._reserve(end, key_states, value_states)
        self._key_store[..., start:end, :] = key_states
        self._value_store[..., start:end, :] = value_states
        self.mark_filled(end)
        return self.keys, self.values

    def keep(self, base: int, offsets: torch.Tensor) -> None:
        """Keep positions [0, base) and then base + offsets (ascending), packed together from `base` on."""
        kept = offsets.numel()
        moved_keys = self._key_store[..., base:, :].index_select(-2, offsets)
        moved_values = self._value_store[..., base:, :].index_select(-2, offsets)
        self._key_store[..., base : base + kept, :] = moved_keys
        self._value_store[..., base : base + kept, :] = moved_values
        self.mark_filled(base + kept)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows, in this order (a batch that drops its finished sequences): the filled
        positions move into new storage of the same capacity."""
        if self._key_store is None:
            return
        stores = []
        for store in (self._key_store, self._value_store):
            kept = store.new_empty(rows.numel(), *store.shape[1:])
            kept[..., : self.length, :] = store[..., : self.length, :].index_select(0, rows)
            stores.append(kept)
        self._key_store, self._value_store = stores
        self.mark_filled(self.length)

    def batch_select_indices(self, indices: torch.Tensor) -> None:  # the cache API's name for the same thing
        self.select_rows(indices)

    def truncate(self, length: int) -> None:
        if self.is_initialized and self._key_store is not None and length < self.length:
            self.mark_filled(length)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, got {tokens_to_remove}")
        if tokens_to_remove:
            self.truncate(max(0, self.length + tokens_to_remove))


class InPlaceCache(DynamicCache):
    """The dynamic cache transformers builds for a config, its full-attention layers written in place (InPlaceLayer);
    other layers (sliding windows) as transformers makes them. store_dtype: the in-place layers' storage dtype (None:
    the keys' own)."""

    def __init__(self, config, store_dtype: torch.dtype | None = None):
        stock = DynamicCache(config=config).layers
        layers = [InPlaceLayer(store_dtype) if type(layer) is DynamicLayer else layer for layer in stock]
        Cache.__init__(self, layers=layers)
