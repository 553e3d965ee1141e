"""The fast path's attention: under a tree mask, SDPA on the grouped key/value heads (`enable_gqa`), registered with
transformers' `AttentionInterface`. Stock transformers copies every layer's cached keys and values once per
query-head group whenever a mask is given, i.e. at every tree step."""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

GROUPED_SDPA = "selfspec_grouped_sdpa"  # the attention implementation the fast path switches `sdpa` models to


def grouped_sdpa_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """transformers' `sdpa` attention, except that under a mask the grouped key/value heads go to SDPA as they are
    (`enable_gqa`) instead of being repeated per query head: same products, no copy of the cache. Anything else
    (no mask, no grouping, position biases, paged caches) is the stock function."""
    if (
        attention_mask is None
        or getattr(module, "num_key_value_groups", 1) == 1
        or kwargs.get("position_bias") is not None
        or kwargs.get("cache") is not None
        or kwargs.get("softcap") is not None
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
