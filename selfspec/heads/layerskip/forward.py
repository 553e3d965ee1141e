"""The target's own forward with the tuned sublayers skipped (stateless: the drafter owns the cache)."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ...errors import SelfspecError
from ...models import Target, sublayer_style
from .config import SkipPlan


class SkippingForward:
    """The target's forward with sublayers skipped, over its own modules. Stateless: the caller owns the cache."""

    def __init__(self, target: Target, plan: SkipPlan, draft_vocab: torch.Tensor | None, split_all: bool = False):
        model = target.execution.runner  # the module tree the target's path runs (its twin with packed linears)
        inner = getattr(model, "model", None)
        if inner is None or not all(hasattr(inner, name) for name in ("layers", "norm", "rotary_emb")):
            raise SelfspecError(f"layerskip: {type(model).__name__} does not expose model.layers / norm / rotary_emb")
        self.model, self.inner, self.plan = model, inner, plan
        self.layers = list(inner.layers[: target.config.num_hidden_layers])
        self.styles = [sublayer_style(layer, "layerskip") for layer in self.layers]
        self.split_all = split_all  # run every layer as two halves (tests check the halves against the stock layer)
        config = target.config
        layer_types = getattr(config, "layer_types", None)
        window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
        self.windows = [
            window if window and (layer_types is None or layer_types[i] == "sliding_attention") else None
            for i in range(len(self.layers))
        ]
        weight = model.get_output_embeddings().weight.detach()
        bias = getattr(model.get_output_embeddings(), "bias", None)
        self.draft_vocab = draft_vocab
        self.lm_weight = weight if draft_vocab is None else weight[draft_vocab.to(weight.device)].clone()
        self.lm_bias = None if bias is None else (bias if draft_vocab is None else bias[draft_vocab.to(bias.device)])
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def __call__(
        self, input_ids: torch.Tensor, cache: DynamicCache, cached: int, last_only: bool = False
    ) -> torch.Tensor:
        """input_ids [n] after `cached` positions already in `cache` -> draft logits [n, V_draft] (or [1, V_draft] for
        the last position only); appends their KV."""
        n = input_ids.shape[0]
        device = input_ids.device
        positions = torch.arange(cached, cached + n, device=device).view(1, n)
        hidden = self.model.get_input_embeddings()(input_ids.view(1, n))  # [1, n, H]
        rotary = self.inner.rotary_emb(hidden, positions)
        masks = {window: self._mask(cached, n, window, hidden.dtype, device) for window in set(self.windows)}
        for index, layer in enumerate(self.layers):
            run_attention, run_mlp = self.plan.run_attention[index], self.plan.run_mlp[index]
            kwargs = dict(
                attention_mask=masks[self.windows[index]],
                position_ids=positions,
                past_key_values=cache,
                position_embeddings=rotary,
            )
            if run_attention and run_mlp and not self.split_all:
                output = layer(hidden, use_cache=True, **kwargs)
                hidden = output[0] if isinstance(output, tuple) else output
                continue
            sandwich = self.styles[index] == "sandwich"
            if run_attention:
                attended = layer.self_attn(hidden_states=layer.input_layernorm(hidden), **kwargs)[0]
                hidden = hidden + (layer.post_attention_layernorm(attended) if sandwich else attended)
            if run_mlp:
                if sandwich:
                    hidden = hidden + layer.post_feedforward_layernorm(
                        layer.mlp(layer.pre_feedforward_layernorm(hidden))
                    )
                else:
                    hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        if last_only:
            hidden = hidden[:, -1:]
        logits = torch.nn.functional.linear(self.inner.norm(hidden)[0], self.lm_weight, self.lm_bias)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @staticmethod
    def _mask(cached: int, n: int, window: int | None, dtype: torch.dtype, device) -> torch.Tensor | None:
        """[1, 1, n, cached + n] additive causal mask (limited to `window` keys back), or None where one new token may
        see every key."""
        total = cached + n
        if n == 1 and (window is None or total <= window):
            return None
        query = torch.arange(cached, total, device=device).view(n, 1)
        key = torch.arange(total, device=device).view(1, total)
        hidden = key > query
        if window is not None:
            hidden |= query - key >= window
        mask = torch.zeros(n, total, dtype=dtype, device=device).masked_fill_(hidden, torch.finfo(dtype).min)
        return mask.view(1, 1, n, total)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.draft_vocab is None else self.draft_vocab.to(draft_ids.device)[draft_ids]
