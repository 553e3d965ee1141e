"""The Medusa recipe: heads on the target's last hidden state (Medusa-1), optionally with LoRA on the base
(Medusa-2)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import SelfspecError
from ..files import atomic_write_text
from ..heads.artifacts import CONFIG, load_head, save_head
from ..heads.medusa import MedusaConfig, MedusaHeads
from ..models import Target
from .config import RecipeConfig
from .data import load_conversations, tokenize_conversation
from .labels import LabeledSequence, label_sequence
from .losses import draft_vocabulary
from .medusa import MedusaTraining, best_tree, head_accuracies
from .stages import RecipeData, recipe_data, summary_entries, train_head

LAYERS = (-1,)


def _with_lora(target: Target, medusa: MedusaConfig):
    from peft import LoraConfig, get_peft_model

    lora = medusa.lora
    peft_config = LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules)
    )
    return get_peft_model(target.model, peft_config)


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
