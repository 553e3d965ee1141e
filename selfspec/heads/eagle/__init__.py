"""The EAGLE drafters: `eagle` (an EAGLE-1 head on the LM head's input) and `eagle3` (the EAGLE-3 head, in the layout
vLLM loads through the speculators format), one drafting loop (EAGLE-2 tree growth) for both."""

from .drafter import EagleConfig, EagleDrafter, EagleFamilyHead, EagleHead, EagleOptions, Frontier, grow_tree
from .eagle3 import (
    Eagle3Config,
    Eagle3Drafter,
    Eagle3Head,
    Eagle3Options,
    eagle3_layers,
    resolve_eagle3_layers,
)

__all__ = [
    "Eagle3Config",
    "Eagle3Drafter",
    "Eagle3Head",
    "Eagle3Options",
    "EagleConfig",
    "EagleDrafter",
    "EagleFamilyHead",
    "EagleHead",
    "EagleOptions",
    "Frontier",
    "eagle3_layers",
    "grow_tree",
    "resolve_eagle3_layers",
]
