"""One forward of the unmodified target, over a draft tree or a plain chunk of tokens, reusing the KV cache. `forward`
is the target's forward on its execution path (`Target.forward`), or a transformers model itself (the stock path):
anything called with transformers' keyword arguments."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import Cache

from .inputs import TreeInputs


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor  # [n, V] for the n tokens just forwarded ([0, V]: none, chunk_forward's logits=False)
    hidden: dict[int, torch.Tensor]  # layer index -> [n, H]; index into hidden_states, -1 = the LM head's input


def _collect(outputs, hidden_layers: tuple[int, ...]) -> ForwardOutput:
    hidden = {layer: outputs.hidden_states[layer][0] for layer in hidden_layers}
    return ForwardOutput(logits=outputs.logits[0], hidden=hidden)


def tree_forward(
    forward: Callable, cache: Cache, inputs: TreeInputs, hidden_layers: tuple[int, ...] = ()
) -> ForwardOutput:
    """Run the target over the tree nodes under the tree mask; the nodes' KV is appended to `cache`."""
    with _masked_attention_kernels(inputs):
        outputs = forward(
            input_ids=inputs.input_ids,
            position_ids=inputs.position_ids,
            attention_mask=inputs.attention_mask,
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=bool(hidden_layers),
        )
    return _collect(outputs, hidden_layers)


def _masked_attention_kernels(inputs: TreeInputs):
    """On CUDA, keep SDPA's cuDNN backend away from tree masks: it builds a new execution plan for every new key
    length, i.e. at every decoding step (docs/execution.md)."""
    if inputs.attention_mask is None or inputs.attention_mask.device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def chunk_forward(
    forward: Callable,
    cache: Cache,
    input_ids: torch.Tensor,
    hidden_layers: tuple[int, ...] = (),
    logits: bool = True,
) -> ForwardOutput:
    """Plain causal forward of `input_ids` [1, m] after whatever `cache` holds (used for prefill). `logits=False`: no
    position's logits ([0, V]; transformers' `logits_to_keep` as an empty index), for a prefill that reads none (its
    last prompt token is the first step's root): the LM head over every position was 14% of a 128-token chunk's time
    on SmolLM2-135M (49,152 x 576), and over the last one alone it still streamed the whole head (1.9 ms of a
    32-position prefill on `compiled`, 3.2 on `q4`)."""
    start = cache.get_seq_length()
    positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device).view(1, -1)
    none = torch.empty(0, dtype=torch.long, device=input_ids.device)
    outputs = forward(
        input_ids=input_ids,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=bool(hidden_layers),
        **({} if logits else {"logits_to_keep": none}),
    )
    return _collect(outputs, hidden_layers)
