"""What this machine offers the execution paths: the CPU's instruction sets and what this PyTorch build and toolchain
can run on it. Detected once per process; path selection (selection.py) takes it as an argument, so tests pass in
the capabilities of machines they do not run on."""

from __future__ import annotations

import functools
import os
import platform
import shutil
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CpuCapabilities:
    avx2: bool = False
    avx512: bool = False  # AVX-512 Foundation
    avx512_bf16: bool = False  # bf16 dot products in AVX-512 registers
    amx_bf16: bool = False  # AMX tiles with bf16 products (Sapphire Rapids and later)
    onednn_linear: bool = False  # this PyTorch build has oneDNN's packed linear kernels (the fast path's products)
    aot_inductor: bool = False  # this PyTorch has AOTInductor packaging (the compiled steps)
    cxx_compiler: bool = False  # a C++ compiler on PATH (AOTInductor builds the steps with it)


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags /proc/cpuinfo lists (empty where there is no such file)."""
    if not os.path.exists("/proc/cpuinfo"):
        return frozenset()
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    return frozenset()


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("" where there is none)."""
    if not os.path.exists("/proc/cpuinfo"):
        return ""
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return ""


def describe_cpu() -> str:
    """One line for reports: the model name and the widest instruction set that matters here."""
    capabilities = detect_capabilities()
    isa = (
        "AMX"
        if capabilities.amx_bf16
        else "AVX-512"
        if capabilities.avx512
        else "AVX2"
        if capabilities.avx2
        else "no AVX2"
    )
    return f"{cpu_model() or platform.machine()}, {isa}"


@functools.lru_cache(maxsize=1)
def detect_capabilities() -> CpuCapabilities:
    """This machine's capabilities, read once (flags from /proc/cpuinfo, the rest from PyTorch and PATH)."""
    flags = cpu_flags()
    return CpuCapabilities(
        avx2="avx2" in flags,
        avx512="avx512f" in flags,
        avx512_bf16="avx512_bf16" in flags,
        amx_bf16="amx_bf16" in flags,
        onednn_linear=torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"),
        aot_inductor=hasattr(torch._inductor, "aoti_compile_and_package"),
        cxx_compiler=any(shutil.which(name) for name in ("g++", "c++", "clang++")),
    )
