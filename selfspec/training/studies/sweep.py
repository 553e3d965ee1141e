"""A short measured sweep of an EAGLE-family recipe's learning rate and warm-up: one copy of the head per setting
(an "arm"), all from the same initial weights, trained in lockstep on the same batches of the recipe's labelled
sample (all its sequences with cached labels; with streamed labels the first 256, which are labelled once and kept,
so the sweep costs no labelling), one pass at most, each arm with its own schedule (warm-up, then the wsd shape: the
full rate, then a linear decay over the last fifth, so each arm ends as a finished short run), then measured on the
recipe's calibration sequences, which no arm trained on. What a long recipe's `train.lr` and `train.warmup_steps`
are chosen by (scripts/train_sweep.py writes the table)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
from tqdm.auto import tqdm

from ...errors import SelfspecError
from ...models import Target
from ..clock import running_time
from ..config import RecipeConfig
from ..data.labels import label_sequence
from ..data.prepare import recipe_data
from ..recipes.eagle import EagleTraining, eagle_family, new_eagle_head
from ..trainer.loop import batch_order, collate, head_accelerator, lr_factors, train_step


@dataclass(frozen=True)
class Arm:
    lr: float
    warmup_steps: int

    @property
    def name(self) -> str:
        return f"lr {self.lr:g}, warm-up {self.warmup_steps}"


def parse_arms(text: str) -> list[Arm]:
    """'3e-4:30,1e-3:30' -> arms (learning rate : warm-up steps)."""
    arms = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        lr, _, warmup = item.partition(":")
        try:
            arm = Arm(float(lr), int(warmup))
        except ValueError:
            raise SelfspecError(f"sweep arm '{item}' is not LR:WARMUP (e.g. 1e-3:30)") from None
        if arm.lr <= 0 or arm.warmup_steps < 0:
            raise SelfspecError(f"sweep arm '{item}': the learning rate must be > 0 and the warm-up >= 0")
        arms.append(arm)
    if not arms:
        raise SelfspecError("no sweep arms given: e.g. --arms 3e-4:30,1e-3:30,3e-3:30")
    return arms


def sweep(target: Target, config: RecipeConfig, arms: list[Arm], steps: int, calibration_sequences: int = 64) -> dict:
    """Train one head per arm for `steps` steps in lockstep -> {"rows": per arm: its settings, its last training
    losses, its calibration loss and top-1 agreements at draft steps 1..U, its seconds; "positions" trained}."""
    if config.drafter not in ("eagle", "eagle3"):
        raise SelfspecError(f"the sweep trains EAGLE-family heads (eagle, eagle3), not '{config.drafter}'")
    if steps < 5:
        raise SelfspecError(f"a sweep needs at least 5 steps, got {steps}")
    eagle, head_cls, layers = eagle_family(target, config)
    timings: dict = {}
    data = recipe_data(target, config, layers, timings)
    sample, batch_size = data.train.sample, config.train.batch_size
    if steps * batch_size > len(sample):
        raise SelfspecError(
            f"{steps} steps of {batch_size} need {steps * batch_size} sequences and the labelled sample holds "
            f"{len(sample)}: at most {len(sample) // batch_size} steps (the sweep makes one pass, no repeats)"
        )
    torch.manual_seed(config.train.seed)
    eagle, first = new_eagle_head(target, eagle, head_cls, data.train.sample)
    _, accelerator = head_accelerator(first)  # the recipe's precision: float32 on a CPU, bf16 autocast on a GPU
    runs = []
    for arm in arms:
        head = copy.deepcopy(first)  # every arm starts from the same weights
        trainable = [p for p in head.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=arm.lr, weight_decay=config.train.weight_decay)
        schedule = replace(
            config.train, lr=arm.lr, warmup_steps=arm.warmup_steps, schedule="wsd", decay_steps=max(1, steps // 5)
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factors(schedule, steps))
        module, optimizer, scheduler = accelerator.prepare(EagleTraining(head, eagle).train(), optimizer, scheduler)
        runs.append(
            {"arm": arm, "step": (module, optimizer, scheduler, accelerator, [trainable]), "seconds": 0.0, "losses": []}
        )
    positions = 0
    for step in tqdm(range(steps), desc=f"sweep ({len(arms)} arms)", unit="step"):
        sequences = [sample[i] for i in batch_order(len(sample), batch_size, config.train.seed, step)]
        batch = collate(sequences, accelerator.device)
        positions += sum(len(sequence.input_ids) for sequence in sequences)
        for run in runs:
            began = running_time()
            torch.manual_seed(config.train.seed * 1_000_003 + step)  # the same feature noise for every arm
            module, optimizer, scheduler, accelerator, clip_groups = run["step"]
            loss, _ = train_step(module, batch, optimizer, scheduler, accelerator, clip_groups, config.train.grad_clip)
            run["losses"].append(loss)
            run["seconds"] += running_time() - began
    calibration = _calibration_batches(target, data, config, calibration_sequences)
    rows = []
    for run in runs:
        measured = _measure(run["step"][0], calibration)
        rows.append(
            {
                "lr": run["arm"].lr,
                "warmup_steps": run["arm"].warmup_steps,
                "train_loss_last10": round(sum(run["losses"][-10:]) / len(run["losses"][-10:]), 4),
                **measured,
                "train_s": round(run["seconds"], 1),
            }
        )
    return {"steps": steps, "positions": positions, "sample_sequences": len(sample), "rows": rows}


def _calibration_batches(target: Target, data, config: RecipeConfig, count: int) -> list:
    """The first `count` calibration sequences, labelled, in batches of the recipe's batch size."""
    examples = data.calibration_examples[:count]
    if not examples:
        raise SelfspecError("no calibration sequences to measure the sweep on: raise data.calibration_fraction")
    layers = tuple(data.train.sample[0].hidden)  # the layers the head reads, as the training labels hold them
    labelled = [label_sequence(target, example, layers, config.labels.top_k) for example in examples]
    size = config.train.batch_size
    return [collate(labelled[i : i + size], target.device) for i in range(0, len(labelled), size)]


def _measure(module: EagleTraining, batches: list) -> dict:
    """Calibration loss and top-1 agreements (draft steps 1..U, teacher-forced at step 1), weighted by batch."""
    module.eval()
    totals: dict[str, float] = {}
    with torch.no_grad():
        for batch in batches:
            loss, metrics = module(batch)
            for key, value in {"calibration_loss": float(loss), **metrics}.items():
                totals[key] = totals.get(key, 0.0) + value
    module.train()
    return {key: round(value / len(batches), 4) for key, value in totals.items()}
