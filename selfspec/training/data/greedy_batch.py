"""Greedy replies to many prompts at once: the regeneration's `batched` engine.

HF `generate` over a left-padded batch pays three costs this loop does not: its cache concatenates every layer's
whole keys and values at each step (a quarter of a wide step on a CPU), rows that have finished stay in the batch
until the last one does, and the prefill computes the LM head at every prompt position. Here keys and values are
written in place (`InPlaceLayer`), finished rows leave the batch (their cache rows dropped) once they are a quarter
of it, and the prefill runs rows of similar prompt length together (padding stays small whatever the batch holds)
and asks for the last position's logits only. Each row sees its own prompt (padding masked by a
4D mask, positions counted from its first real token) and its own replies: the tokens are the target's greedy
choices, as `generate` gives them, up to float ties between batch layouts.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ...execution import InPlaceCache
from ...models import Target

DROP_FINISHED = 0.25  # finished rows leave the batch once they are this share of it (each drop copies the cache)
PREFILL_POSITIONS = 4096  # padded prompt positions in one prefill forward
PREFILL_WASTE = 1.2  # ... and at most this many times its real ones (unless the forward is small anyway)


def supports_in_place(target: Target) -> bool:
    """Whether every layer of the target's cache is a full-attention one this loop can write in place (sliding or
    other special layers: use `generate`)."""
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=target.model.config).layers)


def greedy_replies(target: Target, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The target's greedy reply to each prompt: up to `max_new_tokens` tokens, through the first end marker."""
    if not prompts:
        return []
    device, dtype = target.device, target.dtype
    eos = set(target.eos_token_ids)
    rows = sorted(range(len(prompts)), key=lambda row: len(prompts[row]))  # the prompt each batch row answers
    lengths = torch.tensor([len(prompts[row]) for row in rows], device=device)
    width = len(prompts[rows[-1]])
    # Key columns each batch row may attend to: its prompt right-aligned to `width`, then the replies.
    keys = torch.zeros(len(rows), width + max_new_tokens, dtype=dtype, device=device)
    padding = torch.arange(width, device=device) < (width - lengths)[:, None]
    keys[:, :width].masked_fill_(padding, torch.finfo(dtype).min)
    replies: list[list[int]] = [[] for _ in prompts]
    with torch.inference_mode(), target.execution.active():
        cache, logits = _prefill(target, [prompts[row] for row in rows], width)
        next_positions, cached = lengths.clone(), width
        finished_in_batch: set[int] = set()
        for step in range(max_new_tokens):
            chosen = logits.argmax(-1)
            for index, token in enumerate(chosen.tolist()):
                reply = replies[rows[index]]
                if index in finished_in_batch:
                    continue
                reply.append(token)
                if token in eos or len(reply) == max_new_tokens:
                    finished_in_batch.add(index)
            if len(finished_in_batch) == len(rows) or step + 1 == max_new_tokens:
                break
            if len(finished_in_batch) >= DROP_FINISHED * len(rows):
                keep = [index for index in range(len(rows)) if index not in finished_in_batch]
                kept = torch.tensor(keep, dtype=torch.long, device=device)
                cache.batch_select_indices(kept)
                rows = [rows[index] for index in keep]
                chosen, next_positions, keys = chosen[kept], next_positions[kept], keys[kept]
                finished_in_batch = set()
            cached += 1
            logits = target.forward(
                chosen.view(-1, 1),
                attention_mask=keys[:, None, None, :cached],
                position_ids=next_positions.view(-1, 1),
                past_key_values=cache,
            ).logits[:, -1]
            next_positions = next_positions + 1
    return replies


def _prefill(target: Target, prompts: list[list[int]], width: int) -> tuple[DynamicCache, torch.Tensor]:
    """Prompts sorted by length, shortest first -> (a cache holding each prompt right-aligned to `width` columns,
    the last position's logits [rows, vocab]). Consecutive rows prefill together, as many as fit
    PREFILL_POSITIONS at the longest of them with little padding (PREFILL_WASTE), each chunk padded only to its own
    longest prompt."""
    device, dtype = target.device, target.dtype
    cache = _in_place_cache(target)
    logits = []
    start = 0
    while start < len(prompts):
        end, real = start + 1, len(prompts[start])
        while end < len(prompts):
            padded = (end + 1 - start) * len(prompts[end])
            if padded > PREFILL_POSITIONS or padded > max(PREFILL_WASTE * (real + len(prompts[end])), 512):
                break
            end, real = end + 1, real + len(prompts[end])
        chunk_width = len(prompts[end - 1])
        input_ids = torch.zeros(end - start, chunk_width, dtype=torch.long)
        real = torch.zeros(end - start, chunk_width, dtype=torch.bool)
        for row, ids in enumerate(prompts[start:end]):
            input_ids[row, chunk_width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            real[row, chunk_width - len(ids) :] = True
        # Causal among real tokens; a padding query sees itself only (its output is never read).
        causal = torch.ones(chunk_width, chunk_width, dtype=torch.bool).tril()
        visible = (causal & real[:, None, :]) | torch.eye(chunk_width, dtype=torch.bool)
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
        chunk_cache = _in_place_cache(target)
        logits.append(
            target.forward(
                input_ids.to(device),
                attention_mask=mask.unsqueeze(1).to(device),
                position_ids=(real.long().cumsum(-1) - 1).clamp(min=0).to(device),
                past_key_values=chunk_cache,
                logits_to_keep=1,
            ).logits[:, -1]
        )
        for layer, part in zip(cache.layers, chunk_cache.layers, strict=True):
            if layer.storage is None:  # the batch's storage: `width` columns for every row, filled chunk by chunk
                shape = (len(prompts), part.keys.shape[1], width, part.keys.shape[-1])
                layer.update(part.keys.new_zeros(shape), part.values.new_zeros(shape))
            key_store, value_store = layer.storage
            key_store[start:end, :, width - chunk_width : width] = part.keys
            value_store[start:end, :, width - chunk_width : width] = part.values
        start = end
    return cache, torch.cat(logits)


def _in_place_cache(target: Target) -> DynamicCache:
    return InPlaceCache(target.model.config)  # every layer in place: full attention only (see above)
