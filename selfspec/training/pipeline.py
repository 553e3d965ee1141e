"""`selfspec train <drafter> --config ...`: data -> labels -> train -> tree -> save -> held-out evaluation.

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

from ..decoding import speculative_generate
from ..errors import SelfspecError
from ..files import atomic_write_text
from ..heads import create_drafter, drafter_entry, drafter_names
from ..heads.artifacts import REPORT
from ..models import load_target
from ..options import to_dict
from ..sampling import SamplingConfig
from .clock import running_time
from .config import RecipeConfig
from .sharegpt import load_sharegpt


def evaluate_heldout(heads_dir: Path, drafter: str, config: RecipeConfig) -> dict:
    """Mean accepted length of the trained drafter on held-out ShareGPT prompts, greedy, with the real decoder."""
    if config.eval.heldout_prompts <= 0:
        return {}
    target = load_target(config.model)
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
    target = load_target(config.model)
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
