"""Typed training recipes: a YAML file maps 1:1 onto these dataclasses; unknown keys are an error, not ignored.

The heads' own configs (MedusaConfig, EagleConfig, Eagle3Config, DFlashConfig) live beside their drafters in heads/."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from ..errors import SelfspecError
from ..files import cache_root
from ..heads.dflash import DFlashConfig
from ..heads.eagle import Eagle3Config, EagleConfig
from ..heads.medusa import MedusaConfig
from ..options import from_dict

REGENERATE_ENGINES = ("batched", "generate", "selfspec")  # data.engine_replies, by name


@dataclass(frozen=True)
class DataConfig:
    source: str = "sharegpt"  # "sharegpt" (training split) or a JSONL file of conversations / {"text": ...}
    conversations: int | None = 4000  # how many conversations to use (a seeded sample); null = all
    seed: int = 0
    max_length: int = 512  # tokens per training sequence (longer ones are cut)
    regenerate: bool = True  # replace assistant replies by the target's own greedy replies
    # With regenerate: also this many conversations as they are (all turns, ShareGPT's own replies), the first ones
    # of the same seeded order as `conversations`, beside the regenerated ones; null = all; 0 = none.
    original_conversations: int | None = 0
    max_prompt_tokens: int = 256  # regeneration: skip conversations whose first user turn is longer
    max_new_tokens: int = 192  # regeneration: reply length cap
    regenerate_batch_size: int = 48
    # "batched" (many prompts at once, in-place cache), "generate" (HF generate, same batches) or "selfspec"
    # (lossless decoding, one prompt at a time)
    regenerate_engine: str = "batched"
    calibration_fraction: float = 0.05  # the last part of the data: never trained on; measures top-k accuracies

    def __post_init__(self) -> None:  # checked when the recipe is read, not after hours of regeneration
        if self.original_conversations is not None and self.original_conversations < 0:
            raise SelfspecError(
                f"data.original_conversations must be >= 0 (null: all), got {self.original_conversations}"
            )
        if self.regenerate_engine not in REGENERATE_ENGINES:
            raise SelfspecError(
                f"data.regenerate_engine must be one of {', '.join(REGENERATE_ENGINES)}, got '{self.regenerate_engine}'"
            )
        if not self.regenerate and self.original_conversations != 0:
            raise SelfspecError(
                "data.original_conversations adds the original conversations beside regenerated ones; with "
                "data.regenerate false the data is the original conversations already: leave it 0 and size it "
                "with data.conversations"
            )


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
    checkpoint_every: int = 250  # a checkpoint every this many steps ...
    checkpoint_minutes: float = 10.0  # ... or after this many minutes, whichever comes first (0: by steps only)
    log_every: int = 10
    # "cosine": warm-up, then cosine decay to 5% at max_steps. "wsd" (warm-up, stable, decay): warm-up, the full
    # rate until the last `decay_steps` d, then a linear decay (d/(d+1), ..., 1/(d+1) of it); its stable part does
    # not depend on max_steps, so a long run can be extended, and any checkpoint of it branched into a short decay of
    # its own (a scaling point).
    schedule: str = "cosine"
    decay_steps: int = 0  # wsd: the decay's length in steps
    keep_steps: tuple[int, ...] = ()  # checkpoints taken at these steps and never pruned (branch points)
    # A limit on the training loop's minutes (null: none). After a short measured warm-up the run's total steps are
    # fixed at min(max_steps, the steps that fit what is left of it at the measured pace), and the schedule decays
    # to that total; the plan is kept in the checkpoints, so a resumed run follows it (trainer/loop.py, StepBudget).
    time_budget_minutes: float | None = None

    def __post_init__(self) -> None:  # checked when the recipe is read, not hours later when training starts
        for name in ("batch_size", "max_steps", "checkpoint_every", "log_every"):
            if getattr(self, name) < 1:
                raise SelfspecError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.schedule not in ("cosine", "wsd"):
            raise SelfspecError(f"train.schedule must be 'cosine' or 'wsd', got '{self.schedule}'")
        if self.decay_steps < 0 or (self.schedule == "cosine" and self.decay_steps):
            raise SelfspecError(
                f"train.decay_steps is the wsd schedule's decay (>= 0; 0 with cosine), got {self.decay_steps}"
            )
        if any(step < 1 for step in self.keep_steps):
            raise SelfspecError(f"train.keep_steps must be steps >= 1, got {list(self.keep_steps)}")
        if self.time_budget_minutes is not None and self.time_budget_minutes <= 0:
            raise SelfspecError(
                f"train.time_budget_minutes must be > 0 (null: no limit), got {self.time_budget_minutes}"
            )
        if self.checkpoint_minutes < 0 or self.warmup_steps < 0:
            raise SelfspecError(
                f"train.checkpoint_minutes (0: by steps only) and train.warmup_steps must be >= 0, "
                f"got {self.checkpoint_minutes} and {self.warmup_steps}"
            )


@dataclass(frozen=True)
class EvalConfig:
    heldout_prompts: int = 10  # held-out ShareGPT prompts decoded with the real decoder after training
    max_new_tokens: int = 128


@dataclass(frozen=True)
class RecipeConfig:
    drafter: str = "medusa"
    model: str = "default"
    out: str = "runs/medusa"  # the heads directory written at the end
    work_dir: str | None = None  # regenerated data, label shards, checkpoints (default: see work_path)
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
        """`work_dir`, else outside the checkout: <cache root>/runs/<out's name>-<hash of out's absolute path>, so
        two outputs of one name never share checkpoints and a long run's files survive a clean checkout."""
        if self.work_dir:
            return Path(self.work_dir).expanduser()
        out = Path(self.out).expanduser().resolve()
        return cache_root() / "runs" / f"{out.name}-{hashlib.sha1(str(out).encode()).hexdigest()[:8]}"


JOINT_HEADS = ("eagle3", "dflash", "medusa")  # the heads one label pass can train together (selfspec train heads)


@dataclass(frozen=True)
class HeadRates:
    """Each head's learning rate in a joint recipe (its own AdamW parameter group); null = train.lr."""

    eagle3: float | None = None
    dflash: float | None = None
    medusa: float | None = None


@dataclass(frozen=True)
class JointConfig:
    """`selfspec train heads`: one label pass feeds several heads trained in the same steps (recipes/joint.py).
    The shared sections mean what they mean in a single recipe; each head keeps its own section and is written to
    `out/<head>` (e.g. runs/heads/eagle3) as its own recipe would write it."""

    heads: tuple[str, ...] = JOINT_HEADS  # any non-empty subset of JOINT_HEADS, trained together
    model: str = "default"
    out: str = "runs/heads"  # each head goes to out/<head>
    work_dir: str | None = None  # as RecipeConfig.work_dir (default: derived from `out`)
    data: DataConfig = field(default_factory=DataConfig)
    labels: LabelConfig = field(default_factory=LabelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    head_lr: HeadRates = field(default_factory=HeadRates)
    eagle3: Eagle3Config = field(default_factory=Eagle3Config)
    dflash: DFlashConfig = field(default_factory=DFlashConfig)
    medusa: MedusaConfig = field(default_factory=MedusaConfig)

    def __post_init__(self) -> None:
        unknown = [name for name in self.heads if name not in JOINT_HEADS]
        if not self.heads or unknown or len(set(self.heads)) != len(self.heads):
            raise SelfspecError(f"heads must be distinct names among {', '.join(JOINT_HEADS)}, got {list(self.heads)}")
        if self.medusa.lora is not None:  # Medusa-2 trains the base itself: its labels change as it trains
            raise SelfspecError(
                "a joint recipe trains Medusa-1 only (frozen base): drop medusa.lora, or train "
                "Medusa-2 alone with `selfspec train medusa`"
            )

    def shared_recipe(self) -> RecipeConfig:
        """The recipe the shared stages (data, labels, the trainer's checkpoints) run under."""
        return RecipeConfig(
            "heads",
            self.model,
            self.out,
            self.work_dir,
            self.data,
            self.labels,
            self.train,
            self.eval,
            medusa=self.medusa,
            eagle3=self.eagle3,
            dflash=self.dflash,
        )

    def head_recipe(self, name: str) -> RecipeConfig:
        """Head `name` as its own recipe: its output directory, its learning rate, the shared work directory."""
        rate = getattr(self.head_lr, name)
        return replace(
            self.shared_recipe(),
            drafter=name,
            out=str(Path(self.out) / name),
            work_dir=str(self.work_path),
            train=replace(self.train, lr=self.train.lr if rate is None else rate),
        )

    @property
    def work_path(self) -> Path:
        return self.shared_recipe().work_path


def _read_recipe(path: str | Path, overrides: dict | None) -> dict:
    """A YAML recipe as a mapping, `overrides` (e.g. from CLI flags: {"out": ..., "train.max_steps": 10}) applied."""
    path = Path(path)
    if not path.is_file():
        raise SelfspecError(f"config file '{path}' does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise SelfspecError(f"config file '{path}' is not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise SelfspecError(f"config file '{path}' is not a mapping of recipe keys")
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return data


def load_recipe(path: str | Path, overrides: dict | None = None) -> RecipeConfig:
    """Read a single head's YAML recipe; `overrides` win. A joint recipe (one with `heads:`) is an error here."""
    data = _read_recipe(path, overrides)
    if "heads" in data:
        raise SelfspecError(
            f"{path} is a joint recipe (heads: ...): train it with `selfspec train heads --config {path}`"
        )
    return from_dict(RecipeConfig, data, where=Path(path).name)


def load_joint_recipe(path: str | Path, overrides: dict | None = None) -> JointConfig:
    """Read a joint YAML recipe (`selfspec train heads`); a single head's recipe is an error here."""
    data = _read_recipe(path, overrides)
    if "heads" not in data:
        drafter = data.get("drafter", "medusa")
        raise SelfspecError(
            f"{path} is a '{drafter}' recipe, not a joint one (no `heads:` list): train it with "
            f"`selfspec train {drafter} --config {path}`"
        )
    return from_dict(JointConfig, data, where=Path(path).name)


def tiny_scale(config: RecipeConfig | JointConfig) -> RecipeConfig | JointConfig:
    """The same recipe shrunk to a smoke run of minutes on a CPU (`selfspec train --tiny`): a few conversations,
    short sequences and replies, a handful of steps, one held-out prompt. Model-dependent sizes (layers, draft
    vocabulary) stay as they are. Outputs go beside the real ones with a `-tiny` suffix, so a smoke run never
    leaves its short replies or checkpoints where the real run would resume from them."""
    data, train, evaluation = config.data, config.train, config.eval
    originals = data.original_conversations
    return replace(
        config,
        out=f"{config.out}-tiny",
        work_dir=f"{config.work_dir}-tiny" if config.work_dir else None,
        data=replace(
            data,
            conversations=min(data.conversations or 24, 24),
            original_conversations=0 if originals == 0 else min(originals or 24, 24),  # null (all) too
            max_length=min(data.max_length, 64),
            max_prompt_tokens=min(data.max_prompt_tokens, 48),
            max_new_tokens=min(data.max_new_tokens, 8),
            regenerate_batch_size=min(data.regenerate_batch_size, 8),
            calibration_fraction=0.1,
        ),
        labels=replace(config.labels, shard_examples=min(config.labels.shard_examples, 8)),
        train=replace(
            train,
            batch_size=min(train.batch_size, 2),
            max_steps=min(train.max_steps, 4),
            warmup_steps=min(train.warmup_steps, 1),
            checkpoint_every=2,
            log_every=1,
        ),
        eval=replace(
            evaluation,
            heldout_prompts=min(evaluation.heldout_prompts, 1),
            max_new_tokens=min(evaluation.max_new_tokens, 8),
        ),
    )
