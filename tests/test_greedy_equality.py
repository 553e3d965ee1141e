"""Greedy speculative output equals plain greedy decoding token for token, whatever the drafter proposes."""

from __future__ import annotations

import pytest
import torch

from selfspec.decoding import speculative_generate
from selfspec.heads import create_drafter
from selfspec.models import Target

from .helpers import CORE_FAMILIES, PROMPT, OracleDrafter, RandomDrafter, hf_greedy, make_tiny_target


def drafters_for(target: Target, reference: list[int]):
    full = PROMPT + reference
    return {
        "none": create_drafter("none", target),
        "ngram": create_drafter("ngram", target),
        "oracle": OracleDrafter(target, full, depth=5),
        "oracle-decoys": OracleDrafter(target, full, depth=4, decoys=True),
        "random-wide": RandomDrafter(target, width=3, depth=3),
    }


@pytest.mark.parametrize("family", CORE_FAMILIES)
def test_greedy_equals_plain_greedy(family):
    target = make_tiny_target(family)
    target.model.generation_config.eos_token_id = None  # run the full length
    target = target.with_eos(())
    reference = hf_greedy(target, PROMPT, 40, eos=-1)
    assert len(reference) == 40
    for name, drafter in drafters_for(target, reference).items():
        tokens, stats = speculative_generate(target, drafter, torch.tensor(PROMPT), 40)
        assert list(tokens) == reference, f"{family}/{name} diverged from plain greedy"
        assert stats.new_tokens == 40 and stats.stop_reason == "max_new_tokens"
        if name.startswith("oracle"):
            assert stats.mean_accepted_length > 3.0, f"{family}/{name}: oracle drafts should be accepted"
        if name == "none":
            assert stats.target_forwards == 40


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_greedy_with_sliding_window_family(family):
    target = make_tiny_target(family)
    target = target.with_eos(())
    reference = hf_greedy(target, PROMPT, 24, eos=-1)
    tokens, _ = speculative_generate(
        target, OracleDrafter(target, PROMPT + reference, decoys=True), torch.tensor(PROMPT), 24
    )
    assert list(tokens) == reference


def test_eos_inside_accepted_draft_stops_there():
    target = make_tiny_target("llama")
    target = target.with_eos(())
    free_run = hf_greedy(target, PROMPT, 30, eos=-1)
    eos = free_run[6]  # a token the oracle will draft in the middle of an accepted chain
    first = free_run.index(eos)
    target = target.with_eos((eos,))
    reference = hf_greedy(target, PROMPT, 30, eos=eos)
    assert reference == free_run[: first + 1]
    tokens, stats = speculative_generate(
        target, OracleDrafter(target, PROMPT + free_run, depth=8), torch.tensor(PROMPT), 30
    )
    assert list(tokens) == reference and stats.stop_reason == "eos"
    assert max(stats.accepted_lengths) > 1  # EOS really arrived inside a multi-token step


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7])
def test_exactly_max_new_tokens_even_when_drafts_are_longer(max_new_tokens):
    target = make_tiny_target("qwen2")
    target = target.with_eos(())
    reference = hf_greedy(target, PROMPT, max_new_tokens, eos=-1)
    drafter = OracleDrafter(target, PROMPT + hf_greedy(target, PROMPT, 20, eos=-1), depth=6)
    tokens, stats = speculative_generate(target, drafter, torch.tensor(PROMPT), max_new_tokens)
    assert list(tokens) == reference and len(tokens) == max_new_tokens


def test_stops_at_context_limit():
    target = make_tiny_target("llama", max_position_embeddings=len(PROMPT) + 9)
    target = target.with_eos(())
    reference = hf_greedy(target, PROMPT, 30, eos=-1)[:9]
    drafter = OracleDrafter(target, PROMPT + reference + [3] * 20, depth=5)
    tokens, stats = speculative_generate(target, drafter, torch.tensor(PROMPT), 30)
    assert list(tokens) == reference
    assert stats.stop_reason == "context" and len(PROMPT) + len(tokens) == target.context_limit


def test_single_token_prompt():
    target = make_tiny_target("mistral")
    target = target.with_eos(())
    reference = hf_greedy(target, [7], 12, eos=-1)
    tokens, _ = speculative_generate(target, create_drafter("ngram", target), torch.tensor([7]), 12)
    assert list(tokens) == reference


@pytest.mark.parametrize("family", CORE_FAMILIES)
def test_prefill_runs_the_lm_head_over_no_position(family):
    """A prefill reads no logits: the LM head (49,152 rows on SmolLM2) runs over none of the prompt's positions."""
    from selfspec.batch import BatchEngine, BatchRequest

    target = make_tiny_target(family).with_eos(())
    rows: list[int] = []
    head = target.model.get_output_embeddings()
    handle = head.register_forward_hook(lambda module, inputs, output: rows.append(inputs[0].shape[-2]))
    try:
        speculative_generate(target, create_drafter("none", target), torch.tensor(PROMPT), 3)
        assert rows == [0, 1, 1, 1], rows  # the prefill, then three one-token steps
        if target.sliding_window is not None:
            return  # batched decoding covers full-attention models
        rows.clear()
        engine = BatchEngine(target, lambda: create_drafter("none", target), slots=2)
        engine.submit(BatchRequest(list(PROMPT), 2))
        engine.run()
        assert rows == [0, 1, 1], rows
    finally:
        handle.remove()
