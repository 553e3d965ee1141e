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
