"""A KV cache whose batch rows hold different requests at different lengths (the batch engine's).

Row r holds its request's committed prefix in positions [0, lengths[r]) of every layer's storage. A step writes every
row's new nodes at the same place, after the longest row's prefix (`length`), in one copy a layer, or in place by the
compiled step (execution/compiled.py, through the WrittenInPlace part: `storage`, `reserve`, `mark_filled`); the
attention mask the engine builds tells each row's queries which positions are theirs. After verification `keep` moves
each row's accepted nodes next to its own prefix (one gather and one scatter for every layer and row: the layers
share one storage, `RaggedStorage`). Rows are kept
contiguous from 0: a request that leaves gives its row to the last one (`drop_row`), so a step runs over the first
`rows` rows of the storage, a view, never a copy.

Storage follows the rows in flight, not the longest ever seen: every row has the capacity of the longest, so one long
prompt would otherwise keep slots x its length reserved (46 KB a position and row on SmolLM2-135M) for the life of a
server. It grows by half again what is needed, shrinks to that when a row leaves and the rest need under half of it,
and is freed when the last row leaves.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..execution.kv_storage import WrittenInPlace
from ..memory import populated_zeros

MIN_CAPACITY = 256  # positions reserved per row at least; storage grows to 1.5x what is needed (`_capacity`)


_NO_VIEWS = (None, None, 0, [])


def _capacity(needed: int) -> int:
    return max(MIN_CAPACITY, needed + needed // 2)


class RaggedStorage:
    """Every layer's keys and values in one tensor each, [layers, rows, kv_heads, capacity, head_dim]: what a step
    moves (`keep`: the accepted nodes next to their rows' prefixes; a row that leaves) is one gather and one scatter
    for all layers at once. Per layer, that was 60 indexing calls a step on SmolLM2-135M, 0.6-1.1 ms of a batched
    step of 4-8 requests (18-25 ms)."""

    def __init__(self, num_layers: int, rows: int = 1):
        """rows: the rows made room for at once (the engine's slots): each row added past them copies the storage."""
        self.num_layers, self.min_rows = num_layers, rows
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self._views: tuple = _NO_VIEWS  # (keys, values, rows, each layer's views): `layer_views`

    def layer_views(self, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (keys, values) of the first `rows` rows, [rows, kv_heads, capacity, head_dim] views, made once
        for a storage and a row count: a compiled step reads every layer's three times. Made on every read, the
        cache's methods and the compiled call took 0.68-0.71 s of their own over 986 steps of four requests; made once,
        0.54-0.55 s (cProfile, which weighs every call more than a plain run does; two runs each, 2-core Zen 5)."""
        made = self._views
        if made[0] is self.keys and made[1] is self.values and made[2] == rows:
            return made[3]
        views = list(zip(self.keys[:, :rows].unbind(0), self.values[:, :rows].unbind(0), strict=True))
        self._views = (self.keys, self.values, rows, views)
        return views

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[3]

    @property
    def rows(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]

    def reserve(self, rows: int, needed: int, kv_heads: int, head_dim: int, like: torch.Tensor) -> None:
        """Room for `rows` rows of `needed` positions (kept: what is stored)."""
        if self.keys is not None and self.rows >= rows and self.capacity >= needed:
            return
        capacity = max(_capacity(needed), self.capacity)
        self._replace((self.num_layers, max(rows, self.rows, self.min_rows), kv_heads, capacity, head_dim), like)

    def _replace(self, shape: tuple[int, ...], like: torch.Tensor) -> None:
        """New storage of `shape` (populated: memory.populated_zeros) holding what the old one held where they
        overlap; the layers' views of the old one are dropped."""
        old = (self.keys, self.values)
        self._views = _NO_VIEWS
        self.keys, self.values = populated_zeros(shape, like), populated_zeros(shape, like)
        if old[0] is not None:
            rows, capacity = min(shape[1], old[0].shape[1]), min(shape[3], old[0].shape[3])
            for new, previous in zip((self.keys, self.values), old, strict=True):
                new[:, :rows, :, :capacity] = previous[:, :rows, :, :capacity]

    def keep(self, rows: torch.Tensor, sources: torch.Tensor, destinations: torch.Tensor) -> None:
        """In every layer, position sources[i, j] of row rows[i] moves to destinations[i, j] (all read first)."""
        for store in (self.keys, self.values):
            store[:, rows, :, destinations] = store[:, rows, :, sources]

    def slide(self, row: int, source: int, destination: int, count: int) -> None:
        """In every layer, row `row`'s positions [source, source + count) move to [destination, destination +
        count), the two apart (a plain step's node, or an accepted chain, next to a shorter row's prefix: two slice
        copies, where `keep`'s gather and scatter took 0.2 ms of a step of four requests)."""
        for store in (self.keys, self.values):
            store[:, row, :, destination : destination + count] = store[:, row, :, source : source + count]

    def move(self, source: int, destination: int, length: int) -> None:
        if self.keys is not None:
            for store in (self.keys, self.values):
                store[:, destination, :, :length] = store[:, source, :, :length]

    def fit(self, rows: int, longest: int) -> bool:
        """After a row left: keep storage for `rows` rows of `longest` positions, giving back what is far above that
        (none at all for no rows) -> whether the storage was replaced."""
        if rows == 0:
            replaced = self.keys is not None
            self.keys = self.values = None
            self._views = _NO_VIEWS
            return replaced
        if self.keys is None or self.capacity <= 2 * _capacity(longest):
            return False
        self._replace((*self.keys.shape[:3], _capacity(longest), self.keys.shape[4]), self.keys)
        return True


class RaggedLayer(DynamicLayer, WrittenInPlace):
    """One layer's keys and values for every row: its slice of the cache's RaggedStorage, [rows, kv_heads, capacity,
    head_dim]. `keys`/`values` (what attention reads after a step's write) span the longest row plus the step's new
    positions; a row's positions past its own length, up to the step's, are stale and must be hidden by the mask."""

    _end: int | None = None  # the positions `keys`/`values` span (None: none)

    def __init__(self, lengths: list[int], shared: RaggedStorage, index: int):
        super().__init__()
        self.lengths = lengths  # shared by every layer of the cache: the committed positions of each row
        self.shared, self.index = shared, index  # the cache's storage, and this layer's place in it

    # `keys` and `values` are views of the storage made when read: a compiled step writes every layer in place and
    # only an eager forward reads them (made at every step's `mark_filled`, the 60 views took 0.13-0.17 ms of a step
    # of 1-4 requests). Only None can be set (transformers' own code, a storage replaced): it empties them.
    def _filled(self, part: int) -> torch.Tensor | None:
        """Part 0 (keys) or 1 (values) of the storage over the positions attention reads, [rows, kv_heads, end, D]."""
        return None if self._end is None or self.shared.keys is None else self.storage[part][:, :, : self._end]

    def _set_none(self, tensor: None) -> None:
        if tensor is not None:
            raise AttributeError("a ragged cache layer's keys and values are its storage's: write through update")
        self._end = None

    keys = property(lambda self: self._filled(0), _set_none)
    values = property(lambda self: self._filled(1), _set_none)

    @property
    def store(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This layer's (keys, values) storage for every reserved row (None: none yet)."""
        if self.shared.keys is None:
            return None
        return self.shared.keys[self.index], self.shared.values[self.index]

    def _reserve(self, rows: int, needed: int, like: torch.Tensor) -> None:
        self.shared.reserve(rows, needed, like.shape[1], like.shape[3], like)
        if not self.is_initialized:
            self.is_initialized, self.dtype, self.device = True, like.dtype, like.device

    @property
    def length(self) -> int:
        """Where a step's new positions go in every row: after the longest row's prefix."""
        return max(self.lengths, default=0)

    @property
    def storage(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows in flight's (keys, values) storage, [rows, kv_heads, capacity, head_dim] views (None: none yet)."""
        if self.shared.keys is None:
            return None
        return self.shared.layer_views(len(self.lengths))[self.index]

    def reserve(self, needed: int) -> None:
        shared, rows = self.shared, len(self.lengths)
        if shared.keys is None or shared.rows < rows or shared.capacity < needed:
            self._reserve(rows, needed, self.store[0])

    def mark_filled(self, end: int) -> None:
        """A step's positions [length, end) of every row were written: attention reads [0, end)."""
        self._end = end

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        rows, n = key_states.shape[0], key_states.shape[2]
        if rows != len(self.lengths):
            raise RuntimeError(f"a step of {rows} rows on a ragged cache of {len(self.lengths)}")
        start = self.length
        self._reserve(rows, start + n, key_states)
        keys, values = self.store
        keys[:rows, :, start : start + n] = key_states
        values[:rows, :, start : start + n] = value_states
        self.mark_filled(start + n)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def load(self, row: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Row `row` takes a prefix computed elsewhere: keys and values [1, kv_heads, length, head_dim]."""
        self._reserve(row + 1, keys.shape[2], keys)
        store_keys, store_values = self.store
        store_keys[row, :, : keys.shape[2]] = keys[0]
        store_values[row, :, : values.shape[2]] = values[0]

    @property
    def capacity(self) -> int:
        """Positions reserved per row (0: no storage)."""
        return self.shared.capacity


class RaggedCache(Cache):
    """The layers of one model, every one a RaggedLayer over the same row lengths."""

    def __init__(self, num_layers: int, rows: int = 1):
        """rows: as RaggedStorage's (the rows the storage is first made for)."""
        self.lengths: list[int] = []
        self.shared = RaggedStorage(num_layers, rows)
        super().__init__(layers=[RaggedLayer(self.lengths, self.shared, index) for index in range(num_layers)])

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def add_row(self, keys: list[torch.Tensor] | None, values: list[torch.Tensor] | None, length: int) -> int:
        """A new last row holding `length` positions: each layer's keys and values [1, kv_heads, >= length, head_dim]
        (positions past `length` are left out; None for an empty prefix) -> its index."""
        row = len(self.lengths)
        self.lengths.append(length)
        if length:
            for layer, layer_keys, layer_values in zip(self.layers, keys, values, strict=True):
                layer.load(row, layer_keys[:, :, :length], layer_values[:, :, :length])
        return row

    def keep(self, paths: list[tuple[int, ...]]) -> None:
        """After a step: row r keeps its prefix and the step's nodes on paths[r] (its accepted path, ascending), moved
        from where the step wrote them (after the longest prefix) to after its own prefix. A row as long as the
        longest whose path is a chain from the root is where it should be already."""
        start = max(self.lengths)
        moves = []
        for row, path in enumerate(paths):
            chain, length = path == tuple(range(len(path))), self.lengths[row]
            if chain and length + len(path) <= start:  # one block into positions clear of it: two slice copies
                self.shared.slide(row, start, length, len(path))
            elif not (chain and length == start):  # (else where it should be already)
                moves.append((row, path))
        if moves:
            # one gather and one scatter a layer for every row that moves: rows with shorter paths take their last
            # node again into positions past their new length, which stay stale (the capacity covers start + width)
            widest = max(len(path) for _, path in moves)
            rows = torch.tensor([row for row, _ in moves]).view(-1, 1)
            sources = torch.tensor([[start + path[min(j, len(path) - 1)] for j in range(widest)] for _, path in moves])
            destinations = torch.tensor([[self.lengths[row] + j for j in range(widest)] for row, _ in moves])
            self.shared.keep(rows, sources, destinations)
        for row, path in enumerate(paths):
            self.lengths[row] += len(path)

    def drop_row(self, row: int) -> int | None:
        """Remove row `row`; the last row moves into its place. Returns the index that moved there (None: none did)."""
        last = len(self.lengths) - 1
        if row != last:
            self.shared.move(last, row, self.lengths[last])
            self.lengths[row] = self.lengths[last]
        self.lengths.pop()
        if self.shared.fit(len(self.lengths), max(self.lengths, default=0)):
            for layer in self.layers:
                layer.keys = layer.values = None  # views of the old storage; the next write sets them
        return last if row != last else None

    @property
    def capacity(self) -> int:
        """Positions reserved per row (0: no storage)."""
        return self.shared.capacity
