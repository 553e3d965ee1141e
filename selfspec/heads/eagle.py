"""`eagle`: a one-layer autoregressive head on the target's top hidden state (the LM head's input).

Pair j is (feature of position j - 1, embedding of token j), placed at position j; the head fuses it (a linear
layer on the concatenation), runs one decoder layer built from the base architecture's own transformers class, and
predicts the feature of position j, which the target's frozen LM head (restricted to a reduced draft vocabulary)
turns into a distribution for token j + 1. Committed pairs use the target's true features and stay in the head's
own KV cache; drafted pairs use the head's predictions and are cropped away after every proposal.

Drafting follows EAGLE-2: expand the `top_k` best frontier nodes (by cumulative draft log-probability) by their
top-k children, depth by depth, then keep the best nodes up to the budget (a child never outscores its parent, so
the kept set is a tree). The budget follows this machine's cost curve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from transformers import DynamicCache

from ..cost import CostCurve
from ..errors import SelfspecError
from ..models import Target
from ..training.config import EagleConfig
from ..tree_attention import DraftTree, causal_block_mask, trim_cache
from .artifacts import load_vocab_head
from .base import DraftRequest, Drafter, Observation, register_drafter


class EagleHead(torch.nn.Module):
    def __init__(self, config: EagleConfig, target: Target, draft_vocab: torch.Tensor):
        super().__init__()
        model = target.model
        hidden_size = target.config.hidden_size
        self.config = config
        self.fc = torch.nn.Linear(2 * hidden_size, hidden_size)
        self.layer = type(model.model.layers[0])(target.config, layer_idx=0)  # the base's own decoder-layer class
        self.rotary = type(model.model.rotary_emb)(config=target.config)
        self.register_buffer("draft_vocab", draft_vocab.long().clone())  # [V_draft] target ids, saved
        # Frozen views of the target (not saved): its input embeddings and its LM head rows for the draft vocabulary.
        self.register_buffer("embed_weight", model.get_input_embeddings().weight.detach(), persistent=False)
        lm_weight = model.get_output_embeddings().weight.detach()
        self.register_buffer("draft_lm_weight", lm_weight[draft_vocab].clone(), persistent=False)
        to_draft = torch.full((lm_weight.shape[0],), -1, dtype=torch.long)
        to_draft[draft_vocab] = torch.arange(len(draft_vocab))
        self.register_buffer("target_to_draft", to_draft, persistent=False)
        self.embed_scale = float(getattr(model.get_input_embeddings(), "embed_scale", 1.0))  # Gemma scales embeddings

    def forward(self, features, tokens, position_ids, attention_mask=None, cache=None) -> torch.Tensor:
        """features [B, T, H], tokens [B, T], position_ids [B, T], additive mask [B, 1, T, K] or None (causal,
        only without a cache) -> predicted features [B, T, H]."""
        embedded = torch.nn.functional.embedding(tokens, self.embed_weight).to(features.dtype) * self.embed_scale
        fused = self.fc(torch.cat([features, embedded], dim=-1))
        position_embeddings = self.rotary(fused, position_ids)
        output = self.layer(
            fused, attention_mask=attention_mask, position_ids=position_ids, past_key_values=cache,
            use_cache=cache is not None, position_embeddings=position_embeddings,
        )
        return output[0] if isinstance(output, tuple) else output

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        return features @ self.draft_lm_weight.to(features.dtype).T


@dataclass(frozen=True)
class Frontier:
    """Nodes to expand at one depth (indices into the growing candidate lists)."""

    nodes: list[int]
    log_probs: torch.Tensor  # [f, V_draft] the head's distribution for each frontier node's children


def grow_tree(
    root_log_probs: torch.Tensor,
    expand: Callable[[list[int], list[int], list[int], int], torch.Tensor],
    top_k: int,
    depth: int,
    size_for: Callable[[list[float]], int],
) -> tuple[list[int], list[int]]:
    """EAGLE-2 best-first growth over draft-vocabulary indices.

    root_log_probs: [V_draft] for the root's children. expand(nodes, tokens, parents, depth) feeds the given candidate
    nodes (their draft token indices, their parents, -1 = root, all at `depth`) to the head and returns
    [len(nodes), V_draft] log-probs for their children. size_for(scores)
    gets the candidates' cumulative log-probs, best first, and says how many nodes (root included) to keep. Returns
    (tokens, parents) for the kept non-root nodes: parents index into the same lists, -1 = the root, parents first.
    """
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    frontier = Frontier(nodes=[-1], log_probs=root_log_probs.view(1, -1))
    base_scores = [0.0]
    for level in range(depth):
        top_values, top_indices = frontier.log_probs.topk(min(top_k, frontier.log_probs.shape[-1]), dim=-1)  # [f, k]
        cumulative = torch.tensor(base_scores, dtype=top_values.dtype).view(-1, 1) + top_values.float().cpu()
        first_new = len(tokens)
        for row, node in enumerate(frontier.nodes):
            tokens.extend(top_indices[row].tolist())
            parents.extend([node] * top_indices.shape[1])
            scores.extend(cumulative[row].tolist())
        if level + 1 == depth:
            break
        new_scores = torch.tensor(scores[first_new:])
        chosen = (first_new + new_scores.topk(min(top_k, len(new_scores))).indices).tolist()
        # Only nodes inside the tree the budget would keep now are worth expanding: their children score lower
        # still. On a steep cost curve (a CPU) this stops the growth early and keeps drafting cheap.
        ranked = sorted(scores, reverse=True)
        cut = ranked[max(0, min(len(ranked), size_for(ranked) - 1) - 1)] if size_for(ranked) > 1 else float("inf")
        chosen = [i for i in chosen if scores[i] >= cut]
        if not chosen:
            break
        frontier = Frontier(chosen, expand(chosen, [tokens[i] for i in chosen], [parents[i] for i in chosen], level + 1))
        base_scores = [scores[i] for i in chosen]
    # Rerank: the best nodes overall; a child's score never beats its parent's, and ties keep the earlier (parent).
    order = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))
    order = order[: max(0, size_for([scores[i] for i in order]) - 1)]
    kept = sorted(order)  # creation order: parents before children
    new_index = {old: new for new, old in enumerate(kept)}
    kept_tokens = [tokens[i] for i in kept]
    kept_parents = [new_index[parents[i]] if parents[i] >= 0 else -1 for i in kept]
    assert all(parents[i] < 0 or parents[i] in new_index for i in kept), "a kept node lost its parent"
    return kept_tokens, kept_parents



def best_size(sorted_scores: list[float], cost_curve: CostCurve, max_nodes: int) -> int:
    """Nodes (root included) maximising (1 + sum of the kept nodes' draft path probabilities) / cost(n): a node's
    cumulative draft probability estimates the chance that the target accepts its whole path."""
    best_n, best_value, expected = 1, 1.0 / cost_curve.cost(1), 1.0
    for index, score in enumerate(sorted_scores[: max_nodes - 1]):
        expected += math.exp(score)
        value = expected / cost_curve.cost(index + 2)
        if value > best_value:
            best_n, best_value = index + 2, value
    return best_n


@register_drafter("eagle")
class EagleDrafter(Drafter):
    hidden_layers = (-1,)

    def __init__(self, target: Target, cost_curve: CostCurve, head: EagleHead, max_nodes: int | None = None,
                 top_k: int | None = None, depth: int | None = None, fixed_nodes: int | None = None):
        """max_nodes caps the tree (the size below it follows the cost curve); fixed_nodes verifies that many nodes
        every step whatever the cost (the papers' fixed budgets, e.g. 60)."""
        super().__init__(target, cost_curve)
        self.head = head.to(target.device).eval().requires_grad_(False)
        self.top_k = top_k or head.config.top_k
        self.depth = depth or head.config.depth
        self.max_nodes = fixed_nodes or max_nodes or head.config.max_tree_nodes
        self.fixed_nodes = fixed_nodes
        if min(self.top_k, self.depth, self.max_nodes) < 1:
            raise SelfspecError("eagle: top_k, depth, max_nodes and fixed_nodes must be >= 1")
        self.reset()

    @classmethod
    def load(cls, target: Target, heads_dir: Path | None, cost_curve: CostCurve, **options) -> "EagleDrafter":
        head = load_vocab_head(target, heads_dir, "eagle", EagleConfig, EagleHead)
        try:
            return cls(target, cost_curve, head, **options)
        except TypeError as error:
            raise SelfspecError(f"bad option for drafter 'eagle': {error}") from None

    def reset(self) -> None:
        self.cache = DynamicCache()
        self.position = 0  # position of the last committed pair (= pairs in the head's cache)
        self.root_feature: torch.Tensor | None = None  # [H] the head's feature for the root's position
        self.root_log_probs: torch.Tensor | None = None  # [V_draft] for the root's children

    def _run(self, features, tokens, positions, mask) -> torch.Tensor:
        """One head forward of new pairs after the cache -> [n, H] predicted features (the pairs' KV is cached)."""
        dtype = self.head.fc.weight.dtype
        return self.head(features.to(dtype).unsqueeze(0), tokens.view(1, -1), positions.view(1, -1), mask, self.cache)[0]

    def observe(self, observation: Observation) -> None:
        hidden = observation.hidden.get(-1)
        # Pairs (true feature of position j - 1, token j): after the prefill j = 1 .. L - 1 (rows = prompt[:-1]);
        # after a step the accepted path's rows pair with the tokens just committed.
        tokens = observation.new_tokens[1:] if observation.result is None else observation.new_tokens
        if hidden is None or hidden.shape[0] == 0:
            return
        count = min(hidden.shape[0], len(tokens))
        device = self.head.fc.weight.device
        positions = torch.arange(self.position + 1, self.position + 1 + count, device=device)
        mask = causal_block_mask(self.position, count, self.head.fc.weight.dtype, device)
        with torch.inference_mode():
            features = self._run(hidden[:count], torch.tensor(tokens[:count], device=device), positions, mask)
            self.root_feature = features[-1]
            self.root_log_probs = torch.log_softmax(self.head.draft_logits(features[-1]).float(), dim=-1)
        self.position += count

    def propose(self, request: DraftRequest) -> DraftTree:
        if self.root_log_probs is None or request.max_depth <= 0:
            return DraftTree.root_only(request.root_token)
        committed = self.position
        device, dtype = self.head.fc.weight.device, self.head.fc.weight.dtype
        feature_of: dict[int, torch.Tensor] = {-1: self.root_feature}
        slot_of: dict[int, int] = {}  # expanded node -> its key slot after the committed pairs
        parent_of: dict[int, int] = {}

        def expand(nodes: list[int], draft_tokens: list[int], parents: list[int], depth: int) -> torch.Tensor:
            # Each node's pair: (its parent's feature, its token) at position committed + its depth; it sees the
            # committed pairs, its expanded ancestors and itself.
            parent_of.update(zip(nodes, parents))
            features = torch.stack([feature_of[parent] for parent in parents])
            ids = self.head.draft_vocab[torch.tensor(draft_tokens, device=device)]
            positions = torch.full((len(nodes),), committed + depth, device=device)
            width = committed + len(slot_of) + len(nodes)
            mask = torch.full((len(nodes), width), torch.finfo(dtype).min, dtype=dtype, device=device)
            mask[:, :committed] = 0
            for row, node in enumerate(nodes):
                slot_of[node] = len(slot_of)
                ancestor = node
                while ancestor >= 0:  # depth <= ~8: a short walk
                    mask[row, committed + slot_of[ancestor]] = 0
                    ancestor = parent_of[ancestor]
            outputs = self._run(features, ids, positions, mask.view(1, 1, len(nodes), width))
            for row, node in enumerate(nodes):
                feature_of[node] = outputs[row]
            return torch.log_softmax(self.head.draft_logits(outputs).float(), dim=-1)

        def size_for(sorted_scores: list[float]) -> int:
            if self.fixed_nodes:
                return self.fixed_nodes
            return best_size(sorted_scores, self.cost_curve, self.max_nodes)

        with torch.inference_mode():
            tokens, parents = grow_tree(self.root_log_probs, expand, self.top_k, min(self.depth, request.max_depth), size_for)
        trim_cache(self.cache, committed)
        if not tokens:
            return DraftTree.root_only(request.root_token)
        target_ids = self.head.draft_vocab[torch.tensor(tokens, device=device)]
        root = torch.tensor([request.root_token], device=device)
        return DraftTree(tokens=torch.cat([root, target_ids]).long(), parents=torch.tensor([-1] + [p + 1 for p in parents]))
