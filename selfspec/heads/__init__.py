"""Drafters, one module each. Importing this package registers every built-in drafter."""

from . import auto, dflash, eagle, layerskip, lookup, medusa, none  # noqa: F401  (registration side effect)
from .base import (
    Drafter,
    DrafterEntry,
    DraftRequest,
    Observation,
    create_drafter,
    drafter_entry,
    drafter_names,
    parse_drafter_options,
    register_drafter,
    unregister_drafter,
)

__all__ = [
    "DraftRequest",
    "Drafter",
    "DrafterEntry",
    "Observation",
    "create_drafter",
    "drafter_entry",
    "drafter_names",
    "parse_drafter_options",
    "register_drafter",
    "unregister_drafter",
]
