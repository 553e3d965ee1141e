"""selfspec's native kernels (native.cpp), built once per machine with the C++ compiler the compiled path uses and kept
under the selfspec cache, registered as PyTorch operators:

- `selfspec::small_rows(input, weight, bias)`: a float32 x W^T (+ b) for 1-16 rows that streams the weight as stored
  (once, whatever the row count). At one row a product only has to read its weight once, and on the 2-core EPYC neither
  of PyTorch's kernels does that at the speed memory allows: all of SmolLM2-135M's float32 products (0.54 GB) take 17 ms
  on oneDNN's packed weights and 34 ms on MKL, against 13.2 ms here (docs/execution.md). The fast path's linear layers
  call it below their row split (linears.py, measured against the packed kernel by calibration.py) and the compiled
  `few` graph (compiled.py) is traced with every product on it. Other dtypes, more than 16 rows or a weight not stored
  contiguous fall back to `torch.nn.functional.linear` inside the operator.
- `selfspec::row_attention(query, key, value, mask, scale)`: float32 attention whose every query row is computed in
  one fixed order, so a tree's row equals the one-token step's bit for bit: the q4 path's attention (attention.py),
  in place of float64 SDPA.

Building takes about 10 s (PyTorch's headers). The fast and compiled paths build it when named on the command line
(under `auto` the background build of the compiled graphs does, and a later process loads it in milliseconds); the
q4 path builds it when it prepares, since its attention depends on it. $SELFSPEC_NATIVE=0 leaves it out (PyTorch's
kernels alone, float64 attention on q4).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from ..files import atomic_write, cache_root, cpu_signature

SOURCE = Path(__file__).with_name("native.cpp")
ENV = "SELFSPEC_NATIVE"  # "0": never built nor loaded
# bumped when small_rows' speed at some row count changes: row splits stored with an older one are measured again
# (2: a block of weight rows read from memory once whatever the row count; 3: the next block prefetched at 2+ rows;
# 4: up to four rows in one pass, and lines asked for 48 KB ahead as the weight streams; 5: three or four rows in two
# passes of two over a block of eight weight rows)
SMALL_ROWS_REVISION = 5
DIRECTORY_ENV = "SELFSPEC_KERNELS"  # where the build is kept (default: the selfspec cache's kernels/)


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def _compiler() -> str | None:
    return next((found for name in ("g++", "c++", "clang++") if (found := shutil.which(name))), None)


def _flags() -> list[str]:
    from torch.utils.cpp_extension import include_paths

    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        "-O3",
        "-march=native",  # the library is keyed by this CPU's signature
        "-fopenmp",  # ATen's parallel_for is OpenMP inline; it links the libgomp PyTorch loaded (one thread pool)
        "-shared",
        "-fPIC",
        "-std=c++17",
        "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{path}" for path in include_paths()),
        f"-L{torch_lib}",
        f"-Wl,-rpath,{torch_lib}",
        "-ltorch",
        "-ltorch_cpu",
        "-lc10",
    ]


def library_path() -> Path:
    """Where this machine's build lives: keyed by the source, the CPU, PyTorch's version and the compiler."""
    key = hashlib.sha1(
        SOURCE.read_bytes() + f"{torch.__version__}|{_compiler()}|{sys.version_info[:2]}".encode()
    ).hexdigest()[:12]
    directory = Path(os.environ[DIRECTORY_ENV]) if os.environ.get(DIRECTORY_ENV) else cache_root() / "kernels"
    return directory / f"native-{key}-cpu-{cpu_signature()}.so"


def build() -> Path:
    """Compile the library for this machine unless stored (temp file, then rename) -> its path. Raises
    RuntimeError with the compiler's first line of complaint where it fails."""
    path = library_path()
    if path.is_file():
        return path
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler on PATH (g++, c++ or clang++)")

    def compile_to(temp: Path) -> None:
        done = subprocess.run(
            [compiler, str(SOURCE), "-o", str(temp), *_flags()], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            complaint = next((line for line in (done.stderr or done.stdout).splitlines() if line.strip()), "no output")
            raise RuntimeError(f"compiling {SOURCE.name} failed: {complaint[:300]}")

    return atomic_write(path, compile_to)


@functools.lru_cache(maxsize=1)
def _register(path: str) -> None:
    torch.ops.load_library(path)

    # what export and Inductor see of the operators
    @torch.library.register_fake("selfspec::small_rows")
    def _product_shape(input, weight, bias=None):  # noqa: ARG001
        return input.new_empty(*input.shape[:-1], weight.shape[0])

    @torch.library.register_fake("selfspec::bounded_head")
    def _head_shape(input, weight, codes, scale, bound, argmax_only):  # noqa: ARG001
        return input.new_empty(*input.shape[:-1], weight.shape[0])

    @torch.library.register_fake("selfspec::wide_product")
    def _wide_shape(input, weight):
        return input.new_empty(*input.shape[:-1], weight.shape[0])

    @torch.library.register_fake("selfspec::row_attention")
    def _attention_shape(query, key, value, mask, scale):  # noqa: ARG001
        return query.new_empty(query.shape)


def loaded() -> bool:
    return _register.cache_info().currsize > 0


def load(build_missing: bool = False) -> bool:
    """Make selfspec's operators available in this process -> whether they are: loaded where stored, built
    first where `build_missing` (a failure is said once on stderr, and PyTorch's kernels run)."""
    if not enabled():
        return False
    if loaded():
        return True
    path = library_path()
    if not path.is_file():
        if not build_missing:
            return False
        try:
            build()
        except RuntimeError as error:
            print(f"[selfspec] no small-row kernel ({error}): PyTorch's kernels run", file=sys.stderr, flush=True)
            return False
    _register(str(path))
    return True


def small_rows(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """input [..., in] x weight [out, in]^T (+ bias) on the small-row kernel (load() must have succeeded)."""
    return torch.ops.selfspec.small_rows(input, weight, bias)


def row_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """softmax(query key^T * scale + mask) value, each query row on its own in one fixed order: query [B, H, n, D],
    key and value [B, KV, S, D] (grouped heads as they are), mask additive [B or 1, 1, n, S] or None (causal, the last
    n keys being the queries') -> [B, H, n, D] (load() must have succeeded)."""
    return torch.ops.selfspec.row_attention(query, key, value, mask, scale)


def bounded_head(input: torch.Tensor, weight: torch.Tensor, proxy, argmax_only: torch.Tensor) -> torch.Tensor:
    """An LM head's input [..., in] x weight [out, in]^T (float32: small_rows' product; bfloat16: wide_product's):
    exactly that where `argmax_only` (a bool tensor) is false; where it is true, exact where an element could be its
    row's maximum and -inf elsewhere, found through `proxy` (a head.HeadProxy of the weight). load() must have
    succeeded."""
    return torch.ops.selfspec.bounded_head(input, weight, proxy.codes, proxy.scale, proxy.bound, argmax_only)


def wide_product(input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """input [..., in] (float32) x weight [out, in]^T (bfloat16, widened exactly) in float32, any number of rows, each
    row's result the same whatever the row count (load() must have succeeded)."""
    return torch.ops.selfspec.wide_product(input, weight)
