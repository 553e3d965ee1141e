"""The decoding loop: prefill -> propose -> verify -> commit -> observe.

Batch size 1. The output is what plain decoding of the target gives: token for token when greedy, in distribution
when sampling, whatever the drafter proposes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from .errors import SelfspecError
from .heads.base import Drafter, DraftRequest, Observation
from .heads.paced import request_pacing
from .models import Target, check_prompt_length
from .sampling import SamplingConfig, StepDraws
from .tree_attention import DraftTree, build_tree_inputs, chunk_forward, compact_cache, tree_forward, verify


@dataclass(frozen=True)
class GenerationStats:
    new_tokens: int
    target_forwards: int  # verification forwards (one per step); the prefill is not counted
    accepted_lengths: tuple[int, ...]  # tokens emitted per step, the target's own token included
    tree_sizes: tuple[int, ...]  # nodes verified per step, the root included
    prefill_s: float
    wall_s: float  # prefill included, as a user waiting for the answer sees it
    stop_reason: str  # "eos", "max_new_tokens" or "context"
    paused_steps: int = 0  # steps the drafter's pacing did not ask it for a tree, its drafting not paying (Paced)
    draft_s: float = 0.0  # the drafter's share of the steps: its proposals and its bookkeeping of the results
    verify_s: float = 0.0  # the target's tree forwards and their verification (the rest: prefill, the loop itself)
    path: str = ""  # the execution path the whole generation ran on (stock, fast or compiled)

    @property
    def mean_accepted_length(self) -> float:
        """tau: tokens emitted per target forward."""
        return sum(self.accepted_lengths) / max(1, len(self.accepted_lengths))

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over drafted depth positions (steps that drafted nothing are left out)."""
        drafted = [(a, s) for a, s in zip(self.accepted_lengths, self.tree_sizes, strict=True) if s > 1]
        return sum(a - 1 for a, _ in drafted) / max(1, sum(s - 1 for _, s in drafted))

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> str:
        return (
            f"{self.new_tokens} tokens in {self.wall_s:.2f}s ({self.tokens_per_s:.1f} tok/s), "
            f"{self.target_forwards} target forwards, mean accepted length {self.mean_accepted_length:.2f}, "
            f"stop: {self.stop_reason}"
            + (f", drafting paused for {self.paused_steps} steps" if self.paused_steps else "")
            + (
                f"; {self.draft_s / self.wall_s:.0%} of the time drafting, {self.verify_s / self.wall_s:.0%} verifying"
                if self.wall_s > 0 and self.draft_s > 0
                else ""
            )
        )


@dataclass(frozen=True)
class GenerationResult:
    token_ids: tuple[int, ...]  # the new tokens only
    text: str
    stats: GenerationStats


def check_settings(max_new_tokens: int, seed: int = 0) -> None:
    """The request's settings that need no model (api.check_request checks them before one loads)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise SelfspecError(f"seed must be an integer, got {seed!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise SelfspecError(f"max_new_tokens must be a positive integer, got {max_new_tokens}")


def validate_request(target: Target, input_ids: torch.Tensor, max_new_tokens: int, seed: int = 0) -> torch.Tensor:
    """Check the request up front; returns input_ids as [1, L] long on the target's device."""
    check_settings(max_new_tokens, seed)
    input_ids = torch.as_tensor(input_ids, dtype=torch.long)
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise SelfspecError(f"input_ids must be one sequence ([L] or [1, L]); got shape {tuple(input_ids.shape)}")
    length = input_ids.shape[1]
    if length == 0:
        raise SelfspecError("the prompt is empty: pass at least one token")
    check_prompt_length(length, target.context_limit)
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= target.vocab_size:
        raise SelfspecError(f"input_ids hold token ids outside the vocabulary [0, {target.vocab_size})")
    return input_ids.to(target.device)


def speculative_generate(
    target: Target,
    drafter: Drafter,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    seed: int = 0,
    on_tokens: Callable[[tuple[int, ...]], None] | None = None,
    pace: bool = True,
) -> tuple[tuple[int, ...], GenerationStats]:
    """Generate up to `max_new_tokens` tokens after `input_ids`; `on_tokens` sees each step's committed tokens.
    `target` must be the drafter's own (`drafter.target`, or a copy with other stop tokens: `with_eos`): Medusa-2 heads
    draft for an adapted copy of the model they were loaded with, and the loop decodes the model the drafter drafts
    for. `pace`: pause drafting while it does not pay (heads.paced: a drafter kept as `paced(drafter)` carries its
    pacing across requests, a bare one is paced for this request alone); False asks the drafter for a tree at every
    step. When sampling, `seed` fixes the text: the token at output position t is drawn with a uniform keyed on
    (seed, t) (see StepDraws), so every drafter whose children are deterministic emits what plain sampling with that
    seed emits."""
    if target.model is not drafter.target.model:
        raise SelfspecError(f"drafter '{drafter.name}' drafts for another model than the target passed: pass .target")
    input_ids = validate_request(target, input_ids, max_new_tokens, seed)
    with request_pacing(drafter, pace) as paced_drafter:
        return _generate(target, paced_drafter, input_ids, max_new_tokens, sampling, seed, on_tokens)


def _generate(
    target: Target,
    drafter: Drafter,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    sampling: SamplingConfig,
    seed: int,
    on_tokens: Callable[[tuple[int, ...]], None] | None,
) -> tuple[tuple[int, ...], GenerationStats]:
    """speculative_generate's loop, on a checked request."""
    forward, device, dtype, eos = target.forward, target.device, target.dtype, set(target.eos_token_ids)
    generator = torch.Generator(device=device).manual_seed(seed)
    committed: list[int] = input_ids[0].tolist()
    new_tokens: list[int] = []
    accepted_lengths: list[int] = []
    tree_sizes: list[int] = []
    stop_reason = "max_new_tokens"
    draft_s = verify_s = 0.0
    paused_before = drafter.stats().paused_steps
    start = time.perf_counter()
    with torch.inference_mode(), target.execution.active(), target.execution.argmax_only(sampling.greedy):
        path = target.execution.name  # it cannot change before the block ends (ExecutionPath.switch_if_ready)
        # 1. Prefill everything but the last prompt token: that one is the first tree's root.
        cache = target.new_cache()
        prefill = (
            chunk_forward(forward, cache, input_ids[:, :-1], drafter.hidden_layers, logits=False)
            if committed[1:]
            else None
        )
        drafter.reset()
        drafter.observe(Observation(tuple(committed), prefill.hidden if prefill else {}))
        prefill_s = time.perf_counter() - start
        while True:
            step_start = time.perf_counter()
            budget = min(max_new_tokens - len(new_tokens), target.context_limit - len(committed))
            # 2. Propose, within what the loop can still emit this step (a paused drafter proposes the root alone).
            tree = drafter.propose(DraftRequest(committed[-1], budget - 1, sampling, generator)).pruned(budget - 1)
            _check_root(drafter, tree, committed[-1])
            forward_start = time.perf_counter()
            # 3. One target forward over the tree, after the cached prefix.
            inputs = build_tree_inputs(tree, len(committed) - 1, dtype, device)
            output = tree_forward(forward, cache, inputs, drafter.hidden_layers)
            # 4. Verify: accepted path plus the target's own token (its host sync ends the forward's time).
            result = verify(tree, output.logits, sampling, StepDraws(seed, len(new_tokens), generator))
            forward_s = time.perf_counter() - forward_start
            draft_s, verify_s = draft_s + forward_start - step_start, verify_s + forward_s
            # 5. Commit, stopping at EOS anywhere inside the emitted tokens; keep only the accepted path's KV.
            emitted = result.emitted
            eos_at = next((i for i, token in enumerate(emitted) if token in eos), None)
            if eos_at is not None:
                emitted, stop_reason = emitted[: eos_at + 1], "eos"
            compact_cache(cache, tree.size, result.accepted_path)
            committed.extend(emitted)
            new_tokens.extend(emitted)
            accepted_lengths.append(len(emitted))
            tree_sizes.append(tree.size)
            if on_tokens is not None:
                on_tokens(emitted)
            if eos_at is not None or len(new_tokens) >= max_new_tokens:
                break
            if len(committed) >= target.context_limit:
                stop_reason = "context"
                break
            # 6. Let the drafter see what was committed (and the accepted path's hidden states).
            observe_start = time.perf_counter()
            hidden = _path_rows(output.hidden, result.accepted_path, device)
            drafter.observe(Observation(emitted, hidden, tree, result.accepted_path))
            draft_s += time.perf_counter() - observe_start  # the drafter's bookkeeping of the result
    stats = GenerationStats(
        new_tokens=len(new_tokens),
        target_forwards=len(accepted_lengths),
        accepted_lengths=tuple(accepted_lengths),
        tree_sizes=tuple(tree_sizes),
        prefill_s=prefill_s,
        wall_s=time.perf_counter() - start,
        stop_reason=stop_reason,
        paused_steps=drafter.stats().paused_steps - paused_before,
        draft_s=draft_s,
        verify_s=verify_s,
        path=path,
    )
    return tuple(new_tokens), stats


def _check_root(drafter: Drafter, tree: DraftTree, root_token: int) -> None:
    if tree.token_list[0] != root_token:
        raise SelfspecError(
            f"drafter '{drafter.name}' rooted its tree at token {tree.token_list[0]}, not at the "
            f"last committed token {root_token}: node 0 must be DraftRequest.root_token"
        )


def _path_rows(hidden: dict[int, torch.Tensor], accepted_path: tuple[int, ...], device) -> dict[int, torch.Tensor]:
    """Each layer's hidden states ([tree size, H]) at the accepted path's nodes only ([len(path), H])."""
    if not hidden:
        return {}  # a drafter that reads none (no index to make, at every step)
    path = torch.tensor(accepted_path, device=device)
    return {layer: states.index_select(0, path) for layer, states in hidden.items()}
