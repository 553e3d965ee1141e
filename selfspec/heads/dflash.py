"""`dflash`: a small block-diffusion drafter that drafts a whole block in one pass (DFlash), in the layout of the
DFlash paper and of the speculators library, which vLLM loads (`selfspec export --format speculators`).

The block holds B positions: the last committed token (the anchor), then B - 1 copies of a mask token's embedding
(`mask_token_id`, a token the training data never uses). A few bidirectional decoder layers denoise it in one
forward: Qwen3 decoder layers (stock transformers modules, per-head q/k norms) of the target's width, whatever the
target's architecture. The drafter is conditioned on the target's hidden states from a low, a middle and a high
layer: concatenated, projected by `fc` and normalised (`hidden_norm`) into one context row per committed position.
Context rows are not queries: each layer projects them straight into extra keys and values beside the block's
(k_norm and RoPE at their own positions, no input norm), so they depend only on the target's features and stay in
the drafter's KV cache across steps; the block's keys and values are cropped after each proposal. A block row sees
every context row before the anchor and the whole block. The drafter shares the target's frozen embeddings and LM
head (restricted to a reduced draft vocabulary; its own final `norm`).

The block's per-position distributions become a tree: best-first over per-position top-k, each path scored by the
product of its tokens' marginal probabilities, kept up to the size that maximises expected accepted length per unit
of verification cost on this machine's cost curve.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from ..cost import CostCurve
from ..errors import SelfspecError
from ..models import Target, sublayer_style
from ..tree_attention import DraftTree, trim_cache
from .artifacts import HeadArtifact
from .base import DraftRequest, Observation, check_at_least_one, register_drafter
from .speculators import (
    SpeculatorsDraft,
    build_imported,
    config_document,
    default_aux_layers,
    export_state,
    head_for_export,
    import_directory,
    read_speculators,
    speculators_type,
    write_speculators,
)
from .vocab import ReducedVocabHead, VocabHeadDrafter

MAX_LAYERS = 8


@dataclass(frozen=True)
class DFlashConfig:
    block_size: int = 16  # B: the last committed token, then B - 1 masked positions drafted in one pass
    num_layers: int = 1  # bidirectional drafter layers (Qwen3 decoder layers of the target's width), 1 to 8
    feature_layers: tuple[int, ...] = ()  # target hidden_states indices it is conditioned on; () = 2, N // 2, N - 3
    draft_vocab_size: int = 8192  # the most frequent target tokens in the training labels; 0 = full vocabulary
    mask_token_id: int = -1  # whose embedding fills the masked positions; -1: training picks the rarest token in its data
    own_lm_head: bool = False  # the drafter carries its own draft LM head (imported drafters that trained one)
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


def resolve_feature_layers(config: DFlashConfig, num_layers: int) -> tuple[int, ...]:
    layers = tuple(config.feature_layers) or default_aux_layers(num_layers)
    if len(set(layers)) != len(layers) or not all(0 <= layer <= num_layers for layer in layers):
        raise SelfspecError(f"dflash: feature_layers {list(layers)} must be distinct and lie in 0 .. {num_layers}")
    return layers


def draft_layer_config(target: Target, num_layers: int) -> Qwen3Config:
    """The drafter's decoder layers: Qwen3's (DFlash's), with the target's width, heads, MLP size and RoPE."""
    source = target.config
    heads = source.num_attention_heads
    config = Qwen3Config(
        vocab_size=target.vocab_size, hidden_size=source.hidden_size, intermediate_size=source.intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=getattr(source, "num_key_value_heads", None) or heads,
        head_dim=getattr(source, "head_dim", None) or source.hidden_size // heads,
        hidden_act=getattr(source, "hidden_act", None) or getattr(source, "hidden_activation", "silu"),
        max_position_embeddings=source.max_position_embeddings, rms_norm_eps=getattr(source, "rms_norm_eps", 1e-6),
        rope_parameters=dict(getattr(source, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}),
        attention_bias=False, tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    return config


def _effective_norm_weight(norm: torch.nn.Module, size: int) -> torch.Tensor:
    """What an RMS norm multiplies a unit-RMS row by, whatever its parametrisation (Llama's w, Gemma's 1 + w)."""
    with torch.no_grad():
        return norm(torch.ones(1, size, dtype=next(norm.parameters()).dtype)).float()[0]


class DFlashHead(ReducedVocabHead):
    """Submodule names follow the speculators layout (fc, hidden_norm, layers.*, norm, lm_head), so export and
    import copy weights as they are."""

    def __init__(self, config: DFlashConfig, target: Target, draft_vocab: torch.Tensor):
        super().__init__()
        if config.block_size < 2 or not 1 <= config.num_layers <= MAX_LAYERS:
            raise SelfspecError(f"dflash: block_size must be >= 2 and num_layers 1 to {MAX_LAYERS}")
        if not 0 <= config.mask_token_id < target.vocab_size:
            raise SelfspecError(f"dflash: mask_token_id {config.mask_token_id} is not a token of this model "
                                f"(0 .. {target.vocab_size - 1}); training picks one when it is -1")
        model, hidden_size = target.model, target.config.hidden_size
        self.config = config
        self.feature_layers = resolve_feature_layers(config, target.config.num_hidden_layers)
        self.layer_config = draft_layer_config(target, config.num_layers)
        eps = self.layer_config.rms_norm_eps
        self.fc = torch.nn.Linear(len(self.feature_layers) * hidden_size, hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden_size, eps=eps)
        self.layers = torch.nn.ModuleList(Qwen3DecoderLayer(self.layer_config, layer_idx=i) for i in range(config.num_layers))
        for layer in self.layers:
            layer.self_attn.is_causal = False  # a block attends both ways; what each row sees is the mask's (or all)
        self.norm = Qwen3RMSNorm(hidden_size, eps=eps)
        self.rotary_emb = Qwen3RotaryEmbedding(self.layer_config)
        self.attach_draft_vocab(model.get_output_embeddings().weight, draft_vocab)
        embedding = model.get_input_embeddings()  # a frozen view of the target's (not saved)
        self.register_buffer("embed_weight", embedding.weight.detach(), persistent=False)
        self.embed_scale = float(getattr(embedding, "embed_scale", 1.0))  # Gemma scales its embeddings
        if config.own_lm_head:
            self.lm_head = torch.nn.Linear(hidden_size, len(draft_vocab), bias=False)
            self.lm_head.weight.data.copy_(self.draft_lm_weight)

    def init_from_target(self, target: Target) -> None:
        """Start from the target's own top layers: their projections and MLP where the shapes match, their norms'
        effective scales for pre-norm bases, and the target's final norm; training then adapts them."""
        layers, size = target.model.model.layers, target.config.hidden_size
        for index, layer in enumerate(self.layers):
            source = layers[len(layers) - len(self.layers) + index]
            own = layer.state_dict()
            copied = {name: tensor for name, tensor in source.state_dict().items()
                      if name in own and "norm" not in name and tensor.shape == own[name].shape}
            layer.load_state_dict({**own, **copied})
            if sublayer_style(source, "dflash") == "pre":
                for name in ("input_layernorm", "post_attention_layernorm"):
                    getattr(layer, name).weight.data.copy_(_effective_norm_weight(getattr(source, name), size))
        self.norm.weight.data.copy_(_effective_norm_weight(target.model.model.norm, size))

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """[..., len(feature_layers) * H] target features -> [..., H] context rows."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def block_inputs(self, roots: torch.Tensor) -> torch.Tensor:
        """roots [N] -> [N, B, H]: the anchor token's embedding, then B - 1 mask-token embeddings."""
        ids = torch.full((len(roots), self.config.block_size), self.config.mask_token_id, device=roots.device)
        ids[:, 0] = roots
        return torch.nn.functional.embedding(ids, self.embed_weight).to(self.fc.weight.dtype) * self.embed_scale

    def add_context(self, context: torch.Tensor, position_ids: torch.Tensor, cache: DynamicCache) -> None:
        """context [b, m, H] at position_ids [b, m] -> each layer's keys and values for them, appended to `cache`."""
        cos, sin = (part.unsqueeze(1) for part in self.rotary_emb(context, position_ids))
        for index, layer in enumerate(self.layers):
            attention = layer.self_attn
            shape = (*context.shape[:-1], -1, attention.head_dim)
            keys = attention.k_norm(attention.k_proj(context).view(shape)).transpose(1, 2)  # [b, kv_heads, m, d]
            values = attention.v_proj(context).view(shape).transpose(1, 2)
            cache.update(keys * cos + rotate_half(keys) * sin, values, index)

    def forward(self, context, block, position_ids, attention_mask=None, cache=None) -> torch.Tensor:
        """context [b, m, H], block [b, n, H], position_ids [b, m + n], additive mask [b, 1, n, K + m + n] (K: rows
        already cached) or None (every row sees everything) -> block outputs [b, n, H]. The cache (a fresh one when
        None) ends holding the context rows and the block's; callers crop the block's."""
        cache = DynamicCache() if cache is None else cache
        m = context.shape[1]
        if m:
            self.add_context(context, position_ids[:, :m], cache)
        block_positions = position_ids[:, m:]
        rotary = self.rotary_emb(block, block_positions)
        for layer in self.layers:
            output = layer(block, attention_mask=attention_mask, position_ids=block_positions, past_key_values=cache,
                           use_cache=True, position_embeddings=rotary)
            block = output[0] if isinstance(output, tuple) else output
        return self.norm(block)

    def blocks(self, features: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Training's view: features [b, L, F] and input_ids [b, L] of whole sequences, anchors [b, A] -> outputs
        [b, A, B, H] of every anchor's block, each seeing the context rows before its anchor and its own block."""
        count, length = input_ids.shape
        block = self.config.block_size
        inputs = self.block_inputs(input_ids.gather(1, anchors).view(-1)).view(count, anchors.shape[1] * block, -1)
        offsets = torch.arange(block, device=anchors.device)
        positions = torch.cat([torch.arange(length, device=anchors.device).expand(count, -1),
                               (anchors.unsqueeze(-1) + offsets).view(count, -1)], dim=1)
        mask = training_mask(anchors, length, block, inputs.dtype)
        return self(self.context(features), inputs, positions, mask).view(count, anchors.shape[1], block, -1)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) if self.config.own_lm_head else super().draft_logits(hidden)


def training_mask(anchors: torch.Tensor, length: int, block: int, dtype: torch.dtype) -> torch.Tensor:
    """[b, 1, A*B, L + A*B] additive: block j's rows see the context rows before anchor j and the whole of block j."""
    device = anchors.device
    blocks = anchors.shape[1]
    sees_context = torch.arange(length, device=device).view(1, 1, -1) < anchors.unsqueeze(-1)  # [b, A, L]
    block_of = torch.arange(blocks * block, device=device) // block
    same_block = (block_of.view(-1, 1) == block_of.view(1, -1)).expand(len(anchors), -1, -1)
    allowed = torch.cat([sees_context.repeat_interleave(block, dim=1), same_block], dim=2)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.unsqueeze(1)


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


@register_drafter("dflash", options=DFlashOptions, config=DFlashConfig, recipe="selfspec.training.dflash:train_dflash")
class DFlashDrafter(VocabHeadDrafter):
    head_cls = DFlashHead

    def __init__(self, target: Target, cost_curve: CostCurve, head: DFlashHead, options: DFlashOptions = DFlashOptions()):
        super().__init__(target, cost_curve, head, options)
        self.hidden_layers = head.feature_layers
        self.reset()

    @classmethod
    def load(cls, target: Target, heads_dir: Path | None, cost_curve: CostCurve, options) -> "DFlashDrafter":
        """A selfspec heads directory, or a speculators DFlash one (imported as it loads)."""
        if heads_dir is None or speculators_type(heads_dir) is None:
            return super().load(target, heads_dir, cost_curve, options)
        head = build_imported(DFlashHead, imported_artifact(target, Path(heads_dir)), target, Path(heads_dir))
        drafter = cls(target, cost_curve, head.to(target.dtype), options)
        drafter.heldout_tau = None
        return drafter

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


# Exchange with the speculators library (heads/speculators.py holds the format).


def _expected_layer(target: Target, num_layers: int | None = None) -> dict:
    """The draft-layer config values a speculators DFlash directory must carry to be one selfspec builds for `target`."""
    config = draft_layer_config(target, num_layers or 1)
    expected = {key: getattr(config, key) for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                      "num_key_value_heads", "head_dim", "vocab_size")}
    return {"model_type": "qwen3", **expected}


def imported_artifact(target: Target, directory: Path) -> HeadArtifact:
    """A speculators DFlash directory -> the dflash head artifact for `target` (fingerprinted to it: checked here)."""
    content = read_speculators(directory, target, "dflash", _expected_layer(target))
    fields, where = content.fields, f"'{directory}'"
    if fields.get("sample_from_anchor"):
        raise SelfspecError(f"{where} drafts from the anchor position too (sample_from_anchor), which selfspec's DFlash does not")
    if fields.get("mask_token_id") is None:
        raise SelfspecError(f"{where} has no mask_token_id in its config.json")
    layers = content.layer_config.get("num_hidden_layers")
    if not isinstance(layers, int) or not 1 <= layers <= MAX_LAYERS:
        raise SelfspecError(f"{where} has {layers!r} draft layers: selfspec's DFlash takes 1 to {MAX_LAYERS}")
    if content.layer_config.get("layer_types") and set(content.layer_config["layer_types"]) != {"full_attention"}:
        raise SelfspecError(f"{where} uses sliding-window draft layers, which selfspec's DFlash does not")
    config = DFlashConfig(block_size=int(fields.get("block_size") or 8), num_layers=layers,
                          feature_layers=tuple(fields.get("aux_hidden_state_layer_ids") or ()),
                          draft_vocab_size=len(content.draft_vocab), mask_token_id=int(fields["mask_token_id"]),
                          own_lm_head=content.own_lm_head)
    config = DFlashConfig(**{**config.__dict__, "feature_layers": resolve_feature_layers(config, target.config.num_hidden_layers)})
    state = {**content.state, "draft_vocab": content.draft_vocab}
    return HeadArtifact("dflash", config, state, target.fingerprint, {"imported_from": "speculators", "verifier": content.verifier})



def export_heads(target: Target, heads_dir: Path, out: Path, verifier: str, dtype: str = "bfloat16") -> Path:
    """`selfspec export --format speculators`: dflash heads (selfspec's or speculators') -> a speculators directory."""
    head = head_for_export(target, heads_dir, "dflash", DFlashConfig, DFlashHead, imported_artifact)
    state = export_state(head)
    fields = {"block_size": head.config.block_size, "aux_hidden_state_layer_ids": list(head.feature_layers),
              "mask_token_id": head.config.mask_token_id, "sliding_window_non_causal": False, "sample_from_anchor": False}
    layer_config = config_document(head.layer_config, "float32", num_hidden_layers=head.config.num_layers)
    draft = SpeculatorsDraft("dflash", fields, layer_config, state, head.draft_vocab, head.config.block_size - 1, verifier)
    return write_speculators(Path(out), target, draft, dtype)


def import_heads(target: Target, source: Path, out: Path) -> Path:
    """`selfspec import`: a speculators DFlash directory -> a dflash heads directory fingerprinted to `target`."""
    return import_directory(target, source, out, "dflash", DFlashHead, imported_artifact)
