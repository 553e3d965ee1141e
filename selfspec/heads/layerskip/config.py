"""Layer-skip settings (the tuned data), options (per request) and the skip plan built from them."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import SelfspecError


@dataclass(frozen=True)
class LayerSkipSettings:
    """A layer-skip draft: which sublayers it skips (layer indices) and how far it drafts. The tuned data."""

    skip_attention: tuple[int, ...] = ()
    skip_mlp: tuple[int, ...] = ()
    threshold: float = 0.5  # stop drafting where the draft's top-1 probability falls below this (adapted at run time)
    max_draft: int = 4  # longest chain
    branch_threshold: float = 0.0  # below this top-1 probability, also propose the top-2 token (a leaf); 0 = never
    target_acceptance: float = 0.7  # the adaptive threshold steers the recent acceptance rate towards this
    adapt_step: float = 0.02  # threshold change per step

    def __post_init__(self) -> None:
        if self.max_draft < 1 or not 0.0 <= self.threshold < 1.0:
            raise SelfspecError("layerskip: max_draft must be >= 1 and threshold in [0, 1)")


@dataclass(frozen=True)
class LayerSkipOptions:
    """Run-time options. The settings fields (skip_attention ... adapt_step), when set, override the tuned ones."""

    skip: str = "tuned"  # "tuned" (this model's searched set) or "every-other" (the hand-made baseline)
    adaptive: bool = True  # adapt the threshold toward target_acceptance (Draft & Verify)
    skip_attention: tuple[int, ...] | None = None  # layer indices; on a command line 1+3+5
    skip_mlp: tuple[int, ...] | None = None
    threshold: float | None = None
    max_draft: int | None = None
    branch_threshold: float | None = None
    target_acceptance: float | None = None
    adapt_step: float | None = None

    def __post_init__(self) -> None:
        if self.skip not in ("tuned", "every-other"):
            raise SelfspecError(f"layerskip: skip must be 'tuned' or 'every-other', got '{self.skip}'")

    def overrides(self) -> dict:
        names = (
            "skip_attention",
            "skip_mlp",
            "threshold",
            "max_draft",
            "branch_threshold",
            "target_acceptance",
            "adapt_step",
        )
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


@dataclass(frozen=True)
class SkipPlan:
    """Which sublayers the draft runs, one flag per decoder layer (the count comes from the model's config)."""

    run_attention: tuple[bool, ...]
    run_mlp: tuple[bool, ...]

    @classmethod
    def from_settings(cls, settings: LayerSkipSettings, num_layers: int) -> "SkipPlan":
        for name, indices in (("skip_attention", settings.skip_attention), ("skip_mlp", settings.skip_mlp)):
            bad = [i for i in indices if not 0 <= i < num_layers]
            if bad:
                raise SelfspecError(f"layerskip: {name} holds layer(s) {bad} outside this model's {num_layers} layers")
        return cls(
            run_attention=tuple(i not in settings.skip_attention for i in range(num_layers)),
            run_mlp=tuple(i not in settings.skip_mlp for i in range(num_layers)),
        )


def every_other_layer(num_layers: int) -> tuple[int, ...]:
    """The hand-made baseline: both sublayers of every odd layer skipped."""
    return tuple(range(1, num_layers, 2))
