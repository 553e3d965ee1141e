"""EAGLE: tree growth on hand-made head outputs, the head's cache rollback, save/load, and losslessness (greedy
equality, chi-square) with EAGLE trees."""

from __future__ import annotations

import math

import pytest
import torch

from selfspec.cost import CostCurve
from selfspec.decoding import speculative_generate
from selfspec.errors import SelfspecError
from selfspec.heads import create_drafter
from selfspec.heads.eagle import EagleConfig, EagleHead, grow_tree
from selfspec.tree_attention import causal_block_mask

from .helpers import (
    PROMPT,
    hf_greedy,
    make_tiny_target,
    random_eagle3_head,
    random_eagle_dir,
    tiny_recipe,
    tiny_training_setup,
)


def log_probs(*probabilities):
    return torch.tensor(probabilities).log()


def test_grow_tree_expands_best_frontier_and_reranks():
    # vocabulary of 3; the root's children: 0 (0.6), 1 (0.3), 2 (0.1)
    calls = []

    def expand(nodes, tokens, parents, depth):
        calls.append((nodes, tokens, parents, depth))
        return torch.stack([log_probs(0.5, 0.4, 0.1) if token == 0 else log_probs(0.9, 0.05, 0.05) for token in tokens])

    tokens, parents = grow_tree(log_probs(0.6, 0.3, 0.1), expand, top_k=2, depth=2, size_for=lambda scores: 5)
    # depth 1 expands the best two children (tokens 0 and 1); keep the 4 best of all 7 candidates
    assert calls == [([0, 1], [0, 1], [-1, -1], 1)]
    # candidates (top-2 children each): 0:.6  1:.3  (0,0):.30  (0,1):.24  (1,0):.27  (1,1):.015
    assert tokens == [0, 1, 0, 0] and parents == [-1, -1, 0, 1]  # .6 .3 .30 .27
    seen = []
    tokens, parents = grow_tree(log_probs(0.6, 0.3, 0.1), expand, 2, 2, lambda scores: seen.append(list(scores)) or 6)
    assert [round(math.exp(s), 3) for s in seen[-1]] == [0.6, 0.3, 0.3, 0.27, 0.24, 0.015]
    assert parents == [-1, -1, 0, 0, 1] and tokens == [0, 1, 0, 1, 0]
    # A budget of 2 nodes keeps only the best child: only it is worth expanding, and nothing under it can enter.
    calls.clear()
    tokens, parents = grow_tree(log_probs(0.6, 0.3, 0.1), expand, top_k=2, depth=3, size_for=lambda scores: 2)
    assert [c[0] for c in calls] == [[0]] and tokens == [0] and parents == [-1]


def test_best_size_follows_the_cost_curve():
    scores = [math.log(p) for p in (0.9, 0.8, 0.5, 0.2, 0.1)]
    gains = [math.exp(score) for score in scores]  # a path's draft probability: its chance to be accepted
    assert CostCurve((1, 64), (1.0, 1.0), "flat").best_size(gains)[0] == 6
    assert CostCurve((1, 2, 64), (1.0, 2.0, 64.0), "steep").best_size(gains)[0] == 1
    assert CostCurve((1, 64), (1.0, 1.0), "flat").best_size(gains[:2])[0] == 3


def test_head_cache_rolls_back_after_each_proposal(tmp_path):
    target = make_tiny_target("llama")
    drafter = create_drafter("eagle", target, random_eagle_dir(target, tmp_path / "h"))
    speculative_generate(target, drafter, torch.tensor(PROMPT), 12)
    from selfspec.heads.base import DraftRequest
    from selfspec.sampling import SamplingConfig

    queued = sum(len(tokens) for _, tokens in drafter.pending)  # the last step's pairs, read at the next proposal
    committed = drafter.position + queued
    assert queued > 0 and drafter.cache.get_seq_length() == drafter.position
    tree = drafter.propose(DraftRequest(5, 3, SamplingConfig(), None))
    assert tree.size > 1 and drafter.position == drafter.cache.get_seq_length() == committed and not drafter.pending
    before = drafter.cache.layers[0].keys.clone()
    tree = drafter.propose(DraftRequest(5, 3, SamplingConfig(), None))
    assert tree.size > 1 and drafter.cache.get_seq_length() == committed
    assert torch.equal(drafter.cache.layers[0].keys, before)


def test_wrong_base_and_round_trip(tmp_path):
    target = make_tiny_target("llama")
    directory = random_eagle_dir(target, tmp_path / "h")
    drafter = create_drafter("eagle", target, directory)
    from safetensors.torch import load_file

    state = load_file(str(directory / "model.safetensors"))
    assert set(state) == set(drafter.head.state_dict()) and "embed_weight" not in state
    with pytest.raises(SelfspecError, match="another base model"):
        create_drafter("eagle", make_tiny_target("qwen2"), directory)
    with pytest.raises(SelfspecError, match="'eagle' heads, not 'medusa'"):
        create_drafter("medusa", target, directory)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_unrolled_training_sees_what_drafting_sees(family, kind):
    """Step s of the unrolled training (EAGLE-3's training-time test) equals drafting s levels deep from a committed
    prefix: the same pairs, positions and visible keys."""
    from transformers import DynamicCache

    from selfspec.training.recipes.eagle import EagleTraining, unrolled_mask

    target = make_tiny_target(family)
    if kind == "eagle":
        config = EagleConfig(draft_vocab_size=0, feature_noise=0.0, unroll_steps=3)
        torch.manual_seed(0)
        head = EagleHead(config, target, torch.arange(target.vocab_size)).eval()
        for parameter in head.parameters():
            torch.nn.init.normal_(parameter, std=0.3)
    else:
        head = random_eagle3_head(target).eval()
        config = head.config
    rows, hidden_size = 7, target.config.hidden_size
    features = torch.randn(1, rows, hidden_size)
    input_ids = torch.randint(0, target.vocab_size, (1, rows + 1))
    with torch.no_grad():
        unrolled = list(EagleTraining(head, config).unroll(features, input_ids, 3))
        for t in range(rows - 2):
            cache = DynamicCache()
            positions = torch.arange(1, t + 2).view(1, -1)
            step_output = head(
                features[:, : t + 1],
                input_ids[:, 1 : t + 2],
                positions,
                causal_block_mask(0, t + 1, torch.float32, "cpu"),
                cache,
            )[:, -1:]
            torch.testing.assert_close(step_output[0, 0], unrolled[0][0, t], atol=1e-4, rtol=1e-4)
            for step in (1, 2):
                token = input_ids[:, t + 1 + step : t + 2 + step]
                position = torch.tensor([[t + 1 + step]])
                step_output = head(
                    step_output, token, position, causal_block_mask(t + step, 1, torch.float32, "cpu"), cache
                )
                torch.testing.assert_close(step_output[0, 0], unrolled[step][0, t], atol=1e-4, rtol=1e-4)
    visible = unrolled_mask(3, 2, torch.float32, "cpu")[0, 0] == 0
    assert visible.int().tolist() == [
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 1],
    ]


def test_tiny_eagle_training_lowers_the_loss_and_the_recipe_runs(tmp_path, tiny_checkpoint, fake_sharegpt):
    import json

    from selfspec.models import load_target
    from selfspec.training.config import TrainConfig
    from selfspec.training.recipes.eagle import EagleTraining
    from selfspec.training.trainer.loop import collate, train
    from selfspec.training.trainer.pipeline import run_recipe

    target, sequences, _ = tiny_training_setup(tiny_checkpoint)
    module = EagleTraining(
        EagleHead(EagleConfig(draft_vocab_size=0, feature_noise=0.0), target, torch.arange(target.vocab_size)),
        EagleConfig(feature_noise=0.0),
    )
    batch = collate(sequences, torch.device("cpu"))
    with torch.no_grad():
        before = module.training_loss(batch)[0].item()
    config = TrainConfig(batch_size=4, lr=0.01, warmup_steps=2, max_steps=40, checkpoint_every=100, log_every=5)
    train(module, len(sequences), sequences.__getitem__, config, tmp_path / "ckpt")
    with torch.no_grad():
        after, metrics = module.training_loss(batch)
    assert after.item() < 0.7 * before and set(metrics) == {"top1", "feat"}
    unrolled = EagleTraining(module.head, EagleConfig(feature_noise=0.0, unroll_steps=3))
    loss, metrics = unrolled.training_loss(batch)
    assert torch.isfinite(loss) and set(metrics) == {"top1", "top1@2", "top1@3", "feat"}
    loss.backward()
    assert module.head.fc.weight.grad is not None

    recipe = tiny_recipe(
        tmp_path, tiny_checkpoint, drafter="eagle", eagle=EagleConfig(draft_vocab_size=16, top_k=2, depth=3)
    )
    report = run_recipe(recipe)
    assert report["drafter"] == "eagle" and report["steps"] == 12
    heads_dir = tmp_path / "heads"
    assert json.loads((heads_dir / "config.json").read_text())["drafter"] == "eagle"
    target = load_target(str(tiny_checkpoint))
    target = target.with_eos(())
    prompt = target.encode_prompt("the cat sat on")[0].tolist()
    tokens, _ = speculative_generate(target, create_drafter("eagle", target, heads_dir), torch.tensor(prompt), 20)
    assert list(tokens) == hf_greedy(target, prompt, 20, eos=-1)


def test_eagle3_layers_and_config_checks():
    from selfspec.heads.eagle import Eagle3Config, Eagle3Head, eagle3_layers

    assert eagle3_layers(30) == (2, 15, 27) and eagle3_layers(2) == (0, 1, 2) and eagle3_layers(4) == (0, 2, 4)
    target = make_tiny_target("llama")
    head = Eagle3Head(Eagle3Config(draft_vocab_size=0), target, torch.arange(target.vocab_size))
    names = set(head.state_dict())
    assert {"fc.weight", "layers.0.hidden_norm.weight", "layers.0.input_layernorm.weight", "norm.weight"} <= names
    assert head.fc.bias is None and head.layers[0].self_attn.q_proj.in_features == 2 * target.config.hidden_size
    with pytest.raises(SelfspecError, match="eagle3 predicts no feature: set hidden_weight to 0"):
        Eagle3Head(Eagle3Config(hidden_weight=1.0), target, torch.arange(target.vocab_size))
    with pytest.raises(SelfspecError, match=r"feature_layers \[1, 1\] must be distinct and lie in 0 .. 2"):
        Eagle3Head(Eagle3Config(feature_layers=(1, 1)), target, torch.arange(target.vocab_size))
    with pytest.raises(SelfspecError, match=r"feature_layers \[0, 3\]"):
        Eagle3Head(Eagle3Config(feature_layers=(0, 3)), target, torch.arange(target.vocab_size))


def test_tiny_eagle3_training_lowers_the_loss_and_the_recipe_runs(tmp_path, tiny_checkpoint, fake_sharegpt):
    import json

    from selfspec.heads.eagle import Eagle3Config, Eagle3Head
    from selfspec.models import load_target
    from selfspec.training.config import TrainConfig
    from selfspec.training.recipes.eagle import EagleTraining
    from selfspec.training.trainer.loop import collate, train
    from selfspec.training.trainer.pipeline import run_recipe

    target, sequences, _ = tiny_training_setup(tiny_checkpoint, layers=(0, 1, 2))
    config = Eagle3Config(draft_vocab_size=0, unroll_steps=2)
    module = EagleTraining(Eagle3Head(config, target, torch.arange(target.vocab_size)), config)
    batch = collate(sequences, torch.device("cpu"))
    with torch.no_grad():
        before, metrics = module.training_loss(batch)
    assert set(metrics) == {"top1", "top1@2"}  # a token loss per unrolled step, no feature loss
    train(
        module,
        len(sequences),
        sequences.__getitem__,
        TrainConfig(batch_size=4, lr=0.01, warmup_steps=2, max_steps=40, checkpoint_every=100, log_every=5),
        tmp_path / "ckpt",
    )
    with torch.no_grad():
        after = module.training_loss(batch)[0]
    assert after.item() < 0.7 * before.item()

    recipe = tiny_recipe(
        tmp_path, tiny_checkpoint, drafter="eagle3", eagle3=Eagle3Config(draft_vocab_size=16, top_k=2, depth=3)
    )
    report = run_recipe(recipe)
    assert report["drafter"] == "eagle3" and report["steps"] == 12 and "top1@3" in report["final_metrics"]
    heads_dir = tmp_path / "heads"
    saved = json.loads((heads_dir / "config.json").read_text())
    assert saved["drafter"] == "eagle3" and saved["config"]["feature_layers"] == [0, 1, 2]  # resolved and written
    target = load_target(str(tiny_checkpoint))
    target = target.with_eos(())
    prompt = target.encode_prompt("the cat sat on")[0].tolist()
    tokens, _ = speculative_generate(target, create_drafter("eagle3", target, heads_dir), torch.tensor(prompt), 20)
    assert list(tokens) == hf_greedy(target, prompt, 20, eos=-1)
