"""An LM head for greedy steps: the argmax of the exact product while streaming a quarter of a float32 head's bytes.

A greedy step reads one thing of the LM head's logits: each row's argmax. SmolLM2's head is 49,152 x 576 weights: 113
MB in float32 (the float32 paths), 56 MB in bfloat16 (the q4 path), a fifth of what a float32 step streams and a
fifth of a q4 step's time. `selfspec::bounded_head` (native.cpp) multiplies a row by an int8 proxy of the weight
first (a code per weight and a scale per row, 28 MB), then computes exactly, on the head's own kernel (small_rows for
float32, wide_product for bfloat16), only the logits that could be the maximum; the others are -inf. The argmax is
the full product's bit for bit, ties included, because of a bound per weight row n, worked out here once per head:

    |proxy value - exact value| <= bound[n] * |x|

with |x| the input row's Euclidean norm. With b = scale * code the proxy row and w the weight row: the exact
product's computed value lies within gamma_K * sum_k |w_k x_k| of its sum (any order of summation over K terms in
float32, FMA or not; gamma_K = K u / (1 - K u), u = 2^-24); the proxy's (its codes' sum, then times the scale) within
gamma_(K+1) * sum_k |b_k x_k| of sum_k b_k x_k; and the two sums differ by at most sum_k |w_k - b_k| |x_k|. By
Cauchy-Schwarz all together are at most |x| times the Euclidean norm over k of |w_k - b_k| + gamma_K |w_k| +
gamma_(K+1) |b_k|: that is `bound[n]`, computed in float64 and rounded up. The kernel takes the largest lower bound
over the row (proxy value - bound * |x|) and computes exactly every logit whose upper bound reaches it: the exact
maximum is one of them, as is every logit equal to it. Sampled steps read the whole distribution and take the exact
product as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..files import atomic_write

UNIT_ROUNDOFF = 2.0**-24  # float32's
_CHUNK_ROWS = 4096  # weight rows worked in float64 at once (SmolLM2's whole head would take 0.2 GB a copy)
PROXY_FILE = "head-proxy.pt"  # beside a model's compiled packages (stored_head_proxy)
_CHECKED_ROWS = 256  # rows of a stored proxy made again and compared at each load


@dataclass(frozen=True)
class HeadProxy:
    """What bounded_head needs beside the weight: int8 codes [N, K], a float32 scale per row [N] (proxy row = scale *
    codes) and the float32 bound per row [N]."""

    codes: torch.Tensor
    scale: torch.Tensor
    bound: torch.Tensor


def _gamma(terms: int) -> float:
    return terms * UNIT_ROUNDOFF / (1 - terms * UNIT_ROUNDOFF)


def head_proxy(weight: torch.Tensor) -> HeadProxy:
    """The int8 proxy and bounds of a head weight [N, K], float32 or bfloat16 (about 0.5 s for SmolLM2's)."""
    weight = weight.detach()
    n, k = weight.shape
    codes = torch.empty(n, k, dtype=torch.int8)
    scale = torch.empty(n, dtype=torch.float32)
    bound = torch.empty(n, dtype=torch.float64)
    for start in range(0, n, _CHUNK_ROWS):
        rows = slice(start, start + _CHUNK_ROWS)
        w = weight[rows].double()
        step = (w.abs().amax(1) / 127).float().clamp_min(torch.finfo(torch.float32).tiny)  # the scale, in float32
        q = torch.round(w / step.double()[:, None]).clamp(-127, 127)
        codes[rows], scale[rows] = q.to(torch.int8), step
        b = q * step.double()[:, None]  # the proxy row exactly (an int8 code times a float32 scale fits float64)
        terms = (w - b).abs() + _gamma(k) * w.abs() + _gamma(k + 1) * b.abs()
        bound[rows] = terms.square().sum(1).sqrt()
    rounded = (bound * (1 + 1e-9)).float()  # float64's own error in the sums, then float32's rounding, both upward
    return HeadProxy(codes, scale, torch.nextafter(rounded, torch.tensor(float("inf"))))


def stored_head_proxy(weight: torch.Tensor, directory: Path | None) -> HeadProxy:
    """`head_proxy(weight)`, kept in `directory` (the model's compiled packages, keyed by its weights) so that a later
    load reads it (28 MB in milliseconds) instead of making it again (about 0.4 s at every start). A stored proxy is
    used only where it was made from weights of the same bits (a sum of all of them, kept with it), its shapes fit and
    _CHECKED_ROWS of its rows, spread over the head, equal those rows made anew (each row's codes, scale and bound
    depend on that weight row alone); else it is made again and stored."""
    path = None if directory is None else Path(directory) / PROXY_FILE
    checksum = None if path is None else _bits_sum(weight)  # nothing to compare or store without a directory
    if path is not None and path.is_file():
        try:
            fields = torch.load(path, weights_only=True)
            stored = HeadProxy(fields["codes"], fields["scale"], fields["bound"])
            same = int(fields["checksum"]) == checksum
        except Exception:  # noqa: BLE001  (a damaged file is made again)
            stored, same = None, False
        if same and _fits(stored, weight):
            return stored
    proxy = head_proxy(weight)
    if path is not None and path.parent.is_dir():
        fields = {"codes": proxy.codes, "scale": proxy.scale, "bound": proxy.bound, "checksum": checksum}
        atomic_write(path, lambda temp: torch.save(fields, temp))
    return proxy


def _bits_sum(weight: torch.Tensor) -> int:
    """The sum, modulo 2^64, of the weight's bytes read as 64-bit integers (a change to any one weight changes it)."""
    flat = weight.detach().contiguous().view(-1).view(torch.uint8)
    whole = flat[: flat.numel() - flat.numel() % 8].view(torch.int64).sum()
    return int(whole) + int(flat[flat.numel() - flat.numel() % 8 :].sum())


def _fits(proxy: HeadProxy, weight: torch.Tensor) -> bool:
    n = weight.shape[0]
    if proxy.codes.shape != weight.shape or proxy.scale.shape != (n,) or proxy.bound.shape != (n,):
        return False
    rows = torch.unique(torch.linspace(0, n - 1, min(n, _CHECKED_ROWS)).long())
    fresh = head_proxy(weight[rows])
    return all(torch.equal(getattr(fresh, name), getattr(proxy, name)[rows]) for name in ("codes", "scale", "bound"))
