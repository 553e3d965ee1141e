"""The self-distillation pipeline: data (held-out never read), labels, the trainer (loss goes down, resume),
the whole recipe on a tiny checkpoint, Medusa-2 with LoRA, configs and CLI errors."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from selfspec.cli import main
from selfspec.decoding import speculative_generate
from selfspec.errors import SelfspecError
from selfspec.heads import create_drafter
from selfspec.heads.medusa import MedusaConfig, MedusaLoraConfig
from selfspec.models import load_target
from selfspec.training.config import EvalConfig, TrainConfig, load_joint_recipe, load_recipe
from selfspec.training.data import labels as labels_module
from selfspec.training.data.conversations import load_conversations
from selfspec.training.data.labels import build_label_cache, label_sequence, load_label_cache
from selfspec.training.data.prepare import prepare_examples
from selfspec.training.data.sharegpt import Conversation
from selfspec.training.data.tokenizing import Example, tokenize_conversation
from selfspec.training.trainer.loop import collate, train
from selfspec.training.trainer.pipeline import run_recipe

from .helpers import hf_greedy, record_sharegpt_splits, tiny_recipe, tiny_training_setup


@pytest.mark.parametrize("originals", [0, None], ids=["regenerated", "regenerated+original"])
def test_training_never_reads_the_heldout_split(tmp_path, tiny_checkpoint, fake_sharegpt, monkeypatch, originals):
    splits = record_sharegpt_splits(monkeypatch)
    conversations = load_conversations("sharegpt")
    ids = {c.id for c in conversations}
    assert len(ids) == 98 and "r98" not in ids and "r99" not in ids and "torn" not in ids
    config = tiny_recipe(tmp_path, tiny_checkpoint)
    config = replace(config, data=replace(config.data, original_conversations=originals))
    train_examples, calibration = prepare_examples(load_target(config.model), config)
    assert splits and set(splits) == {"train"}
    assert ("original" in {e.kind for e in train_examples}) == (originals is None)
    assert {e.id for e in train_examples + calibration} <= {f"r{i}" for i in range(98)}


def test_tokenized_conversation_masks_assistant_tokens_only(tiny_checkpoint):
    target = load_target(str(tiny_checkpoint))
    conversation = Conversation(
        "c", ({"role": "user", "content": "the cat sat"}, {"role": "assistant", "content": "a dog ran"})
    )
    example = tokenize_conversation(target, conversation, 64)
    tokens = target.tokenizer.convert_ids_to_tokens(example.input_ids.tolist())
    learned = [t for t, m in zip(tokens, example.loss_mask.tolist(), strict=True) if m]
    assert learned == ["a", "dog", "ran"]
    assert {"the", "cat", "sat"} <= set(tokens[: tokens.index("a")])  # the user turn is rendered, not learned


def test_label_shapes_and_cache_round_trip_and_resume(tmp_path, tiny_checkpoint, monkeypatch):
    target = load_target(str(tiny_checkpoint))
    conversation = Conversation(
        "c", ({"role": "user", "content": "the cat"}, {"role": "assistant", "content": "a big red dog"})
    )
    examples = [replace(tokenize_conversation(target, conversation, 64), id=f"c{i}") for i in range(5)]
    sequence = label_sequence(target, examples[0], (-1, 1), top_k=4)
    length = len(examples[0].input_ids)
    assert sequence.hidden[-1].shape == (length, 32) and sequence.hidden[1].shape == (length, 32)
    assert sequence.topk_ids.shape == (length, 4) and sequence.topk_probs.shape == (length, 4)
    with torch.inference_mode():
        logits = target.model(examples[0].input_ids.view(1, -1)).logits[0]
    assert torch.equal(sequence.topk_ids[:, 0], logits.argmax(-1))  # row t: the target's guess for token t + 1
    softmax = torch.softmax(logits.float(), dim=-1)  # the stored probabilities are the softmax's own (fp16-rounded)
    assert torch.allclose(sequence.topk_probs.float(), softmax.gather(-1, sequence.topk_ids), atol=1e-3, rtol=1e-3)
    assert torch.equal(sequence.topk_ids, softmax.topk(4, dim=-1).indices)
    # An interrupted cache: the first two shards exist, the run stops; the next run labels only the rest.
    calls = []
    real = labels_module.label_sequence
    monkeypatch.setattr(labels_module, "label_sequence", lambda *a, **k: calls.append(1) or real(*a, **k))
    directory = build_label_cache(target, examples[:4], tmp_path / "labels", (-1,), 4, shard_examples=2)
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["shards"], manifest["complete"] = manifest["shards"][:1], False
    (directory / "manifest.json").write_text(json.dumps(manifest))
    calls.clear()
    build_label_cache(target, examples[:4], directory, (-1,), 4, shard_examples=2)
    assert len(calls) == 2  # only the missing shard was labelled again
    cached = load_label_cache(directory)
    assert len(cached) == 4 and torch.equal(cached[0].topk_ids, sequence.topk_ids)
    assert torch.allclose(cached[0].hidden[-1].float(), sequence.hidden[-1].float())


def test_streamed_labels_are_each_sequences_own_labels_with_no_padding(tiny_checkpoint, monkeypatch):
    """label_batch (streamed labels) gives each sequence what label_sequence gives it alone; sequences of one length
    share a forward, and no forward pads (no attention mask: plain causal attention, no position for nothing)."""
    from selfspec.training.data.labels import label_batch

    target = load_target(str(tiny_checkpoint))
    torch.manual_seed(0)
    lengths = [9, 17, 9, 5, 17, 9]
    examples = [
        Example(f"s{i}", torch.randint(3, target.vocab_size, (n,)), torch.ones(n, dtype=torch.bool))
        for i, n in enumerate(lengths)
    ]
    forwards = []
    target.model.register_forward_pre_hook(
        lambda module, args, kwargs: forwards.append((tuple(kwargs["input_ids"].shape), kwargs.get("attention_mask"))),
        with_kwargs=True,
    )
    batch = label_batch(target, examples, (-1, 1), top_k=4)
    assert sorted(shape for shape, _ in forwards) == [(1, 5), (2, 17), (3, 9)]
    assert all(mask is None for _, mask in forwards)
    forwards.clear()
    for example, labeled in zip(examples, batch, strict=True):
        alone = label_sequence(target, example, (-1, 1), top_k=4)
        assert torch.equal(labeled.input_ids, example.input_ids)
        assert torch.equal(labeled.topk_ids.cpu(), alone.topk_ids)
        assert torch.allclose(labeled.topk_probs.float().cpu(), alone.topk_probs.float(), atol=2e-3)
        for layer in (-1, 1):
            assert torch.allclose(labeled.hidden[layer].float().cpu(), alone.hidden[layer].float(), atol=2e-2)


def test_tiny_training_run_lowers_the_loss(tmp_path, tiny_checkpoint):
    _, sequences, make = tiny_training_setup(tiny_checkpoint)
    module = make()
    batch = collate(sequences, torch.device("cpu"))
    with torch.no_grad():
        before = module.training_loss(batch)[0].item()
    config = TrainConfig(batch_size=4, lr=0.02, warmup_steps=2, max_steps=40, checkpoint_every=100, log_every=5)
    summary = train(module, len(sequences), sequences.__getitem__, config, tmp_path / "ckpt")
    with torch.no_grad():
        after, metrics = module.training_loss(batch)
    assert after.item() < 0.8 * before
    assert set(metrics) == {"top1_h1", "top1_h2"} and summary.steps == 40


def test_resume_continues_where_it_stopped(tmp_path, tiny_checkpoint):
    _, sequences, make = tiny_training_setup(tiny_checkpoint)
    config = TrainConfig(batch_size=4, lr=0.02, warmup_steps=2, max_steps=12, checkpoint_every=6, log_every=2)
    straight = make()
    train(straight, len(sequences), sequences.__getitem__, config, tmp_path / "a")
    interrupted, served = make(), []

    def stop_during_step_8(index):  # an interruption after the step-6 checkpoint, mid-way through step 8
        served.append(index)
        if len(served) > 7 * config.batch_size:
            raise KeyboardInterrupt
        return sequences[index]

    with pytest.raises(KeyboardInterrupt):
        train(interrupted, len(sequences), stop_during_step_8, config, tmp_path / "b")
    resumed = make()
    summary = train(resumed, len(sequences), sequences.__getitem__, config, tmp_path / "b", resume=True)
    assert summary.resumed_from == 6
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_whole_recipe_on_a_tiny_checkpoint(tmp_path, tiny_checkpoint, fake_sharegpt):
    config = tiny_recipe(tmp_path, tiny_checkpoint, eval=EvalConfig(heldout_prompts=2, max_new_tokens=8))
    report = run_recipe(config)
    heads_dir = tmp_path / "heads"
    assert (heads_dir / "training_report.json").is_file() and (tmp_path / "work" / "regenerated.jsonl").is_file()
    assert report["steps"] == 12 and report["draft_vocab_size"] == 16
    heldout = report["heldout"]
    assert [prompt["id"] for prompt in heldout["per_prompt"]] == ["r98", "r99"]  # the held-out split: the last 2%
    steps = sum(prompt["tokens"] / prompt["tau"] for prompt in heldout["per_prompt"])
    assert heldout["mean_accepted_length"] == pytest.approx(sum(p["tokens"] for p in heldout["per_prompt"]) / steps)
    data = json.loads((heads_dir / "config.json").read_text())["data"]
    tree, accuracies = data["tree"], data["accuracies"]
    # 2 heads x 3 ranks offer 12 paths, so the tree is full: max_tree_nodes 8 = the root and 7 paths, best first,
    # each path after its parent and valued at the product of its heads' accuracies at its ranks.
    paths = [tuple(path) for path in tree["paths"]]
    assert len(paths) == len(set(paths)) == 7
    assert all(path[:-1] in paths[:index] for index, path in enumerate(paths) if len(path) > 1)
    expected = [math.prod(accuracies[depth][rank] for depth, rank in enumerate(path)) for path in paths]
    assert tree["values"] == pytest.approx(expected, abs=1e-3)
    assert tree["values"] == sorted(tree["values"], reverse=True)
    target = load_target(str(tiny_checkpoint))
    drafter = create_drafter("medusa", target, heads_dir)
    prompt = target.encode_prompt("the cat sat on")[0].tolist()
    target = target.with_eos(())
    tokens, _ = speculative_generate(target, drafter, torch.tensor(prompt), 20)
    assert list(tokens) == hf_greedy(target, prompt, 20, eos=-1)


def test_medusa2_trains_lora_and_the_adapted_model_is_the_target(tmp_path, tiny_checkpoint, fake_sharegpt):
    medusa = MedusaConfig(
        num_heads=2, draft_vocab_size=0, max_rank=3, max_tree_nodes=8, lora=MedusaLoraConfig(rank=4, alpha=8)
    )
    config = tiny_recipe(
        tmp_path,
        tiny_checkpoint,
        medusa=medusa,
        train=TrainConfig(batch_size=4, lr=0.01, warmup_steps=1, max_steps=6, checkpoint_every=3, log_every=2),
    )
    report = run_recipe(config)
    heads_dir = tmp_path / "heads"
    assert (heads_dir / "adapter" / "adapter_config.json").is_file() and "base_ce" in report["final_metrics"]
    original = load_target(str(tiny_checkpoint))
    target = load_target(str(tiny_checkpoint))
    drafter = create_drafter("medusa", target, heads_dir)
    adapted = drafter.target  # the adapter is merged into a copy of the target; the target given stays the original
    changed = [
        name
        for (name, a), (_, b) in zip(
            original.model.state_dict().items(), adapted.model.state_dict().items(), strict=True
        )
        if not torch.equal(a, b)
    ]
    assert changed and all("q_proj" in n or "v_proj" in n for n in changed)
    kept = zip(original.model.state_dict().values(), target.model.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in kept)
    assert create_drafter("medusa", adapted, heads_dir).target is adapted  # the adapted model is not adapted twice
    again = create_drafter("medusa", target, heads_dir).target  # the original again: a copy adapted the same way
    assert torch.equal(again.model.state_dict()[changed[0]], adapted.model.state_dict()[changed[0]])
    adapted = adapted.with_eos(())
    prompt = target.encode_prompt("the dog ran")[0].tolist()
    tokens, _ = speculative_generate(adapted, drafter, torch.tensor(prompt), 16)
    assert list(tokens) == hf_greedy(adapted, prompt, 16, eos=-1)


def test_recipe_config_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("drafter: medusa\ntrain:\n  max_step: 3\n")
    with pytest.raises(SelfspecError, match="unknown key.*max_step"):
        load_recipe(bad)
    bad.write_text("drafter: medusa\ntrain:\n  batch_size: many\n")
    with pytest.raises(SelfspecError, match="expected int"):
        load_recipe(bad)
    good = tmp_path / "good.yaml"
    good.write_text("drafter: medusa\nmedusa:\n  lora: {rank: 4}\n")
    assert load_recipe(good, {"train.max_steps": 3}).train.max_steps == 3
    assert load_recipe(good).medusa.lora.rank == 4


def test_every_shipped_recipe_loads_and_the_long_one_keeps_its_scaling_points():
    root = Path(__file__).resolve().parents[1] / "configs"
    recipes = sorted(root.glob("*.yaml")) + sorted((root / "gpu").glob("*.yaml"))
    assert len(recipes) >= 6
    for path in recipes:  # joint recipes (selfspec train heads) have a loader of their own
        (load_joint_recipe if path.name.startswith("heads-") else load_recipe)(path)
    long = load_recipe(root / "eagle3-smollm2-long.yaml").train
    assert long.schedule == "wsd" and long.warmup_steps < min(long.keep_steps)  # every point past the warm-up
    assert max(long.keep_steps) < long.max_steps - long.decay_steps  # kept steps lie in the stable part
    assert len(long.keep_steps) >= 4 and max(long.keep_steps) >= 16 * min(long.keep_steps)  # 4+ points over 16x


def test_train_cli_errors(tmp_path, capsys):
    assert main(["train", "medusa", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "r.yaml").write_text("drafter: eagle\n")
    assert main(["train", "medusa", "--config", str(tmp_path / "r.yaml")]) == 2
    assert "not 'medusa'" in capsys.readouterr().err


def test_regeneration_engines_agree_and_resume(tmp_path, tiny_checkpoint, fake_sharegpt):
    from selfspec.training.data.regenerate import regenerate
    from selfspec.training.throughput import StageCount

    target = load_target(str(tiny_checkpoint))
    conversations = load_conversations("sharegpt")[:6]
    batched = regenerate(target, conversations, tmp_path / "a.jsonl", max_new_tokens=10, batch_size=4)
    lossless = regenerate(
        target, conversations, tmp_path / "b.jsonl", max_new_tokens=10, batch_size=4, engine="selfspec"
    )
    transformers = regenerate(
        target, conversations, tmp_path / "c.jsonl", max_new_tokens=10, batch_size=4, engine="generate"
    )
    rows_a = [json.loads(line) for line in batched.read_text().splitlines()]
    rows_b = [json.loads(line) for line in lossless.read_text().splitlines()]
    assert rows_a == rows_b == [json.loads(line) for line in transformers.read_text().splitlines()]
    assert len(rows_a) == 6
    assert rows_a[0]["messages"][0]["role"] == "user" and rows_a[0]["messages"][-1]["role"] == "assistant"
    # A torn last line (an interrupted run) is dropped and only the missing conversations are regenerated.
    batched.write_text(batched.read_text() + '{"id": "r9", "mess')
    regenerate(target, load_conversations("sharegpt")[:8], batched, max_new_tokens=10, batch_size=4)
    rows = [json.loads(line) for line in batched.read_text().splitlines()]
    assert [r["id"] for r in rows[:6]] == [r["id"] for r in rows_a] and len(rows) == 8
    # Replies made under other limits (or by another model, or with no settings on record) are never resumed: the
    # file is set aside and the replies made afresh.
    count = StageCount()
    regenerate(target, conversations, batched, max_new_tokens=10, batch_size=4, count=count)
    assert count.tokens == 0  # the same settings: resumed, nothing asked again
    longer = regenerate(target, conversations, batched, max_new_tokens=14, batch_size=4, count=count)
    assert count.sequences == 6 and json.loads(tmp_path.joinpath("a.settings.json").read_text())["max_new_tokens"] == 14
    assert [json.loads(line) for line in tmp_path.joinpath("a.previous.jsonl").read_text().splitlines()] == rows
    assert len(longer.read_text().splitlines()) == 6
    tmp_path.joinpath("a.settings.json").unlink()
    count = StageCount()
    regenerate(target, conversations, batched, max_new_tokens=14, batch_size=4, count=count)
    assert count.sequences == 6


@pytest.mark.parametrize("template", [True, False], ids=["chat-template", "no-template"])
def test_training_data_renders_prompts_as_serving_does(tiny_checkpoint, template):
    """One chat renderer: the tokens before an assistant reply in training data are the tokens `generate` feeds the
    model for the same user turn (they once differed by a trailing newline for tokenizers without a template)."""
    target = load_target(str(tiny_checkpoint))
    if not template:
        target.tokenizer.chat_template = None
    user = {"role": "user", "content": "the cat sat"}
    example = tokenize_conversation(
        target, Conversation("c", (user, {"role": "assistant", "content": "a dog ran"})), 64
    )
    first_learned = example.loss_mask.tolist().index(True)
    served = target.encode_messages([user])[0].tolist()
    assert example.input_ids[:first_learned].tolist() == served
    learned = target.tokenizer.convert_ids_to_tokens(example.input_ids[example.loss_mask].tolist())
    assert learned[:3] == ["a", "dog", "ran"]
