"""Typed training configs: a YAML file maps 1:1 onto these dataclasses; unknown keys are an error, not ignored."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..errors import SelfspecError


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
class LoraConfig:
    rank: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    distill_weight: float = 1.0  # weight of KL(original target || adapted target): keeps the base's outputs


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head
    draft_vocab_size: int = 8192  # the most frequent target tokens in the training labels; 0 = full vocabulary
    head_decay: float = 0.8  # loss weight of head k is decay**k (later heads are harder and matter less)
    max_tree_nodes: int = 64  # tree candidates ranked by the tree builder
    max_rank: int = 10  # top-k ranks per head the tree builder considers
    lora: LoraConfig | None = None  # Medusa-2: train LoRA adapters on the base jointly with the heads


@dataclass(frozen=True)
class EagleConfig:
    draft_vocab_size: int = 8192  # the most frequent target tokens in the training labels; 0 = full vocabulary
    feature_noise: float = 0.1  # training: uniform noise U(-a, a) on input features, so the head copes with its own
    hidden_weight: float = 1.0  # smooth-L1 on the predicted next feature
    token_weight: float = 0.1  # cross-entropy against the target's next-token distribution
    unroll_steps: int = 1  # training: draft steps per position, steps after the first fed the head's own features
    top_k: int = 8  # children per expanded node, and frontier nodes expanded per depth
    depth: int = 6  # deepest draft level
    max_tree_nodes: int = 60  # upper bound; the size used follows the cost curve and the draft's confidence


@dataclass(frozen=True)
class DFlashConfig:
    block_size: int = 16  # B: the last committed token, then B - 1 masked positions drafted in one pass
    num_layers: int = 1  # bidirectional drafter layers, of the base architecture's decoder-layer class
    feature_layers: tuple[int, ...] = ()  # target hidden_states indices it is conditioned on; () = 4 spread over the depth
    draft_vocab_size: int = 8192  # the most frequent target tokens in the training labels; 0 = full vocabulary
    loss_decay: float = 0.8  # training: the loss weight of block position i is decay**(i - 1)
    anchors_per_sequence: int = 8  # training: random block starts per sequence and step
    top_k: int = 4  # drafting: candidate tokens per block position
    max_tree_nodes: int = 32  # upper bound; the size used follows the cost curve and the draft's confidence


@dataclass(frozen=True)
class LayerSkipSettings:
    """A layer-skip draft: which sublayers it skips (layer indices) and how far it drafts."""

    skip_attention: tuple[int, ...] = ()
    skip_mlp: tuple[int, ...] = ()
    threshold: float = 0.5  # stop drafting where the draft's top-1 probability falls below this (adapted at run time)
    max_draft: int = 4  # longest chain
    branch_threshold: float = 0.0  # below this top-1 probability, also propose the top-2 token (a leaf); 0 = never
    target_acceptance: float = 0.7  # the adaptive threshold steers the recent acceptance rate towards this
    adapt_step: float = 0.02  # threshold change per step


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
    dflash: DFlashConfig = field(default_factory=DFlashConfig)

    @property
    def work_path(self) -> Path:
        return Path(self.work_dir) if self.work_dir else Path(str(self.out) + ".work")


def from_dict(cls, data, where: str = "config"):
    """Build dataclass `cls` from a mapping, recursively; unknown keys and wrong types are a SelfspecError."""
    if not isinstance(data, dict):
        raise SelfspecError(f"{where}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise SelfspecError(f"{where}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(fields)}")
    hints = typing.get_type_hints(cls)
    values = {name: _coerce(hints[name], value, f"{where}.{name}") for name, value in data.items()}
    return cls(**values)


def _coerce(hint, value, where: str):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [arg for arg in args if arg is not type(None)]
        return _coerce(inner, value, where)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, where)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise SelfspecError(f"{where}: expected a list, got {value!r}")
        return tuple(_coerce(args[0], item, where) for item in value)
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint in (int, str, bool) and (type(value) is not hint):
        raise SelfspecError(f"{where}: expected {hint.__name__}, got {value!r}")
    return value


def to_dict(config) -> dict:
    return dataclasses.asdict(config)


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
