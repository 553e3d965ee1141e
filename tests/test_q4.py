"""The q4 path: a GGUF file's own 4-bit blocks on torch's int4 CPU kernel, exact on its own terms (its rows do not
depend on how many rows a call has), loaded without a float32 copy of the decoder linears."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from selfspec.errors import SelfspecError
from selfspec.execution import COMPILE_ENV, ExecutionPath, compile_support, detect_capabilities, native
from selfspec.execution.attention import FLOAT64_SDPA, ROW_ATTENTION, float64_sdpa_attention, row_attention
from selfspec.execution.q4 import BFloat16Head, Q4Linear, _reverse_permute, is_four_bit, read_gguf, unpack_blocks
from selfspec.models import default_checkpoint_dir, default_gguf_file, load_target

from .helpers import PROMPT, make_tiny_target, plain_greedy, run_cli, without_eos

ROWS = 16


def random_blocks(out_features: int = 96, in_features: int = 128, seed: int = 0):
    """(codes [N, K] in 0..15, scale [N, K/32], zero [N, K/32]) as a GGUF file's 4-bit blocks hold them."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_features, in_features), dtype=torch.int32, generator=generator)
    scale = torch.rand(out_features, in_features // 32, generator=generator) * 0.1
    zero = torch.randn(out_features, in_features // 32, generator=generator) * 0.1
    return codes, scale, zero


def random_four_bit() -> Q4Linear:
    return Q4Linear(*random_blocks())


def test_the_four_bit_product_is_the_blocks_product_in_bfloat16():
    codes, scale, zero = random_blocks()
    layer = Q4Linear(codes, scale, zero)
    # the weights the kernel holds: scale and zero rounded to bfloat16, then (code - 8) * scale + zero
    scale, zero = (part.bfloat16().float().repeat_interleave(32, 1) for part in (scale, zero))
    weight = (codes.float() - 8) * scale + zero
    hidden = torch.randn(5, 128)
    expected = hidden.bfloat16().float() @ weight.t()
    torch.testing.assert_close(layer(hidden), expected, atol=0.02, rtol=0.01)  # the output rounds to bfloat16


@pytest.mark.parametrize(
    "make",
    [
        random_four_bit,
        lambda: BFloat16Head(torch.nn.Linear(128, 300, bias=False)),
        lambda: BFloat16Head(torch.nn.Linear(131, 300, bias=False), wide=True),  # selfspec's kernel, a scalar tail
    ],
)
def test_rows_do_not_depend_on_the_rows_in_the_call(make):
    layer = make()
    hidden = torch.randn(ROWS, layer.in_features)
    with torch.inference_mode():
        together = layer(hidden)
        for rows in (1, 2, 3, 5, 8):
            alone = torch.cat([layer(hidden[start : start + rows]) for start in range(0, ROWS, rows)])
            assert torch.equal(alone, together), f"{rows} rows a call gave other bits than {ROWS} at once"


def test_the_wide_head_multiplies_the_float32_input_by_the_rounded_weight():
    """The q4 head on selfspec's kernel (where it is built): the bfloat16 weight widened exactly against the float32
    input as it is, float32 sums (float64's product to float32 rounding), any row count, a sliced input too."""
    from selfspec.execution import native

    assert native.load(build_missing=True)
    linear = torch.nn.Linear(133, 70, bias=False)
    head = BFloat16Head(linear, wide=True)
    hidden = torch.randn(3, 40, 133)[:, -1:]  # a view with the batch stride of a longer prompt
    expected = hidden.double() @ head.weight16.double().t()
    torch.testing.assert_close(head(hidden).double(), expected, atol=1e-5, rtol=1e-5)
    rounded = BFloat16Head(linear)(hidden)  # oneDNN's: the input rounded to bfloat16 as well
    assert not torch.equal(head(hidden), rounded) and torch.allclose(head(hidden), rounded, atol=0.1)


def test_the_bfloat16_head_lays_a_sliced_input_out_afresh(monkeypatch):
    """A prefill's last position (transformers' `logits_to_keep`) reaches the head as a [1, 1, H] view with the
    prompt's batch stride, on which oneDNN's bfloat16 product ran 26x slower: the head multiplies plain strides, and
    gives the view the logits the same values laid out afresh get."""
    from selfspec.execution import q4

    head = BFloat16Head(torch.nn.Linear(64, 96, bias=False))
    hidden = torch.randn(1, 10, 64)
    strides = []
    linear = q4.F.linear
    monkeypatch.setattr(q4.F, "linear", lambda x, *rest: strides.append(x.stride()) or linear(x, *rest))
    last = hidden[:, -1:, :]
    assert last.stride() == (640, 64, 1)
    assert torch.equal(head(last), head(last.clone(memory_format=torch.contiguous_format)))
    assert strides == [(64, 64, 1), (64, 64, 1)]


def test_the_default_gguf_blocks_are_the_float32_checkpoints_weights():
    """Unpacked, re-ordered as transformers de-quantises a llama GGUF, the codes give the converted checkpoint's
    float32 weights exactly: the q4 path reads the same weights, not a re-quantisation."""
    metadata, tensors = read_gguf(default_gguf_file())
    assert metadata["general.architecture"] == "llama"
    checkpoint = default_checkpoint_dir() / "model.safetensors"
    heads = {"attn_q": metadata["llama.attention.head_count"], "attn_k": metadata["llama.attention.head_count_kv"]}
    checked = {
        "blk.0.attn_q": "model.layers.0.self_attn.q_proj.weight",
        "blk.7.attn_k": "model.layers.7.self_attn.k_proj.weight",
        "blk.29.ffn_down": "model.layers.29.mlp.down_proj.weight",
    }
    with safe_open(str(checkpoint), "pt") as weights:
        for gguf_name, name in checked.items():
            tensor = tensors[gguf_name]
            codes, scale, zero = unpack_blocks(tensor.data, tensor.type_name)
            weight = (codes.float() - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
            if gguf_name.split(".")[-1] in heads:
                weight = _reverse_permute(weight, heads[gguf_name.split(".")[-1]])
            torch.testing.assert_close(weight, weights.get_tensor(name), atol=2e-6, rtol=0)


@pytest.fixture(scope="module")
def default_q4():
    return load_target("default", path="q4")


def test_the_default_model_loads_four_bit_without_a_float32_copy(default_q4):
    model = default_q4.model
    linears = [module for layer in model.model.layers for module in layer.modules() if isinstance(module, Q4Linear)]
    assert len(linears) == 7 * model.config.num_hidden_layers
    assert not any(type(module) is torch.nn.Linear for module in model.model.layers.modules())
    float_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert float_bytes < 130e6, "only the embeddings (the tied LM head) and the norms stay float32"
    assert default_q4.execution.name == "q4"
    with default_q4.execution.active():
        assert isinstance(default_q4.execution.runner.get_output_embeddings(), BFloat16Head)
    assert type(model.get_output_embeddings()) is torch.nn.Linear  # the model keeps its own


def test_every_drafter_equals_plain_decoding_on_the_default_model(default_q4):
    prompt = default_q4.tokenizer("def fibonacci(n):\n    ", return_tensors="pt").input_ids[0].tolist()
    reference = plain_greedy(default_q4, prompt, 40)
    from selfspec.decoding import speculative_generate
    from selfspec.heads import create_drafter

    for name in ("ngram", "history", "auto"):
        tokens, _ = speculative_generate(default_q4, create_drafter(name, default_q4), torch.tensor(prompt), 40)
        assert list(tokens) == reference, name


def test_paths_and_four_bit_models_that_do_not_go_together():
    float_model = make_tiny_target("llama")
    with pytest.raises(SelfspecError, match="--path q4 runs a GGUF file's 4-bit blocks"):
        ExecutionPath(float_model.model, "q4")
    four_bit = without_eos(make_tiny_target("llama", path="q4"))
    assert four_bit.execution.name == "q4"
    assert ExecutionPath(four_bit.model, "auto").name == "q4"
    assert ExecutionPath(four_bit.model, "stock").name == "stock"
    for path in ("fast", "compiled"):
        with pytest.raises(SelfspecError, match="4-bit linears, which run on --path q4 only"):
            ExecutionPath(four_bit.model, path)
    assert len(plain_greedy(four_bit, PROMPT, 5)) == 5


def test_q4_on_a_checkpoint_directory_is_one_line(tiny_checkpoint):
    done = run_cli("generate", "--model", str(tiny_checkpoint), "--path", "q4", "--prompt", "hi")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"selfspec: error: --path q4 reads a GGUF file's 4-bit blocks: '{tiny_checkpoint}' is not a .gguf file"
    ]


@pytest.mark.parametrize("attention", [float64_sdpa_attention, row_attention])
def test_the_q4_attentions_give_a_trees_rows_the_one_token_steps_bits(attention):
    """SDPA's float32 rows change with the call's shape; in float64, rounded back, they do not, and neither do those
    of selfspec's row attention (native.cpp), a row computed in one order over the keys it sees."""
    assert native.load(build_missing=True)
    generator = torch.Generator().manual_seed(0)
    cached, rows, module = 300, 8, torch.nn.Module()
    query = torch.randn(1, 9, rows, 64, generator=generator)
    keys, values = (torch.randn(1, 3, cached + rows, 64, generator=generator) for _ in range(2))
    mask = torch.full((1, 1, rows, cached + rows), torch.finfo(torch.float32).min)
    mask[..., :cached] = 0
    for row in range(rows):  # a chain: each row sees the cache, the rows before it and itself
        mask[0, 0, row, cached : cached + row + 1] = 0
    together, _ = attention(module, query, keys, values, mask)
    for row in range(rows):
        end = cached + row + 1
        alone, _ = attention(module, query[:, :, row : row + 1], keys[:, :, :end], values[:, :, :end], None)
        assert torch.equal(alone[:, 0], together[:, row]), f"row {row}"


def _chain_logits(target, step_sizes: list[int]) -> torch.Tensor:
    """The logits of an 8-token chain after a prompt, forwarded in steps of these sizes on the target's path."""
    execution = target.execution
    prompt = target.encode_prompt("Write a haiku about the sea.")
    chain = torch.tensor([[504, 2365, 282, 260, 4232, 30, 216, 339]])
    cache, outputs, position, done = execution.new_cache(), [], prompt.shape[1], 0
    with torch.inference_mode(), execution.active():
        execution.forward(prompt, past_key_values=cache)
        for n in step_sizes:
            positions = torch.arange(position, position + n).view(1, n)
            piece = chain[:, done : done + n]
            outputs.append(execution.forward(piece, position_ids=positions, past_key_values=cache).logits[0])
            position, done = position + n, done + n
    return torch.cat(outputs)


@pytest.mark.skipif(not compile_support(detect_capabilities())[0], reason="no AOTInductor build here")
def test_the_compiled_q4_step_gives_a_chain_the_logits_of_its_one_token_steps(monkeypatch):
    """The q4 graph (compiled here, about a minute): one-token steps run unpadded, and 8 tokens at once, 3 + 5 and
    2 + 2 + 2 + 2 give the logits of 8 one-token steps bit for bit."""
    monkeypatch.setenv(COMPILE_ENV, "wait")
    target = load_target("default", path="q4")
    target.execution.prepare()
    assert target.execution.name == "q4-compiled" and target.execution.compiled.graph_for(1) == ("q4", 1)
    one_by_one = _chain_logits(target, [1] * 8)
    for sizes in ([8], [3, 5], [2, 2, 2, 2]):
        assert torch.equal(_chain_logits(target, sizes), one_by_one), sizes


@pytest.mark.parametrize("native_kernels", ["1", "0"])
def test_a_chain_at_once_equals_it_token_by_token_on_the_default_model(default_q4, native_kernels, monkeypatch):
    """The whole path, eager (prefill) and stepping: 8 tokens in one step give the logits of 8 one-token steps,
    bit for bit, with selfspec's row attention or (native kernels off) float64 SDPA over a float64 cache, and the
    model's own attention setting is untouched."""
    monkeypatch.setenv(native.ENV, native_kernels)
    if native_kernels == "0":  # a path of its own, prepared without the native kernels
        default_q4 = load_target("default", path="q4")
    execution = default_q4.execution
    one_by_one = _chain_logits(default_q4, [1] * 8)
    assert torch.equal(_chain_logits(default_q4, [8]), one_by_one)
    assert torch.equal(_chain_logits(default_q4, [3, 5]), one_by_one)
    assert default_q4.config._attn_implementation == "sdpa"
    attention = ROW_ATTENTION if native_kernels == "1" else FLOAT64_SDPA
    assert execution.runner.config._attn_implementation == attention
    assert execution.new_cache().layers[0].store_dtype == (None if native_kernels == "1" else torch.float64)


def test_serve_on_q4_refuses_more_slots_than_its_graph_batches_before_loading_anything():
    done = run_cli("serve", "--path", "q4", "--port", "0", "--slots", "17")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "the q4 path serves up to 16 requests at once" in done.stderr
    done = run_cli("serve", "--port", "0", "--slots", "17")  # `auto` takes q4 for the default GGUF: the same limit
    assert done.returncode == 2 and "--path compiled serves more" in done.stderr.strip()


def test_auto_takes_the_four_bit_path_for_a_four_bit_gguf(tmp_path):
    """`auto` loads a GGUF whose decoder linears are 4-bit blocks for q4 (from its header, before any loading), on
    a CPU in float32; `four_bit=False`, another dtype, or a GGUF with float linears keep the float32 weights."""
    from selfspec.models import loads_four_bit

    assert loads_four_bit("default") and loads_four_bit(default_gguf_file(), "auto", "cpu", torch.float32)
    assert not loads_four_bit("default", "auto", "cpu", torch.bfloat16)
    assert not loads_four_bit("default", "fast") and loads_four_bit("default", "q4")
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 8)  # a header cut short: not one q4 runs
    assert not loads_four_bit(not_gguf)
    float_gguf = _float_linears_gguf(tmp_path / "float.gguf")
    assert read_gguf(float_gguf)[1]["blk.0.attn_q"].type_name == "F32" and not loads_four_bit(float_gguf)
    target = load_target("default")
    assert target.execution.name.startswith("q4") and is_four_bit(target.model)
    assert not is_four_bit(load_target("default", four_bit=False).model)


def _float_linears_gguf(file):
    """A llama GGUF header whose decoder linear is F32 (gguf's own writer; its data one row of zeros)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(file), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return file


def test_a_ggufs_config_and_tokenizer_are_read_from_its_metadata_once(tmp_path, monkeypatch):
    """The q4 path's text files come from the GGUF's metadata the first time (seconds), then from the cache; the
    cached tokenizer encodes and templates as the GGUF's own."""
    from transformers import AutoTokenizer

    import selfspec.models as models

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    file = default_gguf_file()
    directory = models._gguf_text_files(file)
    assert directory.parent == tmp_path / "gguf-text" and not list(directory.parent.glob(".text-*"))
    original = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name, local_files_only=True)
    cached = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    messages = [{"role": "user", "content": "Explain KV caches, then write def f(x):\n    return x ** 2"}]
    rendered = [t.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) for t in (original, cached)]
    assert rendered[0] == rendered[1] and original(rendered[0]).input_ids == cached(rendered[1]).input_ids
    assert cached.eos_token_id == original.eos_token_id
    monkeypatch.setattr(models.AutoConfig, "from_pretrained", None)  # a second call must not parse the GGUF again
    assert models._gguf_text_files(file) == directory
