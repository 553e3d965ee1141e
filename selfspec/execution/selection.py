"""Which execution path runs a model: a pure function of the path asked for, the model (its device, dtype, size and
cache layers) and the CPU's capabilities, so every branch can be tested with capabilities passed in.

- `stock`: transformers as it is, anywhere.
- `fast`: a CPU in float32 with oneDNN's packed linear kernels (linears.py, attention.py, kv_storage.py).
- `compiled`: `fast` with the decoding steps compiled ahead of time (compiled.py); full-attention caches only, and
  it needs AOTInductor and a C++ compiler.
- `q4`: a GGUF file's own 4-bit blocks on torch's int4 CPU kernel (q4.py): a model loaded for it
  (`load_target(..., path="q4")`) has no float32 copy of its decoder linears, so it runs on `q4` (or as it is,
  `stock`) alone.
- `auto`: the best of these that exists here (`q4` for a model loaded 4-bit, which `load_target` does under `auto`
  for a GGUF with 4-bit linears on a CPU: models.loads_four_bit), except that a tiny model stays on
  `stock` (its weights sit in cache anyway, and oneDNN's per-call overhead outweighs what packing saves) and
  $SELFSPEC_COMPILE=0 keeps it from compiling (`compile_mode`: whether `auto` waits for a compile or builds it in the
  background). Asking for a path that cannot run here is an error naming the reason.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..errors import SelfspecError
from .capabilities import CpuCapabilities, detect_capabilities
from .q4 import four_bit_kernel_available, is_four_bit

PATH_CHOICES = ("auto", "stock", "fast", "compiled", "q4")
# `auto` packs only models whose linear layers hold at least this many weights (tiny test models run faster stock).
AUTO_MIN_WEIGHTS = 1 << 20
COMPILE_ENV = "SELFSPEC_COMPILE"  # how `auto` gets its compiled graphs: COMPILE_MODES
# "1" (the default): built by a background process while requests decode on `fast`; "wait": built before the first
# request (a benchmark that wants every request compiled); "0": never (tests; machines where a minute matters).
COMPILE_MODES = {"1": "background", "background": "background", "wait": "wait", "0": "off"}


def compile_mode() -> str:
    """$SELFSPEC_COMPILE as "background", "wait" or "off"; another value is a SelfspecError."""
    value = os.environ.get(COMPILE_ENV, "1").strip().lower()
    if value not in COMPILE_MODES:
        raise SelfspecError(f"${COMPILE_ENV} must be one of {', '.join(COMPILE_MODES)}, got '{value}'")
    return COMPILE_MODES[value]


@dataclass(frozen=True)
class ModelTraits:
    """What path selection needs to know of a model."""

    device_type: str  # "cpu", "cuda", ...
    dtype: torch.dtype
    linear_weights: int  # weights held by its nn.Linear layers
    full_attention_only: bool  # every layer of its cache is a full-attention DynamicLayer (what compiled steps cover)
    four_bit: bool = False  # loaded with 4-bit linears (q4.load_four_bit_model): it runs on the q4 path


def model_traits(model: torch.nn.Module) -> ModelTraits:
    parameter = next(model.parameters())
    linear_weights = sum(module.weight.numel() for module in model.modules() if isinstance(module, torch.nn.Linear))
    full_attention = all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)
    return ModelTraits(parameter.device.type, parameter.dtype, linear_weights, full_attention, is_four_bit(model))


@dataclass(frozen=True)
class PathChoice:
    name: str  # "stock", "fast", "compiled", "q4" or "q4-compiled"
    note: str = ""  # under `auto`, why a faster path does not run here ("" when none is missing)


def fast_path_available(
    device: torch.device | str, dtype: torch.dtype, cpu: CpuCapabilities | None = None
) -> tuple[bool, str]:
    """(whether `fast` differs from `stock` here, why not if it does not); `cpu`: this machine's when not given."""
    device_type = torch.device(device).type
    if device_type != "cpu":
        return False, f"no fast path for {device_type} yet: the stock kernels run"
    if dtype != torch.float32:
        return False, f"the CPU fast path packs float32 weights; this model is {str(dtype).replace('torch.', '')}"
    if not (cpu or detect_capabilities()).onednn_linear:
        return False, "this PyTorch build has no oneDNN linear kernels"
    return True, ""


def compile_support(cpu: CpuCapabilities, model: ModelTraits | None = None) -> tuple[bool, str]:
    """(whether AOTInductor can build the steps of `model` here, why not); no model: whether it can build any."""
    if model is not None and not model.full_attention_only:
        return False, "the compiled step covers full-attention caches only (this model has sliding-window layers)"
    if not cpu.aot_inductor:
        return False, "this PyTorch has no AOTInductor"
    if not cpu.cxx_compiler:
        return False, "no C++ compiler (g++) on this machine"
    return True, ""


def select_path(path: str, model: ModelTraits, cpu: CpuCapabilities, auto_compiles: bool = True) -> PathChoice:
    """The path `path` (a PATH_CHOICES entry) gives this model on this CPU; `auto_compiles`: False where
    $SELFSPEC_COMPILE=0. A named path that cannot run here is a SelfspecError saying why and what to use instead."""
    if path not in PATH_CHOICES:
        raise SelfspecError(f"the execution path must be one of {', '.join(PATH_CHOICES)}, got '{path}'")
    if model.four_bit or path == "q4":
        return _four_bit_choice(path, model, cpu, auto_compiles)
    available, reason = fast_path_available(model.device_type, model.dtype, cpu)
    if path in ("fast", "compiled") and not available:
        raise SelfspecError(f"--path {path}: {reason}; use --path stock or auto")
    if path == "stock":
        return PathChoice("stock")
    if path == "auto" and available and model.linear_weights < AUTO_MIN_WEIGHTS:
        available, reason = False, "a model this small runs faster on the stock path"
    if not available:  # only `auto` gets here
        return PathChoice("stock", reason)
    compiles, why_not = compile_support(cpu, model)
    if path == "compiled" and not compiles:
        raise SelfspecError(f"--path compiled: {why_not}; use --path fast or auto")
    if path != "auto":
        return PathChoice(path)
    if compiles and not auto_compiles:
        compiles, why_not = False, f"${COMPILE_ENV}=0"
    return PathChoice("compiled") if compiles else PathChoice("fast", f"no compiled step: {why_not}")


def _four_bit_choice(path: str, model: ModelTraits, cpu: CpuCapabilities, auto_compiles: bool) -> PathChoice:
    """A model loaded with 4-bit linears runs on `q4` (under `q4` or `auto`) or as it is (`stock`), not on the paths
    that pack float32 weights; `q4` needs such a model. Its steps compiled (`q4-compiled`, built in the background as
    the float32 graphs are) where AOTInductor can build them and $SELFSPEC_COMPILE is not 0."""
    if not model.four_bit:
        raise SelfspecError(
            "--path q4 runs a GGUF file's 4-bit blocks: load the model with --path q4 from a .gguf file (or 'default')"
        )
    if path == "stock":
        return PathChoice("stock")
    if path not in ("q4", "auto"):
        raise SelfspecError(
            f"--path {path}: this model was loaded with 4-bit linears, which run on --path q4 only; load it again "
            f"with --path {path} for its float32 weights"
        )
    if model.device_type != "cpu" or not four_bit_kernel_available():
        raise SelfspecError("--path q4 needs PyTorch's int4 CPU kernel on a CPU: use --path auto")
    compiles, why_not = compile_support(cpu, model)
    if compiles and not auto_compiles:
        compiles, why_not = False, f"${COMPILE_ENV}=0"
    return PathChoice("q4-compiled") if compiles else PathChoice("q4", f"no compiled step: {why_not}")
