"""Drafters, one module each. Importing this package registers every built-in drafter."""

from . import dflash, eagle, layerskip, medusa, ngram, none  # noqa: F401  (registration side effect)
from .base import DraftRequest, Drafter, Observation, create_drafter, drafter_names, register_drafter

__all__ = ["DraftRequest", "Drafter", "Observation", "create_drafter", "drafter_names", "register_drafter"]
