"""The `q4` execution path's weights: a GGUF file's own 4-bit blocks, multiplied by torch's int4 CPU kernel.

A Q4_1 block holds 32 weights of one row as 4-bit codes q with a float16 scale d and minimum m (weight = d*q + m);
Q4_0 has no minimum (weight = d*(q - 8)). torch's `_weight_int4pack_mm_for_cpu` computes (q - 8) * scale + zero per
group of 32 inputs, so a block maps onto it with the same codes: scale = d, zero = m + 8d (Q4_0: zero = 0). What the
kernel rounds: the scale and zero to bfloat16, the activations to bfloat16 on the way in, its output to bfloat16 on
the way out (the residual stream, norms and attention stay float32). The codes are packed for this CPU at load time
(AVX2 and AVX-512 pack differently); no float32 copy of these weights is ever made.

Two properties make the path exact on its own terms: the kernel's rows do not depend on how many rows one call has
(16 rows at once equal 16 one-row calls, bit for bit; MKL's float32 products do not), and neither do those of the
bfloat16 LM head (`BFloat16Head`), so a tree's row computes what a one-token step computes.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import SelfspecError
from ..memory import into_huge_pages
from . import native
from .head import HeadProxy, stored_head_proxy

GROUP = 32  # weights per GGUF block, and the kernel's group size
# block type -> bytes a block takes: a float16 scale (and a float16 minimum for Q4_1), then 16 bytes of codes
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}
_INNER_K_TILES = 8  # the int4 packing's inner tiling (the CPU kernel takes 2, 4 or 8)


def four_bit_kernel_available() -> bool:
    """Whether this PyTorch has the int4 CPU kernel the path runs on."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )


def unpack_blocks(raw: np.ndarray, block_type: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF tensor's rows of 4-bit blocks, raw bytes [N, K/32 * block bytes] -> (codes [N, K] int32 in 0..15,
    scale [N, K/32] float32, zero [N, K/32] float32) such that weight = (code - 8) * scale + zero."""
    block_bytes = _BLOCK_BYTES[block_type]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, block_bytes)  # [N, K/32, bytes]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
    packed = blocks[..., block_bytes - 16 :]  # [N, K/32, 16]: byte j holds code j (low nibble) and j + 16 (high)
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)  # [N, K]
    if block_type == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8.0 * d
    else:
        zero = np.zeros_like(d)
    return torch.from_numpy(codes.astype(np.int32)), torch.from_numpy(d), torch.from_numpy(zero)


class Q4Linear(torch.nn.Module):
    """A linear layer (no bias) over 4-bit codes packed for torch's int4 CPU kernel, with a scale and a zero per group
    of 32 inputs. Any float input is multiplied in bfloat16 and the output comes back in the input's dtype."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
        """codes [N, K] int32 in 0..15; scale, zero [N, K/32] float32: weight = (code - 8) * scale + zero."""
        super().__init__()
        self.out_features, self.in_features = codes.shape
        if self.in_features % GROUP:
            raise SelfspecError(f"a 4-bit layer's inputs ({self.in_features}) must be a multiple of {GROUP}")
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, _INNER_K_TILES))
        # [K/32, N, 2]: per group and output, (scale, zero), as the kernel reads them
        scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
        self.register_buffer("scales_and_zeros", scales_and_zeros)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, self.in_features).to(torch.bfloat16)  # [..., K] -> [rows, K]
        output = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, self.scales_and_zeros)
        return output.to(hidden.dtype).view(*hidden.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, 4-bit groups of {GROUP}"


class BFloat16Head(torch.nn.Module):
    """The q4 path's LM head: the model's (float32) output matrix multiplied in bfloat16 (a copy of it rounded once),
    which reads half the memory and, unlike MKL's float32 product, gives each row the same result whatever the row
    count. The float32 weight stays registered as `weight` (shared with the model), for code that reads it."""

    def __init__(self, linear: torch.nn.Linear, wide: bool = False):
        """wide: multiply on selfspec's kernel (native.wide_product: the float32 input as it is against the bfloat16
        weight widened, float32 sums; half oneDNN's time at one row), else on oneDNN's bfloat16 product (the input
        rounded to bfloat16 too). A bias keeps oneDNN's."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.wide = wide and linear.bias is None
        weight16 = linear.weight.detach().to(torch.bfloat16)
        self.register_buffer("weight16", (into_huge_pages([weight16]) or [weight16])[0], persistent=False)
        self.register_buffer(
            "bias16", None if linear.bias is None else linear.bias.detach().to(torch.bfloat16), persistent=False
        )
        self.argmax_only: torch.Tensor | None = None  # set while a compiled step runs (`deciding`)

    def add_bounds(self, directory: Path | None = None) -> None:
        """Make greedy steps' int8 proxy and bounds (head.py), once: buffers, which the compiled q4 graph reads as its
        constants (made when it is traced or loaded; the eager path never reads them). `directory`: where the proxy
        is kept between runs (the compiled packages')."""
        if self.wide and not hasattr(self, "proxy_codes"):
            proxy = stored_head_proxy(self.weight16, directory)
            for name in ("codes", "scale", "bound"):
                self.register_buffer(f"proxy_{name}", getattr(proxy, name), persistent=False)

    @contextlib.contextmanager
    def deciding(self, argmax_only: torch.Tensor) -> Iterator[None]:
        """Inside, a forward reads `argmax_only` (a bool tensor: the compiled q4 graph's input) and, where it is true,
        computes exactly only the logits that could be a row's maximum (head.py)."""
        self.argmax_only = argmax_only
        try:
            yield
        finally:
            self.argmax_only = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.wide and hidden.dtype == torch.float32:
            if self.argmax_only is not None:  # the proxy read from the buffers now (export traces them as such)
                proxy = HeadProxy(self.proxy_codes, self.proxy_scale, self.proxy_bound)
                return native.bounded_head(hidden, self.weight16, proxy, self.argmax_only)
            return native.wide_product(hidden, self.weight16)
        # Strides made plain: a prefill's last position (`logits_to_keep`) is a [1, 1, H] view whose batch stride is the
        # prompt's, and oneDNN's bfloat16 product took 47 ms on it against 1.8 ms on the same values laid out afresh.
        hidden16 = hidden.to(torch.bfloat16, memory_format=torch.contiguous_format)
        return F.linear(hidden16, self.weight16, self.bias16).to(hidden.dtype)


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of a GGUF file: its name, GGML type name (F32, Q4_1, ...) and raw bytes, one row per line of the
    innermost dimension ([rows, bytes a row], a view of the mapped file)."""

    name: str
    type_name: str
    data: np.ndarray


# GGUF metadata value types -> their size in bytes (8: string, 9: array, read by _skip_value)
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def read_gguf(file: Path) -> tuple[dict[str, object], dict[str, GgufTensor]]:
    """(the scalar and string metadata, the tensors by name without `.weight`) of a GGUF file, read from its header
    alone: gguf's own reader also decodes every array (a tokenizer's 49K strings: seconds), which this skips."""
    import gguf

    buffer = np.memmap(file, dtype=np.uint8, mode="r")
    view = memoryview(buffer)
    offset = 0

    def take(fmt: str):
        nonlocal offset
        values = struct.unpack_from("<" + fmt, view, offset)
        offset += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string() -> str:
        nonlocal offset
        length = take("Q")
        offset += length
        return bytes(view[offset - length : offset]).decode("utf-8", errors="replace")

    def value(kind: int):
        nonlocal offset
        if kind == 8:
            return string()
        if kind == 9:
            item_kind, count = take("IQ")
            if item_kind in _SCALAR_BYTES:
                offset += _SCALAR_BYTES[item_kind] * count
            else:
                for _ in range(count):
                    value(item_kind)
            return None  # arrays are not needed here
        scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}[kind]
        return take(scalar)

    magic, version = take("4sI")
    if magic != b"GGUF" or version < 2:
        raise SelfspecError(f"'{file.name}' is not a GGUF file of version 2 or later")
    tensor_count, field_count = take("QQ")
    metadata = {}
    for _ in range(field_count):
        key = string()
        metadata[key] = value(take("I"))
    infos = []
    for _ in range(tensor_count):
        name = string()
        dims = [take("Q") for _ in range(take("I"))]
        infos.append((name, dims, take("I"), take("Q")))
    alignment = int(metadata.get("general.alignment", 32))
    start = (offset + alignment - 1) // alignment * alignment
    tensors = {}
    for name, dims, type_id, data_offset in infos:
        kind = gguf.GGMLQuantizationType(type_id)
        block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        row_bytes = dims[0] // block * block_bytes
        rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        data = buffer[start + data_offset : start + data_offset + rows * row_bytes].reshape(rows, row_bytes)
        tensors[name.removesuffix(".weight")] = GgufTensor(name, kind.name, data)
    return metadata, tensors


def runs_four_bit(file: Path) -> bool:
    """Whether `file` is a GGUF the q4 path runs: llama architecture, every decoder linear in Q4_0 or Q4_1 blocks
    (read from its header alone, in milliseconds; a file that is not a readable GGUF is False)."""
    try:
        metadata, tensors = read_gguf(file)
    except (OSError, ValueError, KeyError, struct.error, SelfspecError):
        return False
    linears = [t for t in tensors.values() if t.name.startswith("blk.") and t.name.split(".")[-2] in _LINEAR_NAMES]
    return (
        metadata.get("general.architecture") == "llama"
        and bool(linears)
        and all(t.type_name in _BLOCK_BYTES for t in linears)
    )


# the GGUF names of a llama decoder layer's linears (attention q, k, v, output; the MLP's gate, up, down)
_LINEAR_NAMES = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}


def _reverse_permute(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter interleaves the rotary halves of each head's q/k rows; undo it on rows [N, ...] (the
    same reordering transformers applies when it de-quantises a llama GGUF)."""
    half = tensor.shape[0] // heads // 2
    return tensor.reshape(heads, half, 2, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)


def load_four_bit_model(file: Path, config) -> torch.nn.Module:
    """The model of a llama-architecture GGUF file whose decoder linears are 4-bit blocks (Q4_0 or Q4_1), built
    without a float32 copy of those linears: they become `Q4Linear`s over the file's own codes; every other tensor
    (embeddings, norms, a Q8_0 output matrix) is de-quantised to float32. `config`: the model's transformers config."""
    import gguf
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    metadata, tensors = read_gguf(file)
    architecture = metadata.get("general.architecture")
    if architecture != "llama":
        raise SelfspecError(
            f"--path q4 reads llama-architecture GGUF files; '{file.name}' is '{architecture}': use --path auto"
        )
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    with init_empty_weights(include_buffers=False):  # parameters on `meta`: nothing allocated until read below
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    four_bit = 0
    for module_name, module in list(model.named_modules()):
        if not module_name or (type(module) is not torch.nn.Linear and not list(module.parameters(recurse=False))):
            continue
        tensor = tensors.get(names.get_name(module_name) or "")
        if tensor is None:
            if module_name == "lm_head" and config.tie_word_embeddings:
                continue  # tied below
            raise SelfspecError(f"the GGUF file '{file.name}' has no tensor for {module_name}: it cannot run on q4")
        kind = tensor.type_name
        rows_permuted = heads.get(tensor.name.split(".")[-2] if tensor.name.startswith("blk.") else "")
        if type(module) is torch.nn.Linear and module_name != "lm_head" and kind in _BLOCK_BYTES:
            codes, scale, zero = unpack_blocks(tensor.data, kind)
            if rows_permuted:
                codes, scale, zero = (_reverse_permute(part, rows_permuted) for part in (codes, scale, zero))
            parent_name, _, attribute = module_name.rpartition(".")
            setattr(model.get_submodule(parent_name), attribute, Q4Linear(codes, scale, zero))
            four_bit += 1
            continue
        if type(module) is torch.nn.Linear and module_name != "lm_head":
            raise SelfspecError(
                f"--path q4 needs the GGUF's decoder linears in Q4_0 or Q4_1; {tensor.name} is {kind}: use --path auto"
            )
        values = gguf.quants.dequantize(tensor.data, gguf.GGMLQuantizationType[kind])
        values = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(module.weight.shape)  # own memory
        if rows_permuted:
            values = _reverse_permute(values, rows_permuted)
        module.weight = torch.nn.Parameter(values, requires_grad=False)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.get_input_embeddings().weight
    left = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if left or not four_bit:
        raise SelfspecError(f"the GGUF file '{file.name}' could not fill {left[:3] or 'any 4-bit layer'}")
    return model.eval().requires_grad_(False)


def is_four_bit(model: torch.nn.Module) -> bool:
    """Whether `model` was loaded with 4-bit linears (load_four_bit_model)."""
    return any(isinstance(module, Q4Linear) for module in model.modules())
