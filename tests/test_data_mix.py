"""The stated data mix (`data.original_conversations`): the target's regenerated replies and the conversations as they
are (every turn, their own replies) in one seeded order, both kinds in the calibration part, the mix printed and
reported, the held-out split never read, and bad values refused when the recipe is read."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch

import selfspec.training.data.sharegpt as sharegpt_module
import selfspec.training.data.tokenizing as tokenizing
from selfspec.cli import main
from selfspec.errors import SelfspecError
from selfspec.models import load_target
from selfspec.training.config import DataConfig, load_recipe, tiny_scale
from selfspec.training.data.conversations import load_conversations
from selfspec.training.data.mix import data_mix, mix_examples
from selfspec.training.data.prepare import prepare_examples
from selfspec.training.data.tokenizing import Example

from .helpers import WORDS, record_sharegpt_splits, tiny_recipe

RECORDS = 100  # the held-out split is the last 2: r98 and r99
TRAINING_IDS = {f"r{i}" for i in range(RECORDS - 2)}


@pytest.fixture
def multiturn_sharegpt(tmp_path, monkeypatch):
    """A torn ShareGPT-like file of 100 complete records of 1-3 exchanges (+ a torn one), in the tiny tokenizer's
    words, so the original part has multi-turn sequences."""
    rng = random.Random(1)
    records = []
    for index in range(RECORDS):
        turns = []
        for _ in range(1 + index % 3):
            turns.append({"from": "human", "value": " ".join(rng.choice(WORDS) for _ in range(5))})
            turns.append({"from": "gpt", "value": " ".join(rng.choice(WORDS) for _ in range(8))})
        records.append({"id": f"r{index}", "conversations": turns})
    text = "[" + ",".join(json.dumps(r) for r in records) + ', {"id": "torn", "conversations": [{"from": "hum'
    path = tmp_path / "sharegpt.json"
    path.write_text(text)
    monkeypatch.setattr(sharegpt_module, "sharegpt_file", lambda: path)
    return path


def mixed_recipe(tmp_path, checkpoint, originals: int | None, **data_changes):
    config = tiny_recipe(tmp_path, checkpoint)
    return replace(config, data=replace(config.data, original_conversations=originals, **data_changes))


def ids_and_kinds(examples):
    return [(e.id, e.kind) for e in examples]


def test_the_mix_holds_both_kinds_as_stated(tmp_path, tiny_checkpoint, multiturn_sharegpt, capsys):
    config = mixed_recipe(tmp_path, tiny_checkpoint, 40, calibration_fraction=0.1)
    training, calibration = prepare_examples(load_target(config.model), config)
    examples = training + calibration
    # The original part: exactly the first 40 conversations of the seeded order, every turn, their own replies.
    first_40 = load_conversations("sharegpt", limit=40, seed=config.data.seed)
    originals = [e for e in examples if e.kind == "original"]
    assert sorted(e.id for e in originals) == sorted(c.id for c in first_40)
    assert max(len(c.messages) for c in first_40) == 6 and max(int(e.loss_mask.sum()) for e in originals) > 20
    # The regenerated part: every conversation the target gave a non-empty reply to, once.
    rows = [json.loads(line) for line in (tmp_path / "work" / "regenerated.jsonl").read_text().splitlines()]
    replied = {row["id"] for row in rows if row["messages"][-1]["content"].strip()}
    regenerated = [e for e in examples if e.kind == "regenerated"]
    assert sorted(e.id for e in regenerated) == sorted(replied) and len(replied) > 60
    assert all(len(row["messages"]) == 2 for row in rows)  # the first exchange only
    # The calibration part is about calibration_fraction of the whole, holds both kinds in about their share of the
    # sequences, and shares no conversation with the training part.
    places = -(-len(examples) // 10)
    assert places <= len(calibration) <= 2 * places
    share = sum(e.kind == "original" for e in calibration) / len(calibration)
    assert 0 < share < 1 and abs(share - len(originals) / len(examples)) < 0.2
    assert not {e.id for e in training} & {e.id for e in calibration}
    # The one line states the mix: sequences of each kind, their share of the real positions, the two parts.
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("data: "))
    positions = {
        kind: sum(len(e.input_ids) for e in examples if e.kind == kind) for kind in ("regenerated", "original")
    }
    total = sum(positions.values())
    assert line == (
        f"data: {len(regenerated)} regenerated + {len(originals)} original sequences "
        f"({positions['regenerated'] / total:.0%} / {positions['original'] / total:.0%} of {total:,} positions); "
        f"{len(training)} training, {len(calibration)} calibration"
    )
    mix = data_mix(training, calibration)
    assert mix["original"]["sequences"] == 40 and mix["original"]["positions"] == positions["original"]
    assert mix["regenerated"]["calibration_sequences"] + mix["original"]["calibration_sequences"] == len(calibration)


def test_the_mix_is_the_same_on_every_call_and_whatever_the_regeneration_file_order(
    tmp_path, tiny_checkpoint, multiturn_sharegpt
):
    config = mixed_recipe(tmp_path, tiny_checkpoint, None)
    target = load_target(config.model)
    first = prepare_examples(target, config)
    # A resumed run may find the replies in another order (batches sorted by length, an interrupted run's tail).
    path = tmp_path / "work" / "regenerated.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("".join(line + "\n" for line in reversed(lines)))
    again = prepare_examples(target, config)
    for part, repeated in zip(first, again, strict=True):
        assert ids_and_kinds(part) == ids_and_kinds(repeated)
        assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(part, repeated, strict=True))
    training = first[0]
    # Seeded, not sorted by kind: both kinds within the first few training sequences (the streamed labels' sample).
    assert {e.kind for e in training[:8]} == {"regenerated", "original"}
    other_seed = prepare_examples(target, replace(config, data=replace(config.data, seed=1)))
    assert ids_and_kinds(other_seed[0]) != ids_and_kinds(training)


@pytest.mark.parametrize("originals", [None, 30])
def test_the_mix_never_reads_the_heldout_split(tmp_path, tiny_checkpoint, multiturn_sharegpt, monkeypatch, originals):
    splits = record_sharegpt_splits(monkeypatch)
    config = mixed_recipe(tmp_path, tiny_checkpoint, originals)
    training, calibration = prepare_examples(load_target(config.model), config)
    assert splits and set(splits) == {"train"}
    assert {e.kind for e in training} == {"regenerated", "original"}
    assert {e.id for e in training + calibration} <= TRAINING_IDS


@pytest.mark.parametrize(
    "data, fragment",
    [
        ("original_conversations: -1", "must be >= 0"),
        ("regenerate: false\n  original_conversations: 10", "data.regenerate false"),
        ("regenerate: false\n  original_conversations: null", "data.regenerate false"),
        ("original_conversations: many", "expected int"),
        ("regenerate_engine: turbo", "data.regenerate_engine must be one of batched, generate, selfspec"),
    ],
)
def test_bad_mix_values_are_one_line_errors(tmp_path, capsys, data, fragment):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"drafter: eagle\ndata:\n  {data}\n")
    with pytest.raises(SelfspecError, match=fragment):
        load_recipe(recipe)
    assert main(["train", "eagle", "--config", str(recipe), "--model", str(tmp_path / "never-loaded")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("selfspec: error:") and len(err.splitlines()) == 1 and fragment in err, err


def test_the_mix_values_that_are_fine(tmp_path):
    assert DataConfig().original_conversations == 0  # the mix is opt-in: recipes without it keep their data
    assert DataConfig(regenerate=False, original_conversations=0).regenerate is False
    recipe = tmp_path / "r.yaml"
    recipe.write_text("drafter: eagle\ndata:\n  original_conversations: null\n")
    config = load_recipe(recipe)
    assert config.data.original_conversations is None
    assert tiny_scale(config).data.original_conversations == 24  # --tiny: all becomes a handful, 0 stays 0
    assert tiny_scale(replace(config, data=DataConfig())).data.original_conversations == 0


def example(conversation_id: str, kind: str) -> Example:
    return Example(conversation_id, torch.tensor([1, 2, 3]), torch.tensor([False, True, True]), kind)


def test_calibration_takes_each_kinds_share_and_whole_conversations():
    regenerated = [example(name, "regenerated") for name in "abcdefghij"]  # the sample's order
    original = [example(name, "original") for name in "abcde"]
    training, calibration = mix_examples(regenerated, original, 0.2, seed=0)
    # 15 sequences: 3 calibration places, 1 for the original kind (5 of 15) and 2 for the regenerated one; the
    # regenerated tail is i and j, the original tail e, and e's regenerated sequence comes along.
    assert sorted(ids_and_kinds(calibration)) == [
        ("e", "original"),
        ("e", "regenerated"),
        ("i", "regenerated"),
        ("j", "regenerated"),
    ]
    assert sorted(ids_and_kinds(training)) == sorted(
        [(name, "regenerated") for name in "abcdfgh"] + [(name, "original") for name in "abcd"]
    )
    assert ids_and_kinds(mix_examples(regenerated, original, 0.2, seed=0)[0]) == ids_and_kinds(training)
    assert ids_and_kinds(mix_examples(regenerated, original, 0.2, seed=1)[0]) != ids_and_kinds(training)
    # Two calibration places hold one of each kind even where one kind is a sliver of the data.
    _, calibration = mix_examples(regenerated, original[:1], 0.15, seed=0)
    assert {e.kind for e in calibration} == {"regenerated", "original"}


def test_a_mix_with_nothing_left_to_train_on_is_an_error(tmp_path, tiny_checkpoint):
    source = tmp_path / "one.jsonl"
    source.write_text(
        json.dumps(
            {
                "id": "only",
                "messages": [{"role": "user", "content": "the cat sat"}, {"role": "assistant", "content": "a dog ran"}],
            }
        )
        + "\n"
    )
    config = mixed_recipe(tmp_path, tiny_checkpoint, None, source=str(source))
    with pytest.raises(SelfspecError, match="none left to train on"):
        prepare_examples(load_target(config.model), config)


def test_tokenized_examples_are_kept_in_the_work_dir_and_reused_only_for_the_same_inputs(
    tmp_path, tiny_checkpoint, multiturn_sharegpt, monkeypatch
):
    config = mixed_recipe(tmp_path, tiny_checkpoint, None)
    target = load_target(config.model)
    first = prepare_examples(target, config)
    assert sorted(path.name.split("-")[1] for path in (tmp_path / "work").glob("tokenized-*.pt")) == [
        "original",
        "regenerated",
    ]
    calls = []
    real = tokenizing.tokenize_conversation
    monkeypatch.setattr(tokenizing, "tokenize_conversation", lambda *args: calls.append(args[1].id) or real(*args))
    again = prepare_examples(target, config)  # a resumed run: nothing tokenized again, the same examples
    assert calls == []
    for part, repeated in zip(first, again, strict=True):
        assert ids_and_kinds(part) == ids_and_kinds(repeated)
        assert all(
            torch.equal(a.input_ids, b.input_ids) and a.input_ids.dtype == b.input_ids.dtype
            for a, b in zip(part, repeated, strict=True)
        )
        assert all(torch.equal(a.loss_mask, b.loss_mask) for a, b in zip(part, repeated, strict=True))
    shorter = replace(config, data=replace(config.data, max_length=config.data.max_length - 8))
    cut = prepare_examples(target, shorter)  # other inputs: tokenized afresh, never the stored ones
    assert calls and max(len(e.input_ids) for e in cut[0] + cut[1]) <= shorter.data.max_length
    calls.clear()
    fewer = replace(config, data=replace(config.data, original_conversations=30))
    prepare_examples(target, fewer)
    assert len(calls) == 30  # the regenerated part is unchanged and reused; the 30 originals are new


def test_tokenizing_stops_at_the_cut_and_a_worker_pool_gives_the_same_examples(tiny_checkpoint, monkeypatch):
    from selfspec.training.data.sharegpt import Conversation
    from selfspec.training.data.tokenizing import tokenize_all, tokenize_conversation

    target = load_target(str(tiny_checkpoint))
    rng = random.Random(3)
    conversations = []
    for index in range(40):
        turns = []
        for _turn in range(rng.randint(1, 6)):
            turns.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9)))})
            turns.append(
                {"role": "assistant", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))}
            )
        conversations.append(Conversation(f"c{index}", tuple(turns)))
    for max_length in (8, 20, 45):
        for conversation in conversations:  # a cut example is the whole one, cut: later turns change nothing
            whole = tokenize_conversation(target, conversation, 10_000)
            cut = tokenize_conversation(target, conversation, max_length)
            if cut is None:  # nothing learnable inside the cut
                assert not whole.loss_mask[1:max_length].any()
                continue
            assert cut.input_ids.tolist() == whole.input_ids[:max_length].tolist()
            assert cut.loss_mask.tolist() == whole.loss_mask[:max_length].tolist()
    monkeypatch.setattr(tokenizing, "POOL_MIN_CONVERSATIONS", 10)
    serial = tokenize_all(target, conversations, 20, "original", workers=1)
    pools = []

    def recorded(*args, **kwargs):
        pools.append(args)
        return real_pool(*args, **kwargs)

    real_pool = tokenizing.ProcessPoolExecutor
    monkeypatch.setattr(tokenizing, "ProcessPoolExecutor", recorded)
    pooled = tokenize_all(target, conversations, 20, "original", workers=3)
    assert pools == [(3,)]  # the pool path ran
    assert [e and (e.id, e.input_ids.tolist(), e.loss_mask.tolist(), e.kind) for e in pooled] == [
        e and (e.id, e.input_ids.tolist(), e.loss_mask.tolist(), e.kind) for e in serial
    ]
