"""Tree verification: which drafted tokens the target accepts, and the one token it adds.

Terms (as in vLLM's rejection sampler):
- accepted tokens: drafted tokens on the accepted root-to-node path, each one the target itself could have produced;
- recovered token: drawn from what is left of the target's distribution at the first node where every child was
  rejected (greedy: the target's argmax there);
- bonus token: drawn from the target's distribution when the walk reaches a leaf with every token accepted.
Every step therefore emits at least one target token: accepted tokens + (recovered or bonus).

Lossless rules, at a node whose target distribution is p (after temperature / top-k / top-p):
- greedy: accept the child equal to argmax p;
- deterministic children (draft_probs is None), tried in layout order: accept child x with probability p(x); on
  rejection set p(x) = 0 and renormalise; if all fail, draw from what is left of p;
- drawn children (x ~ q = draft_probs[node]): accept x if r < p(x) / q(x); on rejection p <- norm(max(p - q, 0)),
  and, when drawn without replacement, q <- q with x removed, renormalised; if all fail, draw from the residual p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import SamplingConfig, logits_to_probs
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
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Pure function: the accepted path and the target's extra token. Randomness comes only from `generator`."""
    assert target_logits.dim() == 2 and target_logits.shape[0] == tree.size, "need one row of logits per tree node"
    if sampling.greedy:
        return _verify_greedy(tree, target_logits)
    return _verify_sampling(tree, logits_to_probs(target_logits, sampling), generator)


def _result(tree: DraftTree, tokens: list[int], path: list[int], next_token: int) -> VerifyResult:
    return VerifyResult(
        accepted_path=tuple(path),
        accepted_tokens=tuple(tokens[i] for i in path[1:]),
        next_token=next_token,
        is_bonus=not tree.children(path[-1]),
    )


def _verify_greedy(tree: DraftTree, target_logits: torch.Tensor) -> VerifyResult:
    argmax = target_logits.argmax(-1).tolist()  # one host sync per step
    tokens = tree.token_list
    path = [0]
    while True:
        wanted = argmax[path[-1]]
        match = next((child for child in tree.children(path[-1]) if tokens[child] == wanted), None)
        if match is None:
            return _result(tree, tokens, path, wanted)
        path.append(match)


def _verify_sampling(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None) -> VerifyResult:
    tokens = tree.token_list
    vocab = probs.shape[-1]
    path = [0]
    while True:
        node = path[-1]
        children = [c for c in tree.children(node) if 0 <= tokens[c] < vocab]  # ids outside the vocab never win
        if tree.draft_probs is None:
            accepted, residual = _try_deterministic(children, tokens, probs[node], generator)
        else:
            q = tree.draft_probs[node].to(device=probs.device, dtype=probs.dtype)
            accepted, residual = _try_drawn(children, tokens, probs[node], q, tree.without_replacement, generator)
        if accepted is None:
            return _result(tree, tokens, path, _draw(residual, generator))
        path.append(accepted)


def _uniform(generator: torch.Generator | None, device: torch.device) -> float:
    """r ~ U[0, 1). r == 0 is possible; acceptance tests use strict `<` so p(x) = 0 never accepts."""
    return torch.rand((), generator=generator, device=device).item()


def _renormalise(residual: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    mass = residual.sum()
    # Zero mass happens only when p == q up to rounding, where rejection had probability ~0: keep p.
    return residual / mass if mass.item() > _MIN_MASS else fallback


def _try_deterministic(children: list[int], tokens: list[int], p: torch.Tensor, generator):
    """Children chosen without randomness: accept x with probability p(x), else remove x from p."""
    for child in children:
        x = tokens[child]
        if _uniform(generator, p.device) < p[x].item():
            return child, p
        residual = p.clone()
        residual[x] = 0.0
        p = _renormalise(residual, p)
    return None, p


def _try_drawn(children: list[int], tokens: list[int], p: torch.Tensor, q: torch.Tensor, without_replacement, generator):
    """Children drawn from q: accept x if r < p(x)/q(x), else p <- norm(max(p - q, 0))."""
    for child in children:
        x = tokens[child]
        q_x = q[x].item()
        assert q_x > 0, f"token {x} was drafted but has zero draft probability: the drafter's q is inconsistent"
        if _uniform(generator, p.device) * q_x < p[x].item():
            return child, p
        p = _renormalise((p - q).clamp_min(0.0), p)
        if without_replacement:
            q = q.clone()
            q[x] = 0.0
            q = _renormalise(q, q)
    return None, p


def _draw(p: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=generator).item())
