"""One trainer loop for every head.

A head trains through `TrainableHead.training_loss(batch) -> (loss, metrics)`; the loop owns batching, the seeded
data order, AdamW with warm-up + cosine decay, gradient clipping, accelerate (fp32 on CPU, bf16 autocast on GPU,
several GPUs with no code change), a parameter group per part of a head (each its own learning rate and gradient
clipping), an optional time budget (budget.py), the progress bar (loss, first-draft accuracy, token positions per
second, ETA), checkpoints by steps and by time, and `--resume`, after which the run continues exactly as if it had
not stopped.
"""

from __future__ import annotations

import abc
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from ...errors import SelfspecError
from ..clock import running_time
from ..config import TrainConfig
from ..data.labels import LabeledSequence
from .budget import StepBudget
from .checkpoints import (
    CheckpointClock,
    RunProgress,
    latest_checkpoint,
    load_checkpoint,
    run_settings,
    save_checkpoint,
    set_aside,
)


@dataclass(frozen=True)
class ParamGroup:
    """Parameters that share a learning rate and a gradient-norm clip (an AdamW parameter group)."""

    name: str
    params: list[torch.nn.Parameter]
    lr: float | None = None  # None: train.lr


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] long, right-padded with 0
    valid: torch.Tensor  # [B, L] bool: a real token (not padding)
    loss_mask: torch.Tensor  # [B, L] bool: a learnable token
    hidden: dict[int, torch.Tensor]  # layer -> [B, L, H] float32 (empty when the head computes its own)
    topk_ids: torch.Tensor  # [B, L, k] long: the target's top-k after position t
    topk_probs: torch.Tensor  # [B, L, k] float32


class TrainableHead(torch.nn.Module, metaclass=abc.ABCMeta):
    """What the trainer needs from a head: a loss on a batch, and per-head metrics for the progress bar."""

    first_draft_metric: str | None = None  # which metric is the top-1 agreement of the first drafted token

    @abc.abstractmethod
    def training_loss(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """-> (the loss to minimise, metrics for the progress bar); every head's training module defines it."""

    def optimizer_groups(self) -> list[ParamGroup]:
        """The trainable parameters as groups, each with its own learning rate and its own gradient clipping (so one
        part's spike does not throttle the others); by default one group at train.lr."""
        return [ParamGroup("head", [p for p in self.parameters() if p.requires_grad])]

    def forward(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        # The trainer calls the (possibly DDP-wrapped) module, so gradients synchronise across processes.
        return self.training_loss(batch)


def collate(sequences: list[LabeledSequence], device: torch.device) -> Batch:
    width = max(len(s.input_ids) for s in sequences)
    count, k = len(sequences), sequences[0].topk_ids.shape[1]
    where = sequences[0].topk_ids.device  # labels streamed on a GPU stay there

    def padded(shape, dtype):
        return torch.zeros((count, width) + shape, dtype=dtype, device=where)

    batch = Batch(
        padded((), torch.long),
        padded((), torch.bool),
        padded((), torch.bool),
        {},
        padded((k,), torch.long),
        padded((k,), torch.float32),
    )
    for layer, states in sequences[0].hidden.items():
        batch.hidden[layer] = padded((states.shape[1],), torch.float32)
    for row, sequence in enumerate(sequences):
        n = len(sequence.input_ids)
        batch.input_ids[row, :n] = sequence.input_ids
        batch.valid[row, :n] = True
        batch.loss_mask[row, :n] = sequence.loss_mask
        batch.topk_ids[row, :n] = sequence.topk_ids
        batch.topk_probs[row, :n] = sequence.topk_probs.float()
        for layer, states in sequence.hidden.items():
            batch.hidden[layer][row, :n] = states.float()
    return Batch(
        batch.input_ids.to(device),
        batch.valid.to(device),
        batch.loss_mask.to(device),
        {layer: states.to(device) for layer, states in batch.hidden.items()},
        batch.topk_ids.to(device),
        batch.topk_probs.to(device),
    )


@dataclass(frozen=True)
class TrainSummary:
    steps: int
    final_loss: float  # mean over the last log window
    final_metrics: dict[str, float]
    resumed_from: int  # 0 when the run started fresh
    first_draft_accuracy: float | None  # the head's first-draft top-1 agreement at the last step
    tokens: int  # token positions trained over the whole run (resumed parts included), padding excluded
    seconds: float  # wall time of the training loop over the whole run, stops (SIGSTOP) left out
    fetch_seconds: float  # of which getting the batches' sequences (their labelling, when labels are streamed)
    precision: str  # "float32" or "bf16 autocast" (the head's weights stay float32)


def batch_order(count: int, batch_size: int, seed: int, step: int) -> list[int]:
    """The sequence indices of batch `step`: epochs are seeded permutations, so a resumed run sees the same data."""
    per_epoch = max(1, count // batch_size)
    epoch, position = divmod(step, per_epoch)
    order = list(range(count))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order[position * batch_size : (position + 1) * batch_size]


def lr_factors(config: TrainConfig, total_steps: int) -> Callable[[int], float]:
    """The learning rate's factor at each step (see TrainConfig.schedule)."""
    decay_from = total_steps - config.decay_steps  # wsd: the last decay_steps steps decay linearly towards 0

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        if config.schedule == "wsd":
            return 1.0 if step < decay_from else max(0.0, (total_steps - step) / (config.decay_steps + 1))
        progress = (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def train(
    head: TrainableHead,
    sequence_count: int,
    get_sequence: Callable[[int], LabeledSequence],
    config: TrainConfig,
    checkpoint_dir: Path,
    resume: bool = False,
    max_steps: int | None = None,
    get_batch: Callable[[list[int]], list[LabeledSequence]] | None = None,
    branch_from: Path | None = None,
) -> TrainSummary:
    """Train `head` in place for `max_steps` (default config.max_steps) optimizer steps. `get_batch`, when given,
    fetches a batch's sequences at once (streamed labels: one forward of the target for the whole batch).

    `branch_from`: a checkpoint of another run (same data and settings) to continue from, as a branch of it that
    writes its own checkpoints to `checkpoint_dir` (a wsd run's decay from one of its kept steps). With `resume`, a
    branch that already has checkpoints of its own continues from them."""
    if sequence_count == 0:
        raise SelfspecError("no training sequences: check the data source and max_length")
    started, total_steps = running_time(), max_steps or config.max_steps
    clock = CheckpointClock(config, total_steps)
    torch.manual_seed(config.seed)
    on_gpu, accelerator = head_accelerator(head)
    groups = head.optimizer_groups()
    optimizer, scheduler = _optimizer(groups, config, total_steps)
    head, optimizer, scheduler = accelerator.prepare(head, optimizer, scheduler)
    settings = run_settings(config, sequence_count)
    if len(groups) > 1:  # a resumed run must give each part the learning rate it had
        settings["groups"] = {group.name: group.lr for group in groups}
    if not resume and accelerator.is_main_process and (previous := set_aside(checkpoint_dir)):
        tqdm.write(f"starting fresh (no --resume): the earlier run's checkpoints moved to {previous}")
    progress = _start_or_resume(
        checkpoint_dir, resume, accelerator.unwrap_model(head), optimizer, scheduler, settings, branch_from
    )
    if progress.planned_steps:  # a time budget fixed this run's length before it stopped: follow that plan
        planned = min(total_steps, progress.planned_steps)
        total_steps = clock.total_steps = _follow_schedule(scheduler, optimizer, config, planned)
    minutes = None if progress.planned_steps else config.time_budget_minutes
    budget = StepBudget(minutes, total_steps, started, progress.step)
    fetch = get_batch or (lambda indices: [get_sequence(index) for index in indices])
    first_metric = accelerator.unwrap_model(head).first_draft_metric
    resumed_from, seconds_before = progress.step, progress.seconds
    head.train()
    bar = tqdm(  # the ETA is in the postfix, on the run's clock (a stopped process does not stretch it)
        total=total_steps,
        initial=progress.step,
        desc="train",
        unit="step",
        disable=not accelerator.is_main_process,
        bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}{postfix}",
    )
    with bar:
        while progress.step < total_steps:
            step, began = progress.step, running_time()
            sequences = _fetch_batch(fetch, sequence_count, config, step, accelerator, on_gpu)
            fetched = running_time()
            loss, progress.metrics = train_step(
                head,
                collate(sequences, accelerator.device),
                optimizer,
                scheduler,
                accelerator,
                [group.params for group in groups],
                config.grad_clip,
            )
            progress.window_loss = (progress.window_loss + [loss])[-config.log_every :]
            progress.tokens += _count_tokens(sequences, accelerator)
            progress.step, progress.seconds = step + 1, progress.seconds + running_time() - began
            progress.fetch_seconds += fetched - began
            if (planned := budget.plan(progress.step, running_time())) is not None:
                progress.planned_steps = planned
                total_steps = clock.total_steps = bar.total = _follow_schedule(scheduler, optimizer, config, planned)
                tqdm.write(budget.describe())
            if progress.step % config.log_every == 0 or progress.step == total_steps:
                since = (progress.step - resumed_from, progress.seconds - seconds_before)
                bar.set_postfix(_postfix(progress, first_metric, total_steps, since), refresh=False)
            bar.update(1)
            if accelerator.is_main_process and clock.due(progress.step):
                save_checkpoint(
                    checkpoint_dir,
                    accelerator.unwrap_model(head),
                    optimizer,
                    scheduler,
                    progress,
                    settings,
                    kept=config.keep_steps,
                )
                clock.saved()
    head.eval()
    return _summary(progress, total_steps, resumed_from, first_metric, accelerator.mixed_precision == "bf16")


def _fetch_batch(
    fetch: Callable[[list[int]], list[LabeledSequence]],
    sequence_count: int,
    config: TrainConfig,
    step: int,
    accelerator,
    on_gpu: bool,
) -> list[LabeledSequence]:
    """This process's share of step `step`'s batch, fetched (on a GPU, finished: its time belongs to fetching)."""
    indices = batch_order(sequence_count, config.batch_size, config.seed, step)
    # Several processes (GPUs) split each batch; one process takes all of it.
    indices = indices[accelerator.process_index :: accelerator.num_processes] or indices[:1]
    sequences = fetch(indices)
    if on_gpu:  # streamed labels run asynchronously: their time belongs to fetching, not to the step
        torch.cuda.synchronize()
    return sequences


def _optimizer(groups: list[ParamGroup], config: TrainConfig, total_steps: int):
    """AdamW with a parameter group per ParamGroup, and the warm-up + decay schedule over `total_steps`."""
    optimizer = torch.optim.AdamW(
        [{"params": group.params, "lr": config.lr if group.lr is None else group.lr} for group in groups],
        lr=config.lr,
        weight_decay=config.weight_decay,
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factors(config, total_steps))


def _follow_schedule(scheduler, optimizer, config: TrainConfig, total_steps: int) -> int:
    """The schedule rebuilt for a run of `total_steps` (fixed by a time budget), from the step it has reached."""
    lambda_lr = getattr(scheduler, "scheduler", scheduler)  # accelerate wraps it
    lambda_lr.lr_lambdas = [lr_factors(config, total_steps)] * len(optimizer.param_groups)
    _apply_schedule(optimizer, scheduler)
    return total_steps


def _apply_schedule(optimizer, scheduler) -> None:
    """Each group's rate for the next step, from the scheduler's own lambdas at the step it has reached."""
    lambda_lr = getattr(scheduler, "scheduler", scheduler)  # accelerate wraps it
    for group, base, factor in zip(optimizer.param_groups, lambda_lr.base_lrs, lambda_lr.lr_lambdas, strict=True):
        group["lr"] = base * factor(lambda_lr.last_epoch)


def _summary(
    progress: RunProgress, steps: int, resumed_from: int, first_metric: str | None, bf16: bool
) -> TrainSummary:
    return TrainSummary(
        steps=steps,
        final_loss=sum(progress.window_loss) / max(1, len(progress.window_loss)),
        final_metrics=dict(progress.metrics),
        resumed_from=resumed_from,
        first_draft_accuracy=progress.metrics.get(first_metric) if first_metric else None,
        tokens=progress.tokens,
        seconds=progress.seconds,
        fetch_seconds=progress.fetch_seconds,
        precision="bf16 autocast" if bf16 else "float32",
    )


def _start_or_resume(
    directory: Path, resume: bool, head, optimizer, scheduler, settings: dict, branch_from: Path | None = None
) -> RunProgress:
    checkpoint = latest_checkpoint(directory) if resume else None
    if checkpoint is None and branch_from is not None:
        if not branch_from.is_file():
            raise SelfspecError(f"no checkpoint '{branch_from}' to branch from: train the run up to that step first")
        checkpoint = branch_from
    elif resume and checkpoint is None:
        tqdm.write(f"--resume: no checkpoint in {directory}; starting fresh")
    if checkpoint is None:
        return RunProgress()
    progress = load_checkpoint(checkpoint, head, optimizer, scheduler, settings)
    # The next step's rate is this run's schedule's, not the one saved: a branch decays from the step it starts at,
    # and a run resumed with more max_steps follows its longer schedule (with the same schedule they are equal).
    _apply_schedule(optimizer, scheduler)
    tqdm.write(f"resumed from {checkpoint} (step {progress.step}, {progress.tokens:,} token positions trained)")
    return progress


def head_accelerator(head: torch.nn.Module):
    """(on a GPU?, the accelerate Accelerator a head trains under): float32 on a CPU, bf16 autocast on a GPU (the
    head's weights stay float32)."""
    from accelerate import Accelerator

    on_gpu = torch.cuda.is_available() and next(head.parameters()).device.type == "cuda"
    return on_gpu, Accelerator(mixed_precision="bf16" if on_gpu else "no", cpu=not on_gpu)


def train_step(
    head, batch: Batch, optimizer, scheduler, accelerator, clip_groups: list[list[torch.nn.Parameter]], grad_clip: float
) -> tuple[float, dict]:
    """One optimizer step -> (the loss, the head's metrics). The trainer's and the sweep's arms' step alike. Each of
    `clip_groups` (lists of parameters) has its gradient norm clipped to `grad_clip` on its own."""
    with accelerator.autocast():
        loss, metrics = head(batch)
    optimizer.zero_grad(set_to_none=True)
    accelerator.backward(loss)
    if grad_clip > 0:
        for params in clip_groups:
            accelerator.clip_grad_norm_(params, grad_clip)
    optimizer.step()
    scheduler.step()
    return float(loss.detach()), metrics


def _count_tokens(sequences: list[LabeledSequence], accelerator) -> int:
    """The real token positions of the batch (this process's share, summed over the processes)."""
    count = sum(len(sequence.input_ids) for sequence in sequences)
    if accelerator.num_processes > 1:
        count = int(accelerator.reduce(torch.tensor(count, device=accelerator.device), reduction="sum"))
    return count


def _postfix(
    progress: RunProgress, first_metric: str | None, total_steps: int, since: tuple[int, float]
) -> dict[str, str]:
    """The progress bar's numbers: the loss over the log window, the first-draft accuracy, token positions per
    second over the whole run, the ETA at this invocation's pace (`since`: its steps and seconds so far, stops
    left out), then the head's other metrics."""
    shown = {"loss": f"{sum(progress.window_loss) / len(progress.window_loss):.3f}"}
    if first_metric in progress.metrics:
        shown["first_draft_acc"] = f"{progress.metrics[first_metric]:.3f}"
    shown["tok/s"] = f"{progress.tokens / max(progress.seconds, 1e-9):,.0f}"
    steps, seconds = since
    if steps > 0:
        shown["eta"] = tqdm.format_interval((total_steps - progress.step) * seconds / steps)
    shown.update({k: f"{v:.2f}" for k, v in progress.metrics.items() if k != first_metric})
    return shown
