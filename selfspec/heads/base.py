"""The drafter interface and registry.

A drafter proposes a `DraftTree` from what it has observed, and is told what was committed after each step. It never
touches the target's KV cache or the verifier, and the verifier never knows which drafter made the tree.

A drafter is registered with its options class (typed, what `name:key=value` specs and keyword arguments fill), the
config class of its trained or tuned data (None for parameter-free drafters) and the dotted path of its training
recipe ("module:function", imported only by the training pipeline, so heads/ never imports training/).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, ClassVar

import torch

from ..cost import CostCurve, target_cost_curve
from ..errors import SelfspecError
from ..models import Target
from ..options import format_option, from_dict, parse_drafter_spec
from ..sampling import SamplingConfig
from ..tree_attention import DraftTree


@dataclass(frozen=True)
class DraftRequest:
    """What the loop asks for at each step."""

    root_token: int  # the last committed token: node 0 of the tree to propose
    max_depth: int  # deepest node the loop can use (max_new_tokens and context budget); 0 means no draft
    sampling: SamplingConfig
    generator: torch.Generator | None  # draw any random draft tokens from this, so runs are reproducible


@dataclass(frozen=True)
class Observation:
    """What the drafter learns after the prefill (`tree` is None) or after a verified step: the committed tokens, the
    target's hidden states at them, and the drafter's own tree with the part of it the target accepted. (A source of
    `auto` sees its own tree, whichever source's path won; the verifier's result itself is the loop's.)"""

    new_tokens: tuple[int, ...]  # tokens just committed (after the prefill: the whole prompt)
    hidden: dict[int, torch.Tensor]  # layer -> [m, H] at the forwarded committed positions (see below)
    tree: DraftTree | None = None  # the drafter's tree (root only where it drafted nothing); None after the prefill
    accepted_path: tuple[int, ...] = ()  # nodes of `tree` the target accepted, root (0) first; () after the prefill
    # hidden rows: after the prefill, the prompt minus its last token; after a step, the verified tree's accepted
    # path's nodes (root first). The target's extra token is never forwarded in the step that produced it.

    @property
    def accepted_tokens(self) -> tuple[int, ...]:
        """The drafted tokens of `tree` the target accepted: the step's committed tokens start with them."""
        if self.tree is None:
            return ()
        tokens = self.tree.token_list
        return tuple(tokens[node] for node in self.accepted_path[1:])

    @property
    def reached_leaf(self) -> bool:
        """Every drafted token down one branch of `tree` was accepted (the target's token after it is a bonus token
        in the verifier's terms, not a correction)."""
        return self.tree is not None and not self.tree.children(self.accepted_path[-1])


@dataclass(frozen=True)
class DrafterStats:
    """What a drafter reports about itself beyond the loop's GenerationStats (`Drafter.stats()`); a field a drafter
    has nothing to say about keeps its neutral default. Counts run over the drafter's life: the difference of two
    reports is what happened between them."""

    accepted_by_source: dict[str, int] = field(default_factory=dict)  # composite drafters (auto): accepted draft tokens
    left_out: dict[str, str] = field(default_factory=dict)  # composite drafters: default sources not loaded, and why
    tree_nodes: int | None = None  # the tree size its trained parts fixed (Medusa's tree); None where it varies
    # The mean accepted length its trained parts reached on held-out prompts when they were trained (their training
    # report); None where unknown or where nothing was trained.
    heldout_tau: float | None = None
    paused_steps: int = 0  # steps its pacing (paced.Paced) did not ask it for a tree, its drafting not paying

    def accepted_since(self, before: "DrafterStats") -> dict[str, int] | None:
        """Accepted draft tokens by source since `before` (an earlier report), or None for a drafter that does not count
        them by source."""
        earlier = before.accepted_by_source
        return {name: count - earlier.get(name, 0) for name, count in self.accepted_by_source.items()} or None

    def contributions(self) -> str:
        """Accepted draft tokens by source (a token two sources proposed counts for both), then the default sources
        left out and why; empty for a drafter without sources."""
        counts = " ".join(f"{name}={count}" for name, count in self.accepted_by_source.items())
        return counts + "".join(f"; {name} left out ({why})" for name, why in self.left_out.items())


@dataclass(frozen=True)
class NoOptions:
    """Options of a drafter that takes none."""


def check_at_least_one(drafter: str, options) -> None:
    """Every integer option that is set must be >= 1 (node budgets, widths, depths)."""
    bad = [f.name for f in fields(options) if type(getattr(options, f.name)) is int and getattr(options, f.name) < 1]
    if bad:
        raise SelfspecError(f"{drafter}: {', '.join(bad)} must be >= 1")


class Drafter(ABC):
    """Base class. Subclasses set `hidden_layers` if they need target hidden states in `observe`."""

    name: ClassVar[str] = ""
    hidden_layers: tuple[int, ...] = ()  # indices into the target's hidden_states; -1 is the LM head's input

    def __init__(self, target: Target, cost_curve: CostCurve, options=None):
        self.target = target
        self.cost_curve = cost_curve
        self.options = options  # the drafter's typed options (its registered options class)

    @classmethod
    def load(cls, target: Target, heads_dir: Path | None, cost_curve: CostCurve, options) -> "Drafter":
        """Build the drafter for `target` from typed options. Drafters without trained parts reject a heads
        directory."""
        if heads_dir is not None:
            raise SelfspecError(f"drafter '{cls.name}' has no trained heads: drop --heads")
        return cls(target, cost_curve, options)

    def describe(self) -> str:
        """The drafter as a spec string: its name and the options that differ from their defaults."""
        if self.options is None:
            return self.name
        default = type(self.options)()
        changed = [
            f"{f.name}={format_option(getattr(self.options, f.name))}"
            for f in fields(self.options)
            if getattr(self.options, f.name) != getattr(default, f.name)
        ]
        return self.name + (":" + ",".join(changed) if changed else "")

    def reset(self) -> None:  # noqa: B027  (a hook: a drafter without per-sequence state keeps the no-op)
        """Forget everything about the previous sequence."""

    @abstractmethod
    def propose(self, request: DraftRequest) -> DraftTree:
        """A tree whose root is `request.root_token`, no deeper than `request.max_depth`."""

    def observe(self, observation: Observation) -> None:  # noqa: B027  (a hook, as reset is)
        """Update the drafter's own state (its caches, its window of hidden states, its statistics)."""

    def stats(self) -> DrafterStats:
        """What the drafter reports about itself (accepted tokens by source, its fixed tree size, ...); the neutral
        report unless a drafter has something to say."""
        return DrafterStats()

    def drafting_seconds(self, measured: float) -> float:
        """What a step's drafting cost, for its pacing (paced.Paced): `measured` is the wall time of its propose and
        observe, which a drafter that knows better may replace."""
        return measured

    def parts(self) -> tuple["Drafter", ...]:
        """The drafters it drafts through (a composite drafter's sources); none for a drafter of its own."""
        return ()


@dataclass(frozen=True)
class DrafterEntry:
    name: str
    drafter_cls: type[Drafter]
    options_cls: type  # a frozen dataclass, every field with a default
    config_cls: type | None  # the config of its trained heads or tuned data; None = parameter-free
    recipe: str | None  # "module:function" of its training recipe, None = not trainable with `selfspec train`
    composite: bool = False  # drafts through other registered drafters (its sources), e.g. `auto`

    @property
    def has_artifacts(self) -> bool:
        """Whether it reads trained heads or tuned data (so --heads means something to it)."""
        return self.config_cls is not None


_REGISTRY: dict[str, DrafterEntry] = {}


def register_drafter(
    name: str,
    options: type = NoOptions,
    config: type | None = None,
    recipe: str | None = None,
    composite: bool = False,
) -> Callable[[type[Drafter]], type[Drafter]]:
    def decorate(cls: type[Drafter]) -> type[Drafter]:
        if name in _REGISTRY and _REGISTRY[name].drafter_cls is not cls:
            raise ValueError(f"drafter name '{name}' is already registered to {_REGISTRY[name].drafter_cls.__name__}")
        options()  # fail at registration, not at first use, if an options field lacks a default
        cls.name = name
        _REGISTRY[name] = DrafterEntry(name, cls, options, config, recipe, composite)
        return cls

    return decorate


def unregister_drafter(name: str) -> None:
    """Remove a registration (third-party plugins and tests that register temporary drafters)."""
    _REGISTRY.pop(name, None)


def drafter_names() -> list[str]:
    return sorted(_REGISTRY)


def drafter_entry(name: str) -> DrafterEntry:
    if name not in _REGISTRY:
        raise SelfspecError(f"unknown drafter '{name}': choose one of {', '.join(drafter_names())}")
    return _REGISTRY[name]


def parse_drafter_options(spec: str, **options) -> tuple[DrafterEntry, object]:
    """A spec ('layerskip:adaptive=false,max_draft=6') plus keyword options -> (its entry, its typed options).
    The spec's text values and keyword values go through one converter; a key given both ways is an error."""
    name, text_options = parse_drafter_spec(spec)
    entry = drafter_entry(name)
    both = sorted(set(text_options) & set(options))
    if both:
        raise SelfspecError(f"drafter option(s) {', '.join(both)} given both in '{spec}' and as keyword arguments")
    typed = from_dict(entry.options_cls, {**text_options, **options}, where=f"drafter '{name}' options", from_text=True)
    return entry, typed


def create_drafter(spec: str, target: Target, heads_dir: str | Path | None = None, **options) -> Drafter:
    """`create_drafter("layerskip", target, adaptive=False)` or `create_drafter("layerskip:adaptive=false", target)`."""
    entry, typed = parse_drafter_options(spec, **options)
    if heads_dir is not None and not Path(heads_dir).exists():  # a directory, or a file for tuned data (layerskip)
        raise SelfspecError(f"heads directory '{heads_dir}' does not exist")
    cost_curve = target_cost_curve(target)
    return entry.drafter_cls.load(target, None if heads_dir is None else Path(heads_dir), cost_curve, typed)
