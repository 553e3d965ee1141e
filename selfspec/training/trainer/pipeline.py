"""`selfspec train <drafter> --config ...`: data -> labels -> train -> tree -> save -> held-out evaluation.

A recipe (recipes/<drafter>.py, found through the drafter registry, so this module imports none) takes its data and
labels from data/prepare.py, then the last stages here: the trainer over them (train_head), the head written with
the report's training part (save_trained_head, its throughput part), and the held-out evaluation (finish_report).
Every stage keeps its output under the work directory, so an interrupted run picks up where it stopped
(regenerated replies, label shards, trainer checkpoints with --resume).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from ...decoding import speculative_generate
from ...errors import SelfspecError
from ...files import atomic_write_text
from ...heads import create_drafter, drafter_entry, drafter_names
from ...heads.artifacts import REPORT, save_head
from ...models import Target, load_target
from ...options import to_dict
from ...sampling import SamplingConfig
from ..clock import running_time
from ..config import RecipeConfig
from ..data.prepare import RecipeData
from ..data.sharegpt import load_sharegpt
from ..throughput import machine, stage_entry
from .loop import train


def evaluate_heldout(heads_dir: Path, drafter: str, config: RecipeConfig) -> dict:
    """Mean accepted length of the trained drafter on held-out ShareGPT prompts, greedy, with the real decoder."""
    if config.eval.heldout_prompts <= 0:
        return {}
    target = load_target(config.model, four_bit=False)
    drafter_instance = create_drafter(drafter, target, heads_dir)
    target = drafter_instance.target  # Medusa-2 heads decode their own adapted copy of the target
    conversations = load_sharegpt("heldout").conversations
    step = max(1, len(conversations) // config.eval.heldout_prompts)
    chosen = conversations[::step][: config.eval.heldout_prompts]
    per_prompt, lengths, tokens = [], [], 0
    for conversation in tqdm(chosen, desc="held-out eval", unit="prompt"):
        user = next(m for m in conversation.messages if m["role"] == "user")
        input_ids = target.encode_messages([user])[:, -min(512, target.context_limit // 2) :]
        _, stats = speculative_generate(
            target, drafter_instance, input_ids, config.eval.max_new_tokens, SamplingConfig(), pace=False
        )  # acceptance, not speed
        per_prompt.append(
            {"id": conversation.id, "tau": round(stats.mean_accepted_length, 3), "tokens": stats.new_tokens}
        )
        lengths.extend(stats.accepted_lengths)
        tokens += stats.new_tokens
    return {
        "split": "sharegpt heldout",
        "prompts": len(chosen),
        "max_new_tokens": config.eval.max_new_tokens,
        "mean_accepted_length": round(sum(lengths) / max(1, len(lengths)), 3),
        "tree_nodes": drafter_instance.stats().tree_nodes,
        "per_prompt": per_prompt,
    }


def write_report(heads_dir: Path, report: dict) -> None:
    atomic_write_text(heads_dir / REPORT, json.dumps(report, indent=1) + "\n")


def resolve_recipe(drafter: str) -> Callable:
    """The training recipe a drafter registered ("module:function"), imported now."""
    entry = drafter_entry(drafter)
    trainable = [name for name in drafter_names() if drafter_entry(name).recipe]
    if entry.recipe is None:
        raise SelfspecError(f"no training recipe for drafter '{drafter}': choose one of {', '.join(trainable)}")
    module, _, function = entry.recipe.partition(":")
    return getattr(importlib.import_module(module), function)


def run_recipe(config: RecipeConfig, resume: bool = False, max_steps: int | None = None) -> dict:
    """Run a whole training recipe; returns the report that is also written beside the weights."""
    recipe = resolve_recipe(config.drafter)
    torch.manual_seed(config.train.seed)
    timings: dict[str, float] = {}
    start = running_time()
    target = load_target(config.model, four_bit=False)
    report = recipe(target, config, resume, max_steps, timings)
    return finish_report(config, report, timings, start)


def finish_report(config: RecipeConfig, report: dict, timings: dict, start: float) -> dict:
    """A trained head's last stage: the held-out evaluation, the timings (`start`: running_time() when the run
    began) and the recipe added to `report`, which is written beside the weights and returned."""
    began = running_time()
    report["heldout"] = evaluate_heldout(Path(config.out), config.drafter, config)
    timings["heldout_eval_s"] = round(running_time() - began, 1)
    timings["total_s"] = round(running_time() - start, 1)
    report["timings"] = timings
    report["config"] = to_dict(config)
    write_report(Path(config.out), report)
    return report


def train_head(module, data: RecipeData, config: RecipeConfig, resume: bool, max_steps: int | None, timings: dict):
    """The trainer over a recipe's labelled data -> its TrainSummary; timed into `timings`."""
    began = running_time()
    summary = train(
        module,
        data.train.count,
        data.train.get,
        config.train,
        checkpoint_dir(config),
        resume,
        max_steps,
        get_batch=data.train.get_batch,
    )
    timings["train_s"] = round(running_time() - began, 1)
    return summary


def throughput_report(target: Target, config: RecipeConfig, data: RecipeData, summary) -> dict:
    """The report's throughput part: token positions per second of each stage this invocation ran (see
    throughput.py), with the dtype and autocast each ran in."""
    entries = {"machine": machine(target.device)}
    if data.regenerated.sequences:
        entries["regeneration"] = stage_entry(
            f"new tokens generated (greedy, {config.data.regenerate_engine}, {config.data.regenerate_batch_size} "
            "prompts a batch)",
            data.regenerated.tokens,
            data.regenerated.seconds,
            target.dtype,
            prompts=data.regenerated.sequences,
        )
    if config.labels.storage == "stream":
        entries["labels"] = stage_entry(
            "token positions labelled by the target inside the training steps (streamed)",
            summary.tokens,
            summary.fetch_seconds,
            target.dtype,
        )
    elif data.train.labelled and data.train.labelled.sequences:
        entries["labels"] = stage_entry(
            "token positions labelled by the target (cached shards)",
            data.train.labelled.tokens,
            data.train.labelled.seconds,
            target.dtype,
        )
    autocast = "bf16" if summary.precision == "bf16 autocast" else None
    streamed = ", the streamed labelling's time included" if config.labels.storage == "stream" else ""
    entries["training"] = stage_entry(
        f"token positions trained, padding excluded{streamed}",
        summary.tokens,
        summary.seconds,
        "float32",
        autocast,
        steps=summary.steps,
        resumed_from=summary.resumed_from,
    )
    return entries


def checkpoint_dir(config: RecipeConfig) -> Path:
    """Per output, so recipes sharing a work_dir (and its data and labels) never resume each other's checkpoints."""
    return config.work_path / f"checkpoints-{Path(config.out).name}"


def train_and_save(
    target: Target,
    config: RecipeConfig,
    head,
    module,
    head_config,
    data: RecipeData,
    timings: dict,
    resume: bool,
    max_steps: int | None,
    **report,
) -> dict:
    """The last stages of a recipe whose head is all it saves (EAGLE, DFlash): train `module` (which holds `head`),
    write the heads directory, and return the report's training part (`report` adds drafter-specific entries)."""
    summary = train_head(module, data, config, resume, max_steps, timings)
    return save_trained_head(target, config, head, head_config, data, summary, **report)


def save_trained_head(target: Target, config: RecipeConfig, head, head_config, data: RecipeData, summary, **report):
    """Write `head` (trained, as `summary` says) to config.out -> the report's training part."""
    save_head(Path(config.out), config.drafter, head_config, head.state_dict(), target.fingerprint, {})
    return {
        "drafter": config.drafter,
        "training_sequences": data.train.count,
        "calibration_sequences_unused": len(data.calibration_examples),
        "data_mix": data.mix,
        **report,
        "draft_vocab_size": len(head.draft_vocab),
        **summary_entries(target, config, data, summary),
    }


def summary_entries(target: Target, config: RecipeConfig, data: RecipeData, summary) -> dict:
    """The report's entries on the training run itself: steps, final loss and metrics, throughput."""
    return {
        "steps": summary.steps,
        "resumed_from": summary.resumed_from,
        "final_loss": round(summary.final_loss, 4),
        "final_metrics": {k: round(v, 4) for k, v in summary.final_metrics.items()},
        "first_draft_accuracy": summary.first_draft_accuracy and round(summary.first_draft_accuracy, 4),
        "throughput": throughput_report(target, config, data, summary),
    }
