"""`selfspec train heads`: one label pass feeds EAGLE-3, DFlash and Medusa-1 in the same steps (one labelling per
batch, not one per head), each head saved as its own recipe saves it and decoding exactly; each head its own learning
rate and gradient clipping; the time budget fixes the run's length and its schedule; the one-line refusals."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import selfspec.training.data.prepare as prepare_module
import selfspec.training.trainer.loop as trainer_module
from selfspec.cli import main
from selfspec.decoding import speculative_generate
from selfspec.errors import SelfspecError
from selfspec.heads import create_drafter
from selfspec.heads.dflash import DFlashConfig
from selfspec.heads.eagle import Eagle3Config
from selfspec.models import load_target
from selfspec.training.config import (
    HeadRates,
    JointConfig,
    LabelConfig,
    TrainConfig,
    load_joint_recipe,
    load_recipe,
    tiny_scale,
)
from selfspec.training.recipes.joint import JointTraining, run_joint
from selfspec.training.trainer.loop import ParamGroup, train, train_step

from .helpers import hf_greedy, tiny_recipe, tiny_training_setup

ROOT = Path(__file__).resolve().parent.parent


def tiny_joint(tmp_path, checkpoint, **changes) -> JointConfig:
    """The shared sections of the single recipes' tiny test recipe, with every head, labels streamed per batch."""
    single = tiny_recipe(tmp_path, checkpoint)
    config = JointConfig(
        model=single.model,
        out=str(tmp_path / "heads"),
        work_dir=single.work_dir,
        data=single.data,
        labels=LabelConfig(storage="stream", top_k=4),
        train=replace(single.train, max_steps=6, checkpoint_every=3),
        eval=single.eval,
        head_lr=HeadRates(eagle3=0.02, dflash=0.005, medusa=None),
        eagle3=Eagle3Config(draft_vocab_size=16, top_k=2, depth=3, max_tree_nodes=8),
        dflash=DFlashConfig(block_size=4, draft_vocab_size=16, top_k=2, anchors_per_sequence=4),
        medusa=single.medusa,
    )
    return replace(config, **changes)


def test_one_label_pass_feeds_every_head_and_each_saved_head_decodes_exactly(
    tmp_path, tiny_checkpoint, fake_sharegpt, monkeypatch
):
    labelled = []  # one entry per labelling of a training batch: the layers it recorded
    real = prepare_module.label_batch
    monkeypatch.setattr(
        prepare_module,
        "label_batch",
        lambda target, examples, layers, k: labelled.append(layers) or real(target, examples, layers, k),
    )
    config = tiny_joint(tmp_path, tiny_checkpoint)
    reports = run_joint(config)
    assert labelled == [(-1, 0, 1, 2)] * 6  # one pass a step, the union of the heads' layers: not three
    target = load_target(str(tiny_checkpoint)).with_eos(())
    prompt = target.encode_prompt("the cat sat on")[0].tolist()
    expected = hf_greedy(target, prompt, 16, eos=-1)
    for name, first in (("eagle3", "top1"), ("dflash", "top1@1"), ("medusa", "top1_h1")):
        directory = tmp_path / "heads" / name
        written = json.loads((directory / "training_report.json").read_text())
        assert written == json.loads(json.dumps(reports[name]))
        assert written["drafter"] == name and written["steps"] == 6 and first in written["final_metrics"]
        assert written["joint"]["heads"] == ["eagle3", "dflash", "medusa"] and written["joint"]["label_passes"] == 1
        assert written["throughput"]["training"]["tokens"] == reports["eagle3"]["throughput"]["training"]["tokens"]
        assert written["config"]["train"]["lr"] == {"eagle3": 0.02, "dflash": 0.005, "medusa": 0.01}[name]
        drafter = create_drafter(name, target, directory)
        tokens, _ = speculative_generate(target, drafter, torch.tensor(prompt), 16)
        assert list(tokens) == expected, name
    assert reports["dflash"]["feature_layers"] == [0, 1, 2] and len(reports["medusa"]["top_k_accuracy"]) == 2


def _two_medusa_parts(tiny_checkpoint, rates):
    _, sequences, make = tiny_training_setup(tiny_checkpoint)
    return sequences, JointTraining({"a": make(), "b": make()}, rates)


def test_each_head_trains_in_its_own_param_group_at_its_own_rate(tmp_path, tiny_checkpoint):
    sequences, joint = _two_medusa_parts(tiny_checkpoint, {"a": 0.02, "b": 0.0})
    before = {name: p.detach().clone() for name, p in joint.named_parameters() if p.requires_grad}
    config = TrainConfig(batch_size=4, lr=0.5, warmup_steps=0, max_steps=3, checkpoint_every=3)
    train(joint, len(sequences), sequences.__getitem__, config, tmp_path / "ckpt")
    moved = {name for name, p in joint.named_parameters() if p.requires_grad and not torch.equal(p, before[name])}
    assert moved and all(name.startswith("parts.a.") for name in moved)  # b's rate is 0: it never moves
    state = torch.load(tmp_path / "ckpt" / "step-3.pt", weights_only=False)
    assert [group["initial_lr"] for group in state["optimizer"]["param_groups"]] == [0.02, 0.0]
    assert state["settings"]["groups"] == {"a": 0.02, "b": 0.0}  # a resumed run must keep each head's rate


def test_gradient_clipping_is_per_head():
    """One head's gradient spike leaves the other's step alone: each group's norm is clipped on its own."""
    from accelerate import Accelerator

    a, b = torch.nn.Linear(4, 1, bias=False), torch.nn.Linear(4, 1, bias=False)

    class Spiky(torch.nn.Module):
        def forward(self, batch):
            return 1e6 * a.weight.sum() + b.weight.sum(), {}

    groups = [ParamGroup("a", [a.weight]), ParamGroup("b", [b.weight])]
    optimizer = torch.optim.SGD([{"params": g.params} for g in groups], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    before = b.weight.detach().clone()
    train_step(Spiky(), None, optimizer, scheduler, Accelerator(cpu=True), [g.params for g in groups], 1.0)
    # b's gradient is all ones (norm 2 over 4 weights), clipped to norm 1 on its own: each weight moves by 0.5.
    assert torch.allclose(before - b.weight.detach(), torch.full((1, 4), 0.5))


def test_time_budget_fixes_the_step_count_and_the_schedule_ends_there(tmp_path, tiny_checkpoint, monkeypatch, capsys):
    _, sequences, make = tiny_training_setup(tiny_checkpoint)
    now, fetched, cost = [0.0], [], [1.0]
    monkeypatch.setattr(trainer_module, "running_time", lambda: now[0])

    def fetch(index):  # each sequence takes `cost` seconds on the fake clock: a step of 2 takes 2 at first
        now[0] += cost[0]
        fetched.append(index)
        if len(fetched) == 2 * 12 + 1 and "stop" in fetched:
            raise KeyboardInterrupt  # the second run stops in step 13, after its step-10 checkpoint (and plan)
        return sequences[index]

    config = TrainConfig(
        batch_size=2, lr=0.01, warmup_steps=2, max_steps=100, checkpoint_every=10, time_budget_minutes=1.0
    )
    straight = make()
    summary = train(straight, len(sequences), fetch, config, tmp_path / "a")
    # 10 steps measured (2 s each) leave 40 s of the 60: 20 more steps, 30 in all.
    assert summary.steps == 30 and summary.tokens > 0
    assert "time budget 1 min: 30 steps in all" in capsys.readouterr().out
    state = torch.load(tmp_path / "a" / "step-30.pt", weights_only=False)
    assert state["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.05 * 0.01)  # cosine's floor, at step 30
    assert state["progress"]["planned_steps"] == 30
    # A run stopped after its plan was fixed resumes on that plan, not on a new one from its own pace and clock (at
    # 6 s a step it would end at step 20), and ends where the straight run ended, with the same weights.
    fetched[:] = ["stop"]
    with pytest.raises(KeyboardInterrupt):
        train(make(), len(sequences), fetch, config, tmp_path / "b")
    resumed, cost[0] = make(), 3.0
    summary = train(resumed, len(sequences), fetch, config, tmp_path / "b", resume=True)
    assert summary.steps == 30 and summary.resumed_from == 10
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_joint_recipe_refuses_medusa2_in_one_line(tmp_path):
    recipe = tmp_path / "joint.yaml"
    recipe.write_text("heads: [eagle3, medusa]\nmedusa:\n  lora: {rank: 4}\n")
    with pytest.raises(SelfspecError, match="Medusa-1 only") as error:
        load_joint_recipe(recipe)
    assert "\n" not in str(error.value)
    recipe.write_text("heads: [eagle3, eagle]\n")
    with pytest.raises(SelfspecError, match="heads must be"):
        load_joint_recipe(recipe)


def test_train_cli_refuses_a_recipe_of_the_other_kind_before_any_model_loads(tmp_path, capsys, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("selfspec.training.recipes.joint.load_target", no_model)
    monkeypatch.setattr("selfspec.training.trainer.pipeline.load_target", no_model)
    single, joint = tmp_path / "eagle3.yaml", tmp_path / "heads.yaml"
    single.write_text("drafter: eagle3\n")
    joint.write_text("heads: [eagle3, dflash]\n")
    assert main(["train", "heads", "--config", str(single)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("selfspec: error: ") and "not a joint one" in err and err.count("\n") == 1
    assert main(["train", "eagle3", "--config", str(joint)]) == 2
    err = capsys.readouterr().err
    assert "is a joint recipe" in err and "selfspec train heads" in err and err.count("\n") == 1
    joint.write_text("heads: [medusa]\nmedusa: {lora: {rank: 4}}\n")
    assert main(["train", "heads", "--config", str(joint), "--tiny"]) == 2
    assert "Medusa-1 only" in capsys.readouterr().err


def test_shipped_joint_recipes():
    cpu = load_joint_recipe(ROOT / "configs" / "heads-smollm2.yaml")
    gpu = load_joint_recipe(ROOT / "configs" / "gpu" / "heads-smollm2.yaml")
    assert set(cpu.heads) == set(gpu.heads) == {"eagle3", "dflash", "medusa"}
    assert (gpu.data.source, gpu.data.conversations, gpu.labels.storage) == ("sharegpt", None, "stream")
    assert gpu.data.regenerate and gpu.data.original_conversations is None and gpu.data.regenerate_engine == "batched"
    assert (gpu.train.batch_size, gpu.data.max_length) == (64, 1024) and gpu.train.time_budget_minutes
    # ~703 real positions a sequence (configs/gpu/eagle3-smollm2.yaml's measured mix): >= 100M real positions.
    assert gpu.train.batch_size * 703 * gpu.train.max_steps >= 100_000_000
    assert gpu.work_path == Path("runs/gpu-heads/work")
    small = tiny_scale(gpu)
    assert isinstance(small, JointConfig) and small.out == f"{gpu.out}-tiny" and small.train.max_steps <= 4
    assert small.eagle3 == gpu.eagle3 and small.head_lr == gpu.head_lr
    with pytest.raises(SelfspecError, match="joint recipe"):
        load_recipe(ROOT / "configs" / "heads-smollm2.yaml")
    assert cpu.medusa.lora is None and gpu.medusa.lora is None
