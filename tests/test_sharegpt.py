from __future__ import annotations

import json

import pytest

from selfspec.training.data import sharegpt
from selfspec.training.data.sharegpt import heldout_boundary, load_sharegpt, parse_complete_records


def torn_file(tmp_path, records, cut=25):
    text = json.dumps(records, indent=2)
    path = tmp_path / "torn.json"
    path.write_text(text[:-cut])  # the last record loses its end
    return path


def record(i, turns):
    return {"id": f"r{i}", "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_torn_tail_is_skipped_and_labels_are_mapped(tmp_path):
    records = [
        record(0, [("human", "hi"), ("gpt", "hello")]),
        record(1, [("user", "q"), ("chatgpt", ""), ("bard", "a"), ("bing", "b")]),
        record(2, [("system", "be nice"), ("gpt", "no user here")]),
        record(3, [("human", "torn"), ("gpt", "this one is cut off")]),
    ]
    path = torn_file(tmp_path, records)
    assert len(parse_complete_records(path.read_text())) == 3
    data = load_sharegpt("all", path=path)
    assert data.complete_records == 3
    assert [c.id for c in data.conversations] == ["r0", "r1"]
    assert [m["role"] for m in data.conversations[1].messages] == ["user", "assistant", "assistant"]
    assert data.dropped == {"empty turn": 1, "no user turn": 1}


def test_heldout_is_the_last_two_percent_and_disjoint(tmp_path):
    records = [record(i, [("human", f"q{i}"), ("gpt", "a")]) for i in range(200)]
    path = tmp_path / "all.json"
    path.write_text(json.dumps(records))
    train, heldout = load_sharegpt("train", path=path), load_sharegpt("heldout", path=path)
    assert [c.id for c in heldout.conversations] == [f"r{i}" for i in range(196, 200)]
    assert not {c.id for c in train.conversations} & {c.id for c in heldout.conversations}
    assert heldout_boundary(17671) == 17671 - 354


@pytest.fixture(scope="module")
def real_heldout():
    return load_sharegpt("heldout")


def test_real_file_has_17671_complete_records(real_heldout):
    assert real_heldout.complete_records == 17671
    assert len(real_heldout.conversations) == 350


def test_training_split_never_holds_a_heldout_record(real_heldout, monkeypatch):
    heldout_ids = {c.id for c in real_heldout.conversations}
    train_ids = {c.id for c in load_sharegpt("train").conversations}
    assert train_ids and not heldout_ids & train_ids
    with pytest.raises(Exception, match="unknown ShareGPT split"):
        sharegpt.load_sharegpt("eval")
