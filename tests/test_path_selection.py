"""Which execution path runs where: `select_path` is a pure function of the path asked for, the model and the CPU's
capabilities, so machines this suite does not run on (AMX Xeons, CUDA boxes, PyTorch builds without oneDNN or
AOTInductor, hosts without g++) are tested by passing their capabilities in."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from selfspec.errors import SelfspecError
from selfspec.execution import (
    AUTO_MIN_WEIGHTS,
    COMPILE_ENV,
    CpuCapabilities,
    ExecutionPath,
    ModelTraits,
    PathChoice,
    detect_capabilities,
    model_traits,
    package_dir,
    select_path,
)

from .helpers import make_tiny_target

EPYC = CpuCapabilities(avx2=True, onednn_linear=True, aot_inductor=True, cxx_compiler=True)  # AVX2 only
XEON_AMX = replace(EPYC, avx512=True, avx512_bf16=True, amx_bf16=True)
BIG = ModelTraits("cpu", torch.float32, linear_weights=AUTO_MIN_WEIGHTS, full_attention_only=True)
SMALL = replace(BIG, linear_weights=AUTO_MIN_WEIGHTS - 1)


@pytest.mark.parametrize("cpu", [EPYC, XEON_AMX])
def test_auto_takes_the_best_path_this_cpu_and_model_have(cpu):
    assert select_path("auto", BIG, cpu) == PathChoice("compiled")
    assert select_path("auto", BIG, cpu, auto_compiles=False) == PathChoice(
        "fast", f"no compiled step: ${COMPILE_ENV}=0"
    )
    assert select_path("auto", SMALL, cpu) == PathChoice("stock", "a model this small runs faster on the stock path")
    sliding = select_path("auto", replace(BIG, full_attention_only=False), cpu)
    assert sliding.name == "fast" and "sliding-window" in sliding.note
    no_compiler = select_path("auto", BIG, replace(cpu, cxx_compiler=False))
    assert no_compiler == PathChoice("fast", "no compiled step: no C++ compiler (g++) on this machine")
    no_aot = select_path("auto", BIG, replace(cpu, aot_inductor=False))
    assert no_aot == PathChoice("fast", "no compiled step: this PyTorch has no AOTInductor")
    # Not a CPU in float32 with oneDNN: stock, and the note says why (the bf16 kernels are not built yet, AMX or not).
    cuda = select_path("auto", replace(BIG, device_type="cuda"), cpu)
    assert cuda == PathChoice("stock", "no fast path for cuda yet: the stock kernels run")
    assert (
        "packs float32 weights; this model is bfloat16"
        in select_path("auto", replace(BIG, dtype=torch.bfloat16), cpu).note
    )
    no_onednn = select_path("auto", BIG, replace(cpu, onednn_linear=False))
    assert no_onednn == PathChoice("stock", "this PyTorch build has no oneDNN linear kernels")


def test_a_path_asked_for_by_name_runs_or_says_why_not():
    assert select_path("stock", replace(BIG, device_type="cuda"), EPYC) == PathChoice("stock")
    assert select_path("fast", SMALL, EPYC) == PathChoice("fast")  # by name: even where stock would win
    assert select_path("compiled", SMALL, EPYC, auto_compiles=False) == PathChoice(
        "compiled"
    )  # the env var is for auto
    with pytest.raises(SelfspecError, match="--path fast: the CPU fast path packs float32 .*use --path stock or auto"):
        select_path("fast", replace(BIG, dtype=torch.bfloat16), XEON_AMX)
    with pytest.raises(SelfspecError, match="--path compiled: no fast path for cuda yet"):
        select_path("compiled", replace(BIG, device_type="cuda"), EPYC)
    with pytest.raises(SelfspecError, match="--path compiled: no C\\+\\+ compiler .*use --path fast or auto"):
        select_path("compiled", BIG, replace(EPYC, cxx_compiler=False))
    with pytest.raises(SelfspecError, match="--path compiled: the compiled step covers full-attention caches only"):
        select_path("compiled", replace(BIG, full_attention_only=False), EPYC)
    with pytest.raises(SelfspecError, match="must be one of auto, stock, fast, compiled, q4, got .turbo."):
        select_path("turbo", BIG, EPYC)


def test_model_traits_and_the_path_built_from_them():
    llama, gemma2 = make_tiny_target("llama").model, make_tiny_target("gemma2").model
    traits = model_traits(llama)
    linear = sum(module.weight.numel() for module in llama.modules() if isinstance(module, torch.nn.Linear))
    assert traits == ModelTraits("cpu", torch.float32, linear, True) and 0 < linear < AUTO_MIN_WEIGHTS
    assert not model_traits(gemma2).full_attention_only  # sliding-window layers
    path = ExecutionPath(llama, "fast", capabilities=EPYC)
    assert path.name == "fast" and path.compiled is None
    with pytest.raises(SelfspecError, match="no oneDNN"):
        ExecutionPath(llama, "fast", capabilities=replace(EPYC, onednn_linear=False))
    assert detect_capabilities() is detect_capabilities()  # read once


def test_compiled_packages_are_keyed_by_dtype():
    """The weights digest samples values as float32, so a bfloat16 model holding the same values has the same digest:
    the dtype in the key keeps a bf16 build from loading the float32 package (or the reverse)."""
    model = make_tiny_target("llama").model
    with torch.no_grad():
        for parameter in model.parameters():  # values a bfloat16 copy holds exactly
            parameter.copy_(parameter.to(torch.bfloat16).float())
    as_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    fp32_dir, bf16_dir = package_dir(model, "tiny"), package_dir(as_bf16, "tiny")
    assert "--float32--" in fp32_dir.name and "--bfloat16--" in bf16_dir.name
    assert fp32_dir.name.replace("--float32--", "--bfloat16--") == bf16_dir.name  # only the dtype differs
