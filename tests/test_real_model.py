"""On the real default model (SmolLM2-135M-Instruct, fp32): selfspec greedy == transformers greedy."""

from __future__ import annotations

import pytest
import torch

from selfspec import SelfSpec

pytestmark = pytest.mark.real_model

PROMPTS = [
    "Compose an engaging travel blog post about a recent trip to Hawaii.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
]


@pytest.fixture(scope="module")
def specs():
    ngram = SelfSpec("default", drafter="ngram", device="cpu")
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
