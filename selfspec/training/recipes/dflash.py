"""DFlash training: random anchor positions per sequence, each opening a block (the anchor's token, then B - 1 mask
positions) conditioned on the target's features of the positions before the anchor; block position i learns the
target's distribution for token anchor + i (soft cross-entropy against its top-k), weighted by decay**(i - 1).

All blocks of a sequence train in one forward: the sequence's context rows become keys and values, the blocks are
the queries; block j sees the context rows before its anchor and its own block, exactly what it sees when drafting.
"""

from __future__ import annotations

import torch

from ...errors import SelfspecError
from ...heads.dflash import DFlashConfig, DFlashHead, resolve_feature_layers
from ...models import Target
from ..config import RecipeConfig
from ..data.labels import LabeledSequence
from ..data.prepare import recipe_data
from ..trainer.loop import Batch, TrainableHead
from ..trainer.losses import draft_vocabulary
from ..trainer.pipeline import train_and_save

METRIC_POSITIONS = (1, 2, 4, 8)  # block positions whose top-1 agreement the progress bar shows


class DFlashTraining(TrainableHead):
    first_draft_metric = "top1@1"

    def __init__(self, head: DFlashHead, config: DFlashConfig):
        super().__init__()
        if config.anchors_per_sequence < 1 or not 0 < config.loss_decay <= 1:
            raise SelfspecError("dflash: anchors_per_sequence must be >= 1 and loss_decay in (0, 1]")
        self.head = head
        self.config = config

    def training_loss(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        head, block = self.head, self.config.block_size
        features = torch.cat([batch.hidden[layer] for layer in head.feature_layers], dim=-1)  # [b, L, F]
        count, length = batch.input_ids.shape
        anchors = sample_anchors(batch.valid, batch.loss_mask, self.config.anchors_per_sequence)  # [b, A]
        outputs = head.blocks(features, batch.input_ids, anchors)[:, :, 1:]  # [b, A, B-1, H]
        offsets = torch.arange(block, device=anchors.device)
        # Block position i (1..B-1) predicts token anchor + i: the target's distribution after position anchor + i - 1.
        label_at = anchors.unsqueeze(-1) + offsets[:-1]  # [b, A, B-1]
        predicted = (label_at + 1).clamp(max=length - 1)
        usable = (label_at + 1 < length) & batch.valid.gather(1, predicted.view(count, -1)).view_as(label_at)
        usable &= batch.loss_mask.gather(1, predicted.view(count, -1)).view_as(label_at)
        flat = label_at.clamp(max=length - 1).view(count, -1, 1)
        topk = batch.topk_ids.shape[-1]
        ids = batch.topk_ids.gather(1, flat.expand(-1, -1, topk)).view(*label_at.shape, topk)
        probs = batch.topk_probs.gather(1, flat.expand(-1, -1, topk)).view(*label_at.shape, topk)
        logits = head.draft_logits(outputs)  # [b, A, B-1, V_draft]
        per_row, agree, keep = soft_ce_rows(logits, ids, probs, head.target_to_draft)
        keep &= usable
        weights = self.config.loss_decay ** offsets[:-1].to(logits.dtype)  # [B-1]
        weighted = keep * weights
        loss = (per_row * weighted).sum() / weighted.sum().clamp(min=1e-9)
        metrics = {}
        for position in METRIC_POSITIONS:
            if position < block:
                chosen = keep[..., position - 1]
                metrics[f"top1@{position}"] = (
                    float(agree[..., position - 1][chosen].float().mean()) if chosen.any() else 0.0
                )
        return loss, metrics


def soft_ce_rows(logits, ids, probs, to_draft):
    """Per-row soft cross-entropy against the target's top-k, renormalised within the draft vocabulary ->
    (loss [...], top-1 agreement [...] bool, rows with any label mass inside the draft vocabulary [...] bool)."""
    draft_ids = to_draft[ids]  # [..., k], -1 outside the draft vocabulary
    weights = probs.float() * (draft_ids >= 0)
    mass = weights.sum(-1)
    log_probs = torch.log_softmax(logits.float(), dim=-1).gather(-1, draft_ids.clamp(min=0))
    per_row = -(weights * log_probs).sum(-1) / mass.clamp(min=1e-9)
    return per_row, logits.argmax(-1) == draft_ids[..., 0], mass > 0


def sample_anchors(valid: torch.Tensor, loss_mask: torch.Tensor, count: int) -> torch.Tensor:
    """[b, count] anchor positions a per sequence with a >= 1, a + 1 a real, learnable token (drawn with
    replacement, uniformly); a sequence without one gets anchors at 0, whose rows the loss then ignores."""
    candidates = torch.zeros_like(valid, dtype=torch.float32)
    candidates[:, 1:-1] = (valid[:, 2:] & loss_mask[:, 2:]).float()
    empty = candidates.sum(-1) == 0
    candidates[empty, 0] = 1.0
    return torch.multinomial(candidates, count, replacement=True)


def rarest_token(sequences, vocab_size: int) -> int:
    """The mask token: the target token the training sequences use least (never, for a special token the data has
    no use for), the lowest id among ties."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for sequence in sequences:
        counts += torch.bincount(sequence.input_ids, minlength=vocab_size)
    return int(counts.argmin())


def train_dflash(target: Target, config: RecipeConfig, resume: bool, max_steps: int | None, timings: dict) -> dict:
    dflash = config.dflash
    layers = resolve_feature_layers(dflash, target.config.num_hidden_layers)
    data = recipe_data(target, config, layers, timings)
    dflash, head = new_dflash_head(target, dflash, layers, data.train.sample)
    module = DFlashTraining(head, dflash)
    return train_and_save(
        target, config, head, module, dflash, data, timings, resume, max_steps, feature_layers=list(layers)
    )


def new_dflash_head(
    target: Target, dflash: DFlashConfig, layers: tuple[int, ...], sequences: list[LabeledSequence]
) -> tuple[DFlashConfig, DFlashHead]:
    """(config as saved, an untrained fp32 head initialised from the target's top layers) whose mask token (unless
    the config names one) and draft vocabulary come from `sequences`."""
    mask_token = dflash.mask_token_id if dflash.mask_token_id >= 0 else rarest_token(sequences, target.vocab_size)
    # Stored resolved, so loading needs no rule.
    dflash = DFlashConfig(**{**dflash.__dict__, "feature_layers": layers, "mask_token_id": mask_token})
    draft_vocab = draft_vocabulary(sequences, dflash.draft_vocab_size, target.vocab_size)
    head = DFlashHead(dflash, target, draft_vocab).float().to(target.device)  # trains where the target's labels are
    head.init_from_target(target)
    return dflash, head
