"""Medusa: the head-k label shift, the tree from measured accuracies, the drafter's trees, save/load, and
losslessness (greedy equality, chi-square) with Medusa trees."""

from __future__ import annotations

import json

import pytest
import torch

from selfspec.cost import CostCurve
from selfspec.decoding import speculative_generate
from selfspec.errors import SelfspecError
from selfspec.heads import create_drafter
from selfspec.heads.artifacts import save_head
from selfspec.heads.medusa import MedusaHeads, TreeTemplate, expected_gains
from selfspec.training.config import MedusaConfig
from selfspec.training.losses import draft_vocabulary, soft_cross_entropy
from selfspec.training.medusa import best_tree, shifted_labels
from selfspec.training.trainer import Batch

from .conftest import CORE_FAMILIES, make_tiny_target
from selfspec.sampling import logits_to_probs

from .test_chisquare import SAMPLING, VOCAB, chi_square_p_value
from .test_greedy_equality import PROMPT, hf_greedy


def random_heads_dir(target, directory, num_heads=3, draft_vocab=None, seed=0, max_nodes=12):
    """Heads with random (non-zero) weights and a tree from made-up accuracies, saved like trained ones."""
    config = MedusaConfig(num_heads=num_heads, draft_vocab_size=0 if draft_vocab is None else len(draft_vocab), max_rank=3)
    vocab = torch.arange(target.vocab_size) if draft_vocab is None else draft_vocab
    heads = MedusaHeads(config, target.model.get_output_embeddings().weight.float(), vocab)
    torch.manual_seed(seed)
    for parameter in heads.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    accuracies = torch.tensor([[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.1]])[:num_heads]
    paths, values = best_tree(accuracies, max_nodes)
    tree = {"paths": [list(p) for p in paths], "values": values}
    return save_head(directory, "medusa", config, heads.state_dict(), target.fingerprint, {"tree": tree})


def test_head_k_labels_are_shifted_by_k_plus_one():
    # One sequence of 6 tokens; every position learnable except the first two.
    topk_ids = torch.arange(6).view(1, 6, 1) * 10  # the target's top-1 after position t is 10 * t
    batch = Batch(
        input_ids=torch.arange(6).view(1, 6), valid=torch.ones(1, 6, dtype=torch.bool),
        loss_mask=torch.tensor([[False, False, True, True, True, True]]), hidden={},
        topk_ids=topk_ids, topk_probs=torch.ones(1, 6, 1),
    )
    for k in range(3):
        rows, ids, _ = shifted_labels(batch, k)
        # head k reads position t and predicts token t + k + 2 (learnable for t + k + 2 >= 2, < 6)
        expected_t = [t for t in range(6) if 2 <= t + k + 2 < 6]
        assert rows[:, 1].tolist() == expected_t
        assert ids[:, 0].tolist() == [10 * (t + k + 1) for t in expected_t]
    rows, _, _ = shifted_labels(batch, 4)  # nothing left to predict
    assert rows.shape == (0, 2)


def test_soft_cross_entropy_renormalises_inside_the_draft_vocabulary():
    to_draft = torch.tensor([0, -1, 1])  # target ids 0 and 2 are in the draft vocabulary
    logits = torch.tensor([[2.0, 0.0]])
    loss, used, agreement = soft_cross_entropy(logits, torch.tensor([[1, 0]]), torch.tensor([[0.5, 0.5]]), to_draft)
    # all inside mass is on draft index 0: loss = -log softmax([2, 0])[0]
    assert used == 1 and agreement == 0.0  # the top-1 (target id 1) is outside the draft vocabulary
    assert loss.item() == pytest.approx(-torch.log_softmax(logits, -1)[0, 0].item())


def test_draft_vocabulary_keeps_the_most_chosen_tokens():
    from selfspec.training.labels import LabeledSequence

    top1 = torch.tensor([5, 5, 5, 7, 7, 9]).view(-1, 1)
    sequence = LabeledSequence(torch.zeros(6, dtype=torch.long), torch.ones(6, dtype=torch.bool), {}, top1, torch.ones(6, 1))
    assert draft_vocabulary([sequence], 2, 20).tolist() == [5, 7]
    assert draft_vocabulary([sequence], 4, 20).tolist() == [0, 5, 7, 9]
    assert draft_vocabulary([sequence], 0, 20).tolist() == list(range(20))


def test_best_tree_orders_nodes_by_expected_acceptance_parents_first():
    accuracies = torch.tensor([[0.7, 0.2], [0.5, 0.3]])
    paths, values = best_tree(accuracies, max_nodes=6)
    assert paths == [(0,), (0, 0), (0, 1), (1,), (1, 0)]
    assert values == pytest.approx([0.7, 0.35, 0.21, 0.2, 0.1])
    seen = set()
    for path in paths:
        assert path[:-1] == () or path[:-1] in seen
        seen.add(path)


def test_tree_template_gathers_tokens_from_head_ranks():
    template = TreeTemplate([(0,), (1,), (0, 0), (0, 1)], max_rank=2, device=torch.device("cpu"))
    topk_ids = torch.tensor([[11, 12], [21, 22]])  # head 1's top-2, head 2's top-2
    tree = template.build(99, topk_ids)
    assert tree.token_list == [99, 11, 12, 21, 22]
    assert tree.parent_list == (-1, 0, 0, 1, 1)


def test_budget_follows_the_cost_curve():
    values = [0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05]
    flat = CostCurve((1, 64), (1.0, 1.0), "test")  # a GPU-like curve: every node is free
    steep = CostCurve((1, 2, 64), (1.0, 2.0, 64.0), "test")  # each node costs a whole forward
    assert expected_gains(values, flat, 64) == len(values) + 1
    assert expected_gains(values, steep, 64) == 1


def test_save_load_round_trip_and_wrong_base(tmp_path):
    target = make_tiny_target("llama")
    directory = random_heads_dir(target, tmp_path / "heads")
    drafter = create_drafter("medusa", target, directory)
    saved = MedusaHeads(drafter.heads.config, target.model.get_output_embeddings().weight, drafter.heads.draft_vocab)
    from safetensors.torch import load_file

    state = load_file(str(directory / "model.safetensors"))
    assert set(state) == set(saved.state_dict())  # no base weights in the directory
    for name, tensor in drafter.heads.state_dict().items():
        assert torch.equal(tensor, state[name])
    other = make_tiny_target("qwen2")
    with pytest.raises(SelfspecError, match="another base model"):
        create_drafter("medusa", other, directory)
    with pytest.raises(SelfspecError, match="'ngram'"):
        create_drafter("ngram", target, directory)


def test_unknown_config_key_and_foreign_weights_are_rejected(tmp_path):
    target = make_tiny_target("llama")
    directory = random_heads_dir(target, tmp_path / "heads")
    document = json.loads((directory / "config.json").read_text())
    document["config"]["num_head"] = 3
    (directory / "config.json").write_text(json.dumps(document))
    with pytest.raises(SelfspecError, match="unknown key"):
        create_drafter("medusa", target, directory)
    directory = random_heads_dir(target, tmp_path / "heads2")
    from safetensors.torch import load_file, save_file

    state = load_file(str(directory / "model.safetensors"))
    metadata = {"fingerprint": json.dumps(target.fingerprint.to_dict()), "drafter": "medusa"}
    save_file({**state, "heads.9.0.linear.weight": torch.zeros(1)}, str(directory / "model.safetensors"), metadata=metadata)
    with pytest.raises(SelfspecError, match="unexpected"):
        create_drafter("medusa", target, directory)


def test_missing_heads_for_a_model_without_shipped_ones():
    with pytest.raises(SelfspecError, match="no shipped 'medusa' heads match"):
        create_drafter("medusa", make_tiny_target("llama"))


@pytest.mark.parametrize("family", CORE_FAMILIES)
def test_greedy_equality_with_medusa_trees(family, tmp_path):
    target = make_tiny_target(family)
    target.model.generation_config.eos_token_id = None
    target._eos = ()
    reference = hf_greedy(target, PROMPT, 30, eos=-1)
    reduced = torch.arange(0, target.vocab_size, 2)  # a reduced draft vocabulary (every other id)
    for name, vocab in {"full": None, "reduced": reduced}.items():
        directory = random_heads_dir(target, tmp_path / name, draft_vocab=vocab)
        for nodes in (None, 4, 12):
            options = {} if nodes is None else {"max_nodes": nodes}
            drafter = create_drafter("medusa", target, directory, **options)
            tokens, stats = speculative_generate(target, drafter, torch.tensor(PROMPT), 30)
            assert list(tokens) == reference, f"{family}/{name}/{nodes}"
            assert max(stats.tree_sizes) > 1  # it did draft
            if vocab is not None:
                drafted = drafter.heads.topk_target_ids(drafter.last_hidden, 3)
                assert bool((drafted % 2 == 0).all())  # only draft-vocabulary ids come out


def test_chi_square_with_medusa_trees(tmp_path):
    """Two prompt tokens: the prefill gives the heads a hidden state, so the first step verifies a Medusa tree."""
    prompt = [3, 5]
    target = make_tiny_target("llama", vocab_size=VOCAB, initializer_range=0.15, num_hidden_layers=1)
    target._eos = ()
    directory = random_heads_dir(target, tmp_path / "heads", num_heads=2, max_nodes=7)
    drafter = create_drafter("medusa", target, directory, max_nodes=7)
    with torch.inference_mode():
        first = logits_to_probs(target.model(torch.tensor([prompt])).logits[0, -1], SAMPLING)
        second = torch.stack(
            [logits_to_probs(target.model(torch.tensor([prompt + [t]])).logits[0, -1], SAMPLING) for t in range(VOCAB)]
        )
    counts, drafted_steps = torch.zeros(VOCAB, VOCAB), 0
    for seed in range(20_000):
        tokens, stats = speculative_generate(target, drafter, torch.tensor(prompt), 2, SAMPLING, seed=seed)
        counts[tokens[0], tokens[1]] += 1
        drafted_steps += stats.tree_sizes[0] > 1
    assert drafted_steps == 20_000
    assert chi_square_p_value(counts, first[:, None] * second) > 1e-3


def test_cli_generate_and_medusa_tree(tmp_path, tiny_checkpoint, capsys):
    from selfspec.cli import main
    from selfspec.models import load_target

    target = load_target(str(tiny_checkpoint))
    directory = random_heads_dir(target, tmp_path / "heads")
    data = tmp_path / "calibration.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "a big red dog sat on the mat"}]}) + "\n")
    assert main(["medusa-tree", "--model", str(tiny_checkpoint), "--heads", str(directory), "--data", str(data), "--max-nodes", "5"]) == 0
    tree = json.loads((directory / "config.json").read_text())["data"]["tree"]
    assert len(tree["paths"]) == 4 and tree["values"] == sorted(tree["values"], reverse=True)
    args = ["generate", "--model", str(tiny_checkpoint), "--drafter", "medusa", "--heads", str(directory), "--prompt", "the cat", "--max-new-tokens", "8"]
    assert main(args) == 0
    assert "drafter=medusa" in capsys.readouterr().err
    assert main(args[:6] + [str(tmp_path / "nowhere")] + args[7:]) == 2
    assert "does not exist" in capsys.readouterr().err
