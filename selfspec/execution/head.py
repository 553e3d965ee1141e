"""The float32 LM head for greedy steps: the argmax of the exact product while streaming half its bytes.

A greedy step reads one thing of the LM head's logits: each row's argmax. On SmolLM2 the head is 49,152 x 576 float32
weights (113 MB), a fifth of what a decoding step streams. `selfspec::bounded_head` (native.cpp) multiplies a row by a
bfloat16 copy of the weight first (the proxy, 56 MB), then computes exactly, on the small-row kernel, only the logits
that could be the maximum; the others are -inf. The argmax is the full float32 product's bit for bit, ties included,
because of a bound per weight row n, worked out here once per model:

    |proxy value - exact value| <= bound[n] * |x|

with |x| the input row's Euclidean norm. The two computed values differ from their exact sums by at most
gamma_K * sum_k |w_nk x_k| and gamma_K * sum_k |b_nk x_k| (any order of summation over K terms in float32, FMA
or not; gamma_K = K u / (1 - K u), u = 2^-24), and the exact sums by sum_k |w_nk - b_nk| |x_k|; by Cauchy-Schwarz all
three together are at most |x| times the Euclidean norm over k of |w_nk - b_nk| + gamma_K (|w_nk| + |b_nk|), which is
`bound[n]`, computed in float64 and rounded up. The kernel takes the largest lower bound over the row (proxy value -
bound * |x|) and computes exactly every element whose upper bound reaches it: the exact maximum's is one of them, as
is every element equal to it. Sampled steps read the whole distribution and take the exact product as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

UNIT_ROUNDOFF = 2.0**-24  # float32's
_CHUNK_ROWS = 4096  # weight rows worked in float64 at once (SmolLM2's head whole would take 0.2 GB a copy)


@dataclass(frozen=True)
class HeadProxy:
    """What bounded_head needs beside the weight: its bfloat16 copy [N, K] and the bound per row [N] (float32)."""

    proxy: torch.Tensor
    bound: torch.Tensor


def head_proxy(weight: torch.Tensor) -> HeadProxy:
    """The proxy and bounds of a float32 head weight [N, K] (about 0.3 s for SmolLM2's)."""
    weight = weight.detach()
    n, k = weight.shape
    gamma = k * UNIT_ROUNDOFF / (1 - k * UNIT_ROUNDOFF)
    proxy = weight.to(torch.bfloat16).contiguous()
    bound = torch.empty(n, dtype=torch.float64)
    for start in range(0, n, _CHUNK_ROWS):
        w = weight[start : start + _CHUNK_ROWS].double()
        b = proxy[start : start + _CHUNK_ROWS].double()
        terms = (w - b).abs() + gamma * (w.abs() + b.abs())
        bound[start : start + _CHUNK_ROWS] = terms.square().sum(1).sqrt()
    rounded = (bound * (1 + 1e-9)).float()  # float64's own error in the sums, then float32's rounding, both upward
    return HeadProxy(proxy, torch.nextafter(rounded, torch.tensor(float("inf"))))
