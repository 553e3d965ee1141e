"""`layerskip`: the target drafts for itself with some attention and MLP sublayers skipped (Draft & Verify, SWIFT).

No extra weights: the draft runs the target's own embedding, decoder layers (or halves of them), final norm and LM
head, in the target's own transformers classes, skipping the sublayers named in a tuned skip set. It drafts a chain
autoregressively and stops when its top-1 probability falls under a threshold that adapts to the recent acceptance
rate; where it is unsure it can add its top-2 token as a sibling leaf. Its KV cache holds only the layers it runs,
for the committed tokens and the chain it drafted; after verification it is cut back to what was committed.

A draft token costs a forward through most of the target. Its pacing (`Paced`, heads/paced.py) weighs that time
against the target's plain step: where a draft forward costs a whole plain step or more, no draft token can pay for
itself (it is accepted at most once), and the pause rule rests it for long stretches instead of paying probes at every
step.

Skip sets are data: `selfspec tune layerskip` searches them (Optuna) and writes a JSON file keyed by the model's
fingerprint, which this drafter finds by itself. `skip=every-other` uses the hand-made baseline instead.

Modules: config.py (settings, options, the skip plan), forward.py (the skipping forward), drafter.py (the drafter),
skip_file.py (tuned skip sets on disk).
"""

from .config import LayerSkipOptions, LayerSkipSettings, SkipPlan, every_other_layer
from .drafter import LayerSkipDrafter
from .forward import SkippingForward
from .skip_file import (
    TunedSkipSet,
    find_skip_file,
    fingerprint_key,
    load_skip_file,
    save_skip_file,
    user_skip_path,
)

__all__ = [
    "LayerSkipDrafter",
    "LayerSkipOptions",
    "LayerSkipSettings",
    "SkipPlan",
    "SkippingForward",
    "TunedSkipSet",
    "every_other_layer",
    "find_skip_file",
    "fingerprint_key",
    "load_skip_file",
    "save_skip_file",
    "user_skip_path",
]
