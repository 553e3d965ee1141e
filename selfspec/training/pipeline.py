"""`selfspec train <drafter> --config ...`: data -> labels -> train -> tree -> save -> held-out evaluation.

Every stage keeps its output under the work directory, so an interrupted run picks up where it stopped
(regenerated replies, label shards, trainer checkpoints with --resume).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..errors import SelfspecError
from ..models import Target, load_target
from .config import RecipeConfig, to_dict
from .data import Example, load_conversations, regenerate, tokenize_conversation
from .labels import LabeledSequence, build_label_cache, label_sequence, load_label_cache
from .sharegpt import load_sharegpt

REPORT = "training_report.json"


@dataclass(frozen=True)
class LabeledData:
    count: int
    get: object  # Callable[[int], LabeledSequence]
    sample: list[LabeledSequence]  # labelled sequences held in memory (all when cached; a prefix when streaming)


def prepare_examples(target: Target, config: RecipeConfig) -> tuple[list[Example], list[Example]]:
    """(training examples, calibration examples). Reads only the ShareGPT training split."""
    data = config.data
    conversations = load_conversations(data.source, limit=data.conversations, seed=data.seed)
    if data.regenerate:
        path = regenerate(
            target, conversations, config.work_path / "regenerated.jsonl",
            max_prompt_tokens=data.max_prompt_tokens, max_new_tokens=data.max_new_tokens,
            batch_size=data.regenerate_batch_size, engine=data.regenerate_engine,
        )
        # Keep the sample's order (not the file's batch order), so an interrupted or re-batched run gives the same data.
        rank = {conversation.id: index for index, conversation in enumerate(conversations)}
        conversations = sorted((c for c in load_conversations(str(path)) if c.id in rank), key=lambda c: rank[c.id])
    examples = [e for e in (tokenize_conversation(target, c, data.max_length) for c in conversations) if e is not None]
    if len(examples) < 2:
        raise SelfspecError(f"only {len(examples)} usable training sequences: use more conversations")
    calibration = max(1, math.ceil(len(examples) * data.calibration_fraction))
    tqdm.write(f"data: {len(examples) - calibration} training and {calibration} calibration sequences")
    return examples[:-calibration], examples[-calibration:]


def label_examples(target: Target, examples: list[Example], config: RecipeConfig, name: str, layers: tuple[int, ...]) -> LabeledData:
    labels = config.labels
    if labels.storage == "cache":
        directory = build_label_cache(target, examples, config.work_path / f"labels-{name}", layers, labels.top_k, labels.shard_examples)
        sequences = load_label_cache(directory)
        return LabeledData(len(sequences), sequences.__getitem__, sequences)
    if labels.storage == "stream":
        sample = [label_sequence(target, e, layers, labels.top_k) for e in examples[: min(len(examples), 256)]]
        return LabeledData(len(examples), lambda i: label_sequence(target, examples[i], layers, labels.top_k), sample)
    raise SelfspecError(f"labels.storage must be 'cache' or 'stream', got '{labels.storage}'")


@dataclass(frozen=True)
class RecipeData:
    train: LabeledData
    calibration_examples: list[Example]
    calibration: list[LabeledSequence] | None  # labelled calibration sequences, when asked for


def recipe_data(target: Target, config: RecipeConfig, layers: tuple[int, ...], timings: dict, label_calibration: bool = False) -> RecipeData:
    """Examples and labels for a recipe (the shared first stages), timing each into `timings`."""
    began = time.perf_counter()
    train_examples, calibration_examples = prepare_examples(target, config)
    timings["data_s"] = round(time.perf_counter() - began, 1)
    began = time.perf_counter()
    train_data = label_examples(target, train_examples, config, "train", layers)
    calibration = label_examples(target, calibration_examples, config, "calibration", layers).sample if label_calibration else None
    timings["labels_s"] = round(time.perf_counter() - began, 1)
    return RecipeData(train_data, calibration_examples, calibration)


def checkpoint_dir(config: RecipeConfig) -> Path:
    """Per output, so recipes sharing a work_dir (and its data and labels) never resume each other's checkpoints."""
    return config.work_path / f"checkpoints-{Path(config.out).name}"


def evaluate_heldout(heads_dir: Path, drafter: str, config: RecipeConfig) -> dict:
    """Mean accepted length of the trained drafter on held-out ShareGPT prompts, greedy, with the real decoder."""
    from ..decoding import speculative_generate
    from ..heads import create_drafter
    from ..sampling import SamplingConfig

    if config.eval.heldout_prompts <= 0:
        return {}
    target = load_target(config.model)  # fresh: Medusa-2 merges its adapter into the target it is given
    drafter_instance = create_drafter(drafter, target, heads_dir)
    conversations = load_sharegpt("heldout").conversations
    step = max(1, len(conversations) // config.eval.heldout_prompts)
    chosen = conversations[::step][: config.eval.heldout_prompts]
    per_prompt, lengths, tokens = [], [], 0
    for conversation in tqdm(chosen, desc="held-out eval", unit="prompt"):
        user = next(m for m in conversation.messages if m["role"] == "user")
        input_ids = target.encode_messages([user])[:, -min(512, target.context_limit // 2) :]
        _, stats = speculative_generate(target, drafter_instance, input_ids, config.eval.max_new_tokens, SamplingConfig())
        per_prompt.append({"id": conversation.id, "tau": round(stats.mean_accepted_length, 3), "tokens": stats.new_tokens})
        lengths.extend(stats.accepted_lengths)
        tokens += stats.new_tokens
    return {
        "split": "sharegpt heldout",
        "prompts": len(chosen),
        "max_new_tokens": config.eval.max_new_tokens,
        "mean_accepted_length": round(sum(lengths) / max(1, len(lengths)), 3),
        "tree_nodes": getattr(drafter_instance, "tree_nodes", None),
        "per_prompt": per_prompt,
    }


def write_report(heads_dir: Path, report: dict) -> None:
    from .data import _atomic_write_text

    _atomic_write_text(heads_dir / REPORT, json.dumps(report, indent=1) + "\n")


def run_recipe(config: RecipeConfig, resume: bool = False, max_steps: int | None = None) -> dict:
    """Run a whole training recipe; returns the report that is also written beside the weights."""
    from .dflash import train_dflash
    from .eagle import train_eagle
    from .medusa_recipe import train_medusa

    recipes = {"medusa": train_medusa, "eagle": train_eagle, "dflash": train_dflash}
    if config.drafter not in recipes:
        raise SelfspecError(f"no training recipe for drafter '{config.drafter}': choose one of {', '.join(recipes)}")

    torch.manual_seed(config.train.seed)
    timings: dict[str, float] = {}
    start = time.perf_counter()
    target = load_target(config.model)
    report = recipes[config.drafter](target, config, resume, max_steps, timings)
    began = time.perf_counter()
    report["heldout"] = evaluate_heldout(Path(config.out), config.drafter, config)
    timings["heldout_eval_s"] = round(time.perf_counter() - began, 1)
    timings["total_s"] = round(time.perf_counter() - start, 1)
    report["timings"] = timings
    report["config"] = to_dict(config)
    write_report(Path(config.out), report)
    return report
