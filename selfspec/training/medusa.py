"""Medusa training: the per-head loss (Medusa-1: frozen base; Medusa-2: jointly with LoRA on the base) and the tree
built from the heads' measured top-k accuracies.

Shift convention: the target's distribution at position t predicts token t + 1; head k (0-based) reads the hidden
state at t and predicts token t + k + 2, so its label is the target's distribution at position t + k + 1.
"""

from __future__ import annotations

import heapq

import torch

from ..heads.medusa import MedusaHeads, MedusaLoraConfig
from .labels import LabeledSequence
from .losses import soft_cross_entropy
from .trainer import Batch, TrainableHead


def shifted_labels(batch: Batch, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For head k: (rows [N, 2] of (sequence, position t), topk ids [N, K'], topk probs [N, K']) at the positions
    whose predicted token t + k + 2 exists and is learnable."""
    shift = k + 1
    length = batch.input_ids.shape[1]
    if length <= shift + 1:
        empty = torch.zeros(0, dtype=torch.long, device=batch.input_ids.device)
        return empty.view(0, 2), batch.topk_ids[:0, 0], batch.topk_probs[:0, 0]
    learnable = batch.loss_mask[:, shift + 1 :] & batch.valid[:, shift + 1 :]  # token t + k + 2, t in [0, L - k - 2)
    rows = learnable.nonzero()  # [N, 2]: (b, t)
    label_positions = rows[:, 1] + shift
    return rows, batch.topk_ids[rows[:, 0], label_positions], batch.topk_probs[rows[:, 0], label_positions]


class MedusaTraining(TrainableHead):
    """Heads (+ optionally a LoRA-adapted base for Medusa-2) with the self-distillation loss."""

    first_draft_metric = "top1_h1"

    def __init__(
        self,
        heads: MedusaHeads,
        head_decay: float,
        base: torch.nn.Module | None = None,
        lora: MedusaLoraConfig | None = None,
    ):
        super().__init__()
        self.heads = heads
        self.head_decay = head_decay
        self.base = base  # a peft-wrapped target for Medusa-2, else None (hidden states come from the labels)
        self.distill_weight = lora.distill_weight if lora else 0.0

    def training_loss(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        metrics: dict[str, float] = {}
        total = torch.zeros((), device=batch.input_ids.device)
        if self.base is None:
            hidden = batch.hidden[-1]  # [B, L, H]
        else:
            outputs = self.base(input_ids=batch.input_ids, attention_mask=batch.valid.long(), output_hidden_states=True)
            hidden = outputs.hidden_states[-1]
            total = total + self.distill_weight * self._keep_base_outputs(outputs.logits, batch)
            metrics["base_ce"] = float(total.detach())
        for k, head in enumerate(self.heads.heads):
            rows, target_ids, target_probs = shifted_labels(batch, k)
            if len(rows) == 0:
                continue
            logits = self.heads.draft_logits(head(hidden[rows[:, 0], rows[:, 1]]))  # [N, V_draft]
            loss, _, agreement = soft_cross_entropy(logits, target_ids, target_probs, self.heads.target_to_draft)
            total = total + (self.head_decay**k) * loss
            metrics[f"top1_h{k + 1}"] = agreement
        return total, metrics

    def _keep_base_outputs(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Cross-entropy of the adapted base against the original base's top-k: self-distillation keeps its outputs."""
        rows = batch.valid.nonzero()
        log_probs = torch.log_softmax(logits[rows[:, 0], rows[:, 1]].float(), dim=-1)
        probs = batch.topk_probs[rows[:, 0], rows[:, 1]]
        chosen = log_probs.gather(-1, batch.topk_ids[rows[:, 0], rows[:, 1]])
        return -(probs * chosen).sum(-1).mean()


@torch.no_grad()
def head_accuracies(heads: MedusaHeads, sequences: list[LabeledSequence], max_rank: int) -> torch.Tensor:
    """[K, max_rank]: P(rank r of head k is the target's top-1 token at its position), over learnable positions."""
    hits = torch.zeros(heads.num_heads, max_rank)
    counts = torch.zeros(heads.num_heads)
    for sequence in sequences:
        hidden = sequence.hidden[-1].float()
        length = len(sequence.input_ids)
        for k, head in enumerate(heads.heads):
            shift = k + 1
            if length <= shift + 1:
                continue
            positions = (sequence.loss_mask[shift + 1 :]).nonzero().squeeze(-1)
            if len(positions) == 0:
                continue
            logits = heads.draft_logits(head(hidden[positions]))
            ranked = heads.draft_vocab[logits.topk(max_rank, dim=-1).indices]  # [N, max_rank] target ids
            truth = sequence.topk_ids[positions + shift, 0]
            hits[k] += (ranked == truth[:, None]).float().sum(0)
            counts[k] += len(positions)
    return hits / counts.clamp(min=1)[:, None]


def best_tree(accuracies: torch.Tensor, max_nodes: int) -> tuple[list[tuple[int, ...]], list[float]]:
    """Rank paths in order of expected acceptance (product of per-depth accuracies), parents before children.

    Every node's value is at most its parent's (accuracies <= 1), so best-first expansion from the root yields the
    nodes sorted by value with each parent ahead of its children: the first n - 1 paths are the best n-node tree
    under the independence assumption Medusa makes. Returns (paths, values), at most max_nodes - 1 of each.
    """
    num_heads, max_rank = accuracies.shape
    acc = accuracies.tolist()
    frontier = [(-acc[0][rank], (rank,)) for rank in range(max_rank)]
    heapq.heapify(frontier)
    paths, values = [], []
    while frontier and len(paths) < max_nodes - 1:
        negative_value, path = heapq.heappop(frontier)
        paths.append(path)
        values.append(-negative_value)
        if len(path) < num_heads:
            for rank in range(max_rank):
                heapq.heappush(frontier, (negative_value * acc[len(path)][rank], path + (rank,)))
    return paths, values
