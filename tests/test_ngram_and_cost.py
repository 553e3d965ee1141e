from __future__ import annotations

import pytest
import torch

from selfspec.cost import CostCurve, monotone_fit
from selfspec.decoding import speculative_generate
from selfspec.heads import create_drafter
from selfspec.heads.base import DraftRequest, Observation
from selfspec.heads.calibration import AcceptanceCalibration
from selfspec.sampling import SamplingConfig

from .helpers import FLAT, make_tiny_target


def ngram_with_context(context, **options):
    drafter = create_drafter("ngram", make_tiny_target("llama"), **options)
    drafter.cost_curve = FLAT
    drafter.observe(Observation(tuple(context), {}))
    return drafter


def test_ngram_copies_the_continuation_of_the_latest_match():
    drafter = ngram_with_context([5, 6, 7, 8, 9, 1, 5, 6, 7, 3, 4, 5, 6])
    tree = drafter.propose(DraftRequest(6, 4, SamplingConfig(), None))
    paths = [
        [tree.token_list[i] for i in tree.path_to(leaf)][1:] for leaf in range(tree.size) if not tree.children(leaf)
    ]
    # (5, 6) occurs twice before: followed by 7 3 4 5 (latest) and 7 8 9 1 -> one branch per distinct next token
    assert paths[0] == [7, 3, 4, 5]
    assert tree.token_list[0] == 6 and tree.max_depth <= 4


def test_ngram_branches_on_distinct_next_tokens():
    drafter = ngram_with_context([1, 2, 3, 9, 1, 2, 4, 9, 1, 2], max_candidates=3)
    tree = drafter.propose(DraftRequest(2, 3, SamplingConfig(), None))
    assert sorted(tree.token_list[c] for c in tree.children(0)) == [3, 4]


def test_ngram_without_match_proposes_root_only():
    drafter = ngram_with_context([1, 2, 3, 4])
    assert drafter.propose(DraftRequest(4, 5, SamplingConfig(), None)).size == 1


def test_ngram_respects_max_depth():
    drafter = ngram_with_context([1, 2, 3, 4, 5, 6, 7, 1, 2])
    assert drafter.propose(DraftRequest(2, 2, SamplingConfig(), None)).max_depth <= 2
    assert drafter.propose(DraftRequest(2, 0, SamplingConfig(), None)).size == 1


def test_cost_curve_interpolates_and_extrapolates():
    curve = CostCurve((1, 2, 4, 8), (1.0, 1.1, 1.8, 2.0), source="test")
    assert curve.cost(1) == 1.0 and curve.cost(3) == pytest.approx(1.45) and curve.cost(16) == pytest.approx(2.4)
    # the worked-out table (sizes up to 256) and the interpolation past it are one function
    assert curve.cost(256) == pytest.approx(2.0 + 0.05 * 248) and curve.cost(300) == pytest.approx(2.0 + 0.05 * 292)
    assert curve.cost(5.5) == pytest.approx(1.875) and curve.cost(0) == 1.0
    assert curve.largest_size_within(1.8) == 4 and curve.largest_size_within(0.5) == 1


def test_monotone_fit_removes_timing_noise():
    noisy = [1.0, 1.616, 1.912, 1.492, 1.395, 1.248, 1.435, 1.527, 1.845]  # a profile taken under load
    fitted = monotone_fit(noisy)
    assert all(a <= b for a, b in zip(fitted, fitted[1:], strict=False))
    assert fitted[0] == 1.0 and fitted[-1] == pytest.approx(1.845)
    assert sum(fitted) == pytest.approx(sum(noisy))  # pooling keeps the mean of each pooled run
    assert monotone_fit([1.0, 1.1, 1.8]) == [1.0, 1.1, 1.8]


def test_best_chain_length_follows_cost_and_acceptance():
    cpu = CostCurve((1, 2, 4, 8, 16), (1.0, 1.1, 1.8, 2.0, 2.2), source="test")
    gpu = CostCurve((1, 64), (1.0, 1.05), source="test")
    assert cpu.best_chain_length(0.05, 16) == 0  # drafting does not pay
    assert cpu.best_chain_length(0.5, 16) == 1
    assert cpu.best_chain_length(0.95, 16) >= 7
    assert gpu.best_chain_length(0.6, 16) > cpu.best_chain_length(0.6, 16)
    assert curve_size_limit(cpu) == 2


def curve_size_limit(curve):
    return curve.largest_size_within(1.15)


def test_ngram_drafts_again_after_a_bad_stretch():
    """Failures push the acceptance estimate below break-even (no draft); steps without a draft carry no evidence, so
    the estimate drifts back to the prior and drafting resumes instead of staying off for good."""
    from selfspec.tree_attention import DraftTree

    drafter = ngram_with_context([1, 2, 3, 1, 2, 3, 1, 2], max_ngram=1)  # every match one token long: one estimate
    drafter.cost_curve = CostCurve((1, 2, 64), (1.0, 1.5, 40.0), source="test")  # a draft pays above a ~0.5 acceptance
    request = DraftRequest(2, 4, SamplingConfig(), None)
    assert drafter.propose(request).size > 1
    for _ in range(10):  # the drafted 3 rejected, the target's 9 committed
        drafter.observe(Observation((9,), {}, DraftTree.from_paths(2, [[3]]), accepted_path=(0,)))
    assert drafter.acceptance < 0.2 and drafter.propose(request).size == 1
    steps = 0
    while drafter.propose(request).size == 1:  # nothing drafted, the target's 2 committed
        drafter.observe(Observation((2,), {}, DraftTree.root_only(2), accepted_path=(0,)))
        steps += 1
        assert steps < 100, "drafting never resumed"
    assert steps > 5  # not at once: the bad stretch still counts for a while


def test_ngram_keeps_an_acceptance_estimate_for_each_length_of_match():
    """Drafts after 1-gram matches that fail stop drafting after 1-gram matches only: a 3-gram match drafts at once on
    its own estimate (on held-out prompts a 1-gram match's first token was accepted about a fifth of the time, a
    4-gram's four fifths)."""
    from selfspec.tree_attention import DraftTree

    drafter = ngram_with_context([1, 2, 3, 4, 7, 1])  # ends in a 1-gram match: 1 (-> 2 3 4 7)
    drafter.cost_curve = CostCurve((1, 2, 64), (1.0, 1.5, 40.0), source="test")  # a draft pays above a ~0.5 acceptance
    request = DraftRequest(1, 4, SamplingConfig(), None)
    assert drafter.propose(request).size > 1 and drafter.matched == 1
    for _ in range(10):  # the drafted 2 rejected, the target's 9 committed
        drafter.observe(Observation((9,), {}, DraftTree.from_paths(1, [[2]]), accepted_path=(0,)))
    assert drafter.acceptance_estimates[1].factor < 0.2
    assert drafter.acceptance_estimates[3].factor == pytest.approx(0.6)  # the prior: no 3-gram draft yet
    drafter.observe(Observation((1, 2, 3), {}))  # now ends in a 3-gram match: 1 2 3 (-> 4 7)
    assert drafter.propose(DraftRequest(3, 4, SamplingConfig(), None)).size > 1 and drafter.matched == 3
    drafter.observe(Observation((8, 7), {}))  # ends in a 1-gram match only: 7 (-> 1)
    assert drafter.propose(DraftRequest(7, 4, SamplingConfig(), None)).size == 1 and drafter.matched == 1


@pytest.mark.parametrize("learn_prior", [True, False])
def test_a_request_starts_from_what_the_earlier_ones_accepted_after_each_length_of_match(learn_prior):
    """1-gram drafts rejected through one request: the next request's 1-gram estimate starts from that, below
    break-even (no draft after a 1-gram match at its start), the other lengths' from the prior; with
    learn_prior=false every request starts from the prior."""
    from selfspec.tree_attention import DraftTree

    context = (1, 2, 3, 4, 7, 1)  # ends in a 1-gram match: 1 (-> 2 3 4 7)
    drafter = ngram_with_context(context, learn_prior=learn_prior)
    drafter.cost_curve = CostCurve((1, 2, 64), (1.0, 1.5, 40.0), source="test")  # a draft pays above a ~0.5 acceptance
    request = DraftRequest(1, 4, SamplingConfig(), None)
    assert drafter.propose(request).size > 1 and drafter.matched == 1
    for _ in range(10):  # the drafted 2 rejected, the target's 9 committed
        drafter.observe(Observation((9,), {}, DraftTree.from_paths(1, [[2]]), accepted_path=(0,)))
    drafter.reset()  # the next request, the same prompt
    drafter.observe(Observation(context, {}))
    assert drafter.acceptance_estimates[3].factor == pytest.approx(0.6)
    if learn_prior:
        assert drafter.acceptance_estimates[1].factor == pytest.approx(0.6 * 4 / (10 + 4))
        assert drafter.propose(request).size == 1
    else:
        assert drafter.acceptance_estimates[1].factor == pytest.approx(0.6)
        assert drafter.propose(request).size > 1


def test_acceptance_calibration_on_hand_made_histories():
    calibration = AcceptanceCalibration()
    assert calibration.factor == 1.0 and calibration.scaled([0.5, 0.9]) == [0.5, 0.9]
    for _ in range(30):  # the head expected 1.5 accepted tokens a step; the verifier took 0.3
        calibration.proposed([0.9, 0.6])
        calibration.verified(0 if _ % 10 else 3)
    assert 0.05 < calibration.factor < 0.35  # about 0.3 / 1.5, as the decayed sums fluctuate
    shrunk = calibration.factor
    steep = CostCurve((1, 2, 4), (1.0, 1.5, 2.0), source="test")
    assert steep.best_size([0.9, 0.6])[0] == 3 and steep.best_size(calibration.scaled([0.9, 0.6]))[0] == 1
    for _ in range(20):  # steps without a draft: the factor drifts back toward 1, so drafting can restart
        calibration.verified(0)
    assert shrunk < calibration.factor < 1.0
    calibration.reset()
    assert calibration.factor == 1.0
    for _ in range(30):  # an underconfident head: the factor grows, each calibrated gain stays a probability
        calibration.proposed([0.3])
        calibration.verified(1)
    assert calibration.factor > 2.0 and calibration.scaled([0.3, 0.9]) == [min(1.0, 0.3 * calibration.factor), 1.0]


def test_an_overconfident_head_stops_drafting_where_it_does_not_pay(tmp_path):
    """Random EAGLE heads on a tiny target: nothing they draft is accepted, so their trees shrink to the root."""
    from .helpers import PROMPT, random_eagle_dir, without_eos

    target = without_eos(make_tiny_target("llama"))
    drafter = create_drafter("eagle", target, random_eagle_dir(target, tmp_path / "h", top_k=2, depth=2))
    drafter.cost_curve = CostCurve((1, 2, 4, 8), (1.0, 1.3, 1.6, 2.0), source="test")
    _, stats = speculative_generate(target, drafter, torch.tensor(PROMPT), 60)
    assert stats.acceptance_rate < 0.2
    assert stats.tree_sizes[0] > 1 and sum(size > 1 for size in stats.tree_sizes[-20:]) < 10
