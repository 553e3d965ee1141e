"""How the target's forward runs: the execution paths `stock` (transformers as it is), `fast` and `compiled`.

On a CPU in float32, `fast` changes three things, each through a public hook of transformers or PyTorch, and copies
no modelling code:
- linears.py: every `nn.Linear` runs with its weight pre-packed once for oneDNN's small-row GEMMs (q/k/v as one),
  below a row count measured once per machine (calibration.py) on the stock kernel;
- attention.py: attention under a tree mask runs SDPA on the grouped key/value heads, registered with
  transformers' `AttentionInterface`, instead of copying the cache once per query-head group;
- kv_storage.py: the KV cache writes each step's keys and values in place into storage reserved ahead.
`compiled` (compiled.py) is `fast` with the decoding steps compiled ahead of time by AOTInductor. Which path runs is
selection.py's pure function of the path asked for, the model and the CPU's capabilities (capabilities.py);
path.py's `ExecutionPath` runs the chosen one (`forward`), on a twin of the model (twin.py) where it needs other
modules: the model itself is left as transformers made it. Elsewhere (CUDA, other dtypes, a PyTorch
without oneDNN) `auto` is the stock path, and says so.
"""

from .attention import GROUPED_SDPA
from .calibration import CALIBRATION_ROWS, STOCK_ROWS_ENV, calibrate, measure_stock_rows
from .capabilities import CpuCapabilities, describe_cpu, detect_capabilities
from .compiled import CompiledStep, package_dir
from .kv_storage import InPlaceCache, InPlaceLayer
from .linears import (
    PackedLinear,
    RowDispatch,
    SharedInputLinear,
    SharedInputProduct,
    pack_linears,
    pack_weight,
    packed_linear,
)
from .path import ExecutionPath
from .selection import (
    AUTO_MIN_WEIGHTS,
    COMPILE_ENV,
    PATH_CHOICES,
    ModelTraits,
    PathChoice,
    compile_support,
    fast_path_available,
    model_traits,
    select_path,
)
from .twin import sharing_copy

__all__ = [
    "AUTO_MIN_WEIGHTS",
    "CALIBRATION_ROWS",
    "COMPILE_ENV",
    "GROUPED_SDPA",
    "PATH_CHOICES",
    "STOCK_ROWS_ENV",
    "CompiledStep",
    "CpuCapabilities",
    "ExecutionPath",
    "InPlaceCache",
    "InPlaceLayer",
    "ModelTraits",
    "PackedLinear",
    "PathChoice",
    "RowDispatch",
    "SharedInputLinear",
    "SharedInputProduct",
    "calibrate",
    "compile_support",
    "describe_cpu",
    "detect_capabilities",
    "fast_path_available",
    "measure_stock_rows",
    "model_traits",
    "pack_linears",
    "pack_weight",
    "packed_linear",
    "package_dir",
    "select_path",
    "sharing_copy",
]
