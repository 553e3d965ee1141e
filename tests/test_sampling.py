from __future__ import annotations

import pytest
import torch

from selfspec.errors import SelfspecError
from selfspec.sampling import SamplingConfig, logits_to_probs


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0]])
    assert logits_to_probs(logits, SamplingConfig()).tolist() == [[0.0, 1.0, 0.0]]


def test_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    plain = logits_to_probs(logits, SamplingConfig(temperature=1.0))
    torch.testing.assert_close(plain, torch.tensor([0.5, 0.25, 0.15, 0.1]))
    top2 = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    torch.testing.assert_close(top2, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))
    # top_p = 0.7: 0.5 alone is short of 0.7, 0.5 + 0.25 reaches it
    nucleus = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(nucleus, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))
    tiny = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=0.01))
    torch.testing.assert_close(tiny, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    hot = logits_to_probs(logits, SamplingConfig(temperature=2.0))
    assert hot[0] < 0.5 and hot[3] > 0.1


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
        ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
        ({"temperature": 1.0, "top_k": -1}, "top_k"),
    ],
)
def test_bad_sampling_values(kwargs, fragment):
    with pytest.raises(SelfspecError, match=fragment):
        SamplingConfig(**kwargs)
