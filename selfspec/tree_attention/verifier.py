"""Tree verification: which drafted tokens the target accepts, and the one token it adds.

Terms (as in vLLM's rejection sampler):
- accepted tokens: drafted tokens on the accepted root-to-node path, each one the target itself could have produced;
- recovered token: drawn from what is left of the target's distribution at the first node where every child was
  rejected (greedy: the target's argmax there);
- bonus token: drawn from the target's distribution when the walk reaches a leaf with every token accepted.
Every step therefore emits at least one target token: accepted tokens + (recovered or bonus).

Lossless rules, at a node whose target distribution is p (after temperature / top-k / top-p):
- greedy: accept the child equal to argmax p;
- deterministic children (draft_probs is None): draw the target's own token y from p by inverse CDF with the uniform
  of the output position the token lands on (`StepDraws`: keyed on (seed, position) alone) and accept the child
  equal to y; if none is, emit y. Accepting child x with probability p(x), in turn, is the same rule in
  distribution (some child is accepted with probability sum p(children)); keying the draw on the position makes a
  seed give the same text as plain decoding whatever the tree;
- drawn children (x ~ q = draft_probs[node]): accept x if r < p(x) / q(x); on rejection p <- norm(max(p - q, 0)),
  and, when drawn without replacement, q <- q with x removed, renormalised; if all fail, draw from the residual p.
  The uniforms come from the step's generator: a correct sample, but not tied to the position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SelfspecError
from ..sampling import SamplingConfig, StepDraws, draw_token, logits_to_probs
from .tree import DraftTree

_MIN_MASS = 1e-12  # below this a residual distribution is treated as empty


@dataclass(frozen=True)
class VerifyResult:
    accepted_path: tuple[int, ...]  # node indices from the root (0) to the last accepted node, inclusive
    accepted_tokens: tuple[int, ...]  # tokens of accepted_path[1:]
    next_token: int  # the recovered or bonus token
    is_bonus: bool  # True when every drafted token on a root-to-leaf path was accepted

    @property
    def emitted(self) -> tuple[int, ...]:
        return self.accepted_tokens + (self.next_token,)


def verify(
    tree: DraftTree,
    target_logits: torch.Tensor,  # [n, V] the target's logits at every tree node
    sampling: SamplingConfig,
    draws: StepDraws = StepDraws(),
) -> VerifyResult:
    """Pure function: the accepted path and the target's extra token. Randomness comes only from `draws`."""
    if target_logits.dim() != 2 or target_logits.shape[0] != tree.size:
        raise SelfspecError(
            f"verify needs one row of logits per tree node ([{tree.size}, V]), got {tuple(target_logits.shape)}"
        )
    if sampling.greedy:
        argmax = target_logits.argmax(-1).tolist()  # one host sync per step
        return _walk(tree, lambda node, depth: argmax[node])
    if tree.draft_probs is None:
        # Only the accepted path's rows are turned into distributions (top-p sorts a whole vocabulary row).
        return _walk(
            tree, lambda node, depth: draw_token(logits_to_probs(target_logits[node], sampling), draws.uniform(depth))
        )
    return _verify_drawn(tree, logits_to_probs(target_logits, sampling), draws.generator)


def _result(tree: DraftTree, tokens: list[int], path: list[int], next_token: int) -> VerifyResult:
    return VerifyResult(
        accepted_path=tuple(path),
        accepted_tokens=tuple(tokens[i] for i in path[1:]),
        next_token=next_token,
        is_bonus=not tree.children(path[-1]),
    )


def _walk(tree: DraftTree, target_token) -> VerifyResult:
    """From the root, follow the child equal to the target's own token at each node; `target_token(node, depth)`
    is that token (the argmax, or the position-keyed draw). The first node with no such child emits it."""
    tokens = tree.token_list
    path = [0]
    while True:
        wanted = target_token(path[-1], len(path) - 1)
        match = next((child for child in tree.children(path[-1]) if tokens[child] == wanted), None)
        if match is None:
            return _result(tree, tokens, path, wanted)
        path.append(match)


def _verify_drawn(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None) -> VerifyResult:
    tokens = tree.token_list
    vocab = probs.shape[-1]
    # The step's uniforms in one draw: each child is tried at most once, so n - 1 of them always suffice.
    uniforms = iter(torch.rand(max(1, tree.size - 1), generator=generator, device=probs.device).tolist())
    path = [0]
    while True:
        node = path[-1]
        children = [c for c in tree.children(node) if 0 <= tokens[c] < vocab]  # ids outside the vocab never win
        q = tree.draft_probs[node].to(device=probs.device, dtype=probs.dtype)
        accepted, residual = _try_drawn(children, tokens, probs[node], q, tree.without_replacement, uniforms)
        if accepted is None:
            return _result(tree, tokens, path, _draw(residual, generator))
        path.append(accepted)


def _renormalise(residual: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """residual / its mass, on the device (no sync). Zero mass happens only when p == q up to rounding, where
    rejection had probability ~0: keep the fallback then."""
    mass = residual.sum()
    return torch.where(mass > _MIN_MASS, residual / mass.clamp_min(_MIN_MASS), fallback)


def _try_drawn(children: list[int], tokens: list[int], p: torch.Tensor, q: torch.Tensor, without_replacement, uniforms):
    """Children drawn from q: accept x if r < p(x)/q(x), else p <- norm(max(p - q, 0)) (and q without x, when drawn
    without replacement). Every child's residuals are computed on the device first, then copied to the host once.
    Returns (accepted child or None, the residual p to draw from when none is accepted)."""
    p_values, q_values = [], []
    for child in children:
        x = tokens[child]
        p_values.append(p[x])
        q_values.append(q[x])
        p = _renormalise((p - q).clamp_min(0.0), p)
        if without_replacement:
            q = q.clone()
            q[x] = 0.0
            q = _renormalise(q, q)
    if not children:
        return None, p
    p_host, q_host = torch.stack([torch.stack(p_values), torch.stack(q_values)]).tolist()
    for index, child in enumerate(children):
        if q_host[index] <= 0:
            raise SelfspecError(
                f"token {tokens[child]} was drafted but has zero draft probability: the drafter's q "
                "is inconsistent with its tree"
            )
        if next(uniforms) * q_host[index] < p_host[index]:
            return child, p
    return None, p


def _draw(p: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=generator).item())
