"""The DFlash drafter: it feeds the target's features of the committed positions to the head as context rows (kept
in its own KV cache across steps), drafts one block per step in one forward, and turns the block's per-position
distributions into a tree: best-first over per-position top-k, each path scored by the product of its tokens'
marginal probabilities, kept up to the size that maximises expected accepted length per unit of verification cost on
this machine's cost curve."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ...cost import CostCurve
from ...models import Target
from ...tree_attention import DraftTree, trim_cache
from ..base import DraftRequest, Observation, check_at_least_one, register_drafter
from ..vocab import VocabHeadDrafter
from .head import DFlashConfig, DFlashHead
from .interop import imported_artifact


@dataclass(frozen=True)
class DFlashOptions:
    """Drafting options; None = the drafter's trained config."""

    max_nodes: int | None = None  # caps the tree; the size below it follows the cost curve
    top_k: int | None = None
    fixed_nodes: int | None = None  # verify this many nodes every step whatever the cost

    def __post_init__(self) -> None:
        check_at_least_one("dflash", self)


def block_tree(log_probs: torch.Tensor, top_k: int, max_nodes: int, size_for) -> tuple[list[int], list[int]]:
    """Best-first over per-position top-k: log_probs [D, V] are the block's marginals for depths 1..D. A path of
    ranks (r1, ..., rd) scores sum_i log_probs[i, top-r_i]; candidates come off a heap best first, so each one's
    parent came off before it (prefix-closed). size_for(scores) says how many nodes (root included) to keep.
    Returns (draft-vocabulary tokens, parents) for the kept non-root nodes, parents first (-1 = the root)."""
    depth, k = log_probs.shape[0], min(top_k, log_probs.shape[1])
    if depth == 0 or max_nodes < 2:
        return [], []
    values, indices = log_probs.float().topk(k, dim=-1)
    values, indices = values.tolist(), indices.tolist()  # one host copy per proposal
    heap = [(-values[0][0], (0,))]
    order: list[tuple[int, ...]] = []
    scores: list[float] = []
    while heap and len(order) < max_nodes - 1:
        negative, ranks = heapq.heappop(heap)
        order.append(ranks)
        scores.append(-negative)
        level = len(ranks)
        if level < depth:  # its best child
            heapq.heappush(heap, (negative - values[level][0], ranks + (0,)))
        if ranks[-1] + 1 < k:  # its next sibling
            last = ranks[-1]
            heapq.heappush(
                heap, (negative + values[level - 1][last] - values[level - 1][last + 1], ranks[:-1] + (last + 1,))
            )
    kept = order[: max(0, size_for(scores) - 1)]
    node_of = {ranks: index for index, ranks in enumerate(kept)}
    tokens = [indices[len(ranks) - 1][ranks[-1]] for ranks in kept]
    parents = [node_of[ranks[:-1]] if len(ranks) > 1 else -1 for ranks in kept]
    return tokens, parents


@register_drafter(
    "dflash", options=DFlashOptions, config=DFlashConfig, recipe="selfspec.training.recipes.dflash:train_dflash"
)
class DFlashDrafter(VocabHeadDrafter):
    """Loads a selfspec heads directory, or a speculators DFlash one (imported as it loads)."""

    head_cls = DFlashHead
    speculators_import = staticmethod(imported_artifact)

    def __init__(
        self, target: Target, cost_curve: CostCurve, head: DFlashHead, options: DFlashOptions = DFlashOptions()
    ):
        super().__init__(target, cost_curve, head, options)
        self.hidden_layers = head.feature_layers
        self.reset()

    def reset(self) -> None:
        self.calibration.reset()
        self.cache = DynamicCache()
        self.position = 0  # context rows in the drafter's cache (= committed positions with target features)
        self.pending: list[torch.Tensor] = []  # [m, F] target features not yet in the cache

    def observe(self, observation: Observation) -> None:
        self.calibrate(observation)
        if not observation.hidden:
            return
        features = torch.cat([observation.hidden[layer] for layer in self.hidden_layers], dim=-1)  # [m, F]
        self.pending.append(features)

    def propose(self, request: DraftRequest) -> DraftTree:
        depth = min(self.head.config.block_size - 1, request.max_depth)
        if depth <= 0:
            return DraftTree.root_only(request.root_token)
        head, device = self.head, self.head.fc.weight.device
        with torch.inference_mode():
            features = torch.cat(self.pending) if self.pending else torch.zeros(0, head.fc.in_features, device=device)
            self.pending = []
            context = head.context(features).unsqueeze(0)  # [1, m, H]
            root = self.position + context.shape[1]  # the root's position: every committed token before it has a row
            positions = torch.arange(self.position, root + head.config.block_size, device=device).view(1, -1)
            block = head.block_inputs(torch.tensor([request.root_token], device=device))
            outputs = head(context, block, positions, None, self.cache)[0]  # [B, H]: the block sees everything cached
            self.position = root
            trim_cache(self.cache, self.position)  # keep the context rows, drop the block's
            log_probs = torch.log_softmax(head.draft_logits(outputs[1 : depth + 1]).float(), dim=-1)  # [D, V_draft]

        tokens, parents = block_tree(log_probs, self.top_k, self.max_nodes, self.tree_size)
        return head.tree_from_draft_ids(request.root_token, tokens, parents)
