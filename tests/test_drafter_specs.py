"""Drafter specs (`name:key=value,...`) through one parser, in the API, `generate` and `bench`: regression tests for
three bugs a new user hit (a boolean option that stayed on, a bench list split inside a spec, a spec `generate`
could not read)."""

from __future__ import annotations

import json

import pytest
import torch

from selfspec import SelfSpec
from selfspec.bench.harness import parse_drafters
from selfspec.cli import main
from selfspec.decoding import speculative_generate
from selfspec.errors import SelfspecError
from selfspec.heads import create_drafter
from selfspec.models import load_target
from selfspec.options import parse_drafter_spec, split_drafter_specs

from .helpers import PROMPT, make_tiny_target, random_eagle_dir


def test_spec_strings_and_lists():
    assert parse_drafter_spec("eagle:fixed_nodes=60,top_k=10") == ("eagle", {"fixed_nodes": "60", "top_k": "10"})
    assert parse_drafter_spec("eagle:fixed_nodes=60:top_k=10") == ("eagle", {"fixed_nodes": "60", "top_k": "10"})
    assert parse_drafter_spec(" medusa ") == ("medusa", {})
    assert split_drafter_specs("medusa, layerskip:threshold=0.3,max_draft=6,eagle:fixed_nodes=60,top_k=4") == [
        "medusa",
        "layerskip:threshold=0.3,max_draft=6",
        "eagle:fixed_nodes=60,top_k=4",
    ]
    for bad, message in (("eagle:60", "not KEY=VALUE"), ("eagle:top_k=1,top_k=2", "given twice"), ("", "empty")):
        with pytest.raises(SelfspecError, match=message):
            parse_drafter_spec(bad)
    with pytest.raises(SelfspecError, match="comes before any drafter"):
        split_drafter_specs("top_k=3,eagle")


def test_option_values_are_typed_and_checked():
    target = make_tiny_target("llama", num_hidden_layers=3)
    with pytest.raises(SelfspecError, match="adaptive: expected true or false, got 'maybe'"):
        create_drafter("layerskip:skip=every-other,adaptive=maybe", target)
    with pytest.raises(SelfspecError, match="max_draft: expected an integer, got 'six'"):
        create_drafter("ngram:max_draft=six", target)
    with pytest.raises(SelfspecError, match="expected bool, got 1"):
        create_drafter("layerskip", target, skip="every-other", adaptive=1)
    with pytest.raises(SelfspecError, match="given both"):
        create_drafter("ngram:max_draft=3", target, max_draft=4)
    with pytest.raises(SelfspecError, match="max_candidates and max_draft must be >= 1"):
        create_drafter("ngram:max_draft=0", target)
    assert create_drafter("ngram:max_draft=3,prior_acceptance=0.5", target).options.max_draft == 3


@pytest.mark.parametrize("how", ["spec", "keywords", "api"])
def test_layerskip_adaptive_false_turns_adaptation_off(how):
    """Bug: `adaptive=false` arrived as the string 'false', and bool('false') is True."""
    target = make_tiny_target("llama", num_hidden_layers=4)
    options = dict(threshold=0.3, target_acceptance=1.0, adapt_step=0.1)  # an impossible rate: adaptation would move
    if how == "spec":
        drafter = create_drafter(
            "layerskip:skip=every-other,adaptive=false,threshold=0.3,target_acceptance=1,adapt_step=0.1", target
        )
    elif how == "keywords":
        drafter = create_drafter("layerskip", target, skip="every-other", adaptive=False, **options)
    else:
        drafter = SelfSpec(target, drafter="layerskip:skip=every-other,adaptive=false", **options).drafter
    speculative_generate(target, drafter, torch.tensor(PROMPT), 12)
    assert drafter.adaptive is False and drafter.threshold == 0.3
    on = create_drafter("layerskip:skip=every-other,adaptive=true", target, **options)
    speculative_generate(target, on, torch.tensor(PROMPT), 12)
    assert on.threshold > 0.3


def test_generate_reads_specs_with_options(tiny_checkpoint, tmp_path, capsys):
    """Bug: `selfspec generate --drafter eagle:fixed_nodes=60` was 'unknown drafter'."""
    heads = random_eagle_dir(load_target(str(tiny_checkpoint)), tmp_path / "eagle")
    base = ["generate", "--model", str(tiny_checkpoint), "--prompt", "the cat", "--max-new-tokens", "6"]
    assert main(base + ["--drafter", "eagle:fixed_nodes=60", "--heads", str(heads)]) == 0
    assert "drafter=eagle:fixed_nodes=60 " in capsys.readouterr().err
    assert main(base + ["--drafter", "layerskip:skip=every-other,adaptive=false,max_draft=6"]) == 0
    assert "drafter=layerskip:skip=every-other,adaptive=False,max_draft=6 " in capsys.readouterr().err
    assert main(base + ["--drafter", "layerskip:adaptive=nope"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "adaptive: expected true or false" in error


def test_bench_keeps_a_specs_own_commas(tiny_checkpoint, tmp_path, capsys):
    """Bug: the README's `layerskip:threshold=0.3,max_draft=6` was split on its comma ('unknown drafter
    max_draft=6')."""
    assert parse_drafters("ngram,layerskip:threshold=0.3,max_draft=6") == (
        "ngram",
        "layerskip:threshold=0.3,max_draft=6",
    )
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "the big cat"}) + "\n")
    spec = "layerskip:skip=every-other,threshold=0.3,max_draft=6"
    args = [
        "bench",
        "--model",
        str(tiny_checkpoint),
        "--drafters",
        f"ngram,{spec}",
        "--datasets",
        "",
        "--prompts",
        str(prompts),
        "--peers",
        "",
        "--max-new-tokens",
        "6",
        "--out",
        str(tmp_path / "bench"),
    ]
    assert main(args) == 0
    rows = {row["drafter"] for row in json.loads((tmp_path / "bench" / "results.json").read_text())["rows"]}
    assert rows == {"hf", "none", "ngram", spec}
    capsys.readouterr()
    assert main(args[:4] + ["ngram,layerskip:max_draft=many"] + args[5:]) == 2
    assert "max_draft: expected an integer" in capsys.readouterr().err
