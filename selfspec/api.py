"""The high-level Python API: one target in memory, one drafter attached, `generate`."""

from __future__ import annotations

import os
from typing import Callable

import torch

from .cost import current_cost_curve
from .decoding import GenerationResult, check_settings, speculative_generate, validate_request
from .errors import SelfspecError
from .heads import Drafter, create_drafter, parse_drafter_options
from .heads.paced import paced
from .memory import release_freed_memory
from .models import DEFAULT_MODEL, Target, check_prompt, load_target
from .sampling import SamplingConfig


class StepText:
    """Turns each step's committed token ids into (burst, own) text: the step's accepted drafted tokens (all but the
    last) and the target's own token. Text is cut at character boundaries of the whole reply decoded so far, and an
    incomplete multi-byte character waits for the rest (None until it is complete)."""

    def __init__(self, target: Target):
        self.target = target
        self.tokens: list[int] = []
        self.printed = 0

    def split(self, token_ids) -> tuple[str, str] | None:
        token_ids = list(token_ids)
        drafted = len(self.tokens) + len(token_ids) - 1  # tokens up to the end of this step's accepted draft
        self.tokens.extend(token_ids)
        text = self.target.decode(self.tokens)
        if text.endswith("\ufffd"):
            return None
        # A one-token step has no burst: no second decode.
        boundary = self.printed if len(token_ids) == 1 else len(self.target.decode(self.tokens[:drafted]))
        boundary = min(max(boundary, self.printed), len(text))
        pieces = text[self.printed : boundary], text[boundary:]
        self.printed = len(text)
        return pieces


class TextStream:
    """Turns committed token ids into printable text pieces as they arrive (never splitting a multi-byte char)."""

    def __init__(self, target: Target, sink: Callable[[str], None]):
        self.text, self.sink = StepText(target), sink

    def __call__(self, token_ids) -> None:
        pieces = self.text.split(token_ids)
        if pieces is not None:
            self.sink(pieces[0] + pieces[1])


def check_request(
    drafter: str = "auto",
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    prompt: str | None = None,
    **drafter_options,
) -> SamplingConfig:
    """What can be checked of a request before a model loads, by the rules `SelfSpec` and `generate` apply: the drafter
    spec and its options, the sampling settings, max_new_tokens and seed, a prompt with some text (None: not given
    yet). A SelfspecError (one line) names the first problem; the CLI calls this before it loads anything."""
    parse_drafter_options(drafter, **drafter_options)
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    check_settings(max_new_tokens, seed)
    if prompt is not None:
        check_prompt(prompt)
    return sampling


class SelfSpec:
    """A target model with a drafter attached, paced across its requests (heads.paced: a pause carries over).

    >>> spec = SelfSpec("default")  # drafter="auto": the lookups (ngram, history) merged with the model's trained heads
    >>> result = spec.generate("Write a haiku about caches.", max_new_tokens=64)
    >>> result.text, result.stats.mean_accepted_length
    """

    def __init__(
        self,
        model: str | os.PathLike | Target = DEFAULT_MODEL,
        drafter: str = "auto",
        heads: str | os.PathLike | None = None,
        device: str | None = None,
        dtype: torch.dtype | None = None,
        path: str = "auto",
        **drafter_options,
    ):
        """path: the target's execution path when it is loaded here (auto, stock, fast, compiled or q4: see
        selfspec.execution; `auto` takes q4 for a GGUF with 4-bit linears on a CPU, the default model included).

        The drafter's name and options are checked here, before the model loads; the drafter itself is built on first
        use (`drafter`, or the first `generate` once its request has been checked): building it can measure this
        machine's cost curve and pack, calibrate or compile the target's path (minutes, once per machine), which a
        bad request must not wait for."""
        parse_drafter_options(drafter, **drafter_options)
        self.target = model if isinstance(model, Target) else load_target(model, device=device, dtype=dtype, path=path)
        self._drafter_spec, self._heads, self._drafter_options = drafter, heads, drafter_options
        self._drafter: Drafter | None = None
        self._curve_path = ""  # the execution path the drafter's cost curve was made for
        self._paced: Drafter | None = None  # the drafter with its pacing, kept across requests

    @property
    def drafter(self) -> Drafter:
        if self._drafter is None:
            self._drafter = create_drafter(self._drafter_spec, self.target, self._heads, **self._drafter_options)
            self._curve_path = self.target.execution.name  # settled by the curve's reading (cost.target_cost_curve)
        return self._drafter

    def new_drafter(self) -> Drafter:
        """Another drafter like `drafter` (the same spec, heads and options) with state of its own: one per slot of a
        batch (selfspec.batch), where requests in flight together each need theirs."""
        return create_drafter(self._drafter_spec, self.target, self._heads, **self._drafter_options)

    def between_requests(self) -> None:
        """Before a request (generate calls it once the request is checked; chat calls it before the first prompt, so a
        background build begins while the user types): the path may take its compiled graphs now, never during a
        request (execution.ExecutionPath.between_requests), and the drafter then sizes its trees by that path's
        curve."""
        self.target.execution.between_requests()
        drafter, path = self._drafter, self.target.execution.name
        if drafter is not None and (self._curve_path != path or drafter.cost_curve.source.startswith("builtin")):
            curve = current_cost_curve(self.target)  # the build's stored curve once there, the estimate till then
            if curve.source != drafter.cost_curve.source:
                drafter.cost_curve = curve
            self._curve_path = path

    def _paced_drafter(self) -> Drafter:
        """The drafter as requests run it: with its pacing, kept across them (built on first use, as `drafter`)."""
        if self._paced is None:
            self._paced = paced(self.drafter)
        return self._paced

    def generate(
        self,
        prompt: str | None = None,
        input_ids: torch.Tensor | list[int] | None = None,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stream: Callable[[str], None] | None = None,
        on_step: Callable[[tuple[int, ...]], None] | None = None,
        chat: bool = True,
        pace: bool = True,
    ) -> GenerationResult:
        """Generate from a prompt (through the chat template unless chat=False) or from token ids.

        `stream`, if given, receives text pieces as tokens are committed; `on_step` each step's committed token ids
        (the drafted tokens the target accepted, then its own token), e.g. to show the bursts. `pace`: pause drafting
        while it does not
        pay (the default); False asks the drafter for a tree at every step.
        """
        sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
        if (prompt is None) == (input_ids is None):
            raise SelfspecError("pass exactly one of prompt or input_ids")
        if prompt is not None:
            input_ids = self.target.encode_prompt(prompt, chat=chat)
        input_ids = validate_request(
            self.target, input_ids, max_new_tokens, seed
        )  # before any first-use work (`drafter`, the path's packing, calibration and compiling)
        self.between_requests()
        sinks = ([TextStream(self.target, stream)] if stream is not None else []) + (
            [on_step] if on_step is not None else []
        )
        on_tokens = (lambda token_ids: [sink(token_ids) for sink in sinks]) if sinks else None
        drafter = self._paced_drafter()
        tokens, stats = speculative_generate(  # the drafter's target: Medusa-2 heads draft for an adapted copy of it
            drafter.target, drafter, input_ids, max_new_tokens, sampling, seed=seed, on_tokens=on_tokens, pace=pace
        )
        release_freed_memory()  # a long-lived object: what the request freed goes back to the system (memory.py)
        return GenerationResult(token_ids=tokens, text=self.target.decode(tokens), stats=stats)
