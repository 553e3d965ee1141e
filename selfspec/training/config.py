"""Typed training recipes: a YAML file maps 1:1 onto these dataclasses; unknown keys are an error, not ignored.

The heads' own configs (MedusaConfig, EagleConfig, Eagle3Config, DFlashConfig) live beside their drafters in heads/."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..errors import SelfspecError
from ..heads.dflash import DFlashConfig
from ..heads.eagle import Eagle3Config, EagleConfig
from ..heads.medusa import MedusaConfig
from ..options import from_dict


@dataclass(frozen=True)
class DataConfig:
    source: str = "sharegpt"  # "sharegpt" (training split) or a JSONL file of conversations / {"text": ...}
    conversations: int | None = 4000  # how many conversations to use (a seeded sample); null = all
    seed: int = 0
    max_length: int = 512  # tokens per training sequence (longer ones are cut)
    regenerate: bool = True  # replace assistant replies by the target's own greedy replies
    max_prompt_tokens: int = 256  # regeneration: skip conversations whose first user turn is longer
    max_new_tokens: int = 192  # regeneration: reply length cap
    regenerate_batch_size: int = 48
    regenerate_engine: str = "batched"  # "batched" (HF generate, many prompts at once) or "selfspec" (lossless, one by one)
    calibration_fraction: float = 0.05  # the last part of the data: never trained on; measures top-k accuracies


@dataclass(frozen=True)
class LabelConfig:
    storage: str = "cache"  # "cache": shards on disk with a manifest, resumable; "stream": computed per batch
    top_k: int = 16  # the target's top-k next-token probabilities kept per position
    shard_examples: int = 256  # sequences per shard


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    batch_size: int = 8  # sequences per step
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 50
    max_steps: int = 2000
    grad_clip: float = 1.0
    checkpoint_every: int = 250
    log_every: int = 10


@dataclass(frozen=True)
class EvalConfig:
    heldout_prompts: int = 10  # held-out ShareGPT prompts decoded with the real decoder after training
    max_new_tokens: int = 128


@dataclass(frozen=True)
class RecipeConfig:
    drafter: str = "medusa"
    model: str = "default"
    out: str = "runs/medusa"  # the heads directory written at the end
    work_dir: str | None = None  # regenerated data, label shards, checkpoints (default: <out>.work)
    data: DataConfig = field(default_factory=DataConfig)
    labels: LabelConfig = field(default_factory=LabelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    medusa: MedusaConfig = field(default_factory=MedusaConfig)
    eagle: EagleConfig = field(default_factory=EagleConfig)
    eagle3: Eagle3Config = field(default_factory=Eagle3Config)
    dflash: DFlashConfig = field(default_factory=DFlashConfig)

    @property
    def work_path(self) -> Path:
        return Path(self.work_dir) if self.work_dir else Path(str(self.out) + ".work")


def load_recipe(path: str | Path, overrides: dict | None = None) -> RecipeConfig:
    """Read a YAML recipe; `overrides` (e.g. from CLI flags: {"out": ..., "train.max_steps": 10}) win."""
    path = Path(path)
    if not path.is_file():
        raise SelfspecError(f"config file '{path}' does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise SelfspecError(f"config file '{path}' is not valid YAML: {str(error).splitlines()[0]}") from None
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return from_dict(RecipeConfig, data, where=path.name)
