"""selfspec: lossless self-speculative decoding with drafters attached to the target model itself."""

# Importing selfspec changes nothing in the process's environment: its defaults (offline hub, bounded oneDNN kernel
# caches) are applied when a target is loaded (models.apply_environment_defaults).
from .api import SelfSpec, TextStream
from .cost import CostCurve, load_cost_curve, measure_cost_curve
from .decoding import GenerationResult, GenerationStats, speculative_generate
from .errors import SelfspecError
from .heads import Drafter, DraftRequest, Observation, create_drafter, drafter_names, register_drafter
from .models import ModelFingerprint, Target, load_target
from .sampling import SamplingConfig, logits_to_probs
from .tree_attention import DraftTree, VerifyResult, verify

__version__ = "0.1.0"

__all__ = [
    "CostCurve",
    "DraftRequest",
    "DraftTree",
    "Drafter",
    "GenerationResult",
    "GenerationStats",
    "ModelFingerprint",
    "Observation",
    "SamplingConfig",
    "SelfSpec",
    "SelfspecError",
    "Target",
    "TextStream",
    "VerifyResult",
    "create_drafter",
    "drafter_names",
    "load_cost_curve",
    "load_target",
    "logits_to_probs",
    "measure_cost_curve",
    "register_drafter",
    "speculative_generate",
    "verify",
]
