"""Benchmark arithmetic on hand-made step logs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from selfspec.bench import metrics
from selfspec.bench.metrics import RunRecord
from selfspec.bench.report import aggregate, markdown_table, source_table


def record(method, prompt, wall, lengths=(), sizes=(), tokens=None, new_tokens=None, forwards=None, category="c"):
    new = new_tokens if new_tokens is not None else sum(lengths)
    return RunRecord(
        method=method,
        dataset="d",
        category=category,
        prompt_id=prompt,
        new_tokens=new,
        wall_s=wall,
        target_forwards=forwards if forwards is not None else len(lengths),
        accepted_lengths=tuple(lengths),
        tree_sizes=tuple(sizes),
        token_ids=tuple(tokens if tokens is not None else range(new)),
        peak_mem_mb=100.0,
    )


def test_tau_counts_the_targets_own_token():
    # steps emitted 3, 1, 2 tokens in 3 forwards -> tau 2.0
    runs = [record("x", "p", 1.0, lengths=(3, 1, 2), sizes=(4, 4, 1))]
    assert metrics.tau(runs) == 2.0
    # acceptance: drafted steps are the two 4-node trees: (2 + 0) accepted / (3 + 3) drafted
    assert metrics.acceptance_rate(runs) == pytest.approx(2 / 6)


def test_acceptance_is_none_for_peers_without_step_logs():
    assert metrics.acceptance_rate([record("hf", "p", 1.0, new_tokens=10, forwards=10)]) is None


def test_speedup_is_throughput_ratio_over_same_prompts():
    hf = [record("hf", "a", 2.0, new_tokens=20, forwards=20), record("hf", "b", 2.0, new_tokens=20, forwards=20)]
    fast = [record("x", "a", 1.0, lengths=(4,) * 5), record("x", "b", 1.0, lengths=(4,) * 5)]
    assert metrics.speedup(fast, hf) == pytest.approx(2.0)
    assert metrics.tokens_per_s(fast) == pytest.approx(20.0)


def test_cost_ceiling_uses_tree_sizes():
    runs = [record("x", "a", 1.0, lengths=(3, 3), sizes=(8, 8))]
    assert metrics.cost_ceiling(runs, lambda n: 1.0 if n == 1 else 2.0) == pytest.approx(1.5)  # 6 tokens / cost 4


def test_greedy_match_rate_against_hf_tokens():
    reference = {"a": (1, 2, 3), "b": (4, 5)}
    runs = [record("x", "a", 1.0, tokens=(1, 2, 3), new_tokens=3), record("x", "b", 1.0, tokens=(4, 6), new_tokens=2)]
    assert metrics.greedy_match_rate(runs, reference) == 0.5


def test_aggregate_rows_and_table():
    records = [
        record("hf", "a", 2.0, tokens=(1, 2), new_tokens=2, forwards=2, category="math"),
        record("none", "a", 2.0, lengths=(1, 1), sizes=(1, 1), tokens=(1, 2), category="math"),
        record("ngram", "a", 1.0, lengths=(2,), sizes=(3,), tokens=(1, 2), category="math"),
        record("hf", "b", 1.0, tokens=(7,), new_tokens=1, forwards=1, category="code"),
        record("none", "b", 1.0, lengths=(1,), sizes=(1,), tokens=(7,), category="code"),
        record("ngram", "b", 1.0, lengths=(1,), sizes=(1,), tokens=(8,), category="code"),
    ]
    rows = aggregate(records, 0.0, lambda n: 1.0)
    by_name = {row.drafter: row for row in rows}
    assert by_name["ngram"].greedy_match_rate == 0.5 and by_name["hf"].greedy_match_rate == 1.0
    assert by_name["ngram"].speedup_vs_hf == pytest.approx((3 / 2.0) / (3 / 3.0))
    assert by_name["ngram"].tau == pytest.approx(1.5)
    per_category = aggregate(records, 0.0, lambda n: 1.0, by_category=True)
    assert {(r.drafter, r.category) for r in per_category} >= {("ngram", "math"), ("ngram", "code")}
    sampled = aggregate(records, 1.0, lambda n: 1.0)
    assert all(r.greedy_match_rate is None for r in sampled)
    table = markdown_table(rows)
    assert table.count("\n") == len(rows) + 1 and "| ngram |" in table


def test_accepted_tokens_by_source_per_dataset():
    plain = record("ngram", "a", 1.0, lengths=(3, 1), sizes=(4, 1))
    runs = [
        RunRecord(
            **{
                **record("auto", "a", 1.0, lengths=(3, 2, 1), sizes=(5, 4, 1)).__dict__,
                "accepted_by_source": (("ngram", 2), ("eagle", 2)),
            }
        ),
        RunRecord(
            **{
                **record("auto", "b", 1.0, lengths=(2,), sizes=(3,)).__dict__,
                "accepted_by_source": (("ngram", 0), ("eagle", 1)),
            }
        ),
    ]
    assert metrics.accepted_by_source(runs) == {"ngram": 2, "eagle": 3}
    assert metrics.accepted_by_source([plain]) is None
    assert metrics.accepted_draft_tokens(runs) == 4
    rows = aggregate(runs + [plain], 0.0, lambda n: 1.0)
    by_name = {row.drafter: row for row in rows}
    assert (
        by_name["auto"].accepted_by_source == {"ngram": 2, "eagle": 3} and by_name["ngram"].accepted_by_source is None
    )
    table = source_table(rows)
    assert table.splitlines()[2:] == ["| auto | d | 4 | 2 (50%) | 3 (75%) |"]  # no row for the drafter without sources
    assert source_table([by_name["ngram"]]) is None


def test_time_shares_of_the_wall_time():
    timed = [
        replace(record("x", "p", 2.0, lengths=(2,)), draft_s=0.5, verify_s=1.0),
        replace(record("x", "q", 2.0, lengths=(2,)), draft_s=0.3, verify_s=1.4),
    ]
    assert metrics.time_share(timed, "draft_s") == pytest.approx(0.2)
    assert metrics.time_share(timed, "verify_s") == pytest.approx(0.6)
    assert metrics.time_share([record("hf", "p", 1.0, new_tokens=4, forwards=4)], "draft_s") is None
    rows = aggregate(timed + [record("hf", "p", 1.0, new_tokens=2, forwards=2)], 0.0, lambda n: 1.0)
    shares = {row.drafter: (row.draft_share, row.verify_share) for row in rows}
    assert shares == {"x": (0.2, 0.6), "hf": (None, None)}
    assert "| drafting |" in markdown_table(rows)
