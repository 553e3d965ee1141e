"""Layer-skip: skip plans from the config's layer count, the draft path against the target, the draft cache's
rollback, tuned files (round trip, wrong base), and losslessness (greedy equality, chi-square) with layer-skip
drafts."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from selfspec.decoding import speculative_generate
from selfspec.errors import SelfspecError
from selfspec.heads import create_drafter
from selfspec.heads.base import DraftRequest
from selfspec.heads.layerskip import (
    LayerSkipSettings,
    SkippingForward,
    SkipPlan,
    TunedSkipSet,
    every_other_layer,
    load_skip_file,
    save_skip_file,
)
from selfspec.heads.paced import PAUSE_RULE, Paced, PlainStep
from selfspec.sampling import SamplingConfig

from .helpers import CORE_FAMILIES, PROMPT, hf_greedy, make_tiny_target


@pytest.mark.parametrize("layers", [2, 3, 5])
def test_skip_plans_follow_the_configs_layer_count(layers):
    target = make_tiny_target("llama", num_hidden_layers=layers)
    assert every_other_layer(layers) == tuple(range(1, layers, 2))
    plan = SkipPlan.from_settings(LayerSkipSettings(skip_attention=(0,), skip_mlp=(layers - 1,)), layers)
    assert len(plan.run_attention) == len(plan.run_mlp) == layers
    assert plan.run_attention[0] is False and plan.run_mlp[layers - 1] is False and sum(plan.run_mlp) == layers - 1
    with pytest.raises(SelfspecError, match=f"outside this model's {layers} layers"):
        create_drafter("layerskip", target, skip="every-other", skip_mlp=[layers])


@pytest.mark.parametrize("family", CORE_FAMILIES + ["gemma2"])
@pytest.mark.parametrize("split_all", [False, True], ids=["whole-layers", "sublayers"])
def test_draft_path_with_nothing_skipped_reproduces_the_target(family, split_all):
    target = make_tiny_target(family, num_hidden_layers=3)
    tokens = torch.tensor(PROMPT + [7, 9, 11])
    with torch.inference_mode():
        expected = target.model(tokens.view(1, -1)).logits[0]
        forward = SkippingForward(target, SkipPlan.from_settings(LayerSkipSettings(), 3), None, split_all=split_all)
        cache = DynamicCache()
        first = forward(tokens[:8], cache, 0)  # a chunk, then one token at a time, through the draft cache
        rest = [forward(tokens[i : i + 1], cache, i) for i in range(8, len(tokens))]
    torch.testing.assert_close(torch.cat([first, *rest]), expected, atol=1e-5, rtol=1e-4)


def test_skipping_changes_the_draft_and_a_reduced_vocabulary_maps_back():
    target = make_tiny_target("llama", num_hidden_layers=3)
    tokens = torch.tensor(PROMPT)
    with torch.inference_mode():
        full = SkippingForward(target, SkipPlan.from_settings(LayerSkipSettings(), 3), None)(tokens, DynamicCache(), 0)
        plan = SkipPlan.from_settings(LayerSkipSettings(skip_attention=(1,), skip_mlp=(1, 2)), 3)
        skipped = SkippingForward(target, plan, None)(tokens, DynamicCache(), 0)
        vocab = torch.arange(0, target.vocab_size, 3)
        reduced = SkippingForward(target, plan, vocab)
        reduced_logits = reduced(tokens, DynamicCache(), 0)
    assert not torch.allclose(full, skipped)
    torch.testing.assert_close(reduced_logits, skipped[:, vocab])
    assert reduced.to_target_ids(torch.tensor([0, 2])).tolist() == [0, 6]


def _drafter(target, **options):
    return create_drafter("layerskip", target, skip="every-other", **options)


def test_draft_cache_rolls_back_to_the_committed_text():
    target = make_tiny_target("llama", num_hidden_layers=4)
    drafter = _drafter(target, threshold=0.0, max_draft=4, adaptive=False)
    # Run a real generation, then compare the draft cache with one built from scratch on the committed text (what the
    # drafter observed: the loop does not report its last step).
    tokens, stats = speculative_generate(target, drafter, torch.tensor(PROMPT), 9)
    full = drafter.committed
    assert full == (PROMPT + list(tokens))[: len(full)] and len(full) == len(PROMPT) + 9 - stats.accepted_lengths[-1]
    assert drafter.cached == full[: len(drafter.cached)] and drafter.cache.get_seq_length(0) == len(drafter.cached)
    request = DraftRequest(full[-1], 4, SamplingConfig(), None)
    with torch.inference_mode():
        tree = drafter.propose(request)
    fresh = _drafter(target, threshold=0.0, max_draft=4, adaptive=False)
    from selfspec.heads.base import Observation

    fresh.observe(Observation(tuple(full), {}))
    with torch.inference_mode():
        fresh_tree = fresh.propose(request)
    assert tree.token_list == fresh_tree.token_list and tree.size == 5
    assert drafter.cached == full + tree.token_list[1:-1]  # the chain, all but its last token, is cached


def test_threshold_stops_drafting_and_adapts():
    target = make_tiny_target("llama", num_hidden_layers=4)
    never = _drafter(target, threshold=0.99, adaptive=False)
    _, stats = speculative_generate(target, never, torch.tensor(PROMPT), 6)
    assert set(stats.tree_sizes) == {1}
    adaptive = _drafter(target, threshold=0.3, target_acceptance=1.0, adapt_step=0.1)
    speculative_generate(target, adaptive, torch.tensor(PROMPT), 12)
    assert adaptive.threshold > 0.3  # acceptance below the (impossible) target rate raised it


def test_a_draft_that_costs_more_than_a_plain_step_is_paused_unless_unpaced():
    """Layer-skip's draft forwards are its pacing's input: where one costs more than a plain target step, a window of
    them can never pay, and the wrapper rests it for as long as the rule allows (no verdict of the drafter's own)."""
    target = make_tiny_target("llama", num_hidden_layers=4)
    target.model.generation_config.eos_token_id = None
    target = target.with_eos(())
    reference = hf_greedy(target, PROMPT, 20, eos=-1)
    instant = PlainStep()
    instant.seconds = 1e-6  # as if the target's plain step took a microsecond: no draft forward can pay
    drafter = Paced(_drafter(target, threshold=0.0, adaptive=False), plain_step=instant)  # kept across requests
    tokens, stats = speculative_generate(target, drafter, torch.tensor(PROMPT), 20)
    window = PAUSE_RULE.window
    assert min(stats.tree_sizes[:window]) > 1 and set(stats.tree_sizes[window:]) == {1}  # one probe, then paused
    assert list(tokens) == reference and drafter.pause_left > 0
    tokens, stats = speculative_generate(target, drafter, torch.tensor(PROMPT), 20, pace=False)
    assert list(tokens) == reference and set(stats.tree_sizes) != {1}  # unpaced: it drafts whatever it costs
    tokens, stats = speculative_generate(target, drafter, torch.tensor(PROMPT), 20)
    assert list(tokens) == reference and set(stats.tree_sizes) == {1}  # the pause is kept across requests


@pytest.mark.parametrize("family", CORE_FAMILIES)
def test_greedy_equality_with_layerskip_drafts(family):
    target = make_tiny_target(family, num_hidden_layers=4)
    target.model.generation_config.eos_token_id = None
    target = target.with_eos(())
    reference = hf_greedy(target, PROMPT, 30, eos=-1)
    for options in (
        {"threshold": 0.0},
        {"threshold": 0.2, "branch_threshold": 0.9},
        {"skip_attention": [], "skip_mlp": [], "threshold": 0.0, "adaptive": False},
    ):
        drafter = _drafter(target, max_draft=5, **options)
        # Unpaced: drafting with the whole target costs more than it saves, and acceptance is what is checked here.
        tokens, stats = speculative_generate(target, drafter, torch.tensor(PROMPT), 30, pace=False)
        assert list(tokens) == reference, f"{family}/{options}"
        assert max(stats.tree_sizes) > 1
        if not options.get("skip_mlp", True):  # nothing skipped: the draft is the target, every draft accepted
            assert stats.mean_accepted_length > 5.0


def test_tuned_file_round_trip_wrong_base_and_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    target = make_tiny_target("llama", num_hidden_layers=4)
    with pytest.raises(SelfspecError, match="no tuned layer-skip set for this model"):
        create_drafter("layerskip", target)
    settings = LayerSkipSettings(skip_attention=(1, 2), skip_mlp=(3,), threshold=0.4, max_draft=3)
    vocab = torch.arange(0, target.vocab_size, 2)
    from selfspec.heads.layerskip import user_skip_path

    path = save_skip_file(user_skip_path(target), TunedSkipSet(settings, vocab, target.fingerprint, {"trials": 1}))
    loaded = load_skip_file(path, target)
    assert loaded.settings == settings and loaded.draft_vocab.tolist() == vocab.tolist()
    drafter = create_drafter("layerskip", target)  # found by fingerprint, no flags
    assert drafter.settings == settings and drafter.skipping.plan.run_attention == (True, False, False, True)
    assert create_drafter("layerskip", target, threshold=0.1).settings.threshold == 0.1
    other = make_tiny_target("llama", num_hidden_layers=3)
    with pytest.raises(SelfspecError, match="tuned for another base model"):
        create_drafter("layerskip", other, path)
    with pytest.raises(SelfspecError, match="drafter 'layerskip' options: unknown key.*nonsense"):
        create_drafter("layerskip", target, nonsense=1)
    assert not list(path.parent.glob(".*"))  # no temporary file left behind


def _study_trials(storage):
    import optuna

    journal = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(storage)))
    (summary,) = optuna.get_all_study_summaries(journal)
    study = optuna.load_study(study_name=summary.study_name, storage=journal)
    return [(t.params, t.value, t.state.name) for t in study.trials]


def test_seeded_study_is_reproducible_resumable_and_found_by_the_drafter(
    tmp_path, tiny_checkpoint, fake_sharegpt, capsys
):
    from selfspec.cli import main
    from selfspec.models import load_target

    common = [
        "tune",
        "layerskip",
        "--model",
        str(tiny_checkpoint),
        "--prompts",
        "2",
        "--max-new-tokens",
        "6",
        "--draft-vocab-size",
        "12",
        "--seed",
        "3",
    ]
    for name in ("a", "b"):
        assert main(common + ["--trials", "6", "--estimate-only", "--out", str(tmp_path / name)]) == 0
    first, second = (
        _study_trials(tmp_path / "a" / "layerskip.study.log"),
        _study_trials(tmp_path / "b" / "layerskip.study.log"),
    )
    assert len(first) == 6 and first == second
    assert first[0][0]["skip_attn_1"] is True and first[0][0]["skip_attn_0"] is False  # trial 0: the baseline
    # Timed stage, then a resumed study that only runs the missing trials.
    out = tmp_path / "timed"
    assert main(common + ["--trials", "4", "--out", str(out)]) == 0
    assert main(common + ["--trials", "6", "--out", str(out)]) == 0
    trials = _study_trials(out / "layerskip.study.log")
    assert len(trials) == 6 and trials[0][2] == "COMPLETE" and trials[0][1] > 0
    printed = capsys.readouterr().out
    assert "baseline every-other-layer" in printed and "written to" in printed
    target = load_target(str(tiny_checkpoint))
    drafter = create_drafter("layerskip", target, out)
    summary = load_skip_file(out / "layerskip.json", target).study
    assert summary["trials"] == 6 and summary["best"]["value"] >= summary["baseline_every_other_layer"]["value"]
    assert len(drafter.skipping.draft_vocab) == 12 and summary["plain_tokens_per_s"] > 0
    prompt = [1, 5, 6, 7, 8]  # greedy meets no EOS within 8 tokens
    tokens, stats = speculative_generate(target, drafter, torch.tensor(prompt), 8, pace=False)
    assert list(tokens) == hf_greedy(target, prompt, 8) and len(tokens) == 8
    assert max(stats.tree_sizes) > 1  # the tuned drafter drafted, and its drafts stayed lossless


def test_tune_bad_input_is_one_line(tmp_path, tiny_checkpoint, capsys):
    from selfspec.cli import main

    assert main(["tune", "layerskip", "--model", str(tiny_checkpoint), "--data", str(tmp_path / "nope.jsonl")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("selfspec: error: calibration data") and "\n" not in error
    with pytest.raises(SystemExit):
        main(["tune", "layerskip", "--trials", "0"])
