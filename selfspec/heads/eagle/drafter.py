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

from dataclasses import dataclass
from typing import Callable

import torch
from transformers import DynamicCache

from ...cost import CostCurve
from ...models import Target
from ...tree_attention import DraftTree, causal_block_mask, trim_cache
from ..base import DraftRequest, Observation, check_at_least_one, register_drafter
from ..vocab import ReducedVocabHead, VocabHeadDrafter


@dataclass(frozen=True)
class EagleConfig:
    draft_vocab_size: int = 8192  # the most frequent target tokens in the training labels; 0 = full vocabulary
    feature_noise: float = 0.1  # training: uniform noise U(-a, a) on input features, so the head copes with its own
    hidden_weight: float = 1.0  # smooth-L1 on the predicted next feature
    token_weight: float = 0.1  # cross-entropy against the target's next-token distribution
    unroll_steps: int = 1  # training: draft steps per position, steps after the first fed the head's own features
    top_k: int = 8  # children per expanded node, and frontier nodes expanded per depth
    depth: int = 6  # deepest draft level
    max_tree_nodes: int = 60  # upper bound; the size used follows the cost curve and the draft's confidence


@dataclass(frozen=True)
class EagleOptions:
    """Drafting options; None = the head's trained config."""

    max_nodes: int | None = None  # caps the tree; the size below it follows the cost curve
    top_k: int | None = None
    depth: int | None = None
    fixed_nodes: int | None = None  # verify this many nodes every step whatever the cost (the papers' budgets, e.g. 60)

    def __post_init__(self) -> None:
        check_at_least_one("eagle", self)


class EagleFamilyHead(ReducedVocabHead):
    """What the EAGLE drafter needs of a head beside its forward: the target features it reads and how they enter
    it (the target's frozen input embeddings: ReducedVocabHead.attach_embeddings)."""

    feature_layers: tuple[int, ...] = (-1,)  # the target hidden_states the head reads (EAGLE-1: the LM head's input)

    def gather_features(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """The target's hidden states (layer -> [..., H]) -> the head's input features [..., F]."""
        if len(self.feature_layers) == 1:  # EAGLE-1: no copy on the per-step path
            return hidden[self.feature_layers[0]]
        return torch.cat([hidden[layer] for layer in self.feature_layers], dim=-1)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., F] -> the feature the head's forward reads [..., H] (EAGLE-1 reads them as they
        are)."""
        return features


class EagleHead(EagleFamilyHead):
    def __init__(self, config: EagleConfig, target: Target, draft_vocab: torch.Tensor):
        super().__init__()
        model = target.model
        hidden_size = target.config.hidden_size
        self.config = config
        self.fc = torch.nn.Linear(2 * hidden_size, hidden_size)
        self.layer = type(model.model.layers[0])(target.config, layer_idx=0)  # the base's own decoder-layer class
        self.rotary = type(model.model.rotary_emb)(config=target.config)
        self.attach_draft_vocab(model.get_output_embeddings().weight, draft_vocab)
        self.attach_embeddings(model)

    def forward(self, features, tokens, position_ids, attention_mask=None, cache=None) -> torch.Tensor:
        """features [B, T, H], tokens [B, T], position_ids [B, T], additive mask [B, 1, T, K] or None (causal,
        only without a cache) -> predicted features [B, T, H]."""
        fused = self.fc(torch.cat([features, self.embed(tokens, features.dtype)], dim=-1))
        position_embeddings = self.rotary(fused, position_ids)
        output = self.layer(
            fused,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=cache is not None,
            position_embeddings=position_embeddings,
        )
        return output[0] if isinstance(output, tuple) else output


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
        frontier = Frontier(
            chosen, expand(chosen, [tokens[i] for i in chosen], [parents[i] for i in chosen], level + 1)
        )
        base_scores = [scores[i] for i in chosen]
    # Rerank: the best nodes overall; a child's score never beats its parent's, and ties keep the earlier (parent).
    order = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))
    order = order[: max(0, size_for([scores[i] for i in order]) - 1)]
    kept = sorted(order)  # creation order: parents before children
    new_index = {old: new for new, old in enumerate(kept)}
    kept_tokens = [tokens[i] for i in kept]
    kept_parents = [new_index[parents[i]] if parents[i] >= 0 else -1 for i in kept]  # a child never outranks its parent
    return kept_tokens, kept_parents


@register_drafter(
    "eagle", options=EagleOptions, config=EagleConfig, recipe="selfspec.training.recipes.eagle:train_eagle_family"
)
class EagleDrafter(VocabHeadDrafter):
    hidden_layers = (-1,)
    head_cls = EagleHead

    def __init__(self, target: Target, cost_curve: CostCurve, head: EagleHead, options: EagleOptions = EagleOptions()):
        super().__init__(target, cost_curve, head, options)
        self.hidden_layers = head.feature_layers
        self.depth = options.depth or head.config.depth
        self.reset()

    def reset(self) -> None:
        self.calibration.reset()
        self.cache = DynamicCache()
        self.position = 0  # position of the last committed pair (= pairs in the head's cache)
        self.root_feature: torch.Tensor | None = None  # [H] the head's feature for the root's position
        self.root_log_probs: torch.Tensor | None = None  # [V_draft] for the root's children
        self.pending: list[tuple[torch.Tensor, tuple[int, ...]]] = []  # observed pairs the head has not read yet

    def _run(self, features, tokens, positions, mask) -> torch.Tensor:
        """One head forward of new pairs after the cache -> [n, H] predicted features (the pairs' KV is cached)."""
        dtype = self.head.fc.weight.dtype
        return self.head(features.to(dtype).unsqueeze(0), tokens.view(1, -1), positions.view(1, -1), mask, self.cache)[
            0
        ]

    def observe(self, observation: Observation) -> None:
        """Queue the new (feature, token) pairs; the head reads them at the next proposal, in one forward however many
        steps passed without one (the decoding loop pauses drafting that does not pay)."""
        self.calibrate(observation)
        if any(layer not in observation.hidden for layer in self.hidden_layers):
            return
        hidden = self.head.gather_features(observation.hidden)
        # Pairs (true feature of position j - 1, token j): after the prefill j = 1 .. L - 1 (rows = prompt[:-1]);
        # after a step the accepted path's rows pair with the tokens just committed.
        tokens = observation.new_tokens[1:] if observation.tree is None else observation.new_tokens
        if hidden.shape[0] == 0:
            return
        count = min(hidden.shape[0], len(tokens))
        self.pending.append((hidden[:count], tokens[:count]))

    def _catch_up(self) -> None:
        """Run the head over the queued pairs: their KV joins the head's cache, the last one gives the root's
        children."""
        if not self.pending:
            return
        hidden = torch.cat([rows for rows, _ in self.pending])
        tokens = [token for _, queued in self.pending for token in queued]
        self.pending = []
        count = len(tokens)
        device = self.head.fc.weight.device
        positions = torch.arange(self.position + 1, self.position + 1 + count, device=device)
        mask = causal_block_mask(self.position, count, self.head.fc.weight.dtype, device)
        with torch.inference_mode():
            fused = self.head.fuse(hidden.to(self.head.fc.weight.dtype))
            features = self._run(fused, torch.tensor(tokens, device=device), positions, mask)
            self.root_feature = features[-1]
            self.root_log_probs = torch.log_softmax(self.head.draft_logits(features[-1]).float(), dim=-1)
        self.position += count

    def propose(self, request: DraftRequest) -> DraftTree:
        self._catch_up()
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
            parent_of.update(zip(nodes, parents, strict=True))
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

        with torch.inference_mode():
            tokens, parents = grow_tree(
                self.root_log_probs, expand, self.top_k, min(self.depth, request.max_depth), self.tree_size
            )
        trim_cache(self.cache, committed)
        return self.head.tree_from_draft_ids(request.root_token, tokens, parents)
