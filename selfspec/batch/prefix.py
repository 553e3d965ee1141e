"""Prompt prefixes the batch engine has prefilled, kept so that a later prompt starting the same way skips them.

Chat prompts through one template begin alike: every prompt to SmolLM2-Instruct opens with the same 26-token system
preamble, a third of a typical held-out ShareGPT prompt (75 tokens on average, a median of 49), and a client's
system prompt or a conversation's earlier turns repeat the same way. The engine keeps the keys and values (and the
hidden states its drafters read) of the first MAX_POSITIONS positions of the last ENTRIES prompts it prefilled; a
new prompt's prefill starts after the longest prefix it shares with one of them, copied into its cache.

Lossless in the same sense as chunked prefill: a position's keys and values depend only on the tokens up to it
(causal attention), so the copied positions are what this prompt's own prefill computes there, up to the float32
rounding of a forward over another number of rows (the engine's prefill already forwards a prompt in chunks where
`SelfSpec.generate` forwards it whole).

Memory is bounded: ENTRIES x MAX_POSITIONS positions at most (46 KB a position on SmolLM2-135M: 47 MB), whatever a
server runs for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

ENTRIES = 4  # prompts whose prefixes are kept (the least recently used one goes first)
MAX_POSITIONS = 256  # a kept prefix's positions at most


@dataclass(eq=False)  # entries are told apart by identity (`longest` moves one to the end)
class _Entry:
    tokens: tuple[int, ...]
    keys: list[torch.Tensor]  # a layer's keys over the positions: [1, kv_heads, positions, head_dim]
    values: list[torch.Tensor]
    hidden: dict[int, torch.Tensor]  # hidden layer -> [positions, hidden size]


@dataclass(frozen=True)
class Reused:
    """A kept prefix a prompt shares: its first `positions` positions."""

    entry: _Entry
    positions: int

    def load(self, cache: Cache) -> dict[int, torch.Tensor]:
        """Write the shared positions' keys and values into the empty `cache` -> their hidden states by layer."""
        n = self.positions
        for index, (keys, values) in enumerate(zip(self.entry.keys, self.entry.values, strict=True)):
            cache.update(keys[:, :, :n], values[:, :, :n], index)
        return {layer: states[:n] for layer, states in self.entry.hidden.items()}


class PrefixStore:
    """The prefixes of the latest prompts' prefills (most recently used last)."""

    def __init__(self, entries: int = ENTRIES, max_positions: int = MAX_POSITIONS):
        self.entries: list[_Entry] = []
        self.capacity, self.max_positions = entries, max_positions
        self.reused_positions = 0  # over the store's life: positions prompts did not forward

    def longest(self, prefix: list[int], hidden_layers: tuple[int, ...]) -> Reused | None:
        """The kept prefix sharing the most leading tokens with `prefix` (and holding `hidden_layers`), or None."""
        best: Reused | None = None
        for entry in self.entries:
            if not set(hidden_layers) <= set(entry.hidden):
                continue
            shared = _shared(entry.tokens, prefix)
            if shared and (best is None or shared > best.positions):
                best = Reused(entry, shared)
        if best is not None:
            self.entries.remove(best.entry)
            self.entries.append(best.entry)
            self.reused_positions += best.positions
        return best

    def keep(self, prefix: list[int], cache: Cache, hidden: dict[int, torch.Tensor]) -> None:
        """A prompt's prefill is done: keep its first positions (`prefix`: the tokens `cache` holds, in order; padding
        after them is not kept). Kept prefixes that this one extends are replaced by it."""
        n = min(len(prefix), self.max_positions)
        if n == 0 or self.capacity == 0 or not cache.layers:
            return
        tokens = tuple(prefix[:n])
        if any(entry.tokens[:n] == tokens for entry in self.entries):
            return  # already kept (as this or a longer prefix)
        self.entries = [entry for entry in self.entries if tokens[: len(entry.tokens)] != entry.tokens]
        keys = [layer.keys[:, :, :n].clone() for layer in cache.layers]
        values = [layer.values[:, :, :n].clone() for layer in cache.layers]
        self.entries.append(
            _Entry(tokens, keys, values, {layer: states[:n].clone() for layer, states in hidden.items()})
        )
        del self.entries[: max(0, len(self.entries) - self.capacity)]

    def clear(self) -> None:
        self.entries.clear()


def _shared(kept: tuple[int, ...], prefix: list[int]) -> int:
    """How many leading tokens `kept` and `prefix` have in common."""
    n = min(len(kept), len(prefix))
    for index in range(n):
        if kept[index] != prefix[index]:
            return index
    return n
