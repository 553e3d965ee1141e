"""Logits -> probabilities, shared by plain decoding, the drafters and the verifier.

Losslessness depends on every party using the *same* transform: the verifier compares the draft against exactly
the distribution plain sampling would draw from, so this module is the single definition of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import SelfspecError


@dataclass(frozen=True)
class SamplingConfig:
    """How the target's next token is chosen. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0  # 1.0 disables nucleus filtering

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature) or self.temperature < 0:
            raise SelfspecError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise SelfspecError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise SelfspecError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Turn logits [..., V] into float32 probabilities [..., V] after temperature, top-k and top-p.

    Top-k keeps the k largest logits; top-p then keeps the smallest set of most probable tokens whose mass reaches
    top_p (always at least one token). Greedy configs return the one-hot argmax distribution.
    """
    logits = logits.float()
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more probable tokens
        drop_sorted = mass_before >= sampling.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


# ---- position-keyed draws --------------------------------------------------------------------------------------------
# A seed fixes the text: the token at output position t is drawn from p_t with a uniform that depends on (seed, t)
# alone, never on a generator stream shared with the trees. Plain decoding and every verification of deterministic
# children then emit the same token at t whatever was drafted, so a seed gives the same text with every drafter.

_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    """SplitMix64's finaliser: a bijection on 64-bit integers whose outputs pass statistical tests for independence
    even on consecutive inputs, so (seed, position) pairs map to uniforms with no visible pattern."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def position_uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) keyed on (seed, output position): 53 random bits, the same on every machine."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64)) >> 11) * 2.0**-53


def draw_token(probs: torch.Tensor, uniform: float) -> int:
    """Inverse CDF over token ids: the smallest id whose cumulative probability exceeds `uniform` times the total
    mass. probs [V] (need not sum to 1). A token with probability 0 is never drawn: its cumulative value equals its
    predecessor's, so it is never the first to exceed the threshold. float64 sums keep the cut points stable."""
    cdf = probs.double().cumsum(-1)  # [V]
    threshold = (cdf[-1] * uniform).view(1)  # on the device: one host sync below
    return min(int(torch.searchsorted(cdf, threshold, right=True).item()), probs.shape[-1] - 1)


@dataclass(frozen=True)
class StepDraws:
    """The randomness of one decoding step.

    seed and position key the uniforms of the tokens the step emits: the token after the tree's root lands at
    output position `position`, the one after a depth-d node at `position + d`. generator serves only drawn children
    (a tree with draft probabilities, checked by the r < p/q rule) and the drafters' own random choices."""

    seed: int = 0
    position: int = 0  # output position (0 = the first new token) of the token that follows the root
    generator: torch.Generator | None = None

    def uniform(self, depth: int) -> float:
        """The uniform of the token that follows a node at `depth` (the root is depth 0)."""
        return position_uniform(self.seed, self.position + depth)
