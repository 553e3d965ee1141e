"""`dflash`: a small block-diffusion drafter that drafts a whole block in one pass (DFlash).

The block holds B positions: the last committed token (the root), then B - 1 mask embeddings. One to three
bidirectional decoder layers, of the base architecture's own transformers class, denoise it in one forward. They are
conditioned on the target's hidden states from several layers spread through its depth: concatenated, projected and
normalised into one context row per committed position, and injected into every drafter layer as extra keys and
values (each layer gets the same context rows as input beside the block, so their keys/values depend only on the
target's features; they stay in the drafter's KV cache across steps, the block's are cropped after each proposal).
The drafter shares the target's frozen embeddings and LM head (restricted to a reduced draft vocabulary).

The block's per-position distributions become a tree: best-first over per-position top-k, each path scored by the
product of its tokens' marginal probabilities, kept up to the size that maximises expected accepted length per unit
of verification cost on this machine's cost curve.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..cost import CostCurve
from ..errors import SelfspecError
from ..models import Target
from ..tree_attention import DraftTree, trim_cache
from .base import DraftRequest, Observation, check_at_least_one, register_drafter
from .vocab import ReducedVocabHead, VocabHeadDrafter


@dataclass(frozen=True)
class DFlashConfig:
    block_size: int = 16  # B: the last committed token, then B - 1 masked positions drafted in one pass
    num_layers: int = 1  # bidirectional drafter layers, of the base architecture's decoder-layer class
    feature_layers: tuple[int, ...] = ()  # target hidden_states indices it is conditioned on; () = 4 spread over the depth
    draft_vocab_size: int = 8192  # the most frequent target tokens in the training labels; 0 = full vocabulary
    loss_decay: float = 0.8  # training: the loss weight of block position i is decay**(i - 1)
    anchors_per_sequence: int = 8  # training: random block starts per sequence and step
    top_k: int = 4  # drafting: candidate tokens per block position
    max_tree_nodes: int = 32  # upper bound; the size used follows the cost curve and the draft's confidence


@dataclass(frozen=True)
class DFlashOptions:
    """Drafting options; None = the drafter's trained config."""

    max_nodes: int | None = None  # caps the tree; the size below it follows the cost curve
    top_k: int | None = None
    fixed_nodes: int | None = None  # verify this many nodes every step whatever the cost

    def __post_init__(self) -> None:
        check_at_least_one("dflash", self)


def spread_layers(num_layers: int, count: int = 4) -> tuple[int, ...]:
    """`count` hidden_states indices spread through the depth, the last layer included (index num_layers)."""
    return tuple(sorted({max(1, round(num_layers * (i + 1) / count)) for i in range(count)}))


def resolve_feature_layers(config: DFlashConfig, num_layers: int) -> tuple[int, ...]:
    layers = config.feature_layers or spread_layers(num_layers)
    if not all(1 <= layer <= num_layers for layer in layers):
        raise SelfspecError(f"dflash: feature_layers {list(layers)} must lie in 1 .. {num_layers} (this model's layers)")
    return tuple(layers)


class DFlashHead(ReducedVocabHead):
    def __init__(self, config: DFlashConfig, target: Target, draft_vocab: torch.Tensor):
        super().__init__()
        model, hidden_size = target.model, target.config.hidden_size
        if config.block_size < 2 or not 1 <= config.num_layers <= 3:
            raise SelfspecError("dflash: block_size must be >= 2 and num_layers 1 to 3")
        self.config = config
        self.feature_layers = resolve_feature_layers(config, target.config.num_hidden_layers)
        norm_class, eps = type(model.model.norm), getattr(target.config, "rms_norm_eps", 1e-6)
        self.fc = torch.nn.Linear(len(self.feature_layers) * hidden_size, hidden_size, bias=False)
        self.context_norm = norm_class(hidden_size, eps=eps)
        self.mask_embedding = torch.nn.Parameter(torch.zeros(hidden_size))
        layer_class = type(model.model.layers[0])
        self.layers = torch.nn.ModuleList(layer_class(target.config, layer_idx=i) for i in range(config.num_layers))
        self.norm = norm_class(hidden_size, eps=eps)
        self.rotary = type(model.model.rotary_emb)(config=target.config)
        self.attach_draft_vocab(model.get_output_embeddings().weight, draft_vocab)
        # A frozen view of the target's input embeddings (not saved).
        embedding = model.get_input_embeddings()
        self.register_buffer("embed_weight", embedding.weight.detach(), persistent=False)
        self.embed_scale = float(getattr(embedding, "embed_scale", 1.0))  # Gemma scales its embeddings

    def init_from_target(self, target: Target) -> None:
        """Start from the target's own top layers and final norm: training then only has to adapt them."""
        layers = target.model.model.layers
        for index, layer in enumerate(self.layers):
            layer.load_state_dict(layers[len(layers) - len(self.layers) + index].state_dict())
        self.norm.load_state_dict(target.model.model.norm.state_dict())
        with torch.no_grad():
            self.mask_embedding.copy_(self.embed_weight.float().mean(0) * self.embed_scale)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """[..., len(feature_layers) * H] target features -> [..., H] context rows."""
        return self.context_norm(self.fc(features.to(self.fc.weight.dtype)))

    def block_inputs(self, roots: torch.Tensor) -> torch.Tensor:
        """roots [N] -> [N, B, H]: the root token's embedding, then B - 1 mask embeddings."""
        first = torch.nn.functional.embedding(roots, self.embed_weight).to(self.mask_embedding.dtype) * self.embed_scale
        first = first.unsqueeze(1)
        masks = self.mask_embedding.view(1, 1, -1).expand(len(roots), self.config.block_size - 1, -1)
        return torch.cat([first, masks], dim=1)

    def forward(self, context, block, position_ids, attention_mask, cache=None) -> torch.Tensor:
        """context [b, m, H], block [b, n, H], position_ids [b, m + n], additive mask [b, 1, m + n, K] -> block
        outputs [b, n, H]. Every layer reads the same context rows beside the block (their keys/values are the
        injected conditioning); only the block's rows carry on to the next layer."""
        rotary = self.rotary(block, position_ids)
        m = context.shape[1]
        for layer in self.layers:
            output = layer(torch.cat([context, block], dim=1), attention_mask=attention_mask, position_ids=position_ids,
                           past_key_values=cache, use_cache=cache is not None, position_embeddings=rotary)
            block = (output[0] if isinstance(output, tuple) else output)[:, m:]
        return self.norm(block)


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
            heapq.heappush(heap, (negative + values[level - 1][last] - values[level - 1][last + 1], ranks[:-1] + (last + 1,)))
    kept = order[: max(0, size_for(scores) - 1)]
    node_of = {ranks: index for index, ranks in enumerate(kept)}
    tokens = [indices[len(ranks) - 1][ranks[-1]] for ranks in kept]
    parents = [node_of[ranks[:-1]] if len(ranks) > 1 else -1 for ranks in kept]
    return tokens, parents


def block_mask(cached: int, new_context: int, block: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[1, 1, new_context + block, cached + new_context + block] additive: context rows are causal (their outputs are
    never read); block rows see every context row and the whole block (bidirectional)."""
    rows, width = new_context + block, cached + new_context + block
    mask = torch.zeros(rows, width, dtype=dtype, device=device)
    hidden = torch.zeros(rows, width, dtype=torch.bool, device=device)
    hidden[:new_context, cached:] = torch.ones(new_context, new_context + block, dtype=torch.bool, device=device).triu(1)
    return mask.masked_fill_(hidden, torch.finfo(dtype).min).view(1, 1, rows, width)


@register_drafter("dflash", options=DFlashOptions, config=DFlashConfig, recipe="selfspec.training.dflash:train_dflash")
class DFlashDrafter(VocabHeadDrafter):
    head_cls = DFlashHead

    def __init__(self, target: Target, cost_curve: CostCurve, head: DFlashHead, options: DFlashOptions = DFlashOptions()):
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
        head, device, dtype = self.head, self.head.fc.weight.device, self.head.fc.weight.dtype
        with torch.inference_mode():
            features = torch.cat(self.pending) if self.pending else torch.zeros(0, head.fc.in_features, device=device)
            self.pending = []
            context = head.context(features).unsqueeze(0)  # [1, m, H]
            new, block_size = context.shape[1], head.config.block_size
            root = self.position + new  # the root's position: every committed token before it has a context row
            positions = torch.cat([torch.arange(self.position, root), torch.arange(root, root + block_size)]).to(device)
            block = head.block_inputs(torch.tensor([request.root_token], device=device))
            mask = block_mask(self.position, new, block_size, dtype, device)
            outputs = head(context, block, positions.view(1, -1), mask, self.cache)[0]  # [B, H]
            self.position = root
            trim_cache(self.cache, self.position)  # keep the context rows, drop the block's
            log_probs = torch.log_softmax(head.draft_logits(outputs[1 : depth + 1]).float(), dim=-1)  # [D, V_draft]

        tokens, parents = block_tree(log_probs, self.top_k, self.max_nodes, self.tree_size)
        return head.tree_from_draft_ids(request.root_token, tokens, parents)
