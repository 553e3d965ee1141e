"""selfspec: lossless self-speculative decoding with drafters attached to the target model itself."""

# Importing selfspec changes nothing in the process's environment: its defaults (offline hub, bounded oneDNN kernel
# caches) are applied when a target is loaded (models.apply_environment_defaults). Nor does it import torch: each name
# below is imported from its module when first used (PEP 562), so that `selfspec --help` and a command's bad arguments
# answer at once (0.1 s) instead of after torch and transformers have loaded (4 s on the 2-core EPYC).
import importlib

_SOURCES = {
    ".api": ("SelfSpec", "TextStream"),
    ".cost": ("CostCurve", "load_cost_curve", "measure_cost_curve"),
    ".decoding": ("GenerationResult", "GenerationStats", "speculative_generate"),
    ".errors": ("SelfspecError",),
    ".heads": ("Drafter", "DraftRequest", "Observation", "create_drafter", "drafter_names", "register_drafter"),
    ".models": ("ModelFingerprint", "Target", "load_target"),
    ".sampling": ("SamplingConfig", "logits_to_probs"),
    ".tree_attention": ("DraftTree", "VerifyResult", "verify"),
}
_MODULE_OF = {name: module for module, names in _SOURCES.items() for name in names}


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'selfspec' has no attribute '{name}'")
    value = getattr(importlib.import_module(_MODULE_OF[name], __name__), name)
    globals()[name] = value  # later lookups find it at once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))


__version__ = "0.1.0"

__all__ = sorted(_MODULE_OF)
