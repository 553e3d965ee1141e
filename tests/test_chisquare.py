"""Sampling stays lossless: the first two generated tokens follow the target's own distribution.

Each sample runs the real loop (prefill, tree mask, target forward, verifier, cache compaction, a second step when
the first emitted only one token). The expected joint distribution comes from plain full forwards of the target
with the same temperature / top-k / top-p. A verifier that forgets to remove rejected mass must fail the test.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

import selfspec.tree_attention.verifier as verify_module
from selfspec.cost import load_cost_curve
from selfspec.decoding import speculative_generate
from selfspec.heads.base import DraftRequest, Drafter, Observation
from selfspec.sampling import SamplingConfig, logits_to_probs
from selfspec.tree_attention import DraftTree

from .conftest import make_tiny_target

VOCAB = 8
PROMPT = [5]  # one token: no prefill forward, so 50k samples stay fast; step 2 still reads a compacted cache
SAMPLING = SamplingConfig(temperature=1.0, top_k=6, top_p=0.9)
SAMPLES = 50_000


class BigramTreeDrafter(Drafter):
    """A width-2, depth-2 tree from a fixed random bigram table q[last token]: children either drawn from q
    (with or without replacement) or taken as q's top-2 (deterministic)."""

    def __init__(self, target, drawn: bool, without_replacement: bool = False):
        super().__init__(target, load_cost_curve("cpu", target.name))
        # Its own generator: the table must not depend on which tests ran before in the same process.
        rng = torch.Generator().manual_seed(7)
        dirichlet = -torch.rand(VOCAB, VOCAB, generator=rng).log()  # Gamma(1) draws, normalised: Dirichlet(1) rows
        self.table = 0.5 * dirichlet / dirichlet.sum(-1, keepdim=True) + 0.5 / VOCAB
        self.table = 0.5 * torch.rand(VOCAB, VOCAB, generator=rng).softmax(-1) + 0.5 * self.table
        self.drawn, self.without_replacement = drawn, without_replacement

    def _children(self, last: int, generator) -> list[int]:
        q = self.table[last]
        if not self.drawn:
            return torch.topk(q, 2).indices.tolist()
        return torch.multinomial(q, 2, replacement=not self.without_replacement, generator=generator).tolist()

    def propose(self, request: DraftRequest) -> DraftTree:
        if request.max_depth < 1:
            return DraftTree.root_only(request.root_token)
        first = self._children(request.root_token, request.generator)  # nodes 1, 2
        tokens, parents, rows = [request.root_token] + first, [-1, 0, 0], [request.root_token]
        if request.max_depth >= 2:
            tokens += self._children(first[0], request.generator)  # nodes 3, 4 under node 1
            parents += [1, 1]
            rows.append(first[0])
        q_rows = [self.table[r] for r in rows] + [torch.full((VOCAB,), 1.0 / VOCAB)] * (len(tokens) - len(rows))
        # rows must line up with nodes: node 0 -> table[root], node 1 -> table[first[0]], others unused
        q = torch.stack(q_rows)
        return DraftTree(
            tokens=torch.tensor(tokens),
            parents=torch.tensor(parents),
            draft_probs=q if self.drawn else None,
            without_replacement=self.without_replacement,
        )

    def observe(self, observation: Observation) -> None:
        pass


def expected_joint(target, prompt: list[int] = PROMPT) -> torch.Tensor:
    """[V, V]: the target's probability of each pair of next tokens after `prompt`, under SAMPLING."""
    with torch.inference_mode():
        first = logits_to_probs(target.model(torch.tensor([prompt])).logits[0, -1], SAMPLING)
        second = torch.stack(
            [logits_to_probs(target.model(torch.tensor([prompt + [t]])).logits[0, -1], SAMPLING) for t in range(VOCAB)]
        )
    return first[:, None] * second  # [V, V]


def sample_joint(target, drafter, samples: int) -> torch.Tensor:
    counts = torch.zeros(VOCAB, VOCAB)
    for seed in range(samples):
        tokens, _ = speculative_generate(target, drafter, torch.tensor(PROMPT), 2, SAMPLING, seed=seed)
        counts[tokens[0], tokens[1]] += 1
    return counts


def chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    total = counts.sum()
    impossible = expected < 1e-9
    assert counts[impossible].sum() == 0, "sampled a token pair the target gives zero probability"
    observed, predicted = counts[~impossible].double(), (expected[~impossible] * total).double()
    # Pool rare cells so every expected count is >= 5, as the chi-square approximation needs.
    rare = predicted < 5
    if rare.any():
        observed = torch.cat([observed[~rare], observed[rare].sum().view(1)])
        predicted = torch.cat([predicted[~rare], predicted[rare].sum().view(1)])
    return float(chisquare(observed.numpy(), predicted.numpy() * observed.sum().item() / predicted.sum().item()).pvalue)


@pytest.fixture(scope="module")
def target():
    target = make_tiny_target("llama", vocab_size=VOCAB, initializer_range=0.15, num_hidden_layers=1)
    target._eos = ()
    return target


@pytest.mark.parametrize(
    "drawn, without_replacement",
    [(False, False), (True, False), (True, True)],
    ids=["deterministic-children", "drawn-with-replacement", "drawn-without-replacement"],
)
def test_sampled_pairs_follow_target_distribution(target, drawn, without_replacement):
    expected = expected_joint(target)
    assert (expected > 1e-9).sum() >= 12, "the test distribution should have real spread"
    counts = sample_joint(target, BigramTreeDrafter(target, drawn, without_replacement), SAMPLES)
    p_value = chi_square_p_value(counts, expected)
    assert p_value > 1e-3, f"sampled distribution differs from the target's (chi-square p = {p_value:.2e})"


@pytest.mark.parametrize("drawn", [False, True], ids=["deterministic-children", "drawn"])
def test_broken_verifier_is_caught(target, monkeypatch, drawn):
    # The classic bug: after a rejection, keep drawing from the full p instead of the residual.
    monkeypatch.setattr(verify_module, "_renormalise", lambda residual, fallback: fallback)
    counts = sample_joint(target, BigramTreeDrafter(target, drawn), 20_000)
    p_value = chi_square_p_value(counts, expected_joint(target))
    assert p_value < 1e-6, f"a broken verifier went unnoticed (p = {p_value:.2e})"
