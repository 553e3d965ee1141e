"""DFlash: block construction and masks, the tree from block marginals on hand-made distributions, training seeing
what drafting sees, the start from the target's layers, the mask token, save/load and the wrong-base error
(losslessness with DFlash trees: the drafter contract suite; the speculators format: test_speculators.py)."""

from __future__ import annotations

import math

import pytest
import torch

from selfspec.errors import SelfspecError
from selfspec.heads import create_drafter
from selfspec.heads.dflash import DFlashConfig, DFlashHead, block_tree, training_mask
from selfspec.training.recipes.dflash import DFlashTraining, rarest_token, sample_anchors

from .helpers import PROMPT, make_tiny_target, random_dflash_dir, random_dflash_head, tiny_recipe


def visible(mask):
    return (mask[0, 0] == 0).int().tolist()


def test_training_mask_and_anchors():
    # 3 context rows, blocks of 2 anchored at 1 and 2: block j's rows see the context rows < anchor j and block j.
    assert visible(training_mask(torch.tensor([[1, 2]]), 3, 2, torch.float32)) == [
        [1, 0, 0, 1, 1, 0, 0],
        [1, 0, 0, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 1, 1],
        [1, 1, 0, 0, 0, 1, 1],
    ]
    anchors = sample_anchors(
        torch.tensor([[True] * 6, [True] * 3 + [False] * 3]),
        torch.tensor([[False, False, False, True, True, False], [True] * 6]),
        50,
    )
    assert set(anchors[0].tolist()) == {2, 3} and set(anchors[1].tolist()) == {1}


def log_probs(*rows):
    return torch.tensor(rows).log()


def test_block_tree_is_best_first_over_marginals():
    # Depth 1: tokens 0 (.6), 1 (.3); depth 2: tokens 2 (.5), 0 (.4). Paths score by the product of marginals.
    marginals = log_probs([0.6, 0.3, 0.1], [0.4, 0.1, 0.5])
    seen = []
    tokens, parents = block_tree(marginals, top_k=2, max_nodes=6, size_for=lambda scores: seen.append(scores) or 6)
    # Paths (by token): 0 = .6, then 0-2 = .30 and 1 = .3 (a tie: the lower ranks first), 0-0 = .24, 1-2 = .15.
    assert [round(math.exp(s), 3) for s in seen[0]] == [0.6, 0.3, 0.3, 0.24, 0.15]
    assert tokens == [0, 2, 1, 0, 2] and parents == [-1, 0, -1, 0, 2]
    tokens, parents = block_tree(marginals, 2, 6, lambda scores: 3)  # root + 2 best
    assert tokens == [0, 2] and parents == [-1, 0]
    assert block_tree(marginals[:0], 2, 6, lambda scores: 6) == ([], [])


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_training_blocks_see_what_drafting_sees(family):
    """A training block anchored at a equals the drafter's block for root token a after committing tokens 0..a-1,
    with the context rows reaching the drafter's cache in two pieces and an earlier block cropped off."""
    from transformers import DynamicCache

    from selfspec.tree_attention import trim_cache

    target = make_tiny_target(family, num_hidden_layers=3)
    head = random_dflash_head(target, num_layers=2).eval()
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        hidden = target.model(ids, output_hidden_states=True).hidden_states
    features = torch.cat([hidden[layer] for layer in head.feature_layers], -1)
    anchors = torch.tensor([[6, 2, 9]])
    with torch.no_grad():
        trained = head.blocks(features, ids, anchors)  # [1, 3, B, H]
        cache = DynamicCache()
        first = head(
            head.context(features[:, :2]),
            head.block_inputs(ids[0, [2]]),
            torch.arange(0, 2 + 4).view(1, -1),
            None,
            cache,
        )
        trim_cache(cache, 2)
        drafted = head(
            head.context(features[:, 2:6]),
            head.block_inputs(ids[0, [6]]),
            torch.arange(2, 6 + 4).view(1, -1),
            None,
            cache,
        )
    torch.testing.assert_close(trained[0, 1], first[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(trained[0, 0], drafted[0], atol=1e-5, rtol=1e-4)
    assert not torch.allclose(trained[0, 0], trained[0, 2], atol=1e-3)  # another anchor, another block


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_drafter_starts_from_the_target_top_layers(family):
    target = make_tiny_target(family, num_hidden_layers=3)
    head = DFlashHead(
        DFlashConfig(num_layers=2, mask_token_id=0, draft_vocab_size=0), target, torch.arange(target.vocab_size)
    )
    head.init_from_target(target)
    top = target.model.model.layers
    for own, source in zip(head.layers, top[1:], strict=True):
        for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"):
            assert torch.equal(own.get_submodule(name).weight, source.get_submodule(name).weight)
        torch.testing.assert_close(own.input_layernorm.weight, source.input_layernorm.weight, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head.norm.weight, target.model.model.norm.weight, atol=1e-5, rtol=1e-5)
    blocks = head.block_inputs(torch.tensor([5, 7]))  # [2, B, H]: the anchor, then the mask token's embedding
    embeddings = target.model.get_input_embeddings().weight
    assert torch.equal(blocks[1, 0], embeddings[7]) and torch.equal(blocks[0, 3], embeddings[0])


def test_the_mask_token_is_the_rarest_in_the_data():
    from types import SimpleNamespace

    sequences = [
        SimpleNamespace(input_ids=torch.tensor([0, 1, 2, 4, 4])),
        SimpleNamespace(input_ids=torch.tensor([0, 2, 3, 1])),
    ]
    assert rarest_token(sequences, 6) == 5  # never used
    assert rarest_token(sequences, 5) == 3  # used once, every other token twice


def test_wrong_base_round_trip_and_drafter(tmp_path):
    target = make_tiny_target("llama", num_hidden_layers=3)
    directory = random_dflash_dir(target, tmp_path / "d", draft_vocab=torch.arange(0, target.vocab_size, 2))
    drafter = create_drafter("dflash", target, directory)
    assert drafter.hidden_layers == (0, 1, 3) and len(drafter.head.draft_vocab) == target.vocab_size // 2
    with pytest.raises(SelfspecError, match="trained for another base model"):
        create_drafter("dflash", make_tiny_target("llama", num_hidden_layers=2), directory)
    with pytest.raises(SelfspecError, match="'dflash' heads, not 'eagle'"):
        create_drafter("eagle", target, directory)
    with pytest.raises(SelfspecError, match="no shipped 'dflash' heads match"):
        create_drafter("dflash", target)


def test_tiny_dflash_training_lowers_the_loss_and_the_recipe_runs(tmp_path, tiny_checkpoint, fake_sharegpt):
    import json
    import random

    from selfspec.models import load_target
    from selfspec.training.config import TrainConfig
    from selfspec.training.data.labels import label_sequence
    from selfspec.training.data.sharegpt import Conversation
    from selfspec.training.data.tokenizing import tokenize_conversation
    from selfspec.training.trainer.loop import collate, train
    from selfspec.training.trainer.pipeline import run_recipe

    from .helpers import WORDS

    target = load_target(str(tiny_checkpoint))
    config = DFlashConfig(block_size=4, draft_vocab_size=0, anchors_per_sequence=4, mask_token_id=0)
    head = DFlashHead(config, target, torch.arange(target.vocab_size))
    head.init_from_target(target)
    rng = random.Random(1)
    sequences = []
    for index in range(16):
        conversation = Conversation(
            str(index),
            (
                {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(4))},
                {"role": "assistant", "content": " ".join(rng.choice(WORDS[:6]) for _ in range(12))},
            ),
        )
        sequences.append(
            label_sequence(target, tokenize_conversation(target, conversation, 64), head.feature_layers, 4)
        )
    module = DFlashTraining(head, config)
    batch = collate(sequences, torch.device("cpu"))
    torch.manual_seed(0)
    with torch.no_grad():
        before = module.training_loss(batch)[0].item()
    train(
        module,
        len(sequences),
        sequences.__getitem__,
        TrainConfig(batch_size=4, lr=0.01, warmup_steps=2, max_steps=40, checkpoint_every=100, log_every=5),
        tmp_path / "ckpt",
    )
    torch.manual_seed(0)
    with torch.no_grad():
        after, metrics = module.training_loss(batch)
    assert after.item() < 0.8 * before and set(metrics) == {"top1@1", "top1@2"}
    recipe = tiny_recipe(
        tmp_path,
        tiny_checkpoint,
        drafter="dflash",
        out=str(tmp_path / "dflash"),
        dflash=DFlashConfig(block_size=4, draft_vocab_size=16, top_k=2),
    )
    report = run_recipe(recipe)
    assert report["drafter"] == "dflash" and report["steps"] == 12 and report["feature_layers"] == [0, 1, 2]
    saved = json.loads((tmp_path / "dflash" / "config.json").read_text())
    assert saved["drafter"] == "dflash" and saved["config"]["feature_layers"] == [0, 1, 2]
    assert 0 <= saved["config"]["mask_token_id"] < target.vocab_size  # -1 in the recipe: resolved from the data
    assert create_drafter("dflash", target, tmp_path / "dflash").hidden_layers == (0, 1, 2)
