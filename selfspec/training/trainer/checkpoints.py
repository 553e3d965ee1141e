"""Trainer checkpoints: everything a stopped run needs to continue exactly as if it had not stopped.

A checkpoint holds the head's trainable weights, the optimizer and scheduler states, the RNG states (CPU and CUDA),
the progress numbers (step, token positions trained, seconds, the loss window) and the settings that fix the data
order and the optimisation. It is written atomically (a temporary file renamed over the name), so a run killed at
any moment (SIGKILL included) leaves the previous checkpoints intact; the newest two are kept, and those of the
steps in `keep_steps` (the points a scaling study branches from) are never pruned.

When one is due: every `checkpoint_every` steps or after `checkpoint_minutes`, whichever comes first, at each of
`keep_steps`, and at the end.
"""

from __future__ import annotations

import glob
import pickle
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from time import monotonic

import torch

from ...errors import SelfspecError
from ...files import atomic_write
from ..config import TrainConfig

# Settings a resumed run must share with the checkpoint: they fix the data order and the optimisation so far.
# (max_steps may grow, to train on, and so may a wsd run's decay_steps; checkpoint and log intervals, and the steps
# kept, may change freely.)
RUN_SETTINGS = ("seed", "batch_size", "lr", "weight_decay", "warmup_steps", "grad_clip", "schedule")


@dataclass
class RunProgress:
    """What a run has done so far, over all its invocations: saved in each checkpoint, so the numbers continue."""

    step: int = 0
    tokens: int = 0  # token positions trained: the real tokens of every batch, padding excluded
    seconds: float = 0.0  # wall time in the training loop, stops (SIGSTOP) left out (clock.running_time)
    fetch_seconds: float = 0.0  # of which getting the batches' sequences (labelling them, with labels.storage: stream)
    window_loss: list[float] = field(default_factory=list)  # the last log_every losses
    metrics: dict[str, float] = field(default_factory=dict)  # the head's metrics at the last step
    planned_steps: int | None = None  # the run's total steps, once a time budget fixed them (budget.py)


def run_settings(config: TrainConfig, sequence_count: int) -> dict:
    return {"sequences": sequence_count, **{name: getattr(config, name) for name in RUN_SETTINGS}}


class CheckpointClock:
    """Says when a checkpoint is due: every `checkpoint_every` steps or `checkpoint_minutes` after the last one
    (or the start), whichever comes first, and after the last step."""

    def __init__(self, config: TrainConfig, total_steps: int):
        self.every, self.total_steps = config.checkpoint_every, total_steps
        self.kept = set(config.keep_steps)
        self.seconds = config.checkpoint_minutes * 60
        self.last = monotonic()

    def due(self, steps_done: int) -> bool:
        timed = self.seconds > 0 and monotonic() - self.last >= self.seconds
        return timed or steps_done % self.every == 0 or steps_done == self.total_steps or steps_done in self.kept

    def saved(self) -> None:
        self.last = monotonic()


def latest_checkpoint(directory: Path) -> Path | None:
    found = sorted(glob.glob(str(directory / "step-*.pt")), key=lambda name: int(Path(name).stem.split("-")[1]))
    return Path(found[-1]) if found else None


def set_aside(directory: Path) -> Path | None:
    """A fresh start where an earlier run left checkpoints: move them to `<directory>.previous` (replacing an older
    one), so the new run's checkpoints never mix with them and a forgotten --resume loses nothing."""
    if latest_checkpoint(directory) is None:
        return None
    previous = directory.with_name(directory.name + ".previous")
    shutil.rmtree(previous, ignore_errors=True)
    directory.rename(previous)
    return previous


def trainable_state(head: torch.nn.Module) -> dict[str, torch.Tensor]:
    names = {name for name, p in head.named_parameters() if p.requires_grad}
    return {
        name: tensor.detach().cpu()
        for name, tensor in head.state_dict().items()
        if name in names or name.endswith("draft_vocab")
    }


def save_checkpoint(
    directory: Path,
    head,
    optimizer,
    scheduler,
    progress: RunProgress,
    settings: dict,
    keep: int = 2,
    kept: tuple[int, ...] = (),
) -> Path:
    """Write step-<n>.pt; prune all but the newest `keep`, except the steps in `kept`."""
    state = {
        "step": progress.step,
        "head": trainable_state(head),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "progress": asdict(progress),
        "settings": settings,
    }
    path = atomic_write(directory / f"step-{progress.step}.pt", lambda temp: torch.save(state, temp))
    prunable = [p for p in directory.glob("step-*.pt") if int(p.stem.split("-")[1]) not in kept]
    for old in sorted(prunable, key=lambda p: int(p.stem.split("-")[1]))[:-keep]:
        old.unlink()
    return path


def load_checkpoint(path: Path, head, optimizer, scheduler, settings: dict) -> RunProgress:
    """Restore a checkpoint into the head, optimizer, scheduler and RNGs -> the run's progress at that point.
    A checkpoint of another head or another recipe is a one-line error, never a silent partial load."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except (pickle.UnpicklingError, EOFError, RuntimeError, OSError) as error:  # not a checkpoint (or not ours)
        raise SelfspecError(
            f"checkpoint '{path}' cannot be read ({type(error).__name__}): start without --resume"
        ) from None
    _check_compatible(path, state, head, settings)
    # Frozen base weights are not in checkpoints: keep the head's own, and load the whole set strictly.
    head.load_state_dict({**head.state_dict(), **state["head"]}, strict=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    if state.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return RunProgress(**{**state.get("progress", {}), "step": int(state["step"])})


def _check_compatible(path: Path, state: dict, head, settings: dict) -> None:
    own = trainable_state(head)
    missing = set(own) - set(state["head"])
    if missing:
        raise SelfspecError(
            f"checkpoint '{path}' does not match this head (missing {sorted(missing)[:3]}): start without --resume"
        )
    unexpected = set(state["head"]) - set(head.state_dict())
    if unexpected:
        raise SelfspecError(
            f"checkpoint '{path}' holds weights this head lacks ({sorted(unexpected)[:3]}): start without --resume"
        )
    reshaped = [name for name, tensor in own.items() if tensor.shape != state["head"][name].shape]
    if reshaped:
        name = reshaped[0]
        raise SelfspecError(
            f"checkpoint '{path}' has {name} of shape {list(state['head'][name].shape)}, this head "
            f"{list(own[name].shape)}: start without --resume"
        )
    for key, value in (state.get("settings") or {}).items():
        if settings.get(key) != value:
            what = "training sequences" if key == "sequences" else f"train.{key}"
            raise SelfspecError(
                f"checkpoint '{path}' was made with {what} {value}, this run has {settings.get(key)}: "
                "restore the recipe, or start without --resume"
            )
