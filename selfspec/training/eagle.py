"""EAGLE training: from pair (feature t, token t + 1) predict feature t + 1 (smooth L1) and, through the target's
frozen LM head, the target's distribution at t + 1 (soft cross-entropy against its top-k), with uniform noise on
the input features so the head tolerates its own imperfect features when it drafts several steps ahead."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..errors import SelfspecError
from ..heads.artifacts import save_head
from ..heads.eagle import EagleHead, causal_block_mask
from ..models import Target
from .config import EagleConfig, RecipeConfig
from .losses import draft_vocabulary, soft_cross_entropy
from .trainer import Batch, TrainableHead, train

LAYERS = (-1,)


class EagleTraining(TrainableHead):
    def __init__(self, head: EagleHead, config: EagleConfig):
        super().__init__()
        self.head = head
        self.config = config

    def training_loss(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        hidden = batch.hidden[-1]  # [B, L, H] the target's LM-head inputs
        length = hidden.shape[1]
        if length < 3:
            zero = self.head.fc.weight.sum() * 0.0
            return zero, {}
        features = hidden[:, :-1]  # feature t, t = 0 .. L - 2
        if self.training and self.config.feature_noise > 0:
            features = features + (torch.rand_like(features) * 2 - 1) * self.config.feature_noise
        tokens = batch.input_ids[:, 1:]  # token t + 1
        positions = torch.arange(1, length, device=hidden.device).expand(hidden.shape[0], -1)
        mask = causal_block_mask(0, length - 1, features.dtype, hidden.device)
        predicted = self.head(features, tokens, positions, mask)  # [B, L - 1, H]: feature t + 1
        # Learn where token t + 2 exists and is learnable (the next-token label sits at position t + 1).
        learnable = torch.zeros_like(batch.loss_mask[:, 1:])
        learnable[:, :-1] = batch.loss_mask[:, 2:] & batch.valid[:, 2:]
        chosen = predicted[learnable]
        hidden_loss = torch.nn.functional.smooth_l1_loss(chosen, hidden[:, 1:][learnable])
        token_loss, _, agreement = soft_cross_entropy(
            self.head.draft_logits(chosen), batch.topk_ids[:, 1:][learnable], batch.topk_probs[:, 1:][learnable],
            self.head.target_to_draft,
        )
        loss = self.config.hidden_weight * hidden_loss + self.config.token_weight * token_loss
        return loss, {"top1": agreement, "feat": float(hidden_loss.detach())}


def train_eagle(target: Target, config: RecipeConfig, resume: bool, max_steps: int | None, timings: dict) -> dict:
    from .pipeline import checkpoint_dir, recipe_data

    eagle = config.eagle
    if min(eagle.top_k, eagle.depth, eagle.max_tree_nodes) < 1:
        raise SelfspecError("eagle: top_k, depth and max_tree_nodes must be >= 1")
    data = recipe_data(target, config, LAYERS, timings)
    train_data = data.train

    draft_vocab = draft_vocabulary(train_data.sample, eagle.draft_vocab_size, target.vocab_size)
    head = EagleHead(eagle, target, draft_vocab).float()
    module = EagleTraining(head, eagle)
    began = time.perf_counter()
    summary = train(module, train_data.count, train_data.get, config.train, checkpoint_dir(config), resume, max_steps)
    timings["train_s"] = round(time.perf_counter() - began, 1)
    save_head(Path(config.out), "eagle", eagle, head.state_dict(), target.fingerprint, {})
    return {
        "drafter": "eagle",
        "training_sequences": train_data.count,
        "calibration_sequences_unused": len(data.calibration_examples),
        "draft_vocab_size": len(draft_vocab),
        "steps": summary.steps,
        "resumed_from": summary.resumed_from,
        "final_loss": round(summary.final_loss, 4),
        "final_metrics": {k: round(v, 4) for k, v in summary.final_metrics.items()},
    }
