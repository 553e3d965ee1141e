"""`selfspec train heads --config ...`: one label pass feeds EAGLE-3, DFlash and Medusa-1, trained in the same steps.

Each single recipe runs the target over its data for its own labels. Here one target forward per batch (or one label
cache) records the union of the layers the heads read (EAGLE-3's and DFlash's feature layers, Medusa's last hidden
state) and the top-k distribution, and every head trains on that batch in the same optimizer step: the loss is the sum
of the heads' own losses (EagleTraining, DFlashTraining, MedusaTraining as their recipes use them), each head its own
AdamW parameter group with its own learning rate and gradient clipping. The stages before and after are the single
recipes' own: data and labels (data/prepare.py), the trainer (checkpoints, --resume, the time budget), then each head
saved, reported and evaluated exactly as its recipe does, into out/<head>.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ...heads.dflash import resolve_feature_layers
from ...heads.eagle import Eagle3Head, resolve_eagle3_layers
from ...models import Target, load_target
from ..clock import running_time
from ..config import JointConfig
from ..data.prepare import RecipeData, recipe_data
from ..trainer.loop import Batch, ParamGroup, TrainableHead, TrainSummary
from ..trainer.pipeline import finish_report, save_trained_head, train_head
from .dflash import DFlashTraining, new_dflash_head
from .eagle import EagleTraining, check_eagle, new_eagle_head
from .medusa import LAYERS as MEDUSA_LAYERS
from .medusa import MedusaTraining, check_medusa, new_medusa_heads, save_medusa


@dataclass(frozen=True)
class Part:
    """One head of a joint run: its training module, the head inside it, and its config as saved."""

    module: TrainableHead
    head: torch.nn.Module
    config: object  # Eagle3Config | DFlashConfig | MedusaConfig, resolved as the head's own recipe saves it


class JointTraining(TrainableHead):
    """The heads' losses summed; metrics reported per head, prefixed with its name (`eagle3.top1`, `medusa.loss`)."""

    def __init__(self, parts: dict[str, TrainableHead], rates: dict[str, float | None]):
        super().__init__()
        self.parts = torch.nn.ModuleDict(parts)
        self.rates = rates
        first = next(iter(parts))
        self.first_draft_metric = f"{first}.{parts[first].first_draft_metric}"

    def training_loss(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        total, metrics = 0.0, {}
        for name, part in self.parts.items():
            loss, own = part.training_loss(batch)
            total = total + loss
            metrics[f"{name}.loss"] = float(loss.detach())
            metrics.update({f"{name}.{key}": value for key, value in own.items()})
        return total, metrics

    def optimizer_groups(self) -> list[ParamGroup]:
        return [
            ParamGroup(name, [p for p in part.parameters() if p.requires_grad], self.rates[name])
            for name, part in self.parts.items()
        ]


def joint_layers(config: JointConfig, num_layers: int) -> tuple[int, ...]:
    """The union of the target layers the heads read: what the one label pass records."""
    layers: set[int] = set()
    if "eagle3" in config.heads:
        layers.update(resolve_eagle3_layers(config.eagle3, num_layers))
    if "dflash" in config.heads:
        layers.update(resolve_feature_layers(config.dflash, num_layers))
    if "medusa" in config.heads:
        layers.update(MEDUSA_LAYERS)
    return tuple(sorted(layers))


def new_parts(target: Target, config: JointConfig, data: RecipeData) -> dict[str, Part]:
    """Fresh heads, each built as its recipe builds it, over the same labelled sample (their draft vocabularies)."""
    sample, parts = data.train.sample, {}
    for name in config.heads:
        if name == "eagle3":
            eagle, head = new_eagle_head(target, config.eagle3, Eagle3Head, sample)
            parts[name] = Part(EagleTraining(head, eagle), head, eagle)
        elif name == "dflash":
            layers = resolve_feature_layers(config.dflash, target.config.num_hidden_layers)
            dflash, head = new_dflash_head(target, config.dflash, layers, sample)
            parts[name] = Part(DFlashTraining(head, dflash), head, dflash)
        else:
            heads = new_medusa_heads(target, config.medusa, sample)
            parts[name] = Part(MedusaTraining(heads, config.medusa.head_decay), heads, config.medusa)
    return parts


def head_summary(summary: TrainSummary, name: str, first_metric: str | None) -> TrainSummary:
    """The joint run's summary as head `name`'s own: its metrics unprefixed, its loss at the last step as final_loss
    (the joint window's mean is of the sum of the heads' losses)."""
    prefix = f"{name}."
    own = {key[len(prefix) :]: value for key, value in summary.final_metrics.items() if key.startswith(prefix)}
    loss = own.pop("loss", summary.final_loss)
    return replace(
        summary,
        final_loss=loss,
        final_metrics=own,
        first_draft_accuracy=own.get(first_metric) if first_metric else None,
    )


def run_joint(config: JointConfig, resume: bool = False, max_steps: int | None = None) -> dict[str, dict]:
    """Train every head of `config` from one label pass -> {head: its report}, each also written to
    out/<head>/training_report.json beside the weights, with its held-out evaluation."""
    check_eagle("eagle3", config.eagle3)
    check_medusa(config.medusa)
    torch.manual_seed(config.train.seed)
    timings: dict[str, float] = {}
    start = running_time()
    target = load_target(config.model, four_bit=False)
    shared = config.shared_recipe()
    layers = joint_layers(config, target.config.num_hidden_layers)
    data = recipe_data(target, shared, layers, timings, label_calibration="medusa" in config.heads)
    parts = new_parts(target, config, data)
    rates = {name: config.head_recipe(name).train.lr for name in parts}
    module = JointTraining({name: part.module for name, part in parts.items()}, rates)
    summary = train_head(module, data, shared, resume, max_steps, timings)
    joint = {
        "heads": list(config.heads),
        "label_passes": 1,
        "layers": list(layers),
        "final_loss_sum": round(summary.final_loss, 4),  # the heads' losses summed, mean over the last log window
        "learning_rates": rates,
    }
    reports = {}
    for name, part in parts.items():
        recipe = config.head_recipe(name)
        own = head_summary(summary, name, part.module.first_draft_metric)
        if name == "medusa":
            report = save_medusa(target, recipe, part.head, data, own)
        elif name == "dflash":
            feature_layers = list(part.head.feature_layers)
            report = save_trained_head(target, recipe, part.head, part.config, data, own, feature_layers=feature_layers)
        else:
            report = save_trained_head(target, recipe, part.head, part.config, data, own)
        reports[name] = dict(report, joint=joint)
    return {name: finish_report(config.head_recipe(name), reports[name], dict(timings), start) for name in parts}
