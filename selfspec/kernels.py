"""Execution paths of the target's forward: `stock` (transformers as it is) and `fast`.

On a CPU in float32, `fast` runs every `nn.Linear` of the target with its weight pre-packed once for oneDNN's
small-row GEMMs. Stock PyTorch takes a gemv for one row and, for 2+ rows, a GEMM that repacks the weight on every
call, so a forward over a 2-16-node tree costs 1.5-2.2x a one-token step although it reads the same weights; with
the weights packed once, the GEMM for 16 rows reads them as one row does. The path wraps the stock modules (the
packed weight is built from the module's own weight, the module itself is put back after use); no modelling code is
copied. Elsewhere (CUDA, other dtypes, a PyTorch without oneDNN) `fast` is the stock path, and says so.

The path is active only inside `ExecutionPath.active()`, which the decoding loop enters for a whole generation:
transformers' own `generate`, training and anything else that uses the model outside it run the stock modules.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from .errors import SelfspecError

KERNEL_CHOICES = ("auto", "stock", "fast")
_PACK_ROWS = 16  # the batch size oneDNN packs for: the tree sizes that matter on a CPU
# `auto` packs only models whose linear layers hold at least this many weights: below it the weights sit in cache
# anyway and oneDNN's per-call overhead outweighs what packing saves (tiny test models run faster stock).
AUTO_MIN_WEIGHTS = 1 << 20


class PackedLinear(torch.nn.Module):
    """A frozen nn.Linear whose weight oneDNN has packed once. Inference only: the packed copy is not trainable."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the stock parameter, shared: code that reads `.weight` still finds it
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _PACK_ROWS)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, self.in_features)  # [..., in] -> [rows, in]
        output = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return output.view(*hidden.shape[:-1], self.out_features)


def fast_path_available(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """(whether `fast` differs from `stock` here, why not if it does not)."""
    if device.type != "cpu":
        return False, f"no fast path for {device.type} yet: the stock kernels run"
    if dtype != torch.float32:
        return False, f"the CPU fast path packs float32 weights; this model is {str(dtype).replace('torch.', '')}"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False, "this PyTorch build has no oneDNN linear kernels"
    return True, ""


def _linear_weights(model: torch.nn.Module) -> int:
    return sum(module.weight.numel() for module in model.modules() if isinstance(module, torch.nn.Linear))


class ExecutionPath:
    """How the target's forward runs. `kernels`: 'stock', 'fast', or 'auto' (fast wherever it exists)."""

    def __init__(self, model: torch.nn.Module, kernels: str = "auto"):
        if kernels not in KERNEL_CHOICES:
            raise SelfspecError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got '{kernels}'")
        parameter = next(model.parameters())
        available, reason = fast_path_available(parameter.device, parameter.dtype)
        if kernels == "fast" and not available:
            raise SelfspecError(f"--kernels fast: {reason}; use --kernels stock or auto")
        if kernels == "auto" and available and _linear_weights(model) < AUTO_MIN_WEIGHTS:
            available, reason = False, "a model this small runs faster on the stock kernels"
        self.model = model
        self.requested = kernels
        self.name = "fast" if kernels in ("fast", "auto") and available else "stock"
        self.note = reason if kernels == "auto" and not available else ""
        self._swaps: list[tuple[torch.nn.Module, str, torch.nn.Module, torch.nn.Module]] | None = None
        self._depth = 0  # nested activations: only the outermost swaps modules in and out

    def _build_swaps(self) -> list[tuple[torch.nn.Module, str, torch.nn.Module, torch.nn.Module]]:
        """(parent, attribute, stock module, packed module) for every nn.Linear of the model, packed once."""
        swaps = []
        with torch.no_grad():
            for parent in self.model.modules():
                for attribute, child in parent.named_children():
                    if type(child) is torch.nn.Linear:
                        swaps.append((parent, attribute, child, PackedLinear(child)))
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
        if self._swaps is None:
            self._swaps = self._build_swaps()
        for parent, attribute, _, packed in self._swaps:
            setattr(parent, attribute, packed)
        self._depth = 1
        try:
            yield
        finally:
            self._depth = 0
            for parent, attribute, stock, _ in self._swaps:
                setattr(parent, attribute, stock)

    def invalidate(self) -> None:
        """Forget the packed weights (after the model's weights change, e.g. an adapter merged into it)."""
        self._swaps = None
