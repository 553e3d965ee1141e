"""Pieces every head's training shares: the reduced draft vocabulary and the soft cross-entropy against the target."""

from __future__ import annotations

from collections import Counter

import torch

from ..data.labels import LabeledSequence


def draft_vocabulary(sequences: list[LabeledSequence], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` target tokens most often chosen by the target (top-1 at learnable positions), ascending ids.
    size 0 (or >= vocab) means the whole vocabulary."""
    counts: Counter = Counter()
    for sequence in sequences:
        counts.update(sequence.topk_ids[:, 0].tolist())
    return most_frequent(counts, size, vocab_size)


def most_frequent(counts: Counter, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most counted token ids, ascending; size 0 (or >= vocab) means the whole vocabulary."""
    if size <= 0 or size >= vocab_size:
        return torch.arange(vocab_size)
    chosen = [token for token, _ in counts.most_common(size)]
    if len(chosen) < size:  # little data: fill with the lowest unused ids, so the size is what the config says
        used = set(chosen)
        chosen += [token for token in range(vocab_size) if token not in used][: size - len(chosen)]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def soft_cross_entropy(
    logits: torch.Tensor, target_ids: torch.Tensor, target_probs: torch.Tensor, to_draft: torch.Tensor
):
    """CE of draft logits [N, V_d] against the target's top-k (ids in target space), renormalised within the draft
    vocabulary. Returns (loss, rows used, top-1 agreement)."""
    draft_ids = to_draft[target_ids]  # [N, K'], -1 outside the draft vocabulary
    inside = draft_ids >= 0
    weights = target_probs * inside
    mass = weights.sum(-1)
    keep = mass > 0
    log_probs = torch.log_softmax(logits.float(), dim=-1).gather(-1, draft_ids.clamp(min=0))
    per_row = -(weights * log_probs).sum(-1) / mass.clamp(min=1e-9)
    loss = per_row[keep].mean() if keep.any() else logits.sum() * 0.0
    agreement = (logits.argmax(-1) == draft_ids[:, 0]).float().mean() if len(logits) else torch.tensor(0.0)
    return loss, int(keep.sum()), float(agreement)
