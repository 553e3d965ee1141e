"""Compact forms of float32 weights that give back every float32 value exactly, for the compiled `few` graph.

A decoding step at one to sixteen rows is bound by how fast its weights stream from memory, and a float32 weight often
carries less than 32 bits of information a value:
- a checkpoint released in bfloat16 and loaded as float32: each value's lower 16 bits are zero, so its bfloat16 copy
  (half the bytes) widens back to it exactly;
- a model de-quantised from a 4-bit GGUF file (the default SmolLM2 comes as Q4_1): each block of 32 values of a row
  is d * code + m with a float16 scale d and minimum m and a 4-bit code, rounded once to float32. Its Q4_1 coding
  (24 bytes a block: d and m as float32, 16 bytes of codes: 0.75 bytes a weight) gives back fma(d, code, m), which
  is that float32 value bit for bit (d * code is exact, and the sum is rounded once either way).
`compact_weights` finds, for each linear weight of the decoder, the first form that reproduces all of its values
(checked value by value, never assumed), and selfspec's small-row product (native.cpp) multiplies over it exactly as
over the float32 weight: the same products, summed in the same order, so every output is the float32 product's bit
for bit. A weight that no form reproduces stays float32.
"""

from __future__ import annotations

import torch

BLOCK = 32  # weights a Q4_1 block codes
BLOCK_BYTES = 24  # a coded block's bytes: d and m (float32 each), 16 bytes of 4-bit codes
_SCALE_STEPS = (0, -1, 1, -2, 2)  # float16 neighbours of a block's estimated scale that are tried, in this order


def bfloat16_exact(weight: torch.Tensor) -> bool:
    """Whether every float32 value of `weight` is a bfloat16 value (its lower 16 bits zero)."""
    return weight.dtype == torch.float32 and not (weight.detach().contiguous().view(torch.int32) & 0xFFFF).any()


def q4_1_coded(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [N, K] (float32, K a multiple of 32) Q4_1-coded -> bytes [N, K / 32 * 24] (native.cpp's layout), or
    None where some block is not d * code + m rounded once (d and m float16, codes 0..15)."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK or not weight.numel():
        return None
    rows = weight.shape[0]
    blocks = weight.detach().reshape(rows, -1, BLOCK)
    low, high = blocks.amin(-1), blocks.amax(-1)  # the code-0 value is m itself (d * 0 + m)
    if not torch.equal(low.half().float().view(torch.int32), low.view(torch.int32)):
        return None
    estimate = ((high - low) / 15).half().view(torch.int16)
    scale = torch.zeros_like(low)
    codes = torch.zeros(blocks.shape, dtype=torch.uint8)
    left = high > low  # blocks of one value: d = 0, every code 0 (m itself, checked below with the others)
    for step in _SCALE_STEPS:
        if not left.any():
            break
        candidate = (estimate[left] + step).view(torch.float16).float()
        within, base = blocks[left], low[left].unsqueeze(-1)
        trial = torch.round((within - base) / candidate.unsqueeze(-1)).clamp_(0, 15)
        rebuilt = candidate.unsqueeze(-1) * trial + base  # d * code is exact: rounded once, as fma(d, code, m)
        exact = (candidate > 0) & (rebuilt.view(torch.int32) == within.view(torch.int32)).all(-1)  # bits, not values
        found = left.nonzero(as_tuple=True)
        hits = tuple(index[exact] for index in found)
        scale[hits] = candidate[exact]
        codes[hits] = trial[exact].to(torch.uint8)
        left[hits] = False
    if left.any():
        return None
    nibbles = codes[..., : BLOCK // 2] | (codes[..., BLOCK // 2 :] << 4)  # byte j: code j, and code j + 16 above it
    numbers = torch.stack([scale, low], dim=-1).view(torch.uint8)  # [N, K / 32, 8]: d, then m
    return torch.cat([numbers, nibbles], dim=-1).reshape(rows, -1).contiguous()


def compact_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The decoder's linear weights that a compact form reproduces exactly, by their names in the compiled step
    (`model.` + the model's own name) -> their Q4_1 coding (uint8) where it does, else their bfloat16 copy where that
    does. The output embeddings (the LM head, outside the decoder) are left as they are."""
    decoder = {id(module) for module in model.get_decoder().modules()}
    compact = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if type(module) is not torch.nn.Linear or id(module) not in decoder or module.weight.dtype != torch.float32:
                continue
            weight = module.weight.detach()
            coded = q4_1_coded(weight)
            if coded is not None:
                compact[f"model.{name}.weight"] = coded
            elif bfloat16_exact(weight):
                compact[f"model.{name}.weight"] = weight.to(torch.bfloat16)
    return compact


def expanded(compact: torch.Tensor, in_features: int) -> torch.Tensor:
    """A compact weight (as compact_weights gives it) back as float32 [N, in_features]."""
    if compact.dtype == torch.bfloat16:
        return compact.float()
    blocks = compact.view(compact.shape[0], -1, BLOCK_BYTES)
    numbers = blocks[..., :8].contiguous().view(torch.float32)  # [N, K / 32, 2]
    nibbles = blocks[..., 8:]
    codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).float()
    return torch.addcmul(numbers[..., 1:2], numbers[..., 0:1], codes).reshape(compact.shape[0], in_features)
