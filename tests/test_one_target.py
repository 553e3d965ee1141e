"""One target where there is one: the decoding loop refuses a target other than the drafter's, and the benchmark runs
its drafters through SelfSpec, as users do, building none itself."""

from __future__ import annotations

import pytest
import torch

import selfspec.api as api
from selfspec.bench.runner import BenchSettings, build_methods
from selfspec.decoding import speculative_generate
from selfspec.errors import SelfspecError
from selfspec.heads import create_drafter

from .helpers import PROMPT, make_tiny_target, without_eos


def test_a_target_other_than_the_drafters_is_a_one_line_error():
    target, other = make_tiny_target("llama"), make_tiny_target("llama", seed=1)
    drafter = create_drafter("ngram", target)
    with pytest.raises(SelfspecError, match="drafts for another model than the target passed") as error:
        speculative_generate(other, drafter, torch.tensor(PROMPT), 4)
    assert "\n" not in str(error.value)
    # The drafter's own target, or a copy of it with other stop tokens, decodes.
    tokens, _ = speculative_generate(without_eos(target), drafter, torch.tensor(PROMPT), 4)
    assert len(tokens) == 4


class _BuiltBySelfSpec(Exception):
    pass


def _refuse(*args, **kwargs):
    raise _BuiltBySelfSpec


def test_the_bench_runs_each_drafter_through_selfspec(monkeypatch):
    target = without_eos(make_tiny_target("llama"))
    generated = []
    generate = api.SelfSpec.generate

    def spy(self, *args, **kwargs):
        generated.append(self)
        return generate(self, *args, **kwargs)

    with monkeypatch.context() as patched:  # the drafters are built by a SelfSpec each, nowhere else
        patched.setattr(api, "create_drafter", _refuse)
        with pytest.raises(_BuiltBySelfSpec):
            build_methods(target, ["ngram"], [], BenchSettings())
    monkeypatch.setattr(api.SelfSpec, "generate", spy)
    methods = build_methods(target, ["ngram"], [], BenchSettings())
    output = methods["ngram"](torch.tensor([PROMPT]), 8, 0)
    methods["ngram"](torch.tensor([PROMPT]), 8, 1)
    assert len(output.token_ids) == 8 and len(generated) == 2 and generated[0] is generated[1]  # one kept per method
