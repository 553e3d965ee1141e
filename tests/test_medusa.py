"""Medusa: the head-k label shift, the tree from measured accuracies, the drafter's trees, save/load, and
losslessness (greedy equality, chi-square) with Medusa trees."""

from __future__ import annotations

import json

import pytest
import torch

from selfspec.cost import CostCurve
from selfspec.errors import SelfspecError
from selfspec.heads import create_drafter
from selfspec.heads.medusa import MedusaHeads, TreeTemplate
from selfspec.training.recipes.medusa import best_tree, shifted_labels
from selfspec.training.trainer.loop import Batch
from selfspec.training.trainer.losses import draft_vocabulary, soft_cross_entropy

from .helpers import PROMPT, hf_greedy, make_tiny_target, random_medusa_dir, without_eos


def test_head_k_labels_are_shifted_by_k_plus_one():
    # One sequence of 6 tokens; every position learnable except the first two.
    topk_ids = torch.arange(6).view(1, 6, 1) * 10  # the target's top-1 after position t is 10 * t
    batch = Batch(
        input_ids=torch.arange(6).view(1, 6),
        valid=torch.ones(1, 6, dtype=torch.bool),
        loss_mask=torch.tensor([[False, False, True, True, True, True]]),
        hidden={},
        topk_ids=topk_ids,
        topk_probs=torch.ones(1, 6, 1),
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
    from selfspec.training.data.labels import LabeledSequence

    top1 = torch.tensor([5, 5, 5, 7, 7, 9]).view(-1, 1)
    sequence = LabeledSequence(
        torch.zeros(6, dtype=torch.long), torch.ones(6, dtype=torch.bool), {}, top1, torch.ones(6, 1)
    )
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
    tree = template.build(99, topk_ids, 5)
    assert tree.token_list == [99, 11, 12, 21, 22]
    assert tree.parent_list == (-1, 0, 0, 1, 1)
    smaller = template.build(99, topk_ids, 3)  # the best 3-node tree: a prefix of the layout
    assert smaller.token_list == [99, 11, 12] and smaller.parent_list == (-1, 0, 0)


def test_budget_follows_the_cost_curve():
    values = [0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05]
    flat = CostCurve((1, 64), (1.0, 1.0), "test")  # a GPU-like curve: every node is free
    steep = CostCurve((1, 2, 64), (1.0, 2.0, 64.0), "test")  # each node costs a whole forward
    assert flat.best_size(values) == (len(values) + 1, pytest.approx((1 + sum(values)) / 1.0))
    assert steep.best_size(values)[0] == 1
    assert flat.best_size(values, draft_cost_per_node=1.0, min_size=2)[0] == 2  # drafting costs a step per node


def test_save_load_round_trip_and_wrong_base(tmp_path):
    target = make_tiny_target("llama")
    directory = random_medusa_dir(target, tmp_path / "heads")
    drafter = create_drafter("medusa", target, directory)
    saved = MedusaHeads(drafter.head.config, target, drafter.head.draft_vocab)
    from safetensors.torch import load_file

    state = load_file(str(directory / "model.safetensors"))
    assert set(state) == set(saved.state_dict())  # no base weights in the directory
    for name, tensor in drafter.head.state_dict().items():
        assert torch.equal(tensor, state[name])
    other = make_tiny_target("qwen2")
    with pytest.raises(SelfspecError, match="another base model"):
        create_drafter("medusa", other, directory)
    with pytest.raises(SelfspecError, match="'ngram'"):
        create_drafter("ngram", target, directory)


def test_unknown_config_key_and_foreign_weights_are_rejected(tmp_path):
    target = make_tiny_target("llama")
    directory = random_medusa_dir(target, tmp_path / "heads")
    document = json.loads((directory / "config.json").read_text())
    document["config"]["num_head"] = 3
    (directory / "config.json").write_text(json.dumps(document))
    with pytest.raises(SelfspecError, match="unknown key"):
        create_drafter("medusa", target, directory)
    directory = random_medusa_dir(target, tmp_path / "heads2")
    from safetensors.torch import load_file, save_file

    state = load_file(str(directory / "model.safetensors"))
    metadata = {"fingerprint": json.dumps(target.fingerprint.to_dict()), "drafter": "medusa"}
    save_file(
        {**state, "heads.9.0.linear.weight": torch.zeros(1)}, str(directory / "model.safetensors"), metadata=metadata
    )
    with pytest.raises(SelfspecError, match="unexpected"):
        create_drafter("medusa", target, directory)


def test_missing_heads_for_a_model_without_shipped_ones():
    with pytest.raises(SelfspecError, match="no shipped 'medusa' heads match"):
        create_drafter("medusa", make_tiny_target("llama"))


def test_cli_generate_and_medusa_tree(tmp_path, tiny_checkpoint, capsys):
    from selfspec.cli import main
    from selfspec.models import load_target

    target = load_target(str(tiny_checkpoint))
    directory = random_medusa_dir(target, tmp_path / "heads")
    data = tmp_path / "calibration.jsonl"
    data.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "the cat"},
                    {"role": "assistant", "content": "a big red dog sat on the mat"},
                ]
            }
        )
        + "\n"
    )
    assert (
        main(
            [
                "medusa-tree",
                "--model",
                str(tiny_checkpoint),
                "--heads",
                str(directory),
                "--data",
                str(data),
                "--max-nodes",
                "5",
            ]
        )
        == 0
    )
    tree = json.loads((directory / "config.json").read_text())["data"]["tree"]
    assert len(tree["paths"]) == 4 and tree["values"] == sorted(tree["values"], reverse=True)
    args = [
        "generate",
        "--model",
        str(tiny_checkpoint),
        "--drafter",
        "medusa",
        "--heads",
        str(directory),
        "--prompt",
        "the cat",
        "--max-new-tokens",
        "8",
    ]
    assert main(args) == 0
    assert "drafter=medusa" in capsys.readouterr().err
    assert main(args[:6] + [str(tmp_path / "nowhere")] + args[7:]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_medusa2_decodes_its_own_adapted_copy_and_plain_decoding_beside_it_the_original(tmp_path):
    """The demo, `auto` and the benchmark share one Target: attaching Medusa-2 heads (a LoRA adapter merged into the
    model) must leave the model that plain decoding beside them reads as it was."""
    from selfspec.api import SelfSpec

    original = without_eos(make_tiny_target("llama"))  # the same weights, never given to a drafter
    target = without_eos(make_tiny_target("llama"))
    directory = random_medusa_dir(target, tmp_path / "heads", lora=True)
    medusa, plain = SelfSpec(target, drafter="medusa", heads=directory), SelfSpec(target, drafter="none")
    reference = hf_greedy(original, PROMPT, 16, eos=-1)
    assert list(plain.generate(input_ids=PROMPT, max_new_tokens=16).token_ids) == reference
    adapted = medusa.drafter.target
    assert adapted is not target and adapted.model is not target.model
    adapted_reference = hf_greedy(adapted, PROMPT, 16, eos=-1)
    assert adapted_reference != reference  # the adapter changes what the model decodes: the test can tell them apart
    assert list(medusa.generate(input_ids=PROMPT, max_new_tokens=16).token_ids) == adapted_reference
    auto = SelfSpec(target, drafter="auto", heads=directory, sources=("ngram", "medusa"))
    assert (
        list(auto.generate(input_ids=PROMPT, max_new_tokens=16).token_ids) == reference
    )  # auto verifies on the shared one
    for (name, weight), shared in zip(
        original.model.state_dict().items(), target.model.state_dict().values(), strict=True
    ):
        assert torch.equal(weight, shared), f"{name} of the shared target changed"
    # The copy owns only what the adapter changed (q_proj, v_proj); every other weight is the shared target's memory.
    own = {
        name
        for name, weight in adapted.model.state_dict().items()
        if weight.data_ptr() != target.model.state_dict()[name].data_ptr()
    }
    assert own and all("q_proj" in name or "v_proj" in name for name in own)


def test_medusa2_refuses_a_target_it_cannot_copy(tmp_path, monkeypatch):
    import selfspec.heads.medusa as medusa_module

    target = make_tiny_target("llama")
    directory = random_medusa_dir(target, tmp_path / "heads", lora=True)

    def no_memory(model, new_parameters):
        raise RuntimeError("out of memory\ntraceback details")

    monkeypatch.setattr(medusa_module, "sharing_copy", no_memory)
    with pytest.raises(SelfspecError, match=r"cannot be copied \(out of memory\)") as error:
        create_drafter("medusa", target, directory)
    assert "\n" not in str(error.value) and not target.adapters  # one line, and the shared target left alone
