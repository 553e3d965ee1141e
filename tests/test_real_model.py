"""On the real default model (SmolLM2-135M-Instruct, fp32): selfspec greedy == transformers greedy."""

from __future__ import annotations

import pytest
import torch

from selfspec import SelfSpec
from selfspec.models import load_target

pytestmark = pytest.mark.real_model

PROMPTS = [
    "Compose an engaging travel blog post about a recent trip to Hawaii.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
]


@pytest.fixture(scope="module")
def specs():
    # the float32 weights (`auto` would take the GGUF's own 4-bit blocks, whose text transformers does not give)
    ngram = SelfSpec(load_target("default", device="cpu", four_bit=False), drafter="ngram")
    return ngram, SelfSpec(ngram.target, drafter="none")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_default_model_greedy_matches_hf_generate(specs, prompt):
    ngram, none = specs
    ids = ngram.target.encode_prompt(prompt)
    with torch.inference_mode():
        reference = ngram.target.model.generate(ids, max_new_tokens=48, do_sample=False)[0, ids.shape[1] :].tolist()
    for spec in (ngram, none):
        result = spec.generate(input_ids=ids, max_new_tokens=48)
        assert list(result.token_ids) == reference
    assert result.text.strip()


# drafter -> (options for a fixed budget, the aggregate mean accepted length it must beat)
SHIPPED = {
    "medusa": ({"max_nodes": 16}, 1.3),
    "eagle": ({"fixed_nodes": 16}, 1.3),
    "layerskip": ({"adaptive": False}, 1.5),
    "dflash": ({"fixed_nodes": 16}, 1.05),  # a short CPU training run: its drafts are accepted, rarely
}


@pytest.mark.parametrize("drafter", list(SHIPPED))
def test_shipped_heads_greedy_match_hf_generate(specs, drafter):
    """The heads (or tuned data) in the repository attach to the default model with no flags, stay small, and stay
    lossless."""
    from selfspec.heads.artifacts import SHIPPED_DIR

    ngram, _ = specs
    shipped = SHIPPED_DIR / f"{drafter}-smollm2"
    # Every retrained head adds its size to each clone's history: the largest (DFlash, two decoder layers in float32)
    # is ~31 MiB.
    assert sum(f.stat().st_size for f in shipped.rglob("*") if f.is_file()) < 40 * 2**20
    assert SelfSpec(ngram.target, drafter=drafter).drafter.target is ngram.target  # found with no flags
    # A fixed budget: the default size follows this machine's stored cost curve, which varies.
    options, floor = SHIPPED[drafter]
    spec = SelfSpec(ngram.target, drafter=drafter, **options)
    accepted = forwards = 0
    for prompt in PROMPTS:
        ids = ngram.target.encode_prompt(prompt)
        with torch.inference_mode():
            reference = ngram.target.model.generate(ids, max_new_tokens=48, do_sample=False)[0, ids.shape[1] :].tolist()
        result = spec.generate(input_ids=ids, max_new_tokens=48, pace=False)  # acceptance, not speed, is checked
        assert list(result.token_ids) == reference
        accepted += result.stats.new_tokens
        forwards += result.stats.target_forwards
    assert accepted / forwards > floor  # drafts are accepted
