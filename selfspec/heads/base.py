"""The drafter interface and registry.

A drafter proposes a `DraftTree` from what it has observed, and is told what was committed after each step. It never
touches the target's KV cache or the verifier, and the verifier never knows which drafter made the tree.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar

import torch

from ..cost import CostCurve, load_cost_curve
from ..errors import SelfspecError
from ..models import Target
from ..sampling import SamplingConfig
from ..tree_attention import DraftTree, VerifyResult


@dataclass(frozen=True)
class DraftRequest:
    """What the loop asks for at each step."""

    root_token: int  # the last committed token: node 0 of the tree to propose
    max_depth: int  # deepest node the loop can use (max_new_tokens and context budget); 0 means no draft
    sampling: SamplingConfig
    generator: torch.Generator | None  # draw any random draft tokens from this, so runs are reproducible


@dataclass(frozen=True)
class Observation:
    """What the drafter learns after the prefill (result is None) or after a verified step."""

    new_tokens: tuple[int, ...]  # tokens just committed (after the prefill: the whole prompt)
    hidden: dict[int, torch.Tensor]  # layer -> [m, H] at the forwarded committed positions (see below)
    result: VerifyResult | None  # the step's verification, None after the prefill
    tree: DraftTree | None  # the tree that was verified, None after the prefill
    # hidden rows: after the prefill, the prompt minus its last token; after a step, the accepted path's nodes
    # (root first). The target's extra token is never forwarded in the step that produced it.


class Drafter(ABC):
    """Base class. Subclasses set `hidden_layers` if they need target hidden states in `observe`."""

    name: ClassVar[str] = ""
    hidden_layers: tuple[int, ...] = ()  # indices into the target's hidden_states; -1 is the LM head's input

    def __init__(self, target: Target, cost_curve: CostCurve):
        self.target = target
        self.cost_curve = cost_curve

    @classmethod
    def load(cls, target: Target, heads_dir: Path | None, cost_curve: CostCurve, **options) -> "Drafter":
        """Build the drafter for `target`. Drafters without trained parts reject a heads directory."""
        if heads_dir is not None:
            raise SelfspecError(f"drafter '{cls.name}' has no trained heads: drop --heads")
        try:
            return cls(target, cost_curve, **options)
        except TypeError as error:
            raise SelfspecError(f"bad option for drafter '{cls.name}': {error}") from None

    def reset(self) -> None:
        """Forget everything about the previous sequence."""

    @abstractmethod
    def propose(self, request: DraftRequest) -> DraftTree:
        """A tree whose root is `request.root_token`, no deeper than `request.max_depth`."""

    def observe(self, observation: Observation) -> None:
        """Update the drafter's own state (its caches, its window of hidden states, its statistics)."""


_REGISTRY: dict[str, type[Drafter]] = {}


def register_drafter(name: str) -> Callable[[type[Drafter]], type[Drafter]]:
    def decorate(cls: type[Drafter]) -> type[Drafter]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"drafter name '{name}' is already registered to {_REGISTRY[name].__name__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def drafter_names() -> list[str]:
    return sorted(_REGISTRY)


def create_drafter(name: str, target: Target, heads_dir: str | Path | None = None, **options) -> Drafter:
    if name not in _REGISTRY:
        raise SelfspecError(f"unknown drafter '{name}': choose one of {', '.join(drafter_names())}")
    if heads_dir is not None and not Path(heads_dir).exists():  # a directory, or a file for tuned data (layerskip)
        raise SelfspecError(f"heads directory '{heads_dir}' does not exist")
    cost_curve = load_cost_curve(target.device, target.name)
    return _REGISTRY[name].load(target, None if heads_dir is None else Path(heads_dir), cost_curve, **options)
