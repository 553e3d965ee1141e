"""Execution paths of the target's forward: `stock` (transformers as it is) and `fast`.

On a CPU in float32, `fast` changes three things, each through a public hook of transformers or PyTorch:
- every `nn.Linear` of the target runs with its weight pre-packed once for oneDNN's small-row GEMMs. Stock PyTorch
  takes a gemv for one row and, for 2+ rows, a GEMM that repacks the weight on every call, so a forward over a
  2-16-node tree costs 1.5-2.2x a one-token step although it reads the same weights; with the weights packed once,
  the GEMM for 16 rows reads them as one row does. Projections that read the same input (a layer's q, k and v) run
  as one GEMM over their concatenated weights. The packed modules are built from the stock modules' own weights and
  the stock modules are put back after use. Below a row count measured once per machine (`RowDispatch`) they call
  the stock kernel instead: on some CPUs it beats the packed one at a few rows (an AVX-512 Xeon: up to 3 rows),
  on others it never does (an AVX2 EPYC).
- attention under a tree mask runs SDPA on the grouped key/value heads (`enable_gqa`, registered with transformers'
  `AttentionInterface`): stock transformers copies every layer's cached keys and values once per query-head group
  whenever a mask is given, i.e. at every tree step.
- the KV cache (`new_cache`) writes each step's keys and values in place into storage reserved ahead, instead of
  concatenating every layer's whole cache at every step; compaction moves the accepted nodes within that storage.
No modelling code is copied. Elsewhere (CUDA, other dtypes, a PyTorch without oneDNN) `fast` is the stock path,
and says so.

`compiled` is `fast` with the decoding steps (1-64 new tokens after a cache) compiled ahead of time by AOTInductor
(selfspec.compiled): inside `active()` the model's forward routes those steps to the compiled graphs and anything
else (prefill) to the eager fast path.

The path is active only inside `ExecutionPath.active()`, which the decoding loop enters for a whole generation:
transformers' own `generate`, training and anything else that uses the model outside it run the stock modules.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import statistics
import sys
import time
from typing import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .compiled import COMPILE_ENV, CompiledStep, compiler_available
from .errors import SelfspecError, first_line
from .files import atomic_write_text, cache_root, cpu_signature

KERNEL_CHOICES = ("auto", "stock", "fast", "compiled")
_PACK_ROWS = 16  # the batch size oneDNN packs for: the tree sizes that matter on a CPU
# `auto` packs only models whose linear layers hold at least this many weights: below it the weights sit in cache
# anyway and oneDNN's per-call overhead outweighs what packing saves (tiny test models run faster stock).
AUTO_MIN_WEIGHTS = 1 << 20


STOCK_ROWS_ENV = "SELFSPEC_STOCK_ROWS"  # fixes RowDispatch.stock_rows instead of measuring it (tests, or by hand)
CALIBRATION_ROWS = (1, 2, 3, 4, 6, 8)  # row counts timed; from the first where packing wins, it is used
_ALWAYS_STOCK = 1 << 30


class RowDispatch:
    """Which kernel the fast path's linear layers call for an input of r rows: the stock one (MKL's gemv or GEMM) when
    r < `stock_rows`, the packed oneDNN one otherwise. One object is shared by every packed module of a path (the
    target's and its drafters'), so one measurement sets them all."""

    def __init__(self, stock_rows: int = 1):
        self.stock_rows = stock_rows
        self.source = "default"  # where stock_rows came from: default, env, measured, or the cached file

    def use_stock(self, hidden: torch.Tensor) -> bool:
        return hidden.numel() < self.stock_rows * hidden.shape[-1]  # rows = numel / in_features


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] weight packed once by oneDNN for small-row products (see `packed_linear`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS)


def packed_linear(hidden: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """hidden [..., in] x a packed weight (+ bias) -> [..., out]."""
    rows = hidden.reshape(-1, hidden.shape[-1])  # [..., in] -> [rows, in]
    output = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return output.view(*hidden.shape[:-1], out_features)


def _plain_linears(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Linear]]:
    """(parent, attribute, layer) for every plain nn.Linear inside `module`."""
    return [(parent, attribute, child) for parent in module.modules() for attribute, child in parent.named_children()
            if type(child) is torch.nn.Linear]


class PackedLinear(torch.nn.Module):
    """A frozen nn.Linear whose weight oneDNN has packed once. Inference only: the packed copy is not trainable. The
    stock parameters stay registered (shared), so code that reads `.weight` and the state dict are unchanged."""

    def __init__(self, linear: torch.nn.Linear, dispatch: RowDispatch):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = pack_weight(linear.weight)
        self._bias = None if linear.bias is None else linear.bias.detach()
        self.dispatch = dispatch

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.dispatch.use_stock(hidden):
            return F.linear(hidden, self.weight, self.bias)
        return packed_linear(hidden, self.packed, self._bias, self.out_features)


# Linear layers of one module that read the same input: on the fast path each group runs as one GEMM over the
# concatenated weights (one pass over the input, one call instead of three).
SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"),)


class SharedInputProduct:
    """The product of an input with the concatenated weights of sibling linear layers (a layer's q/k/v projections).
    Whichever member is called first with an input computes every member's output; the others take theirs if they
    are called with that same tensor, and recompute otherwise, so any call order or a lone call stays correct."""

    def __init__(self, layers: list[torch.nn.Linear], dispatch: RowDispatch):
        self.layers, self.dispatch = layers, dispatch
        with torch.no_grad():
            self.packed = pack_weight(torch.cat([layer.weight for layer in layers]))
            biases = [layer.bias if layer.bias is not None else layer.weight.new_zeros(layer.out_features) for layer in layers]
            self.bias = None if all(layer.bias is None for layer in layers) else torch.cat(biases).detach()
        ends = torch.tensor([layer.out_features for layer in layers]).cumsum(0).tolist()
        self.bounds = list(zip([0] + ends[:-1], ends))
        self.out_features = ends[-1]
        self.input: torch.Tensor | None = None
        self.outputs: list[torch.Tensor | None] = []

    def output(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        if self.dispatch.use_stock(hidden):  # each member on its own, as stock
            return F.linear(hidden, self.layers[index].weight, self.layers[index].bias)
        if self.input is not hidden or self.outputs[index] is None:
            full = packed_linear(hidden, self.packed, self.bias, self.out_features)
            self.input, self.outputs = hidden, [full[..., start:end] for start, end in self.bounds]
        output, self.outputs[index] = self.outputs[index], None
        if all(pending is None for pending in self.outputs):
            self.input = None  # nothing held between calls
        return output.contiguous()


class SharedInputLinear(torch.nn.Module):
    """One member of a `SharedInputProduct`, standing in for a frozen nn.Linear (whose parameters stay registered)."""

    def __init__(self, linear: torch.nn.Linear, product: SharedInputProduct, index: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.product, self.index = product, index

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.product.output(self.index, hidden)


def _shared_input_swaps(module: torch.nn.Module, dispatch: RowDispatch) -> list[tuple[torch.nn.Module, str, torch.nn.Module, torch.nn.Module]]:
    swaps = []
    for parent in module.modules():
        for names in SHARED_INPUT_GROUPS:
            layers = [getattr(parent, name, None) for name in names]
            if all(type(layer) is torch.nn.Linear for layer in layers) and len({(layer.in_features, layer.weight.dtype)
                                                                                 for layer in layers}) == 1:
                product = SharedInputProduct(layers, dispatch)
                swaps += [(parent, name, layer, SharedInputLinear(layer, product, index))
                          for index, (name, layer) in enumerate(zip(names, layers))]
    return swaps


GROUPED_SDPA = "selfspec_grouped_sdpa"  # the attention implementation the fast path switches `sdpa` models to


def grouped_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' `sdpa` attention, except that under a mask the grouped key/value heads go to SDPA as they are
    (`enable_gqa`) instead of being repeated per query head: same products, no copy of the cache. Anything else
    (no mask, no grouping, position biases, paged caches) is the stock function."""
    if (attention_mask is None or getattr(module, "num_key_value_groups", 1) == 1
            or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None or kwargs.get("softcap") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)


class InPlaceLayer(DynamicLayer):
    """A full-attention cache layer whose keys and values live in storage reserved ahead (doubled when full): a step
    writes its positions in place, and `keys`/`values` are views of the filled prefix. Compaction after verification
    (`keep`) and trimming (`truncate`) move or drop positions inside that storage."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_store = self._value_store = None
        self.length = 0

    def _reserve(self, needed: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        capacity = 0 if self._key_store is None else self._key_store.shape[-2]
        if needed <= capacity:
            return
        capacity = max(256, 2 * needed)
        key_store = key_states.new_empty(*key_states.shape[:-2], capacity, key_states.shape[-1])
        value_store = value_states.new_empty(*value_states.shape[:-2], capacity, value_states.shape[-1])
        if self.length:
            key_store[..., : self.length, :] = self.keys
            value_store[..., : self.length, :] = self.values
        self._key_store, self._value_store = key_store, value_store

    def reserve(self, needed: int) -> None:
        """Room for `needed` positions in storage (for writers other than `update`: the compiled step)."""
        self._reserve(needed, self._key_store, self._value_store)

    def _expose(self, length: int) -> None:
        self.length = length
        self.keys = self._key_store[..., :length, :]
        self.values = self._value_store[..., :length, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        self._reserve(end, key_states, value_states)
        self._key_store[..., start:end, :] = key_states
        self._value_store[..., start:end, :] = value_states
        self._expose(end)
        return self.keys, self.values

    def keep(self, base: int, offsets: torch.Tensor) -> None:
        """Keep positions [0, base) and then base + offsets (ascending), packed together from `base` on."""
        kept = offsets.numel()
        moved_keys = self._key_store[..., base:, :].index_select(-2, offsets)
        moved_values = self._value_store[..., base:, :].index_select(-2, offsets)
        self._key_store[..., base : base + kept, :] = moved_keys
        self._value_store[..., base : base + kept, :] = moved_values
        self._expose(base + kept)

    def truncate(self, length: int) -> None:
        if self.is_initialized and self._key_store is not None:
            self._expose(min(length, self.length))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, got {tokens_to_remove}")
        if tokens_to_remove:
            self.truncate(max(0, self.length + tokens_to_remove))

    def reset(self) -> None:
        self._key_store = self._value_store = None
        self.length = 0
        super().reset()


def fast_path_available(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """(whether `fast` differs from `stock` here, why not if it does not)."""
    if device.type != "cpu":
        return False, f"no fast path for {device.type} yet: the stock kernels run"
    if dtype != torch.float32:
        return False, f"the CPU fast path packs float32 weights; this model is {str(dtype).replace('torch.', '')}"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False, "this PyTorch build has no oneDNN linear kernels"
    return True, ""


def _time_pass(modules: list[torch.nn.Module], inputs: dict[int, torch.Tensor]) -> float:
    began = time.perf_counter()
    for module in modules:
        module(inputs[module.in_features])
    return time.perf_counter() - began


def measure_stock_rows(modules: list[torch.nn.Module], dispatch: RowDispatch, repeats: int = 5) -> tuple[int, dict]:
    """Time one pass over every packed module (in forward order, so the weights stream from memory as in a forward)
    with the stock and the packed kernels, interleaved, at each of CALIBRATION_ROWS -> (stock_rows: one past the
    largest row count up to which stock wins at every size, {rows: [stock ms, packed ms]}: the medians)."""
    kept, timings = dispatch.stock_rows, {}
    try:
        with torch.inference_mode():
            for rows in CALIBRATION_ROWS:
                inputs = {size: torch.randn(1, rows, size) * 0.1 for size in {module.in_features for module in modules}}
                samples = {_ALWAYS_STOCK: [], 0: []}
                for _ in range(repeats + 1):  # the first round warms up and is dropped
                    for mode in samples:
                        dispatch.stock_rows = mode
                        samples[mode].append(_time_pass(modules, inputs))
                timings[rows] = [round(statistics.median(samples[mode][1:]) * 1e3, 3) for mode in samples]
    finally:
        dispatch.stock_rows = kept
    stock_rows = 1
    for rows in CALIBRATION_ROWS:
        if timings[rows][0] >= timings[rows][1]:
            break
        stock_rows = rows + 1
    return stock_rows, timings


def calibrate(dispatch: RowDispatch, modules: list[torch.nn.Module]) -> None:
    """Set `dispatch.stock_rows` for these modules on this machine: $SELFSPEC_STOCK_ROWS, else the stored result for
    this machine and these weight shapes, else measured now (a few seconds, once) and stored."""
    if os.environ.get(STOCK_ROWS_ENV):
        dispatch.stock_rows, dispatch.source = max(1, int(os.environ[STOCK_ROWS_ENV])), f"${STOCK_ROWS_ENV}"
        return
    shapes = sorted(tuple(module.weight.shape) for module in modules)
    signature = hashlib.sha1(repr(shapes).encode()).hexdigest()[:12]
    path = cache_root() / "profiles" / f"cpu-{cpu_signature()}-{torch.get_num_threads()}threads--linears-{signature}--stock-rows.json"
    if path.is_file():
        dispatch.stock_rows, dispatch.source = int(json.loads(path.read_text())["stock_rows"]), str(path)
        return
    dispatch.stock_rows, timings = measure_stock_rows(modules, dispatch)
    dispatch.source = f"measured, stored in {path}"
    atomic_write_text(path, json.dumps({"stock_rows": dispatch.stock_rows, "ms_stock_packed": timings}, indent=1) + "\n")


def _linear_weights(model: torch.nn.Module) -> int:
    return sum(module.weight.numel() for module in model.modules() if isinstance(module, torch.nn.Linear))


class ExecutionPath:
    """How the target's forward runs. `kernels`: 'stock', 'fast', 'compiled' (fast, with the decoding steps compiled
    ahead of time: selfspec.compiled), or 'auto' (the best of these that exists here)."""

    def __init__(self, model: torch.nn.Module, kernels: str = "auto", model_name: str = "model"):
        if kernels not in KERNEL_CHOICES:
            raise SelfspecError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got '{kernels}'")
        parameter = next(model.parameters())
        available, reason = fast_path_available(parameter.device, parameter.dtype)
        if kernels in ("fast", "compiled") and not available:
            raise SelfspecError(f"--kernels {kernels}: {reason}; use --kernels stock or auto")
        if kernels == "auto" and available and _linear_weights(model) < AUTO_MIN_WEIGHTS:
            available, reason = False, "a model this small runs faster on the stock kernels"
        compiles, why_not = compiler_available(model) if available else (False, reason)
        if kernels == "compiled" and not compiles:
            raise SelfspecError(f"--kernels compiled: {why_not}; use --kernels fast or auto")
        if kernels == "auto" and compiles and os.environ.get(COMPILE_ENV, "1") == "0":
            compiles, why_not = False, f"${COMPILE_ENV}=0"
        self.model = model
        self.requested = kernels
        self.name = "stock"
        if kernels in ("fast", "compiled", "auto") and available:
            self.name = "compiled" if kernels in ("compiled", "auto") and compiles else "fast"
        self.note = reason if kernels == "auto" and not available else (
            f"no compiled step: {why_not}" if kernels == "auto" and self.name == "fast" else "")
        self.compiled = CompiledStep(model, model_name, InPlaceLayer) if self.name == "compiled" else None
        self._swaps: list[tuple[torch.nn.Module, str, torch.nn.Module, torch.nn.Module]] | None = None
        self.dispatch = RowDispatch()  # calibrated when the swaps are built
        self._depth = 0  # nested activations: only the outermost swaps modules in and out

    def _build_swaps(self) -> list[tuple[torch.nn.Module, str, torch.nn.Module, torch.nn.Module]]:
        """(parent, attribute, stock module, fast module) for every nn.Linear of the model, packed once: sibling
        projections that read one input (SHARED_INPUT_GROUPS) as one GEMM, the others each on its own."""
        with torch.no_grad():
            swaps = _shared_input_swaps(self.model, self.dispatch)
            shared = {id(stock) for _, _, stock, _ in swaps}
            swaps += [(parent, attribute, child, PackedLinear(child, self.dispatch))
                      for parent, attribute, child in _plain_linears(self.model) if id(child) not in shared]
        calibrate(self.dispatch, [fast for _, _, _, fast in swaps])
        return swaps

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run the model on this path inside the block; the stock modules are back afterwards, whatever happens."""
        if self.name == "stock" or self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        config = self.model.config
        attention = config._attn_implementation
        if attention == "sdpa":
            config._attn_implementation = GROUPED_SDPA
        try:
            if self.compiled is not None:
                self._load_compiled()  # traces the stock modules, so before the packed ones go in
            if self._swaps is None:
                self._swaps = self._build_swaps()
        except BaseException:
            config._attn_implementation = attention
            raise
        for parent, attribute, _, packed in self._swaps:
            setattr(parent, attribute, packed)
        if self.compiled is not None:
            self.model.forward = self.compiled.route(type(self.model).forward.__get__(self.model))
        self._depth = 1
        try:
            yield
        finally:
            self._depth = 0
            self.model.__dict__.pop("forward", None)
            config._attn_implementation = attention
            for parent, attribute, stock, _ in self._swaps:
                setattr(parent, attribute, stock)

    def _load_compiled(self) -> None:
        """Load (or compile, once per machine) the compiled steps. Under `auto` a failure leaves the fast path, said
        once; asked for by name, it is an error."""
        try:
            self.compiled.load()
        except (KeyboardInterrupt, SelfspecError):
            raise
        except Exception as error:  # noqa: BLE001  (export and C++ compilation fail in many ways)
            reason = first_line(error)[:200]
            if self.requested == "compiled":
                raise SelfspecError(f"--kernels compiled: compiling the step failed ({reason}); use --kernels fast") from None
            print(f"[selfspec] no compiled step ({reason}): the fast path runs", file=sys.stderr, flush=True)
            self.name, self.note, self.compiled = "fast", f"no compiled step: {reason}", None

    def pack(self, module: torch.nn.Module) -> bool:
        """For a drafter's own frozen, inference-only modules (its heads): on `fast` and `compiled`, every nn.Linear inside is
        swapped for good for a packed one, as the target's are inside `active()`. Returns whether it packed."""
        if self.name == "stock":
            return False
        with torch.no_grad():
            for parent, attribute, child in _plain_linears(module):
                setattr(parent, attribute, PackedLinear(child, self.dispatch))
        return True

    def new_cache(self) -> DynamicCache:
        """A KV cache for this path: on `fast` and `compiled`, full-attention layers are written in place (InPlaceLayer)."""
        cache = DynamicCache(config=self.model.config)
        if self.name != "stock":
            cache.layers = [InPlaceLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
        return cache

    def invalidate(self) -> None:
        """Forget the packed weights and compiled steps (after the model's weights change, e.g. an adapter merged into
        it): the next activation packs, and loads or compiles, for the new weights."""
        self._swaps = None
        if self.compiled is not None:
            self.compiled.runners = None
