"""EAGLE training: from pair (feature t, token t + 1) predict feature t + 1 (smooth L1) and, through the target's
frozen LM head, the target's distribution at t + 1 (soft cross-entropy against its top-k), with uniform noise on
the input features so the head tolerates its own imperfect features when it drafts several steps ahead; optionally
unrolled over several draft steps on its own features (EAGLE-3's training-time test).

EAGLE-3 (`eagle3`) trains through the same loop: its features are three layers' hidden states fused by its fc, it
has no feature loss (hidden_weight 0) and unrolls three steps by default."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ...errors import SelfspecError
from ...heads.eagle import Eagle3Config, Eagle3Head, EagleConfig, EagleFamilyHead, EagleHead, resolve_eagle3_layers
from ...models import Target
from ..config import RecipeConfig
from ..data.labels import LabeledSequence
from ..data.prepare import recipe_data
from ..trainer.loop import Batch, TrainableHead
from ..trainer.losses import draft_vocabulary, soft_cross_entropy
from ..trainer.pipeline import train_and_save


class EagleTraining(TrainableHead):
    """Step 0 is teacher-forced: pair t = (the target's feature t, token t + 1). With `unroll_steps` U > 1 the head
    then drafts on as it does at decoding time (EAGLE-3's training-time test): at step s, row t holds the pair
    (the head's own step s - 1 prediction of feature t + s, token t + s + 1) at position t + s + 1, attending to
    the teacher-forced pairs 0..t and to row t of every earlier step, exactly the keys a depth-s draft node sees."""

    first_draft_metric = "top1"

    def __init__(self, head: EagleFamilyHead, config: EagleConfig):
        super().__init__()
        if config.unroll_steps < 1:
            raise SelfspecError(f"eagle.unroll_steps must be >= 1, got {config.unroll_steps}")
        self.head = head
        self.config = config

    def training_loss(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        inputs = self.head.gather_features(batch.hidden)  # [B, L, F] the target's features
        rows = inputs.shape[1] - 1  # pairs t = 0 .. L - 2
        steps = min(self.config.unroll_steps, rows - 1)
        if steps < 1:
            return self.head.fc.weight.sum() * 0.0, {}
        features = inputs[:, :-1]  # step 0: feature t
        if self.training and self.config.feature_noise > 0:
            features = features + (torch.rand_like(features) * 2 - 1) * self.config.feature_noise
        total, metrics = 0.0, {}
        for step, predicted in enumerate(self.unroll(self.head.fuse(features), batch.input_ids, steps)):
            # Learn where the label (feature and distribution at t + s + 1) exists and token t + s + 2 is learnable.
            learnable = torch.zeros_like(batch.loss_mask[:, 1:])
            learnable[:, : rows - 1 - step] = batch.loss_mask[:, 2 + step :] & batch.valid[:, 2 + step :]
            chosen = predicted[learnable]
            labelled = learnable[:, : rows - step]  # the same rows, indexing labels from position s + 1
            token_loss, _, agreement = soft_cross_entropy(
                self.head.draft_logits(chosen),
                batch.topk_ids[:, 1 + step :][labelled],
                batch.topk_probs[:, 1 + step :][labelled],
                self.head.target_to_draft,
            )
            total = total + self.config.token_weight * token_loss
            metrics["top1" if step == 0 else f"top1@{step + 1}"] = agreement
            if self.config.hidden_weight:  # EAGLE-1: the next feature (the LM head's input) is a label too
                hidden_loss = torch.nn.functional.smooth_l1_loss(chosen, batch.hidden[-1][:, 1 + step :][labelled])
                total = total + self.config.hidden_weight * hidden_loss
                if step == 0:
                    metrics["feat"] = float(hidden_loss.detach())
        return total / steps, metrics

    def unroll(self, features: torch.Tensor, input_ids: torch.Tensor, steps: int):
        """features [B, N, H] (step 0's, feature t), input_ids [B, N + 1] -> yields each step's predicted features
        [B, N, H]: row t of step s predicts feature t + s + 1."""
        rows = features.shape[1]
        cache = DynamicCache()
        for step in range(steps):
            # Row t at step s: token t + s + 1 at position t + s + 1 (rows past the sequence's end hold padding).
            tokens = torch.zeros_like(input_ids[:, 1:])
            tokens[:, : rows - step] = input_ids[:, 1 + step :]
            positions = torch.arange(1 + step, rows + 1 + step, device=features.device).expand(features.shape[0], -1)
            predicted = self.head(
                features, tokens, positions, unrolled_mask(rows, step, features.dtype, features.device), cache
            )
            yield predicted
            features = predicted  # the next step reads the head's own features


def unrolled_mask(rows: int, step: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[1, 1, rows, (step + 1) * rows] additive: row t sees step-0 keys 0..t and its own row of steps 1..step."""
    allowed = torch.zeros(rows, (step + 1) * rows, dtype=torch.bool, device=device)
    allowed[:, :rows] = torch.ones(rows, rows, dtype=torch.bool, device=device).tril()
    diagonal = torch.arange(rows, device=device)
    for earlier in range(1, step + 1):
        allowed[diagonal, earlier * rows + diagonal] = True
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.view(1, 1, rows, (step + 1) * rows)


def train_eagle_family(
    target: Target, config: RecipeConfig, resume: bool, max_steps: int | None, timings: dict
) -> dict:
    """The `eagle` and `eagle3` recipes: data, a fresh head over the sample's draft vocabulary, the trainer."""
    eagle, head_cls, layers = eagle_family(target, config)
    check_eagle(config.drafter, eagle)
    data = recipe_data(target, config, layers, timings)
    eagle, head = new_eagle_head(target, eagle, head_cls, data.train.sample)
    return train_and_save(target, config, head, EagleTraining(head, eagle), eagle, data, timings, resume, max_steps)


def check_eagle(name: str, eagle: EagleConfig) -> None:
    """Checked before any data is made."""
    if min(eagle.top_k, eagle.depth, eagle.max_tree_nodes) < 1:
        raise SelfspecError(f"{name}: top_k, depth and max_tree_nodes must be >= 1")


def eagle_family(target: Target, config: RecipeConfig) -> tuple[EagleConfig, type, tuple[int, ...]]:
    """An EAGLE-family recipe's (head config, head class, target layers its labels hold), for studies that build
    heads of the recipe themselves (sweep, scaling)."""
    if config.drafter == "eagle3":
        return config.eagle3, Eagle3Head, resolve_eagle3_layers(config.eagle3, target.config.num_hidden_layers)
    return config.eagle, EagleHead, (-1,)


def new_eagle_head(
    target: Target, eagle: EagleConfig, head_cls, sequences: list[LabeledSequence]
) -> tuple[EagleConfig, EagleFamilyHead]:
    """(config as saved, an untrained fp32 head of `head_cls`) whose draft vocabulary is the most frequent tokens
    of `sequences`."""
    draft_vocab = draft_vocabulary(sequences, eagle.draft_vocab_size, target.vocab_size)
    head = head_cls(eagle, target, draft_vocab).float().to(target.device)  # trains where the target's labels are
    if isinstance(eagle, Eagle3Config):  # the layers used are part of the head: written into its config
        eagle = Eagle3Config(**{**eagle.__dict__, "feature_layers": head.feature_layers})
    return eagle, head
