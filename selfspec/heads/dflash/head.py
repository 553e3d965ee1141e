"""The DFlash head: its config, the draft decoder layers (stock transformers Qwen3 modules of the target's width),
the context rows made from the target's features, the block forward (drafting and training share it) and the
training mask. Submodule names follow the speculators layout, so export and import copy weights as they are."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from ...errors import SelfspecError
from ...models import Target, sublayer_style
from ..speculators import resolve_aux_layers
from ..vocab import ReducedVocabHead

MAX_LAYERS = 8


@dataclass(frozen=True)
class DFlashConfig:
    block_size: int = 16  # B: the last committed token, then B - 1 masked positions drafted in one pass
    num_layers: int = 1  # bidirectional drafter layers (Qwen3 decoder layers of the target's width), 1 to 8
    feature_layers: tuple[int, ...] = ()  # target hidden_states indices it is conditioned on; () = 2, N // 2, N - 3
    draft_vocab_size: int = 8192  # the most frequent target tokens in the training labels; 0 = full vocabulary
    mask_token_id: int = (
        -1
    )  # whose embedding fills the masked positions; -1: training picks the rarest token in its data
    own_lm_head: bool = False  # the drafter carries its own draft LM head (imported drafters that trained one)
    loss_decay: float = 0.8  # training: the loss weight of block position i is decay**(i - 1)
    anchors_per_sequence: int = 8  # training: random block starts per sequence and step
    top_k: int = 4  # drafting: candidate tokens per block position
    max_tree_nodes: int = 32  # upper bound; the size used follows the cost curve and the draft's confidence


def resolve_feature_layers(config: DFlashConfig, num_layers: int) -> tuple[int, ...]:
    return resolve_aux_layers("dflash", config.feature_layers, num_layers)


def draft_layer_config(target: Target, num_layers: int) -> Qwen3Config:
    """The drafter's decoder layers: Qwen3's (DFlash's), with the target's width, heads, MLP size and RoPE."""
    source = target.config
    heads = source.num_attention_heads
    config = Qwen3Config(
        vocab_size=target.vocab_size,
        hidden_size=source.hidden_size,
        intermediate_size=source.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(source, "num_key_value_heads", None) or heads,
        head_dim=getattr(source, "head_dim", None) or source.hidden_size // heads,
        hidden_act=getattr(source, "hidden_act", None) or getattr(source, "hidden_activation", "silu"),
        max_position_embeddings=source.max_position_embeddings,
        rms_norm_eps=getattr(source, "rms_norm_eps", 1e-6),
        rope_parameters=dict(
            getattr(source, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
        ),
        attention_bias=False,
        tie_word_embeddings=False,
        attn_implementation="sdpa",  # the head's own config (never the target's), through the public argument
    )
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
            raise SelfspecError(
                f"dflash: mask_token_id {config.mask_token_id} is not a token of this model "
                f"(0 .. {target.vocab_size - 1}); training picks one when it is -1"
            )
        model, hidden_size = target.model, target.config.hidden_size
        self.config = config
        self.feature_layers = resolve_feature_layers(config, target.config.num_hidden_layers)
        self.layer_config = draft_layer_config(target, config.num_layers)
        eps = self.layer_config.rms_norm_eps
        self.fc = torch.nn.Linear(len(self.feature_layers) * hidden_size, hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden_size, eps=eps)
        self.layers = torch.nn.ModuleList(
            Qwen3DecoderLayer(self.layer_config, layer_idx=i) for i in range(config.num_layers)
        )
        for layer in self.layers:
            layer.self_attn.is_causal = False  # a block attends both ways; what each row sees is the mask's (or all)
        self.norm = Qwen3RMSNorm(hidden_size, eps=eps)
        self.rotary_emb = Qwen3RotaryEmbedding(self.layer_config)
        self.attach_draft_vocab(model.get_output_embeddings().weight, draft_vocab, config.own_lm_head)
        self.attach_embeddings(model)

    def init_from_target(self, target: Target) -> None:
        """Start from the target's own top layers: their projections and MLP where the shapes match, their norms'
        effective scales for pre-norm bases, and the target's final norm; training then adapts them."""
        layers, size = target.model.model.layers, target.config.hidden_size
        for index, layer in enumerate(self.layers):
            source = layers[len(layers) - len(self.layers) + index]
            own = layer.state_dict()
            copied = {
                name: tensor
                for name, tensor in source.state_dict().items()
                if name in own and "norm" not in name and tensor.shape == own[name].shape
            }
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
        return self.embed(ids, self.fc.weight.dtype)

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
            output = layer(
                block,
                attention_mask=attention_mask,
                position_ids=block_positions,
                past_key_values=cache,
                use_cache=True,
                position_embeddings=rotary,
            )
            block = output[0] if isinstance(output, tuple) else output
        return self.norm(block)

    def blocks(self, features: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Training's view: features [b, L, F] and input_ids [b, L] of whole sequences, anchors [b, A] -> outputs
        [b, A, B, H] of every anchor's block, each seeing the context rows before its anchor and its own block."""
        count, length = input_ids.shape
        block = self.config.block_size
        inputs = self.block_inputs(input_ids.gather(1, anchors).view(-1)).view(count, anchors.shape[1] * block, -1)
        offsets = torch.arange(block, device=anchors.device)
        positions = torch.cat(
            [
                torch.arange(length, device=anchors.device).expand(count, -1),
                (anchors.unsqueeze(-1) + offsets).view(count, -1),
            ],
            dim=1,
        )
        mask = training_mask(anchors, length, block, inputs.dtype)
        return self(self.context(features), inputs, positions, mask).view(count, anchors.shape[1], block, -1)


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
