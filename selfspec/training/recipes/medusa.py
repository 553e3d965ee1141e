"""Medusa training: heads on the target's last hidden state (Medusa-1: frozen base; Medusa-2: jointly with LoRA on
the base), the per-head loss and the tree built from the heads' measured top-k accuracies; the recipe, and
`selfspec medusa-tree`, which measures the tree again on other data.

Shift convention: the target's distribution at position t predicts token t + 1; head k (0-based) reads the hidden
state at t and predicts token t + k + 2, so its label is the target's distribution at position t + k + 1.
"""

from __future__ import annotations

import heapq
import json
from pathlib import Path

import torch

from ...errors import SelfspecError
from ...files import atomic_write_text
from ...heads.artifacts import CONFIG, load_head, save_head
from ...heads.medusa import MedusaConfig, MedusaHeads, MedusaLoraConfig
from ...models import Target
from ..config import RecipeConfig
from ..data.conversations import load_conversations
from ..data.labels import LabeledSequence, label_sequence
from ..data.prepare import RecipeData, recipe_data
from ..data.tokenizing import tokenize_conversation
from ..trainer.loop import Batch, TrainableHead
from ..trainer.losses import draft_vocabulary, soft_cross_entropy
from ..trainer.pipeline import summary_entries, train_head

LAYERS = (-1,)  # the target layers Medusa's labels hold: the last hidden state


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


def train_medusa(target: Target, config: RecipeConfig, resume: bool, max_steps: int | None, timings: dict) -> dict:
    medusa = check_medusa(config.medusa)
    data = recipe_data(target, config, LAYERS, timings, label_calibration=True)
    heads = new_medusa_heads(target, medusa, data.train.sample)
    base = None
    if medusa.lora is not None:
        base = _with_lora(target, medusa)  # only the adapters train; the original labels were recorded before this
    module = MedusaTraining(heads, medusa.head_decay, base=base, lora=medusa.lora)
    summary = train_head(module, data, config, resume, max_steps, timings)
    report = save_medusa(target, config, heads, data, summary, base)
    if base is not None:
        base.unload()  # give the target back its original layers (the adapter is saved with the heads)
    return report


def check_medusa(medusa: MedusaConfig) -> MedusaConfig:
    """Checked before any data is made."""
    if medusa.num_heads < 1 or medusa.num_layers < 1 or medusa.max_rank < 1 or medusa.max_tree_nodes < 2:
        raise SelfspecError("medusa: num_heads, num_layers, max_rank must be >= 1 and max_tree_nodes >= 2")
    return medusa


def new_medusa_heads(target: Target, medusa: MedusaConfig, sequences: list[LabeledSequence]) -> MedusaHeads:
    """Untrained fp32 heads whose draft vocabulary is the most frequent tokens of `sequences`."""
    draft_vocab = draft_vocabulary(sequences, medusa.draft_vocab_size, target.vocab_size)
    return MedusaHeads(medusa, target, draft_vocab).float().to(target.device)  # where the labels are


def _with_lora(target: Target, medusa: MedusaConfig):
    from peft import LoraConfig, get_peft_model

    lora = medusa.lora
    peft_config = LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules)
    )
    return get_peft_model(target.model, peft_config)


def save_medusa(target: Target, config: RecipeConfig, heads: MedusaHeads, data: RecipeData, summary, base=None) -> dict:
    """The tree from the trained heads' top-k accuracies on the labelled calibration sequences, then the heads
    directory (with the LoRA adapter of `base`, Medusa-2) -> the report's training part."""
    medusa = config.medusa
    heads.eval()
    accuracies = head_accuracies(heads, data.calibration, medusa.max_rank)
    paths, values = best_tree(accuracies, medusa.max_tree_nodes)
    extra = {
        "tree": {"paths": [list(p) for p in paths], "values": [round(v, 5) for v in values]},
        "accuracies": [[round(a, 4) for a in row] for row in accuracies.tolist()],
    }
    save_head(
        Path(config.out),
        "medusa",
        medusa,
        heads.state_dict(),
        target.fingerprint,
        extra,
        write_adapter=(lambda directory: base.save_pretrained(str(directory))) if base is not None else None,
    )
    train_data = data.train
    return {
        "drafter": "medusa",
        "variant": "medusa-2 (LoRA)" if medusa.lora else "medusa-1 (frozen base)",
        "training_sequences": train_data.count,
        "training_tokens": sum(len(s.input_ids) for s in train_data.sample)
        if config.labels.storage == "cache"
        else None,
        "calibration_sequences": len(data.calibration),
        "data_mix": data.mix,
        "draft_vocab_size": len(heads.draft_vocab),
        "top_k_accuracy": extra["accuracies"],
        **summary_entries(target, config, data, summary),
    }


def rebuild_tree(
    target: Target, heads_dir: Path, source: str, conversations: int, max_nodes: int, max_length: int = 512
) -> dict:
    """`selfspec medusa-tree`: re-measure the heads' top-k accuracies on `source` and rewrite the tree data."""
    artifact = load_head(heads_dir, "medusa", MedusaConfig, target)
    heads = MedusaHeads(artifact.config, target, artifact.state["draft_vocab"]).float()
    heads.load_state_dict(artifact.state, strict=True)
    examples = [
        e
        for e in (tokenize_conversation(target, c, max_length) for c in load_conversations(source, conversations))
        if e
    ]
    if not examples:
        raise SelfspecError(f"no usable sequences in '{source}'")
    sequences = [label_sequence(target, e, LAYERS, 1) for e in examples]
    accuracies = head_accuracies(heads, sequences, artifact.config.max_rank)
    paths, values = best_tree(accuracies, max_nodes)
    document = json.loads((heads_dir / CONFIG).read_text())
    document["data"]["tree"] = {"paths": [list(p) for p in paths], "values": [round(v, 5) for v in values]}
    document["data"]["accuracies"] = [[round(a, 4) for a in row] for row in accuracies.tolist()]
    atomic_write_text(heads_dir / CONFIG, json.dumps(document, indent=1) + "\n")
    return {"sequences": len(sequences), "nodes": len(paths) + 1, "accuracies": document["data"]["accuracies"]}
