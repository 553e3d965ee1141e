"""The fast path's attention: under a tree mask, SDPA on the grouped key/value heads (`enable_gqa`), registered with
transformers' `AttentionInterface`. Stock transformers copies every layer's cached keys and values once per
query-head group whenever a mask is given, i.e. at every tree step.

The q4 path's attention must compute each row of a tree as the one-token step at that position does: SDPA's float32
rows depend on how many query rows and keys one call has (its kernels block them), and on the q4 path each difference
of one float32 unit can flip a bfloat16 rounding at the next product's input, so a tree's row would drift from the
one-token step's. `ROW_ATTENTION` is selfspec's own float32 kernel (native.cpp), which computes every row in one fixed
order over the keys it sees (masked keys skipped), so the rows are equal by construction. Where the native kernels
are not built, `FLOAT64_SDPA`: the same SDPA computed in float64 whatever the call, over a float64 cache; there the
differences stay ~1e-16, below what rounding the result to float32 can see (2.8x the native kernel's time over 512
cached positions)."""

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


FLOAT64_SDPA = "selfspec_float64_sdpa"  # the q4 path's attention: rows equal whatever the call's shape


def float64_sdpa_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """SDPA in float64 on the grouped key/value heads (the cache may hold them in float64 already: no copy then),
    the output in the query's dtype. Anything SDPA alone cannot express (position biases, soft-capping, paged
    caches) is an error rather than a silent, shape-dependent fallback."""
    if any(kwargs.get(name) is not None for name in ("position_bias", "softcap", "cache")):
        raise ValueError("the float64 attention takes plain SDPA attention only")
    if is_causal is None:
        is_causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    mask = attention_mask
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(torch.float64)
    groups = query.shape[1] != key.shape[1]
    output = torch.nn.functional.scaled_dot_product_attention(
        query.to(torch.float64),
        key.to(torch.float64),
        value.to(torch.float64),
        attn_mask=mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=bool(is_causal) and mask is None,
        enable_gqa=groups,
    )
    return output.to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register(FLOAT64_SDPA, float64_sdpa_attention)
AttentionMaskInterface.register(FLOAT64_SDPA, sdpa_mask)


ROW_ATTENTION = "selfspec_row_attention"  # the q4 path's attention where selfspec's native kernels are built


def row_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """selfspec's float32 attention whose rows do not depend on the call's shape (native.cpp), on the grouped
    key/value heads as they are. Anything it cannot express (dropout, position biases, soft-capping, paged caches) is
    an error rather than a silent, shape-dependent fallback."""
    from . import native

    if dropout or any(kwargs.get(name) is not None for name in ("position_bias", "softcap", "cache")):
        raise ValueError("the row attention takes plain SDPA attention only")
    if is_causal is None:
        is_causal = attention_mask is None and getattr(module, "is_causal", True)
    mask = attention_mask
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype).masked_fill(~mask, float("-inf"))
    elif mask is None and not is_causal:
        mask = query.new_zeros(query.shape[0], 1, query.shape[2], key.shape[2])
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    output = native.row_attention(query, key, value, mask, float(scale))
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(ROW_ATTENTION, row_attention)
AttentionMaskInterface.register(ROW_ATTENTION, sdpa_mask)
