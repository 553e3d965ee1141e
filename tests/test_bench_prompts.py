from __future__ import annotations

import json
from collections import Counter

import pytest

from selfspec import SelfspecError
from selfspec.training.data.prompt_sets import load_prompt_file, load_prompt_set


def test_mtbench_80_questions_8_categories_and_spread_limit():
    items = load_prompt_set("mtbench")
    assert len(items) == 80 and len({i.category for i in items}) == 8
    sample = load_prompt_set("mtbench", limit=16)
    assert set(Counter(i.category for i in sample).values()) == {2}
    assert [i.id for i in sample] == [i.id for i in load_prompt_set("mtbench", limit=16)]  # deterministic


def test_humaneval_and_sharegpt_sets():
    humaneval = load_prompt_set("humaneval")
    assert len(humaneval) == 164 and "def " in humaneval[0].text
    assert len(load_prompt_set("humaneval", limit=5)) == 5
    sharegpt = load_prompt_set("sharegpt")
    assert len(sharegpt) == 350 and all(0 < len(i.text) <= 2000 for i in sharegpt)


def test_unknown_dataset():
    with pytest.raises(SelfspecError, match="mtbench"):
        load_prompt_set("gsm8k")


def test_prompt_file_shapes_and_errors(tmp_path):
    good = tmp_path / "mine.jsonl"
    rows = [
        {"prompt": "plain"},
        {"turns": ["first turn", "second"], "category": "x"},
        {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "shared"}]},
    ]
    good.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert [i.text for i in load_prompt_file(good)] == ["plain", "first turn", "shared"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"nothing": 1}\n')
    with pytest.raises(SelfspecError, match="bad.jsonl, line 2"):
        load_prompt_file(bad)
    torn = tmp_path / "torn.jsonl"
    torn.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(SelfspecError, match="line 2: not valid JSON"):
        load_prompt_file(torn)
    with pytest.raises(SelfspecError, match="cannot read"):
        load_prompt_file(tmp_path / "missing.jsonl")
