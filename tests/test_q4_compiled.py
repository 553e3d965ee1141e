"""The q4 path compiled: its one graph (`q4`, 2-64 rows) is built in the background under `--path q4`, reads the
twin's own weights, and decoding through it equals plain decoding through it, row for row. One tiny 4-bit Llama
is compiled for the module (one graph, under a minute on 2 cores)."""

from __future__ import annotations

import types

import pytest
import torch

from selfspec.decoding import speculative_generate
from selfspec.execution import ExecutionPath, compile_support, detect_capabilities
from selfspec.execution import background as background_module
from selfspec.heads import create_drafter

from .helpers import PROMPT, OracleDrafter, RandomDrafter, make_tiny_target, plain_greedy, without_eos

pytestmark = pytest.mark.skipif(
    not compile_support(detect_capabilities())[0], reason=compile_support(detect_capabilities())[1]
)

LONG_PROMPT = [1] + [3 + (7 * i) % 90 for i in range(40)]  # past the compiled graphs' smallest cache


@pytest.fixture(scope="module")
def compiled_q4(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setenv("SELFSPEC_CACHE", str(tmp_path_factory.mktemp("selfspec-cache")))
    patch.setenv("SELFSPEC_COMPILE", "wait")  # this test compiles in the foreground
    target = without_eos(make_tiny_target("llama", path="q4", max_position_embeddings=512))
    with target.execution.active():
        pass
    yield target
    patch.undo()


def test_q4_steps_run_in_its_graph_and_equal_plain_decoding(compiled_q4, monkeypatch):
    execution = compiled_q4.execution
    assert execution.name == "q4-compiled" and set(execution.compiled.runners) == {"q4"}
    stored = sorted(path.name for path in execution.compiled.directory.iterdir())
    assert "q4.pt2" in stored and "-q4-" in execution.compiled.directory.name
    graphs, original = [], type(execution.compiled).__call__

    def counting(self, input_ids, *args):
        graphs.append(self.graph_for(input_ids.shape[1]))
        return original(self, input_ids, *args)

    monkeypatch.setattr(type(execution.compiled), "__call__", counting)
    reference = plain_greedy(compiled_q4, LONG_PROMPT, 24)
    full = LONG_PROMPT + reference
    for drafter in (
        create_drafter("ngram", compiled_q4),
        OracleDrafter(compiled_q4, full, depth=5),
        RandomDrafter(compiled_q4, width=3, depth=3),
    ):
        tokens, _ = speculative_generate(compiled_q4, drafter, torch.tensor(LONG_PROMPT), 24)
        assert list(tokens) == reference, type(drafter).__name__
    assert {graph for graph, _ in graphs} == {"q4"}
    assert ("q4", 2) in graphs and any(rows > 2 for _, rows in graphs)  # one-token steps padded, trees as they are


def test_a_greedy_q4_step_computes_only_the_logits_that_could_be_its_argmax(compiled_q4):
    """Under `argmax_only` (greedy decoding) the q4 graph's head (BFloat16Head on wide_product, head.py) computes
    exactly only the logits that could be each row's maximum, -inf elsewhere: the full step's argmax and bits."""
    from selfspec.tree_attention import DraftTree, build_tree_inputs, chunk_forward, tree_forward

    chain = DraftTree(tokens=torch.tensor([12, 30, 31]), parents=torch.tensor([-1, 0, 1]))
    results = {}
    with torch.inference_mode(), compiled_q4.execution.active():
        for argmax_only in (False, True):
            cache = compiled_q4.execution.new_cache()
            chunk_forward(compiled_q4.forward, cache, torch.tensor([LONG_PROMPT]))
            with compiled_q4.execution.argmax_only(argmax_only):
                inputs = build_tree_inputs(chain, len(LONG_PROMPT), compiled_q4.dtype, "cpu")
                results[argmax_only] = tree_forward(compiled_q4.forward, cache, inputs).logits
    full, bounded = results[False], results[True]
    kept = torch.isfinite(bounded)
    assert torch.equal(bounded.argmax(-1), full.argmax(-1)) and torch.equal(bounded[kept], full[kept])
    assert kept.sum() < kept.numel()


def test_q4_under_its_own_name_builds_its_graph_in_the_background(monkeypatch, tmp_path):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("SELFSPEC_COMPILE", "1")
    calls = []
    monkeypatch.setattr(
        background_module, "spawn_compile", lambda *args: calls.append(args) or types.SimpleNamespace(pid=1)
    )
    target = make_tiny_target("llama", path="q4")
    execution = ExecutionPath(target.model, "q4", "tiny", source="model.gguf")
    execution.prepare()
    assert execution.name == "q4" and execution.pending is not None  # eager meanwhile
    assert execution.pending.graphs_needed() == ("q4",)
    assert "being built in the background" in execution.start_build()
    assert calls[0][0] == "model.gguf" and calls[0][3] == "q4"
    assert len(plain_greedy(without_eos(target), PROMPT, 4)) == 4
