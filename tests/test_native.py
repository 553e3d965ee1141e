"""selfspec's small-row product (selfspec/execution/native.cpp): built once per machine, it computes x W^T + b
as a float64 reference does (to float32 rounding), each row the same whatever the row count of the call, and leaves
what it does not handle to PyTorch's own product; the fast path's linear layers take it below their row split."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from selfspec.execution import ExecutionPath, PackedLinear, RowDispatch, compile_support, detect_capabilities
from selfspec.execution import compact as compact_module
from selfspec.execution import native as native_module

from .helpers import make_tiny_target, q4_1_values

pytestmark = pytest.mark.skipif(
    not compile_support(detect_capabilities())[0], reason=compile_support(detect_capabilities())[1]
)


@pytest.fixture(scope="module")
def kernel():
    assert native_module.load(build_missing=True), "the small-row kernel did not build"
    return native_module.small_rows


@pytest.mark.parametrize(
    "rows, out_features, in_features, bias",
    [
        (1, 576, 576, False),
        (2, 1536, 576, True),
        (3, 577, 100, True),
        (4, 7, 33, False),
        (4, 577, 100, True),
        (5, 64, 80, False),
        (6, 35, 576, True),
        (7, 40, 1536, False),
        (9, 64, 80, True),
        (16, 577, 100, True),
    ],
)
@pytest.mark.parametrize("narrow", [False, True])
def test_the_small_row_product_equals_a_float64_reference_row_by_row(
    kernel, rows, out_features, in_features, bias, narrow
):
    """Vector and scalar tails of the input, a last block of fewer output features, a bias or none, 1-16 rows (one
    pass, or passes of four and the rest): within float32 rounding of float64's product, and every row bit for bit
    what a one-row call gives. A bfloat16 weight (`narrow`) gives bit for bit what its float32 widening gives."""
    torch.manual_seed(rows)
    x, weight = torch.randn(1, rows, in_features), torch.randn(out_features, in_features)
    b = torch.randn(out_features) if bias else None
    if narrow:
        weight = weight.bfloat16()
        assert torch.equal(kernel(x, weight, b), kernel(x, weight.float(), b))
    output = kernel(x, weight, b)
    reference = F.linear(x.double(), weight.double(), None if b is None else b.double())
    assert output.shape == (1, rows, out_features) and output.dtype == torch.float32
    torch.testing.assert_close(output.double(), reference, atol=2e-5 * in_features**0.5, rtol=1e-5)
    one_by_one = torch.cat([kernel(x[:, row : row + 1], weight, b) for row in range(rows)], dim=1)
    assert torch.equal(output, one_by_one)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("out_features, in_features, bias", [(576, 576, False), (1536, 576, True), (13, 64, True)])
def test_a_coded_weight_gives_what_its_float32_values_give_bit_for_bit(kernel, rows, out_features, in_features, bias):
    """A Q4_1 GGUF's weights as float32 (d * code + m per block of 32) and their coding (compact.py): the coding gives
    back every value bit for bit, and the small-row product over it (each block's codes widened in registers) is the
    float32 weight's product bit for bit, 1-16 rows, with a bias or none; weights not of that form are not coded."""
    torch.manual_seed(rows * out_features)
    weight = q4_1_values(torch.randn(out_features, in_features))
    coded = compact_module.q4_1_coded(weight)
    assert coded is not None and coded.dtype == torch.uint8 and coded.shape == (out_features, in_features // 32 * 24)
    assert torch.equal(compact_module.expanded(coded, in_features).view(torch.int32), weight.view(torch.int32))
    x, b = torch.randn(1, rows, in_features), (torch.randn(out_features) if bias else None)
    assert torch.equal(kernel(x, coded, b), kernel(x, weight, b))
    many = torch.randn(17, in_features)  # past the kernel's rows: ATen's product over the decoded weight
    assert torch.equal(kernel(many, coded, b), F.linear(many, weight, b))
    assert compact_module.q4_1_coded(torch.randn(out_features, in_features)) is None
    nudged = weight.clone()
    nudged[0, 5] = torch.nextafter(nudged[0, 5], torch.tensor(float("inf")))  # one value off the coding's grid
    assert compact_module.q4_1_coded(nudged) is None


def test_what_it_does_not_handle_runs_pytorchs_own_product(kernel):
    """More than 16 rows, another dtype, a weight not stored contiguous: exactly F.linear's result (over a bfloat16
    weight's float32 widening where the input is float32)."""
    torch.manual_seed(0)
    weight, bias = torch.randn(40, 24), torch.randn(40)
    many = torch.randn(17, 24)
    assert torch.equal(kernel(many, weight, bias), F.linear(many, weight, bias))
    narrow = weight.bfloat16()
    assert torch.equal(kernel(many, narrow, bias), F.linear(many, narrow.float(), bias))
    half = torch.randn(2, 24, dtype=torch.bfloat16)
    assert torch.equal(kernel(half, weight.bfloat16()), F.linear(half, weight.bfloat16()))
    strided = torch.randn(24, 40).t()
    one = torch.randn(1, 24)
    assert torch.equal(kernel(one, strided), F.linear(one, strided))


def test_the_fast_path_takes_it_below_its_row_split(kernel, monkeypatch):
    """A path named on the command line loads (or builds) the kernel and its packed layers call it below the split;
    $SELFSPEC_NATIVE=0 leaves PyTorch's stock kernel there."""
    target = make_tiny_target("llama")
    path = ExecutionPath(target.model, "fast")
    assert path.row_split().kernel == "small" and path.dispatch.stock_rows == 2  # the suite's split
    layer = next(module for module in path.runner.modules() if isinstance(module, PackedLinear))
    hidden = torch.randn(1, 1, layer.in_features)
    with torch.inference_mode():
        assert torch.equal(layer(hidden), kernel(hidden, layer.weight, layer.bias))
    monkeypatch.setenv(native_module.ENV, "0")
    assert ExecutionPath(target.model, "fast").row_split().kernel == "stock"


def test_a_build_that_fails_says_why_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(native_module.DIRECTORY_ENV, str(tmp_path))
    monkeypatch.setattr(native_module, "loaded", lambda: False)
    monkeypatch.setattr(native_module, "_flags", lambda: ["-DSELFSPEC_BROKEN", "-include", "no-such-header.h"])
    assert native_module.load(build_missing=True) is False
    assert "no small-row kernel (compiling native.cpp failed" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no library, no temporary file
    monkeypatch.setattr(native_module, "_compiler", lambda: None)
    assert native_module.load(build_missing=True) is False
    assert "no C++ compiler" in capsys.readouterr().err
    assert native_module.load(build_missing=False) is False and capsys.readouterr().err == ""


def test_the_unpacked_kernels_name_keys_the_stored_row_split():
    dispatch = RowDispatch()
    assert dispatch.kernel == "stock"
    dispatch.use_small_rows()
    assert dispatch.kernel == "small"
    assert dispatch.key == f"small-r{native_module.SMALL_ROWS_REVISION}"  # a new kernel revision is measured again


def _tree_mask(cached: int, rows: int, hidden: tuple[int, int] | None = None) -> torch.Tensor:
    lowest = torch.finfo(torch.float32).min
    mask = torch.zeros(1, 1, rows, cached + rows)
    mask[..., cached:] = torch.triu(torch.full((rows, rows), lowest), 1)
    if hidden is not None:  # a tree: this row does not see that earlier node
        mask[0, 0, hidden[0], cached + hidden[1]] = lowest
    return mask


@pytest.mark.parametrize(
    "cached, rows, head_dim, batch",
    [(40, 1, 64, 1), (300, 7, 64, 1), (33, 5, 20, 1), (70, 3, 128, 2), (17, 2, 72, 2), (300, 1, 64, 4), (90, 2, 64, 3)],
)
def test_the_row_attention_equals_float64_sdpa_and_each_row_its_own_keys_alone(kernel, cached, rows, head_dim, batch):
    """Against float64 SDPA (grouped heads, an additive tree mask, one per sequence, or none: causal) to float32
    rounding; and each row bit for bit what it gives alone over only the keys it sees (so at other places among them),
    from key/value views of a larger storage (a cache)."""
    torch.manual_seed(cached)
    query = torch.randn(batch, 9, rows, head_dim)
    keys, values = (torch.randn(batch, 3, cached + rows + 50, head_dim)[:, :, : cached + rows] for _ in range(2))
    mask = _tree_mask(cached, rows, (rows - 1, 0) if rows > 2 else None).repeat(batch, 1, 1, 1)
    if batch > 1:  # the second sequence sees fewer keys (a shorter one in a ragged batch)
        mask[1, :, :, : cached // 2] = torch.finfo(torch.float32).min
    for sequence in range(2, batch):  # as the batch engine's: shorter prefixes, then the keys up to the longest hidden
        mask[sequence, :, :, cached - 37 * sequence : cached] = torch.finfo(torch.float32).min
    scale = head_dim**-0.5
    output = native_module.row_attention(query, keys, values, mask, scale)
    as_double = [tensor.double() for tensor in (query, keys, values, mask)]
    reference = F.scaled_dot_product_attention(*as_double[:3], attn_mask=as_double[3], scale=scale, enable_gqa=True)
    torch.testing.assert_close(output.double(), reference, atol=2e-6, rtol=1e-5)
    causal = native_module.row_attention(query, keys, values, None, scale)
    expected = F.scaled_dot_product_attention(
        *as_double[:3], attn_mask=_tree_mask(cached, rows).double(), scale=scale, enable_gqa=True
    )
    torch.testing.assert_close(causal.double(), expected, atol=2e-6, rtol=1e-5)
    for sequence in range(batch):
        for row in range(rows):
            seen = (mask[sequence, 0, row] == 0).nonzero().flatten()
            alone = native_module.row_attention(
                query[sequence : sequence + 1, :, row : row + 1],
                keys[sequence : sequence + 1, :, seen],
                values[sequence : sequence + 1, :, seen],
                torch.zeros(1, 1, 1, len(seen)),
                scale,
            )
            assert torch.equal(alone, output[sequence : sequence + 1, :, row : row + 1]), (sequence, row)


def _near_ties(rows: int = 4000, features: int = 96, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A head whose rows are one row plus noise far below bfloat16's precision, and inputs: bfloat16 rounding
    reorders such rows, so their proxy's argmax is often not the exact one. Two rows are equal (a tie)."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(features, generator=generator)
    weight = base + 1e-4 * torch.randn(rows, features, generator=generator)
    weight[rows // 2] = weight[rows // 3]
    return weight.contiguous(), torch.randn(16, features, generator=generator)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bounded_head_gives_the_exact_products_argmax_bit_for_bit(kernel, dtype):
    """Greedy steps' LM head (head.py), for a float32 weight (small_rows' product) and a bfloat16 one (wide_product's,
    the q4 head's): with argmax_only every row's argmax is the full product's (ties to the lower index), the elements
    it computes are that product's bits and the rest -inf; without it, the product itself. The inputs are built so
    that the int8 proxy alone picks another row, and so that bounds of zero (the proxy trusted as it is) pick a wrong
    one: the bound is what makes it exact."""
    from selfspec.execution.head import HeadProxy, head_proxy

    weight, inputs = _near_ties()
    weight = weight.to(dtype)
    product = kernel if dtype == torch.float32 else native_module.wide_product
    head = head_proxy(weight)
    full = product(inputs, weight)
    yes, no = torch.tensor(True), torch.tensor(False)
    assert torch.equal(native_module.bounded_head(inputs, weight, head, no), full)
    for rows in (1, 2, 5, 16):
        bounded = native_module.bounded_head(inputs[:rows], weight, head, yes)
        assert torch.equal(bounded.argmax(-1), full[:rows].argmax(-1))
        kept = torch.isfinite(bounded)
        assert torch.equal(bounded[kept], full[:rows][kept]) and bool((bounded[~kept] == float("-inf")).all())
        alone = [native_module.bounded_head(inputs[row : row + 1], weight, head, yes) for row in range(rows)]
        assert torch.equal(bounded, torch.cat(alone))  # the proxy's rows too: a row's logits whatever the row count
    proxy = head.codes.float() * head.scale[:, None]
    # integers up to 16,383: where the kernel codes its inputs as int16 (AVX-512 VNNI) they are coded exactly, so its
    # slack for the coding is 0 and the bound alone stands between the proxy and a wrong argmax
    whole = torch.round(inputs / inputs.abs().amax(-1, keepdim=True) * 16383)
    whole_full = product(whole, weight)
    assert (F.linear(whole, proxy).argmax(-1) != whole_full.argmax(-1)).any(), "the proxy alone finds every argmax"
    assert torch.equal(native_module.bounded_head(whole, weight, head, yes).argmax(-1), whole_full.argmax(-1))
    unbounded = HeadProxy(head.codes, head.scale, torch.zeros_like(head.bound))
    assert not torch.equal(native_module.bounded_head(whole, weight, unbounded, yes).argmax(-1), whole_full.argmax(-1))
    tie = torch.zeros(1, weight.shape[1])  # every logit 0: the first row wins, as in the full product
    assert native_module.bounded_head(tie, weight, head, yes).argmax().item() == 0
    # the bound holds with room: the proxy's value lies within bound * |x| of the exact one
    gap = (F.linear(inputs.double(), proxy.double()) - full.double()).abs()
    assert bool((gap <= head.bound.double() * inputs.double().norm(dim=-1, keepdim=True)).all())
    assert head.codes.dtype == torch.int8 and head.bound.dtype == head.scale.dtype == torch.float32
    spread = torch.randn(4003, 96).to(dtype)  # rows far apart: most logits are left out (and a last partial block)
    spread_head = head_proxy(spread)
    for rows in (1, 3, 16):
        bounded = native_module.bounded_head(inputs[:rows], spread, spread_head, yes)
        assert torch.equal(bounded.argmax(-1), product(inputs[:rows], spread).argmax(-1))
        alone = [native_module.bounded_head(inputs[row : row + 1], spread, spread_head, yes) for row in range(rows)]
        assert torch.equal(bounded, torch.cat(alone))
    assert torch.isfinite(bounded).sum() < bounded.numel() // 10


def test_the_bounded_head_allows_for_how_it_codes_its_inputs(kernel):
    """Where the kernel codes its input rows as int16 (AVX-512 VNNI, steps of max |x| / 16,383), its slack must count
    the coding's error too. Here the proxy is the weight itself (codes / 128, every row's scale 1/128) and one input
    row is made so that the coding alone swaps the top two logits, by more than float32's rounding slack: weight row 1
    meets one element just under half a step (coded 0) with code 92, row 2 meets 90 elements just over half a step
    (coded 1) with code 1, so row 1 wins exactly (92 x 0.49 > 90 x 0.5001) and row 2 in the coded product. Elsewhere
    this is one more exactness check."""
    from selfspec.execution.head import head_proxy

    step = 0.125
    codes = torch.zeros(8, 96, dtype=torch.int64)
    codes[:, 1] = 127  # every row's largest code: its scale 1/128, exact
    codes[1, 2] = 92
    codes[2, 3:93] = 1
    weight = (codes.float() / 128).contiguous()
    inputs = torch.zeros(1, 96)
    inputs[0, 0] = 16383 * step  # the largest element: the coding's step (its weights 0)
    inputs[0, 2] = 0.49 * step
    inputs[0, 3:93] = 0.5001 * step
    full = kernel(inputs, weight)
    assert full.argmax().item() == 1
    bounded = native_module.bounded_head(inputs, weight, head_proxy(weight), torch.tensor(True))
    assert bounded.argmax().item() == 1 and bounded[0, 1] == full[0, 1]


def test_the_head_proxy_is_stored_beside_the_packages_and_checked_when_read(tmp_path, monkeypatch):
    """stored_head_proxy makes the proxy once and stores it; a later load reads it (making only the rows it checks);
    one stored for other weights (a row changed), or a damaged file, is made again; no directory: made, not stored."""
    from selfspec.execution import head as head_module

    weight = torch.randn(1000, 64)
    made = []
    real = head_module.head_proxy
    monkeypatch.setattr(head_module, "head_proxy", lambda w: made.append(w.shape[0]) or real(w))
    first = head_module.stored_head_proxy(weight, tmp_path)
    assert made == [1000] and (tmp_path / head_module.PROXY_FILE).is_file()
    again = head_module.stored_head_proxy(weight, tmp_path)
    assert made[1:] == [256] and all(torch.equal(getattr(again, n), getattr(first, n)) for n in ("codes", "bound"))
    checked = torch.unique(torch.linspace(0, 999, 256).long())
    row = int(checked[len(checked) // 3])
    other = weight.clone()
    other[row] *= 2  # a row the check reads
    remade = head_module.stored_head_proxy(other, tmp_path)
    assert made[-1] == 1000 and torch.equal(remade.codes, real(other).codes)
    (tmp_path / head_module.PROXY_FILE).write_bytes(b"not a proxy")
    assert torch.equal(head_module.stored_head_proxy(weight, tmp_path).bound, first.bound) and made[-1] == 1000
    head_module.stored_head_proxy(weight, None)
    assert made[-1] == 1000 and len(list(tmp_path.iterdir())) == 1
    unchecked = weight.clone()
    unchecked[next(r for r in range(1000) if r not in set(checked.tolist()))] += 1e-3  # a row the check skips
    before = len(made)
    head_module.stored_head_proxy(unchecked, tmp_path)
    assert made[before:] == [1000]  # the bits' sum tells the weights apart
