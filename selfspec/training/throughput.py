"""How fast each stage of a recipe ran, for `training_report.json`: token positions per second of regeneration
(new tokens generated), labelling (positions the target labelled) and training (real positions trained, padding
excluded), with the seconds and counts behind each rate, the dtype and autocast it ran in, and the machine."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..execution.capabilities import describe_cpu


@dataclass
class StageCount:
    """Filled in by a stage as it works: what it did in this invocation (work an earlier, interrupted invocation
    already did is kept on disk and not counted again)."""

    tokens: int = 0
    seconds: float = 0.0
    sequences: int = 0


def stage_entry(
    counts: str, tokens: int, seconds: float, dtype: torch.dtype | str, autocast: str | None = None, **extra
) -> dict:
    """One stage's line in the report; `counts` says what its tokens are."""
    return {
        "counts": counts,
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
        "dtype": str(dtype).removeprefix("torch."),
        "autocast": autocast,
        **extra,
    }


def machine(device: torch.device) -> str:
    """The device the stages ran on, in words: the GPU's name, or the CPU's model, widest instruction set and cores."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (cuda)"
    return f"{describe_cpu()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
