"""`selfspec bench --quick` end to end on the default model: the files, the rows, the peers."""

from __future__ import annotations

import json

import pytest

from selfspec.cli import main

pytestmark = pytest.mark.real_model


def test_bench_quick_writes_results(tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["bench", "--quick", "--datasets", "mtbench", "--drafters", "ngram", "--out", str(out), "--device", "cpu"]) == 0
    table = capsys.readouterr().out
    assert "| ngram | mtbench |" in table and "| hf_prompt_lookup |" in table
    results = json.loads((out / "results.json").read_text())
    rows = {row["drafter"]: row for row in results["rows"]}
    assert set(rows) == {"hf", "none", "ngram", "hf_prompt_lookup", "hf_early_exit"}
    for row in rows.values():
        assert row["n_prompts"] == 2 and row["greedy_match_rate"] == 1.0 and row["tau"] >= 1.0
        for key in ("temperature", "acceptance_rate", "tokens_per_s", "speedup_vs_hf", "speedup_vs_none", "peak_mem_mb"):
            assert key in row
    assert rows["hf"]["speedup_vs_hf"] == 1.0
    for name in ("results.md", "speedup.png", "tau_by_category.png"):
        assert (out / name).stat().st_size > 0


def test_bench_rejects_unknown_names(capsys):
    assert main(["bench", "--quick", "--drafters", "medusaa"]) == 2
    assert "unknown drafter 'medusaa'" in capsys.readouterr().err
    assert main(["bench", "--quick", "--datasets", "gsm8k"]) == 2
    assert "unknown dataset 'gsm8k'" in capsys.readouterr().err
