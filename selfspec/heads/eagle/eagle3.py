"""`eagle3`: the EAGLE-3 head, in the standard layout that vLLM, SGLang and the speculators library load
(`selfspec export --format speculators`, `selfspec import`, and `--heads` pointing at such a directory: speculators.py).

Two things differ from EAGLE-1 (`eagle`):
- The target features are the hidden states of a low, a middle and a high layer (hidden_states indices 2, N // 2 and
  N - 3 by default), concatenated and projected by `fc` (3H -> H, no bias).
- The decoder layer reads [embedding of token j, feature of position j - 1] side by side (2H wide q/k/v
  projections), each half through its own norm (`input_layernorm`, `hidden_norm`), with the feature as the residual.
  The head predicts no feature: its output goes through its own final `norm` into the draft LM head, and that same
  output is the feature its next draft step reads.
Trained with the training-time test (several draft steps unrolled on the head's own outputs) and a token loss only.
Drafting, caching and tree growth are EAGLE's (heads/eagle/drafter.py): only the head differs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import SelfspecError
from ...models import Target, sublayer_style
from ..artifacts import HeadArtifact
from ..base import check_at_least_one, register_drafter
from ..speculators import (
    SpeculatorsDraft,
    config_document,
    default_aux_layers,
    export_state,
    head_for_export,
    import_directory,
    read_speculators,
    resolve_aux_layers,
    write_speculators,
)
from .drafter import EagleConfig, EagleDrafter, EagleFamilyHead, EagleOptions

LAYER_TYPES = ("llama", "qwen3")  # the draft decoder layers speculators defines for EAGLE-3
_UNSUPPORTED_OPTIONS = ("norm_before_fc", "fc_norm", "norm_output")  # speculators variants selfspec's head lacks


@dataclass(frozen=True)
class Eagle3Config(EagleConfig):
    feature_noise: float = 0.0  # the training-time test stands in for EAGLE-1's input noise
    hidden_weight: float = 0.0  # EAGLE-3 predicts no feature: must stay 0
    token_weight: float = 1.0
    unroll_steps: int = 3  # training: draft steps per position, the ones after the first on the head's own outputs
    feature_layers: tuple[int, ...] = ()  # target hidden_states indices fused by fc; () = 2, N // 2, N - 3
    norm_before_residual: bool = False  # the residual is the normalised feature (a speculators option)
    own_lm_head: bool = False  # the head carries its own draft LM head (imported heads that trained one)


@dataclass(frozen=True)
class Eagle3Options(EagleOptions):
    def __post_init__(self) -> None:
        check_at_least_one("eagle3", self)


eagle3_layers = default_aux_layers  # a low, a middle and a high layer: 2, N // 2, N - 3


def resolve_eagle3_layers(config: Eagle3Config, num_layers: int) -> tuple[int, ...]:
    return resolve_aux_layers("eagle3", config.feature_layers, num_layers)


class Eagle3Head(EagleFamilyHead):
    """Submodule names follow the speculators layout (fc, layers.0.*, layers.0.hidden_norm, norm, lm_head), so export
    and import are a renaming-free copy of the weights."""

    def __init__(self, config: Eagle3Config, target: Target, draft_vocab: torch.Tensor):
        super().__init__()
        if config.hidden_weight:
            raise SelfspecError("eagle3 predicts no feature: set hidden_weight to 0")
        model, hidden_size = target.model, target.config.hidden_size
        self.config = config
        self.feature_layers = resolve_eagle3_layers(config, target.config.num_hidden_layers)
        self.fc = torch.nn.Linear(len(self.feature_layers) * hidden_size, hidden_size, bias=False)
        layer = type(model.model.layers[0])(target.config, layer_idx=0)  # the base's own decoder-layer class
        self.style = sublayer_style(layer, "eagle3")
        attention = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):  # they read [embedding, feature]: twice the width
            projection = getattr(attention, name)
            setattr(
                attention,
                name,
                torch.nn.Linear(2 * hidden_size, projection.out_features, bias=projection.bias is not None),
            )
        layer.hidden_norm = copy.deepcopy(layer.input_layernorm)
        self.layers = torch.nn.ModuleList([layer])
        self.norm = copy.deepcopy(model.model.norm)  # the head's own; starts as the target's final norm
        self.rotary = type(model.model.rotary_emb)(config=target.config)
        self.attach_draft_vocab(model.get_output_embeddings().weight, draft_vocab, config.own_lm_head)
        self.attach_embeddings(model)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(features)

    def forward(self, features, tokens, position_ids, attention_mask=None, cache=None) -> torch.Tensor:
        """features [B, T, H] (fc's output for target features, the head's own output for drafted ones), tokens [B, T],
        position_ids [B, T], additive mask [B, 1, T, K] or None (causal, only without a cache) -> output [B, T, H]."""
        layer = self.layers[0]
        normed = layer.hidden_norm(features)
        residual = normed if self.config.norm_before_residual else features
        joined = torch.cat([layer.input_layernorm(self.embed(tokens, features.dtype)), normed], dim=-1)  # [B, T, 2H]
        attended = layer.self_attn(
            hidden_states=joined,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            position_embeddings=self.rotary(features, position_ids),
        )[0]
        if self.style == "sandwich":  # Gemma-2: norms after both sublayers too
            hidden = residual + layer.post_attention_layernorm(attended)
            return hidden + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(hidden)))
        hidden = residual + attended
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().draft_logits(self.norm(hidden))  # the head's own final norm, then its (or the target's) LM head


def check_layer_type(target: Target) -> None:
    model_type = getattr(target.config, "model_type", None)
    if model_type not in LAYER_TYPES:
        raise SelfspecError(
            f"speculators defines EAGLE-3 draft layers for {', '.join(LAYER_TYPES)} models, not "
            f"'{model_type}': this head can be used in selfspec but not exported"
        )


def _layer_config(target: Target) -> dict:
    """The draft decoder layer's transformers config: the target's, one layer deep."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = 1
    config.tie_word_embeddings = False
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1]
    return config_document(
        config, str(target.dtype).removeprefix("torch."), num_hidden_layers=1, vocab_size=target.vocab_size
    )


def imported_artifact(target: Target, directory: Path) -> HeadArtifact:
    """A speculators EAGLE-3 directory -> the eagle3 head artifact for `target` (fingerprinted to it: checked here)."""
    expected = {
        "model_type": target.config.model_type,
        "hidden_size": target.config.hidden_size,
        "vocab_size": target.vocab_size,
        "num_hidden_layers": 1,
    }
    content = read_speculators(directory, target, "eagle3", expected)
    for option in _UNSUPPORTED_OPTIONS:
        if content.fields.get(option):
            raise SelfspecError(
                f"'{directory}' uses the speculators option {option}, which selfspec's EAGLE-3 head does not implement"
            )
    config = Eagle3Config(
        draft_vocab_size=len(content.draft_vocab),
        feature_layers=tuple(content.fields.get("eagle_aux_hidden_state_layer_ids") or ()),
        norm_before_residual=bool(content.fields.get("norm_before_residual")),
        own_lm_head=content.own_lm_head,
    )
    layers = resolve_eagle3_layers(config, target.config.num_hidden_layers)
    config = Eagle3Config(**{**config.__dict__, "feature_layers": layers})
    state = {**content.state, "draft_vocab": content.draft_vocab}
    return HeadArtifact(
        "eagle3", config, state, target.fingerprint, {"imported_from": "speculators", "verifier": content.verifier}
    )


@register_drafter(
    "eagle3", options=Eagle3Options, config=Eagle3Config, recipe="selfspec.training.recipes.eagle:train_eagle_family"
)
class Eagle3Drafter(EagleDrafter):
    """Loads a selfspec heads directory, or a speculators EAGLE-3 one (imported as it loads)."""

    head_cls = Eagle3Head
    speculators_import = staticmethod(imported_artifact)


def export_heads(target: Target, heads_dir: Path, out: Path, verifier: str, dtype: str = "bfloat16") -> Path:
    """`selfspec export --format speculators`: eagle3 heads (selfspec's or speculators') -> a speculators directory."""
    check_layer_type(target)
    head = head_for_export(target, heads_dir, "eagle3", Eagle3Config, Eagle3Head, imported_artifact)
    state = export_state(head)
    fields = {
        "eagle_aux_hidden_state_layer_ids": list(head.feature_layers),
        "norm_before_residual": head.config.norm_before_residual,
        **{option: False for option in _UNSUPPORTED_OPTIONS},
        "embed_requires_grad": False,
    }
    draft = SpeculatorsDraft(
        "eagle3", fields, _layer_config(target), state, head.draft_vocab, head.config.depth, verifier
    )
    return write_speculators(Path(out), target, draft, dtype)


def import_heads(target: Target, source: Path, out: Path) -> Path:
    """`selfspec import`: a speculators EAGLE-3 directory -> an eagle3 heads directory fingerprinted to `target`."""
    return import_directory(target, source, out, "eagle3", Eagle3Head, imported_artifact)
