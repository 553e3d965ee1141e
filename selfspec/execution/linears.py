"""The fast path's linear layers: every `nn.Linear` of the target runs with its weight pre-packed once for oneDNN's
small-row GEMMs.

Stock PyTorch takes a gemv for one row and, for 2+ rows, a GEMM that repacks the weight on every call, so a forward
over a small tree costs well above a one-token step although it reads the same weights; with the weights packed
once, the GEMM for 16 rows reads them as one row does. Projections that read the same input (a layer's q, k and v)
run as one GEMM over their concatenated weights. The packed modules share the stock modules' weights and stand in
for them in the path's twin of the model (twin.py): the model itself keeps its stock modules. Below a row count
measured once per machine (`RowDispatch`, calibration.py) they call the row split's unpacked kernel instead: selfspec's
own small-row product where it is built (native.py), else PyTorch's stock one (MKL's gemv or GEMM); at one row or
a few it streams the weight faster than the packed GEMM (docs/execution.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_PACK_ROWS = 16  # the batch size oneDNN packs for: the tree sizes that matter on a CPU
# Linear layers of one module that read the same input: on the fast path each group runs as one GEMM over the
# concatenated weights (one pass over the input, one call instead of three).
SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"),)


class RowDispatch:
    """Which kernel the fast path's linear layers call for an input of r rows: the unpacked one (`stock`: selfspec's
    small-row product where it is loaded, else PyTorch's F.linear) when r < `stock_rows`, the packed oneDNN one
    otherwise. One object is shared by every packed module of a path (the target's and its drafters'), so one
    measurement sets them all."""

    def __init__(self, stock_rows: int = 1):
        self.stock_rows = stock_rows
        self.source = "default"  # where stock_rows came from: default, env, measured, or the cached file
        self.stock = F.linear  # (input, weight, bias) -> output: the kernel below the split (use_small_rows)

    def use_small_rows(self) -> None:
        """Take selfspec's small-row product (loaded: native.load) as the kernel below the split."""
        from . import native

        self.stock = native.small_rows

    @property
    def kernel(self) -> str:
        """The unpacked kernel's name (for reports and the calibration's key)."""
        return "stock" if self.stock is F.linear else "small"

    @property
    def key(self) -> str:
        """What keys the stored row split: the unpacked kernel's name, and for selfspec's own its revision (a changed
        kernel is measured again)."""
        from . import native

        return self.kernel if self.kernel == "stock" else f"{self.kernel}-r{native.SMALL_ROWS_REVISION}"

    def use_stock(self, hidden: torch.Tensor) -> bool:
        return hidden.numel() < self.stock_rows * hidden.shape[-1]  # rows = numel / in_features


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] weight packed once by oneDNN for small-row products (see `packed_linear`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS)


def packed_linear(
    hidden: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """hidden [..., in] x a packed weight (+ bias) -> [..., out]."""
    rows = hidden.reshape(-1, hidden.shape[-1])  # [..., in] -> [rows, in]
    output = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return output.view(*hidden.shape[:-1], out_features)


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
            return self.dispatch.stock(hidden, self.weight, self.bias)
        return packed_linear(hidden, self.packed, self._bias, self.out_features)


class SharedInputProduct:
    """The product of an input with the concatenated weights of sibling linear layers (a layer's q/k/v projections).
    Whichever member is called first with an input computes every member's output; the others take theirs if they
    are called with that same tensor, and recompute otherwise, so any call order or a lone call stays correct."""

    def __init__(self, layers: list[torch.nn.Linear], dispatch: RowDispatch):
        self.layers, self.dispatch = layers, dispatch
        with torch.no_grad():
            self.packed = pack_weight(torch.cat([layer.weight for layer in layers]))
            biases = [
                layer.bias if layer.bias is not None else layer.weight.new_zeros(layer.out_features) for layer in layers
            ]
            self.bias = None if all(layer.bias is None for layer in layers) else torch.cat(biases).detach()
        ends = torch.tensor([layer.out_features for layer in layers]).cumsum(0).tolist()
        self.bounds = list(zip([0] + ends[:-1], ends, strict=True))
        self.out_features = ends[-1]
        self.input: torch.Tensor | None = None
        self.outputs: list[torch.Tensor | None] = []

    def output(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        if self.dispatch.use_stock(hidden):  # each member on its own, as stock
            return self.dispatch.stock(hidden, self.layers[index].weight, self.layers[index].bias)
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


def plain_linears(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Linear]]:
    """(parent, attribute, layer) for every plain nn.Linear inside `module`."""
    return [
        (parent, attribute, child)
        for parent in module.modules()
        for attribute, child in parent.named_children()
        if type(child) is torch.nn.Linear
    ]


def _pack_shared_inputs(module: torch.nn.Module, dispatch: RowDispatch) -> list[torch.nn.Module]:
    packed = []
    for parent in module.modules():
        for names in SHARED_INPUT_GROUPS:
            layers = [getattr(parent, name, None) for name in names]
            if (
                all(type(layer) is torch.nn.Linear for layer in layers)
                and len({(layer.in_features, layer.weight.dtype) for layer in layers}) == 1
            ):
                product = SharedInputProduct(layers, dispatch)
                for index, (name, layer) in enumerate(zip(names, layers, strict=True)):
                    packed.append(SharedInputLinear(layer, product, index))
                    setattr(parent, name, packed[-1])
    return packed


def pack_linears(module: torch.nn.Module, dispatch: RowDispatch, share_inputs: bool = True) -> list[torch.nn.Module]:
    """Replace every nn.Linear inside `module`, which must be frozen and inference-only (the fast path's twin of the
    target, a drafter's head), with a packed one sharing its weights: sibling projections that read one input
    (SHARED_INPUT_GROUPS) as one GEMM where `share_inputs`, the others each on its own. Returns the packed modules
    in the module's order (calibration times them as a forward streams them)."""
    with torch.no_grad():
        packed = _pack_shared_inputs(module, dispatch) if share_inputs else []
        for parent, attribute, child in plain_linears(module):
            packed.append(PackedLinear(child, dispatch))
            setattr(parent, attribute, packed[-1])
    return packed
