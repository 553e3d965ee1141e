"""One trainer loop for every head.

A head trains through `TrainableHead.training_loss(batch) -> (loss, metrics)`; the loop owns batching, the seeded
data order, AdamW with warm-up + cosine decay, gradient clipping, accelerate (fp32 on CPU, bf16 autocast on GPU,
several GPUs with no code change), the progress bar, periodic checkpoints and `--resume`.
"""

from __future__ import annotations

import abc
import glob
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from ..errors import SelfspecError
from ..files import atomic_write
from .config import TrainConfig
from .labels import LabeledSequence


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

    @abc.abstractmethod
    def training_loss(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """-> (the loss to minimise, metrics for the progress bar); every head's training module defines it."""

    def forward(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        # The trainer calls the (possibly DDP-wrapped) module, so gradients synchronise across processes.
        return self.training_loss(batch)


def collate(sequences: list[LabeledSequence], device: torch.device) -> Batch:
    width = max(len(s.input_ids) for s in sequences)
    count, k = len(sequences), sequences[0].topk_ids.shape[1]

    def padded(shape, dtype):
        return torch.zeros((count, width) + shape, dtype=dtype)

    batch = Batch(padded((), torch.long), padded((), torch.bool), padded((), torch.bool), {}, padded((k,), torch.long), padded((k,), torch.float32))
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
        batch.input_ids.to(device), batch.valid.to(device), batch.loss_mask.to(device),
        {layer: states.to(device) for layer, states in batch.hidden.items()},
        batch.topk_ids.to(device), batch.topk_probs.to(device),
    )


@dataclass(frozen=True)
class TrainSummary:
    steps: int
    final_loss: float  # mean over the last log window
    final_metrics: dict[str, float]
    resumed_from: int  # 0 when the run started fresh


def _batch_order(count: int, batch_size: int, seed: int, step: int) -> list[int]:
    """The sequence indices of batch `step`: epochs are seeded permutations, so a resumed run sees the same data."""
    per_epoch = max(1, count // batch_size)
    epoch, position = divmod(step, per_epoch)
    order = list(range(count))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order[position * batch_size : (position + 1) * batch_size]


def _latest_checkpoint(directory: Path) -> Path | None:
    found = sorted(glob.glob(str(directory / "step-*.pt")), key=lambda name: int(Path(name).stem.split("-")[1]))
    return Path(found[-1]) if found else None


def train(
    head: TrainableHead,
    sequence_count: int,
    get_sequence: Callable[[int], LabeledSequence],
    config: TrainConfig,
    checkpoint_dir: Path,
    resume: bool = False,
    max_steps: int | None = None,
) -> TrainSummary:
    """Train `head` in place for `max_steps` (default config.max_steps) optimizer steps."""
    from accelerate import Accelerator

    if sequence_count == 0:
        raise SelfspecError("no training sequences: check the data source and max_length")
    total_steps = max_steps or config.max_steps
    torch.manual_seed(config.seed)
    on_gpu = torch.cuda.is_available() and next(head.parameters()).device.type == "cuda"
    accelerator = Accelerator(mixed_precision="bf16" if on_gpu else "no", cpu=not on_gpu)
    trainable = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay)

    def schedule(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    head, optimizer, scheduler = accelerator.prepare(head, optimizer, scheduler)
    start_step = 0
    checkpoint = _latest_checkpoint(checkpoint_dir) if resume else None
    if resume and checkpoint is None:
        tqdm.write(f"--resume: no checkpoint in {checkpoint_dir}; starting fresh")
    if checkpoint is not None:
        start_step = _load_checkpoint(checkpoint, accelerator.unwrap_model(head), optimizer, scheduler)
        tqdm.write(f"resumed from {checkpoint} (step {start_step})")
    window_loss: list[float] = []
    metrics: dict[str, float] = {}
    head.train()
    with tqdm(total=total_steps, initial=start_step, desc="train", unit="step", disable=not accelerator.is_main_process) as bar:
        for step in range(start_step, total_steps):
            indices = _batch_order(sequence_count, config.batch_size, config.seed, step)
            # Several processes (GPUs) split each batch; one process takes all of it.
            indices = indices[accelerator.process_index :: accelerator.num_processes] or indices[:1]
            batch = collate([get_sequence(i) for i in indices], accelerator.device)
            with accelerator.autocast():
                loss, metrics = head(batch)
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            if config.grad_clip > 0:
                accelerator.clip_grad_norm_(trainable, config.grad_clip)
            optimizer.step()
            scheduler.step()
            window_loss = (window_loss + [float(loss.detach())])[-config.log_every :]
            if (step + 1) % config.log_every == 0 or step + 1 == total_steps:
                bar.set_postfix(loss=f"{sum(window_loss) / len(window_loss):.3f}", **{k: f"{v:.2f}" for k, v in metrics.items()})
            bar.update(1)
            if accelerator.is_main_process and ((step + 1) % config.checkpoint_every == 0 or step + 1 == total_steps):
                _save_checkpoint(checkpoint_dir, step + 1, accelerator.unwrap_model(head), optimizer, scheduler)
    head.eval()
    final = sum(window_loss) / max(1, len(window_loss))
    return TrainSummary(steps=total_steps, final_loss=final, final_metrics=dict(metrics), resumed_from=start_step)


def _trainable_state(head: torch.nn.Module) -> dict[str, torch.Tensor]:
    names = {name for name, p in head.named_parameters() if p.requires_grad}
    return {name: tensor.detach().cpu() for name, tensor in head.state_dict().items() if name in names or name.endswith("draft_vocab")}


def _save_checkpoint(directory: Path, step: int, head, optimizer, scheduler, keep: int = 2) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    state = {
        "step": step,
        "head": _trainable_state(head),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "torch_rng": torch.get_rng_state(),
    }
    atomic_write(directory / f"step-{step}.pt", lambda temp: torch.save(state, temp))
    for old in sorted(directory.glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1]))[:-keep]:
        old.unlink()


def _load_checkpoint(path: Path, head, optimizer, scheduler) -> int:
    state = torch.load(path, map_location="cpu", weights_only=False)
    missing = set(_trainable_state(head)) - set(state["head"])
    if missing:
        raise SelfspecError(f"checkpoint '{path}' does not match this head (missing {sorted(missing)[:3]}): start without --resume")
    unexpected = set(state["head"]) - set(head.state_dict())
    if unexpected:
        raise SelfspecError(f"checkpoint '{path}' holds weights this head lacks ({sorted(unexpected)[:3]}): start without --resume")
    # Frozen base weights are not in checkpoints: keep the head's own, and load the whole set strictly.
    head.load_state_dict({**head.state_dict(), **state["head"]}, strict=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    return int(state["step"])
