"""Fixtures. Everything else the tests share lives in helpers.py."""

from __future__ import annotations

import atexit
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

import selfspec.training.data.sharegpt as sharegpt_module
from selfspec.execution import native
from selfspec.files import cache_root
from selfspec.models import Target

from .helpers import CORE_FAMILIES, WORDS, make_tiny_target, make_word_tokenizer

torch.set_num_threads(1)  # tiny models: threading overhead dominates, and xdist runs two workers
# Trees sized by the built-in curves, not by timings taken while the suite runs (test_kernels turns it back on).
os.environ["SELFSPEC_AUTO_PROFILE"] = "0"
# The fast path's linear layers: one row on the stock kernel, 2+ rows packed (a fixed split, not this machine's
# measured one), so every greedy test mixes the two kernels as decoding on such a CPU does.
os.environ["SELFSPEC_STOCK_ROWS"] = "2"
# The compiled path: steps of 1-3 rows in its `few` graph, more in `tree` (a fixed split, not the graphs timed), so
# decoding through it mixes the two graphs.
os.environ["SELFSPEC_FEW_ROWS"] = "3"
# `auto` does not compile the real model's steps (minutes) in the suite; test_compiled compiles a tiny model by name.
os.environ["SELFSPEC_COMPILE"] = "0"
# The suite never reads what this machine stored (cost curves measured under other load, a row split, compiled graphs):
# a cache of its own, made once by the controlling process (xdist's workers inherit it), sharing only the converted
# default model with the user's cache.
if "SELFSPEC_SUITE_CACHE" not in os.environ:
    _suite_cache = Path(tempfile.mkdtemp(prefix="selfspec-suite-cache-"))
    _models = cache_root() / "models"
    _models.mkdir(parents=True, exist_ok=True)
    (_suite_cache / "models").symlink_to(_models.resolve(), target_is_directory=True)
    os.environ["SELFSPEC_CACHE"] = os.environ["SELFSPEC_SUITE_CACHE"] = str(_suite_cache)
    # selfspec's small-row kernel, built once for the whole suite (a test with a cache of its own would build it again)
    os.environ["SELFSPEC_KERNELS"] = str(_suite_cache / "kernels")
    native.load(build_missing=True)  # before the workers start: every test sees the same kernels
    atexit.register(shutil.rmtree, _suite_cache, True)

RECORDS = 100  # fake ShareGPT records; the held-out split is the last 2


@pytest.fixture(params=CORE_FAMILIES)
def tiny_target(request) -> Target:
    return make_tiny_target(request.param)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A saved tiny Llama with a tokenizer: a real checkpoint directory for CLI and loader tests."""
    tokenizer = make_word_tokenizer(WORDS)
    target = make_tiny_target("llama", vocab_size=len(tokenizer))
    directory = tmp_path_factory.mktemp("tiny-llama")
    target.model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture
def fake_sharegpt(tmp_path, monkeypatch):
    """A torn ShareGPT-like file of 100 complete records (+ a torn one) written with the tiny tokenizer's words."""
    rng = random.Random(0)
    records = []
    for index in range(RECORDS):
        question = " ".join(rng.choice(WORDS) for _ in range(6))
        answer = " ".join(rng.choice(WORDS) for _ in range(12))
        records.append(
            {
                "id": f"r{index}",
                "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}],
            }
        )
    text = "[" + ",".join(json.dumps(r) for r in records) + ', {"id": "torn", "conversations": [{"from": "hum'
    path = tmp_path / "sharegpt.json"
    path.write_text(text)
    monkeypatch.setattr(sharegpt_module, "sharegpt_file", lambda: path)
    return path
