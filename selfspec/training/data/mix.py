"""The mix of a recipe's examples: the calibration part split off, regenerated and original sequences combined, and
the report's account of the mix."""

from __future__ import annotations

import math
import random

from ...errors import SelfspecError
from ..config import DataConfig
from .tokenizing import Example


def split_calibration(examples: list[Example], data: DataConfig) -> tuple[list[Example], list[Example]]:
    """One kind of data: the last `calibration_fraction` (at least one sequence) is the calibration part."""
    if len(examples) < 2:
        raise SelfspecError(f"only {len(examples)} usable training sequences: use more conversations")
    calibration = max(1, math.ceil(len(examples) * data.calibration_fraction))
    return examples[:-calibration], examples[-calibration:]


def mix_examples(
    regenerated: list[Example], original: list[Example], fraction: float, seed: int
) -> tuple[list[Example], list[Example]]:
    """(training, calibration) from both kinds, each given in the sample's seeded order.

    The calibration part (`fraction` of all sequences, at least one) takes the last examples of each kind, as many as
    the kind's share of the sequences (at least one of each once it has two places), and with them the other kind's
    example of the same conversations, so no conversation is both trained on and calibrated on. Each part is then
    shuffled with `seed`, so any stretch of it, such as the first streamed sequences a draft vocabulary is counted
    on, holds both kinds. All of it is a function of the sample's order and the seed: a resumed run gets the same
    data whatever order its regeneration file is in."""
    total = len(regenerated) + len(original)
    places = max(1, math.ceil(total * fraction))
    from_original = round(places * len(original) / max(total, 1))
    if places >= 2 and regenerated and original:
        from_original = min(max(from_original, 1), places - 1)
    from_regenerated = places - from_original
    held = {e.id for e in regenerated[max(0, len(regenerated) - from_regenerated) :]}
    held |= {e.id for e in original[max(0, len(original) - from_original) :]}
    training = [e for e in regenerated + original if e.id not in held]
    calibration = [e for e in regenerated + original if e.id in held]
    rng = random.Random(seed)
    rng.shuffle(training)
    rng.shuffle(calibration)
    return training, calibration


KINDS = ("regenerated", "original")


def data_mix(training: list[Example], calibration: list[Example]) -> dict:
    """The report's `data_mix`: per kind of sequence, how many (and how many of them in the calibration part), their
    real token positions and, of those, the assistant positions the loss covers."""
    mix = {}
    for kind in KINDS:
        chosen = [e for e in training + calibration if e.kind == kind]
        if chosen:
            mix[kind] = {
                "sequences": len(chosen),
                "calibration_sequences": sum(e.kind == kind for e in calibration),
                "positions": sum(len(e.input_ids) for e in chosen),
                "assistant_positions": sum(int(e.loss_mask.sum()) for e in chosen),
            }
    return mix


def describe_mix(mix: dict) -> str:
    """One line: e.g. `data: 9,180 regenerated + 16,700 original sequences (31% / 69% of 12.3M positions); ...`."""
    positions = sum(part["positions"] for part in mix.values())
    calibration = sum(part["calibration_sequences"] for part in mix.values())
    sequences = sum(part["sequences"] for part in mix.values())
    kinds = " + ".join(f"{part['sequences']:,} {kind}" for kind, part in mix.items())
    shares = " / ".join(f"{part['positions'] / max(positions, 1):.0%}" for part in mix.values())
    scale = f"{positions / 1e6:.1f}M" if positions >= 1e6 else f"{positions:,}"
    of = f"{shares} of {scale} positions" if len(mix) > 1 else f"{scale} positions"
    return f"data: {kinds} sequences ({of}); {sequences - calibration:,} training, {calibration:,} calibration"
