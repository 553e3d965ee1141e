"""`selfspec bench --quick` end to end on the default model: the files, the rows, the peers."""

from __future__ import annotations

import json

import pytest

from selfspec.cli import main

pytestmark = pytest.mark.real_model


def test_bench_quick_writes_results(tmp_path, capsys):
    out = tmp_path / "bench"
    flags = ["--device", "cpu", "--path", "fast"]  # the float32 weights, whose text transformers' generate gives
    assert main(["bench", "--quick", "--datasets", "mtbench", "--drafters", "ngram", "--out", str(out), *flags]) == 0
    table = capsys.readouterr().out
    assert "| ngram | mtbench |" in table and "| hf_prompt_lookup |" in table
    results = json.loads((out / "results.json").read_text())
    rows = {row["drafter"]: row for row in results["rows"]}
    assert set(rows) == {"hf", "none", "ngram", "hf_prompt_lookup", "hf_early_exit"}
    for row in rows.values():
        assert row["n_prompts"] == 2 and row["greedy_match_rate"] == 1.0 and row["tau"] >= 1.0
        for key in (
            "temperature",
            "acceptance_rate",
            "tokens_per_s",
            "speedup_vs_hf",
            "speedup_vs_none",
            "peak_mem_mb",
        ):
            assert key in row
    assert rows["hf"]["speedup_vs_hf"] == 1.0
    for name in ("results.md", "speedup.png", "tau_by_category.png"):
        assert (out / name).stat().st_size > 0


def test_bench_rejects_unknown_names(capsys):
    assert main(["bench", "--quick", "--drafters", "medusaa"]) == 2
    assert "unknown drafter 'medusaa'" in capsys.readouterr().err
    assert main(["bench", "--quick", "--datasets", "gsm8k"]) == 2
    assert "unknown dataset 'gsm8k'" in capsys.readouterr().err


def test_bench_heads_go_to_the_drafters_of_their_kind(tmp_path):
    from selfspec.bench.runner import BenchSettings, build_methods
    from selfspec.errors import SelfspecError

    from .helpers import make_tiny_target, random_eagle3_dir, random_eagle_dir

    target = make_tiny_target("llama")
    heads = random_eagle3_dir(target, tmp_path / "eagle3")
    methods = build_methods(target, ["ngram", "eagle3", "auto:sources=ngram+eagle3"], [], BenchSettings(), heads)
    assert {"hf", "none", "ngram", "eagle3", "auto:sources=ngram+eagle3"} == set(methods)
    # An EAGLE-1 directory is not handed to eagle3, which then looks for heads shipped for this model: there are none.
    with pytest.raises(SelfspecError, match="no shipped 'eagle3' heads match this model"):
        build_methods(target, ["eagle3"], [], BenchSettings(), random_eagle_dir(target, tmp_path / "eagle"))
