"""The regeneration's batched engine (selfspec/training/data/greedy_batch.py): many prompts of different lengths at
once, finished rows leaving the batch, each reply the target's own greedy reply to its prompt alone."""

import pytest

from selfspec.training.data import greedy_batch
from selfspec.training.data.greedy_batch import greedy_replies, supports_in_place

from .helpers import hf_greedy, make_tiny_target

PROMPTS = [[1, 5, 17, 33, 5, 17, 40, 8, 9, 5, 17], [1, 7], [1, 60, 61, 62, 63, 64, 65], [1, 9, 9, 9, 30]]


def reference(target, prompts, max_new_tokens):
    """Each prompt alone through transformers' `generate` (no padding), cut after its first end marker."""
    replies = []
    for prompt in prompts:
        reply = hf_greedy(target, prompt, max_new_tokens, eos=target.eos_token_ids[0])
        cut = next((i for i, token in enumerate(reply) if token in target.eos_token_ids), None)
        replies.append(reply if cut is None else reply[: cut + 1])
    return replies


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma"])
@pytest.mark.parametrize("kernels", ["stock", "fast"])
@pytest.mark.parametrize("prefill_positions", [4096, 24])  # one prefill forward; several, each its own width
def test_each_reply_is_the_prompts_own_greedy_reply(family, kernels, prefill_positions, monkeypatch):
    monkeypatch.setattr(greedy_batch, "PREFILL_POSITIONS", prefill_positions)
    target = make_tiny_target(family, path=kernels)
    assert supports_in_place(target)
    prompts = PROMPTS * 3  # 12 rows: several drops of finished rows
    assert greedy_replies(target, prompts, 24) == reference(target, prompts, 24)


def test_every_token_sits_at_the_position_it_has_when_its_prompt_runs_alone(monkeypatch):
    """Padding shifts no position: a prompt's tokens count from 0 at its first real token, its reply on from its
    length (rotary embeddings hide a constant shift from the tokens, not from a model with absolute positions)."""
    monkeypatch.setattr(greedy_batch, "PREFILL_POSITIONS", 24)
    target = make_tiny_target("llama")
    calls = []
    target.model.model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append((kwargs["input_ids"], kwargs["position_ids"])), with_kwargs=True
    )
    greedy_replies(target, PROMPTS, 5)
    prefills = [(ids, positions) for ids, positions in calls if ids.shape[1] > 1]
    assert len(prefills) > 1
    for ids, positions in prefills:
        for row_ids, row_positions in zip(ids.tolist(), positions.tolist(), strict=True):
            start = next(i for i, token in enumerate(row_ids) if token)  # pad is 0; every prompt starts with 1
            assert row_positions[start:] == list(range(len(row_ids) - start))
    decodes = [positions.view(-1).tolist() for ids, positions in calls if ids.shape[1] == 1]
    lengths = sorted(len(prompt) for prompt in PROMPTS)
    assert decodes[0] == lengths and decodes[-1] == [length + len(decodes) - 1 for length in lengths]


def test_rows_that_end_early_leave_the_batch_and_the_rest_go_on(monkeypatch):
    """An end marker that some prompts reach within a few tokens and others later: the batch shrinks (rows dropped
    from the cache) and the remaining replies are unchanged."""
    target = make_tiny_target("llama")
    first = [hf_greedy(target, prompt, 1)[0] for prompt in PROMPTS]
    target = target.with_eos((first[0],))  # the first prompt ends at once; the others may meet it later
    drops = []
    select = greedy_batch.DynamicCache.batch_select_indices
    monkeypatch.setattr(
        greedy_batch.DynamicCache,
        "batch_select_indices",
        lambda cache, rows: (drops.append(rows.tolist()), select(cache, rows))[1],
    )
    replies = greedy_replies(target, PROMPTS, 30)
    assert replies[0] == [first[0]] and drops and len(drops[0]) < len(PROMPTS)
    assert replies == reference(target, PROMPTS, 30)
    assert all(len(reply) == 30 or reply[-1] == first[0] for reply in replies)


def test_a_model_with_sliding_layers_is_left_to_generate():
    assert not supports_in_place(make_tiny_target("gemma2"))


def test_no_prompts_no_replies():
    assert greedy_replies(make_tiny_target("llama"), [], 8) == []


def test_the_throughput_script_times_the_engines_on_the_same_prompts(tmp_path, tiny_checkpoint, fake_sharegpt):
    """scripts/regeneration_throughput.py: every engine answers the same prompts (the same replies here), each
    timed; bad numbers are one line and exit 2 before any model is loaded."""
    import importlib.util
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "regeneration_throughput.py"
    spec = importlib.util.spec_from_file_location("regeneration_throughput", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "out"
    module.main(["--model", str(tiny_checkpoint), "--prompts", "8", "--batch-sizes", "3", "--max-new-tokens", "6",
                 "--out", str(out)])  # fmt: skip
    rows = json.loads((out / "throughput.json").read_text())["rows"]
    assert [row["engine"] for row in rows] == ["batched", "generate"]
    assert all(row["prompts"] == 8 and row["replies_identical_to_batched"] == 8 for row in rows)
    assert rows[0]["new_tokens"] == rows[1]["new_tokens"] > 0 and all(row["new_tokens_per_s"] > 0 for row in rows)
    done = subprocess.run(
        [sys.executable, str(script), "--batch-sizes", "4,x"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "--batch-sizes" in done.stderr
