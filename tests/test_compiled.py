"""The compiled execution path (selfspec.execution.compiled): the decoding steps compiled ahead of time compute what
the eager fast path computes, write the KV cache in place, are compiled once and then loaded, and decoding through
them equals plain greedy decoding. One tiny Llama is compiled for the whole module (two graphs, about a minute
on 2 cores)."""

from __future__ import annotations

import os
import shutil
import types
import zipfile
from dataclasses import replace

import pytest
import torch

from selfspec import SelfSpec
from selfspec.batch import BatchEngine, BatchRequest
from selfspec.cli import main
from selfspec.cost import load_cost_curve
from selfspec.decoding import speculative_generate
from selfspec.errors import SelfspecError
from selfspec.execution import COMPILE_ENV, CompiledStep, ExecutionPath, compile_support, detect_capabilities
from selfspec.execution import background as background_module
from selfspec.execution import compiled as compiled_module
from selfspec.execution.compact import expanded
from selfspec.heads import create_drafter
from selfspec.models import Target
from selfspec.tree_attention import DraftTree, build_tree_inputs, chunk_forward, compact_cache, tree_forward

from .helpers import (
    PROMPT,
    BigramTreeDrafter,
    chi_square_p_value,
    chi_target,
    expected_joint,
    give_compact_forms,
    hf_greedy,
    make_tiny_target,
    model_as_made,
    q4_1_values,
    random_eagle_dir,
    sample_joint,
    without_eos,
)

pytestmark = pytest.mark.skipif(
    not compile_support(detect_capabilities())[0], reason=compile_support(detect_capabilities())[1]
)

LONG_PROMPT = [1] + [3 + (7 * i) % 90 for i in range(40)]  # past the compiled graphs' smallest cache
# the tiny Llama's weights given compact forms (compiled_target): `few` takes these coded as a Q4_1 GGUF's, those in
# bfloat16, the rest in float32
CODED = (
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
)
NARROW = ("model.layers.1.self_attn.k_proj.weight",)
TREE = DraftTree(tokens=torch.tensor([5, 17, 33, 40, 8, 9, 11]), parents=torch.tensor([-1, 0, 0, 1, 1, 2, 3]))


@pytest.fixture(scope="module")
def compiled_target(tmp_path_factory):
    """A tiny Llama on the compiled path, its packages compiled into a fresh cache directory."""
    cache = tmp_path_factory.mktemp("selfspec-cache")
    patch = pytest.MonkeyPatch()
    patch.setenv("SELFSPEC_CACHE", str(cache))

    messages = []
    base = without_eos(make_tiny_target("llama", max_position_embeddings=512))
    with torch.no_grad():  # weights as a Q4_1 GGUF's or a bfloat16 checkpoint's come to float32, and others
        for name in CODED:
            weight = base.model.get_parameter(name)
            weight.copy_(q4_1_values(weight))
        for name in NARROW:
            weight = base.model.get_parameter(name)
            weight.copy_(weight.bfloat16().float())
    target = Target(model=base.model, tokenizer=None, name=base.name, path="compiled").with_eos(())
    target.execution.compiled.log = messages.append
    split = pytest.MonkeyPatch()
    split.setenv("SELFSPEC_STOCK_ROWS", "8")  # a row split that uses both graphs, so both are built (and kept)
    with torch.inference_mode(), target.execution.active():
        pass
    split.undo()
    yield target, cache, messages
    patch.undo()


@pytest.mark.parametrize("stock_rows, small_graph", [(8, "few"), (1, "tree")])
def test_the_compiled_step_computes_what_the_fast_path_does(compiled_target, monkeypatch, stock_rows, small_graph):
    """A one-token, a two-token and a 7-token step give the fast path's logits, hidden states and cache. Steps of 1-3
    tokens run in `few` (every product on selfspec's small-row kernel) where that kernel wins at their rows
    (`stock_rows` past them), else in `tree`."""
    target, _, messages = compiled_target
    assert target.execution.name == "compiled" and sum("compiling" in message for message in messages) == 2
    step = target.execution.compiled
    monkeypatch.setattr(step.dispatch, "stock_rows", stock_rows)
    ran = []
    for kind, runner in list(step.runners.items()):
        monkeypatch.setitem(
            step.runners, kind, lambda *inputs, kind=kind, runner=runner: ran.append(kind) or runner(*inputs)
        )
    fast = ExecutionPath(target.model, "fast")
    pair = DraftTree(tokens=torch.tensor([12, 30]), parents=torch.tensor([-1, 0]))
    results = {}
    with torch.inference_mode():
        for name, path in (("fast", fast), ("compiled", target.execution)):
            with path.active():
                cache = path.new_cache()
                chunk_forward(path.forward, cache, torch.tensor([LONG_PROMPT]))
                cached = len(LONG_PROMPT)
                one = DraftTree.root_only(7)
                single = tree_forward(path.forward, cache, build_tree_inputs(one, cached, target.dtype, "cpu"), (0, 2))
                compact_cache(cache, 1, (0,))
                two = tree_forward(
                    path.forward, cache, build_tree_inputs(pair, cached + 1, target.dtype, "cpu"), (0, 2)
                )
                compact_cache(cache, 2, (0, 1))
                tree = tree_forward(
                    path.forward, cache, build_tree_inputs(TREE, cached + 3, target.dtype, "cpu"), (0, 2)
                )
                compact_cache(cache, TREE.size, (0, 2, 5))  # a second child wins: a gather in the in-place storage
                steps = single, two, tree
                results[name] = steps, [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    assert ran == [small_graph, small_graph, "tree"]
    for compiled_step, fast_step in zip(results["compiled"][0], results["fast"][0], strict=True):
        torch.testing.assert_close(compiled_step.logits, fast_step.logits, atol=1e-4, rtol=1e-4)
        for layer in (0, 2):
            torch.testing.assert_close(compiled_step.hidden[layer], fast_step.hidden[layer], atol=1e-4, rtol=1e-4)
    assert results["compiled"][1][0][0].shape[-2] == len(LONG_PROMPT) + 3 + 3
    for (keys, values), (fast_keys, fast_values) in zip(results["compiled"][1], results["fast"][1], strict=True):
        torch.testing.assert_close(keys, fast_keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values, fast_values, atol=1e-5, rtol=1e-5)


def test_few_takes_the_weights_a_compact_form_reproduces_in_that_form(compiled_target):
    """The linear weights whose float32 values a compact form gives back exactly are the ones `few` takes in it (its
    package lists them): a Q4_1 GGUF's coded, a bfloat16 checkpoint's in bfloat16, made from the model's own, which
    keeps its float32 weights; the others stay float32. (That products over them are the float32 products bit for
    bit: test_native; that steps in `few` equal the fast path's and decode as plain greedy: the other tests here.)"""
    target, _, _ = compiled_target
    step = target.execution.compiled
    forms = {f"model.{name}": torch.uint8 for name in CODED} | {f"model.{name}": torch.bfloat16 for name in NARROW}
    listing = ",".join(f"{name}:{str(dtype).removeprefix('torch.')}" for name, dtype in sorted(forms.items()))
    assert step.runners["few"].package.get_metadata()[compiled_module.COMPACT] == listing
    assert {name: weight.dtype for name, weight in step.compact.items()} == forms
    for name, compact in step.compact.items():
        weight = target.model.get_parameter(name.removeprefix("model."))
        assert weight.dtype == torch.float32
        assert torch.equal(expanded(compact, weight.shape[1]).view(torch.int32), weight.view(torch.int32))
    assert target.model.get_parameter("model.layers.0.self_attn.k_proj.weight").dtype == torch.float32


def test_the_steps_go_to_the_graphs_and_the_rest_runs_eager(compiled_target, monkeypatch):
    target, _, _ = compiled_target
    calls, made = [], model_as_made(target.model)
    step = target.execution.compiled
    original = CompiledStep.__call__
    monkeypatch.setattr(
        CompiledStep, "__call__", lambda self, ids, *rest: calls.append(ids.shape[1]) or original(self, ids, *rest)
    )
    with torch.inference_mode(), target.execution.active():
        cache = target.new_cache()
        chunk_forward(target.forward, cache, torch.tensor([PROMPT]))  # prefill: eager
        tree_forward(
            target.forward, cache, build_tree_inputs(TREE, len(PROMPT), target.dtype, "cpu")
        )  # short cache: eager
        compact_cache(cache, TREE.size, (0,))
        chunk_forward(target.forward, cache, torch.tensor([LONG_PROMPT]))
        cached = cache.get_seq_length()
        tree_forward(target.forward, cache, build_tree_inputs(TREE, cached, target.dtype, "cpu"))
        compact_cache(cache, TREE.size, (0,))
        chunk_forward(target.forward, cache, torch.arange(3, 83).view(1, 80))  # more rows than the tree graph takes
    assert calls == [TREE.size] and step is target.execution.compiled
    assert model_as_made(target.model) == made  # the path is called, never set on the model


def test_a_mask_that_hides_cached_positions_is_honoured_by_the_graph(compiled_target, monkeypatch):
    """The graphs take the whole mask: one that hides cached positions (a padded row of a batch, as the regeneration's
    engine leaves when its batch is down to one row) runs compiled and gives the fast path's logits."""
    from selfspec.training.data.greedy_batch import greedy_replies

    target, _, _ = compiled_target
    calls = []
    original = CompiledStep.__call__
    monkeypatch.setattr(
        CompiledStep, "__call__", lambda self, ids, *rest: calls.append(ids.shape[1]) or original(self, ids, *rest)
    )
    hidden = torch.zeros(1, 1, 1, len(LONG_PROMPT) + 1, dtype=target.dtype)
    hidden[..., 1:9] = torch.finfo(target.dtype).min  # positions 1-8 of the prompt hidden
    logits = {}
    with torch.inference_mode():
        for name, path in (("fast", ExecutionPath(target.model, "fast")), ("compiled", target.execution)):
            with path.active():
                cache = path.new_cache()
                chunk_forward(path.forward, cache, torch.tensor([LONG_PROMPT]))
                logits[name] = path.forward(
                    torch.tensor([[7]]),
                    attention_mask=hidden,
                    position_ids=torch.tensor([[len(LONG_PROMPT)]]),
                    past_key_values=cache,
                ).logits
    assert calls == [1]
    torch.testing.assert_close(logits["compiled"], logits["fast"], atol=1e-5, rtol=1e-5)
    # The regeneration's engine on the compiled path: a short prompt left alone in its batch, its cache padded.
    short, long = LONG_PROMPT[:20], LONG_PROMPT + LONG_PROMPT[1:20]
    alone = greedy_replies(target, [short], 12)[0]
    first_of_long = greedy_replies(target, [long], 1)[0][0]
    ending = target.with_eos((first_of_long,))  # the long prompt's row ends at once and leaves the batch
    both = greedy_replies(ending, [short, long], 12)
    cut = next((i for i, token in enumerate(alone) if token == first_of_long), None)
    assert both == [alone if cut is None else alone[: cut + 1], [first_of_long]]


def test_a_chain_in_few_gives_each_token_what_one_token_steps_give_it(compiled_target, monkeypatch):
    """`few`'s rows do not depend on how many rows a step has: six tokens verified in one `few` step get the logits and
    keys that six one-token steps give them, bit for bit (so every drafter's greedy output equals `none`'s on this
    path even at a near tie). The split between the graphs is timed on the real packages."""
    target, _, _ = compiled_target
    step = target.execution.compiled
    chain = torch.tensor([5, 17, 33, 40, 8, 9])
    cached = len(LONG_PROMPT)
    ran = {}
    for kind in ("few", "tree"):
        monkeypatch.setattr(step, "graph_for", lambda n, batch=1, kind=kind: (kind, n))
        with torch.inference_mode(), target.execution.active():
            for mode in ("one by one", "at once"):
                cache = target.new_cache()
                chunk_forward(target.forward, cache, torch.tensor([LONG_PROMPT]))
                if mode == "at once":
                    tree = DraftTree(tokens=chain, parents=torch.arange(-1, len(chain) - 1))
                    logits = tree_forward(target.forward, cache, build_tree_inputs(tree, cached, target.dtype, "cpu"))
                    logits = logits.logits
                else:
                    logits = torch.cat(
                        [
                            tree_forward(
                                target.forward,
                                cache,
                                build_tree_inputs(DraftTree.root_only(int(token)), cached + i, target.dtype, "cpu"),
                            ).logits
                            for i, token in enumerate(chain)
                        ]
                    )
                ran[kind, mode] = logits, cache.layers[-1].keys.clone()
    assert torch.equal(ran["few", "one by one"][0], ran["few", "at once"][0])
    assert torch.equal(ran["few", "one by one"][1], ran["few", "at once"][1])
    torch.testing.assert_close(ran["tree", "at once"][0], ran["few", "one by one"][0], atol=1e-4, rtol=1e-4)
    timings, spread = step.time_graphs(repeats=1)
    assert set(timings) == set(compiled_module.SPLIT_SIZES) and spread >= 1.0
    assert all(len(pair) == 2 and min(pair) > 0 for pair in timings.values())


@pytest.mark.parametrize("name", ["none", "ngram"])
def test_the_batch_engine_verifies_its_requests_in_one_compiled_step(compiled_target, monkeypatch, tmp_path, name):
    """Requests of different lengths decoded together on the compiled path: their steps run in one graph as one
    batch (rows of other lengths, each seeing its own prefix: `few` up to its rows in all, `tree` beyond), and each
    request's greedy reply is its own alone."""
    target, _, _ = compiled_target
    step = target.execution.compiled
    batches = []
    for kind, runner in list(step.runners.items()):
        monkeypatch.setitem(
            step.runners, kind, lambda ids, *rest, runner=runner: batches.append(ids.shape[0]) or runner(ids, *rest)
        )
    prompts = [LONG_PROMPT, LONG_PROMPT[:25], LONG_PROMPT + LONG_PROMPT[5:30]]
    expected = [hf_greedy(target, prompt, 14, eos=-1) for prompt in prompts]
    engine = BatchEngine(target, lambda: create_drafter(name, target), slots=3)
    requests = [BatchRequest(prompt, 14) for prompt in prompts]
    for request in requests:
        engine.submit(request)
    done = {id(result.request): list(result.token_ids) for result in engine.run()}
    assert [done[id(request)] for request in requests] == expected
    assert max(batches) == 3


def test_a_greedy_step_in_few_computes_only_the_logits_that_could_be_its_argmax(compiled_target, monkeypatch):
    """Under `argmax_only` (greedy decoding) the `few` graph's LM head computes exactly the logits that could be each
    row's maximum and leaves -inf elsewhere (head.py): the same argmax and the same bits where computed, the rest of
    the step (hidden states, cache) unchanged."""
    target, _, _ = compiled_target
    monkeypatch.setattr(target.execution.compiled.dispatch, "stock_rows", 8)
    chain = DraftTree(tokens=torch.tensor([12, 30, 31]), parents=torch.tensor([-1, 0, 1]))
    results = {}
    with torch.inference_mode(), target.execution.active():
        for argmax_only in (False, True):
            cache = target.execution.new_cache()
            chunk_forward(target.forward, cache, torch.tensor([LONG_PROMPT]))
            with target.execution.argmax_only(argmax_only):
                inputs = build_tree_inputs(chain, len(LONG_PROMPT), target.dtype, "cpu")
                results[argmax_only] = tree_forward(target.forward, cache, inputs, (0, 2))
    assert not target.execution.compiled.argmax_only  # the block ended
    full, bounded = results[False].logits, results[True].logits
    kept = torch.isfinite(bounded)
    assert torch.equal(bounded.argmax(-1), full.argmax(-1)) and torch.equal(bounded[kept], full[kept])
    assert kept.sum() < kept.numel() // 2  # most of the vocabulary is left out
    for layer in (0, 2):
        assert torch.equal(results[True].hidden[layer], results[False].hidden[layer])


@pytest.mark.parametrize("stock_rows", [8, 1])  # steps of 1-3 tokens in `few`, or in `tree`
def test_greedy_through_the_compiled_path_is_plain_greedy(compiled_target, tmp_path, monkeypatch, stock_rows):
    target, _, _ = compiled_target
    monkeypatch.setattr(target.execution.compiled.dispatch, "stock_rows", stock_rows)
    reference = hf_greedy(target, LONG_PROMPT, 40, eos=-1)
    for spec, heads in (("none", None), ("ngram", None), ("eagle:fixed_nodes=6", random_eagle_dir(target, tmp_path))):
        tokens, _ = speculative_generate(target, create_drafter(spec, target, heads), torch.tensor(LONG_PROMPT), 40)
        assert list(tokens) == reference, spec


def _decodes_as_plain_greedy(family: str, stock_rows: str, compact: bool, tmp_path, monkeypatch) -> Target:
    """A tiny `family` model on the compiled path (a cache of its own, the row split at `stock_rows`; `compact`: some
    weights in compact forms) whose `none` and `ngram` decoding equal HF `generate`'s greedy tokens -> its target."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("SELFSPEC_STOCK_ROWS", stock_rows)
    base = without_eos(make_tiny_target(family, max_position_embeddings=512))
    if compact:
        give_compact_forms(base.model)
    target = Target(model=base.model, tokenizer=None, name=base.name, path="compiled").with_eos(())
    target.execution.compiled.log = lambda message: None
    reference = hf_greedy(target, LONG_PROMPT, 30, eos=-1)
    for spec in ("none", "ngram"):
        tokens, _ = speculative_generate(target, create_drafter(spec, target), torch.tensor(LONG_PROMPT), 30)
        assert list(tokens) == reference, f"{family} {spec}"
    return target


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma"])
def test_other_full_attention_families_compile_and_decode_as_plain_greedy(family, tmp_path, monkeypatch):
    # a row split at one row: every step in `tree` (`few` is covered on llama, and below)
    target = _decodes_as_plain_greedy(family, "1", False, tmp_path, monkeypatch)
    assert target.execution.name == "compiled" and set(target.execution.compiled.runners) == {"tree"}
    # A row split at one row sends no step to `few`: it is not built.
    assert sorted(path.name for path in target.execution.compiled.directory.glob("*.pt2")) == ["tree.pt2"]


@pytest.mark.parametrize("family, stock_rows", [("llama", "1"), ("qwen3", "1"), ("llama", "8"), ("qwen2", "8")])
def test_sampling_through_the_compiled_path_follows_the_target_distribution(
    compiled_target, family, stock_rows, monkeypatch
):
    """The chi-square check of test_chisquare, with a prompt long enough that every tree step runs compiled; steps of
    1-3 tokens in `tree` (a row split at 1), or in `few` (at 8: over weights in compact forms, among them qwen2's
    biased q projection coded)."""
    monkeypatch.setenv("SELFSPEC_STOCK_ROWS", stock_rows)
    target = chi_target(path="compiled", family=family, compact=stock_rows == "8")
    target.execution.compiled.log = lambda message: None
    graphs = []
    choose = CompiledStep.graph_for
    monkeypatch.setattr(
        CompiledStep, "graph_for", lambda self, n, b=1: graphs.append((n, choose(self, n, b)[0])) or choose(self, n, b)
    )
    prompt = [1 + (3 * i) % 7 for i in range(24)]
    counts = sample_joint(target, BigramTreeDrafter(target, drawn=True, without_replacement=True), 12_000, prompt)
    assert chi_square_p_value(counts, expected_joint(target, prompt)) > 1e-3
    assert {graph for n, graph in graphs if n < 4} == {"few" if stock_rows == "8" else "tree"}
    if stock_rows == "8":
        forms = {weight.dtype for weight in target.execution.compiled.compact.values()}
        assert len(target.execution.compiled.compact) == 3 and forms == {torch.uint8, torch.bfloat16}


@pytest.mark.parametrize("family", ["qwen2", "gemma"])
def test_a_second_family_in_few_over_compact_weights_is_plain_greedy(family, tmp_path, monkeypatch):
    """Greedy equality with HF `generate` through `few` over weights in compact forms on other architectures than the
    module's Llama (qwen2: its q projection, coded, has a bias; gemma: another MLP and norm)."""
    target = _decodes_as_plain_greedy(family, "8", True, tmp_path, monkeypatch)
    assert "few" in target.execution.compiled.runners and len(target.execution.compiled.compact) == 3


def test_packages_are_compiled_once_and_then_loaded(compiled_target):
    target, cache, _ = compiled_target
    stored = sorted(path.name for path in compiled_module.package_dir(target.model, target.name).iterdir())
    # no temporary file left, here or beside another model's; the LM head's proxy kept for the next load (head.py)
    assert stored == ["few.pt2", "head-proxy.pt", "tree.pt2"]
    with zipfile.ZipFile(compiled_module.package_dir(target.model, target.name) / "few.pt2") as package:
        wrapper = next(name for name in package.namelist() if name.endswith("wrapper.json"))
        code = package.read(wrapper)
        assert b"small_rows" in code and b"row_attention" in code  # `few` calls selfspec's kernels
        assert b"bounded_head" in code  # and its own LM head (head.py)
        kernels = [package.read(name) for name in package.namelist() if name.endswith("kernel.cpp")]
        assert kernels and not any(b"#pragma omp" in kernel for kernel in kernels)  # its own loops on one thread
    assert not [path for path in (cache / "compiled").rglob("*") if path.name.startswith(".")]
    messages = []
    again = CompiledStep(target.model, target.name, log=messages.append)
    again.load()
    assert messages == [] and set(again.runners) == {"few", "tree"}
    with torch.no_grad():
        target.model.lm_head.weight[0, 0] += 1.0  # other weights: another package
        try:
            assert compiled_module.package_dir(target.model, target.name) != again.directory
        finally:
            target.model.lm_head.weight[0, 0] -= 1.0


def test_choosing_the_compiled_path(monkeypatch, tmp_path):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))  # no stored curve: the compiled path's own built-in one
    assert load_cost_curve("cpu", "tiny-llama", "compiled").source == "builtin (cpu-compiled)"
    model = make_tiny_target("llama").model
    monkeypatch.delenv(COMPILE_ENV)  # the suite keeps `auto` from compiling
    assert ExecutionPath(model, "auto").name == "stock"  # tiny: stock kernels win
    monkeypatch.setattr("selfspec.execution.selection.AUTO_MIN_WEIGHTS", 0)
    assert ExecutionPath(model, "auto").name == "compiled"
    sliding = make_tiny_target("gemma2").model  # sliding-window layers: not covered, so fast
    assert ExecutionPath(sliding, "auto").name == "fast" and "sliding-window" in ExecutionPath(sliding, "auto").note
    monkeypatch.setenv(COMPILE_ENV, "0")
    path = ExecutionPath(model, "auto")
    assert path.name == "fast" and COMPILE_ENV in path.note
    without_compiler = replace(detect_capabilities(), cxx_compiler=False)
    with pytest.raises(SelfspecError, match="--path compiled: no C.. compiler"):
        ExecutionPath(model, "compiled", capabilities=without_compiler)


def test_a_failed_compilation_leaves_the_fast_path_under_auto(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv(COMPILE_ENV, "wait")  # compiled before the first request, in this process
    monkeypatch.setattr("selfspec.execution.selection.AUTO_MIN_WEIGHTS", 0)
    monkeypatch.setattr(compiled_module, "compile_step", lambda *args: (_ for _ in ()).throw(RuntimeError("no luck")))
    target = make_tiny_target("llama")
    with torch.inference_mode(), target.execution.active():
        pass
    assert target.execution.name == "fast" and "no compiled step (no luck)" in capsys.readouterr().err
    named = ExecutionPath(target.model, "compiled", target.name)
    named.compiled.log = lambda message: None
    with pytest.raises(SelfspecError, match="compiling the step failed \\(no luck\\)"), named.active():
        pass


def test_a_switch_between_requests_keeps_each_request_on_one_path(compiled_target, tmp_path, monkeypatch, capsys):
    """Under `auto` with nothing stored, request 1 runs on `fast` while the graphs are built; they are stored while it
    is in flight (copied from the fixture's build, as the background process would store them), and it stays on
    `fast` to its last token; request 2 runs compiled. Both equal plain greedy decoding."""
    target, _, _ = compiled_target
    built = target.execution.compiled.directory
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))  # nothing stored here
    monkeypatch.setenv("SELFSPEC_AUTO_PROFILE", "1")  # the first drafter measures the fast path's curve
    monkeypatch.delenv(COMPILE_ENV)
    monkeypatch.setattr("selfspec.execution.selection.AUTO_MIN_WEIGHTS", 0)
    monkeypatch.setattr(background_module, "spawn_compile", lambda *args: types.SimpleNamespace(pid=1))
    calls = []
    original = CompiledStep.__call__
    monkeypatch.setattr(
        CompiledStep, "__call__", lambda self, ids, *rest: calls.append(ids.shape[1]) or original(self, ids, *rest)
    )
    auto = Target(model=target.model, tokenizer=None, name=target.name, path="auto", source="tiny").with_eos(())
    spec = SelfSpec(auto, drafter="ngram")
    refused = []

    def graphs_arrive(token_ids) -> None:
        shutil.copytree(built, auto.execution.pending.directory, dirs_exist_ok=True)
        refused.append(auto.execution.switch_if_ready())

    first = spec.generate(input_ids=LONG_PROMPT, max_new_tokens=40, on_step=graphs_arrive)
    assert first.stats.path == "fast" and calls == [] and refused and not any(refused)
    assert auto.execution.name == "fast" and "built in the background" in capsys.readouterr().err
    assert spec.drafter.cost_curve.source.endswith("--fast.json")  # measured on the path it ran
    monkeypatch.setattr(
        "selfspec.cost.forward_time_samples", lambda *args, **kwargs: pytest.fail("measured while a request waits")
    )
    second = spec.generate(input_ids=LONG_PROMPT, max_new_tokens=40)
    assert second.stats.path == "compiled" and calls and auto.execution.name == "compiled"
    # Until the build's stored curve is there, the compiled path's estimate sizes the trees.
    assert spec.drafter.cost_curve.source == "builtin (cpu-compiled)"
    assert capsys.readouterr().err.count("switching to the compiled path") == 1
    reference = hf_greedy(target, LONG_PROMPT, 40, eos=-1)
    assert list(first.token_ids) == reference and list(second.token_ids) == reference


def test_the_batch_engine_takes_the_compiled_graphs_once_built_while_idle(compiled_target, tmp_path, monkeypatch):
    """A server under `auto` with nothing stored: its engine decodes on `fast`, starts the build while idle, and takes
    the graphs at an idle moment after they are stored (never with a request in flight); its slots' drafters then size
    their trees by the compiled path's curve. Replies equal plain greedy decoding on both paths."""
    target, _, _ = compiled_target
    built = target.execution.compiled.directory
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    monkeypatch.delenv(COMPILE_ENV)
    monkeypatch.setattr("selfspec.execution.selection.AUTO_MIN_WEIGHTS", 0)
    started = []
    spawn = lambda *args: started.append(args) or types.SimpleNamespace(pid=1)  # noqa: E731
    monkeypatch.setattr(background_module, "spawn_compile", spawn)
    auto = Target(model=target.model, tokenizer=None, name=target.name, path="auto", source="tiny").with_eos(())
    engine = BatchEngine(auto, lambda: create_drafter("ngram", auto), slots=2)
    engine.between_requests()
    assert auto.execution.name == "fast" and len(started) == 1
    reference = hf_greedy(target, LONG_PROMPT, 20, eos=-1)
    engine.submit(BatchRequest(LONG_PROMPT, 20))
    engine.step()
    shutil.copytree(built, auto.execution.pending.directory, dirs_exist_ok=True)
    engine.between_requests()  # a request in flight: no switch
    assert auto.execution.name == "fast"
    assert [list(result.token_ids) for result in engine.run()] == [reference]
    engine.between_requests()
    assert auto.execution.name == "compiled" and engine.drafters[0].cost_curve.source == "builtin (cpu-compiled)"
    engine.submit(BatchRequest(LONG_PROMPT, 20))
    assert [list(result.token_ids) for result in engine.run()] == [reference]


def test_the_compile_command_builds_the_graphs_ahead(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    assert main(["compile", "--model", str(tiny_checkpoint)]) == 0
    out = capsys.readouterr().out
    # the suite's split sends one-token steps to the small-row kernel, so `few` is built too
    assert "graphs few, tree (row split at 2)" in out and "building few, tree" in out and "done in" in out
    (directory,) = (tmp_path / "compiled").iterdir()
    assert sorted(path.name for path in directory.glob("*.pt2")) == ["few.pt2", "tree.pt2"]
    # an older package format's packages of the same model and machine are never read again: removed, except one
    # an older selfspec is building now; other keys are left alone
    current = f"--format{compiled_module.PACKAGE_FORMAT}--"
    older = [directory.parent / directory.name.replace(current, f"--format{n}--") for n in (1, 9)]
    building = directory.parent / directory.name.replace(current, "--format8--")
    other_versions = directory.parent / (directory.name.replace(current, "--format9--") + "-other")
    other_model = directory.parent / ("x" + directory.name.replace(current, "--format9--"))
    for stale in (*older, building, other_versions, other_model):
        stale.mkdir()
        (stale / "tree.pt2").write_bytes(b"0" * 3 * 2**20)
    (building / "compile.pid").write_text(str(os.getpid()))  # a live build
    assert main(["compile", "--model", str(tiny_checkpoint)]) == 0  # stored: loaded, nothing built
    out = capsys.readouterr().out
    assert "all stored already" in out and out.count("an older package format's") == 2
    assert f"removed {older[0].name} (3 MB)" in out
    kept = {path.name for path in (tmp_path / "compiled").iterdir()}
    assert kept == {directory.name, building.name, other_versions.name, other_model.name}


def test_a_frozen_graph_of_weights_on_huge_pages_stores_each_weight_once(tmp_path):
    """A loaded target's weights are views of one huge-page mapping (models._own_memory); AOTInductor sizes a frozen
    constant by its storage, so `tree` stored the whole mapping once per weight (147 GB asked for SmolLM2: a
    MemoryError, and no compiled path) until the traced twin took weights of their own."""
    from selfspec.models import _own_memory

    target = without_eos(make_tiny_target("llama", max_position_embeddings=512))
    _own_memory(target.model)
    weights = [*target.model.parameters()]
    shared = {weight.untyped_storage().data_ptr() for weight in weights}
    if len(shared) != 1:
        pytest.skip("no huge-page mapping here (not Linux, or THP off): the weights own their memory already")
    mapping = weights[0].untyped_storage().nbytes()  # 2 MB or more: one mapping under every weight
    compiled_module.compile_step(target.model, "tree", tmp_path / "tree.pt2")
    with zipfile.ZipFile(tmp_path / "tree.pt2") as package:
        stored = sum(item.file_size for item in package.infolist() if item.filename.endswith(".so"))
    # the graph's code and its copies of the weights (100 KB), not the mapping again for each of them (15 MB)
    assert stored < 2 * mapping, f"{stored} bytes stored for weights in a mapping of {mapping} bytes"
    assert all(weight.untyped_storage().data_ptr() in shared for weight in target.model.parameters())  # model as it was
