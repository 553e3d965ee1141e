"""Long runs stop anywhere and continue with --resume exactly as if they had not stopped: the trainer (checkpoints
by steps and by time, optimizer, scheduler, RNG, data order and progress numbers), a whole recipe interrupted in
regeneration, labelling and training in turn, a run killed with SIGKILL, and one-line errors for checkpoints of
another head or recipe."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import selfspec.training.data.labels as labels_module
import selfspec.training.data.regenerate as regenerate_module
import selfspec.training.trainer.checkpoints as checkpoints_module
import selfspec.training.trainer.loop as trainer_module
from selfspec.cli import main
from selfspec.errors import SelfspecError
from selfspec.heads.eagle import EagleConfig, EagleHead
from selfspec.training.config import TrainConfig
from selfspec.training.recipes.eagle import EagleTraining
from selfspec.training.trainer.loop import train
from selfspec.training.trainer.pipeline import run_recipe

from .helpers import tiny_recipe, tiny_training_setup


class Stop(Exception):
    """Stands in for the run being stopped (a crash, Ctrl-C; SIGKILL has a test of its own)."""


def _eagle_maker(tiny_checkpoint):
    """EAGLE with feature noise: its steps draw random numbers, so a resume that lost the RNG state would show."""
    target, sequences, _ = tiny_training_setup(tiny_checkpoint)

    def make():
        torch.manual_seed(7)
        return EagleTraining(
            EagleHead(EagleConfig(draft_vocab_size=0, feature_noise=0.2), target, torch.arange(target.vocab_size)),
            EagleConfig(feature_noise=0.2),
        )

    return sequences, make


CONFIG = TrainConfig(
    batch_size=4, lr=0.02, warmup_steps=3, max_steps=12, checkpoint_every=5, checkpoint_minutes=10, log_every=4
)


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, left), (_, right) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(left, right), name


def _stopping_at(sequences, step: int, on_step=None):
    """get_sequence that stops the run when it fetches batch `step` (0-based), after calling on_step(k) per batch."""
    served = []

    def get(index):
        served.append(index)
        batch = (len(served) - 1) // CONFIG.batch_size
        if len(served) % CONFIG.batch_size == 1 and on_step:
            on_step(batch)
        if batch == step:
            raise Stop
        return sequences[index]

    return get


def test_resume_after_a_step_checkpoint_equals_the_uninterrupted_run(tmp_path, tiny_checkpoint):
    sequences, make = _eagle_maker(tiny_checkpoint)
    straight = make()
    reference = train(straight, len(sequences), sequences.__getitem__, CONFIG, tmp_path / "a")
    with pytest.raises(Stop):  # stopped while fetching step 8's batch: the last checkpoint is step 5's
        train(make(), len(sequences), _stopping_at(sequences, 7), CONFIG, tmp_path / "b")
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["step-5.pt"]
    resumed = make()
    summary = train(resumed, len(sequences), sequences.__getitem__, CONFIG, tmp_path / "b", resume=True)
    assert summary.resumed_from == 5
    _assert_same_weights(straight, resumed)
    # The progress numbers continue: the same token count, loss window and metrics as the straight run's.
    assert (summary.tokens, summary.final_loss, summary.final_metrics) == (
        reference.tokens,
        reference.final_loss,
        reference.final_metrics,
    )
    assert summary.first_draft_accuracy == reference.final_metrics["top1"]


def test_a_time_checkpoint_between_step_checkpoints_resumes_exactly(tmp_path, tiny_checkpoint, monkeypatch):
    sequences, make = _eagle_maker(tiny_checkpoint)
    straight = make()
    train(straight, len(sequences), sequences.__getitem__, CONFIG, tmp_path / "a")
    now = [1000.0]
    monkeypatch.setattr(checkpoints_module, "monotonic", lambda: now[0])

    def clock(step):  # step 7 (0-based 6) takes 11 minutes: the 10-minute checkpoint fires after it
        now[0] += 660.0 if step == 6 else 1.0

    with pytest.raises(Stop):
        train(make(), len(sequences), _stopping_at(sequences, 8, clock), CONFIG, tmp_path / "b")
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["step-5.pt", "step-7.pt"]
    resumed = make()
    summary = train(resumed, len(sequences), sequences.__getitem__, CONFIG, tmp_path / "b", resume=True)
    assert summary.resumed_from == 7
    _assert_same_weights(straight, resumed)


def test_resume_errors_are_one_line(tmp_path, tiny_checkpoint):
    sequences, make = _eagle_maker(tiny_checkpoint)
    train(make(), len(sequences), sequences.__getitem__, replace(CONFIG, max_steps=5), tmp_path / "c")
    with pytest.raises(SelfspecError, match=r"made with train.batch_size 4, this run has 2: restore the recipe"):
        train(make(), len(sequences), sequences.__getitem__, replace(CONFIG, batch_size=2), tmp_path / "c", resume=True)
    with pytest.raises(SelfspecError, match=r"made with training sequences 12, this run has 11"):
        train(make(), 11, sequences.__getitem__, CONFIG, tmp_path / "c", resume=True)
    _, _, make_medusa = tiny_training_setup(tiny_checkpoint)
    with pytest.raises(SelfspecError, match="does not match this head.*start without --resume"):
        train(make_medusa(), len(sequences), sequences.__getitem__, CONFIG, tmp_path / "c", resume=True)
    (tmp_path / "c" / "step-9.pt").write_text("not a checkpoint")
    with pytest.raises(SelfspecError, match="cannot be read"):
        train(make(), len(sequences), sequences.__getitem__, CONFIG, tmp_path / "c", resume=True)
    with pytest.raises(SelfspecError, match="train.checkpoint_every must be >= 1, got 0"):
        replace(CONFIG, checkpoint_every=0)


def test_a_bad_checkpoint_setting_is_one_line_before_any_work(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("drafter: eagle3\ntrain:\n  checkpoint_minutes: -5\n")
    assert main(["train", "eagle3", "--config", str(recipe)]) == 2
    expected = (
        "selfspec: error: train.checkpoint_minutes (0: by steps only) and train.warmup_steps must be >= 0, "
        "got -5.0 and 50"
    )
    assert capsys.readouterr().err.strip().splitlines() == [expected]


def _stop_after(monkeypatch, module, name: str, calls: int) -> list:
    """Make module.name raise Stop on its (calls + 1)-th call; returns the list of calls made."""
    real, made = getattr(module, name), []

    def wrapped(*args, **kwargs):
        made.append(1)
        if len(made) > calls:
            raise Stop
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)
    return made


def _counting(monkeypatch, module, name: str) -> list:
    return _stop_after(monkeypatch, module, name, 10**9)


def test_a_recipe_stopped_in_each_stage_resumes_to_the_uninterrupted_heads(
    tmp_path, tiny_checkpoint, fake_sharegpt, monkeypatch
):
    straight = tiny_recipe(
        tmp_path / "straight", tiny_checkpoint, drafter="eagle", out=str(tmp_path / "straight-heads")
    )
    run_recipe(straight)
    config = replace(straight, out=str(tmp_path / "heads"), work_dir=str(tmp_path / "work"))
    with monkeypatch.context() as patch:  # 1. stopped after the first regeneration batch (of 16 prompts)
        _stop_after(patch, regenerate_module, "_batched_replies", 1)
        with pytest.raises(Stop):
            run_recipe(config, resume=True)
    first_replies = (tmp_path / "work" / "regenerated.jsonl").read_text().splitlines()
    assert 0 < len(first_replies) <= 16
    with monkeypatch.context() as patch:  # 2. resumed, stopped after two label shards (of 16 sequences)
        generated = _counting(patch, regenerate_module, "_batched_replies")
        _stop_after(patch, labels_module, "label_sequence", 40)
        with pytest.raises(Stop):
            run_recipe(config, resume=True)
    replies = (tmp_path / "work" / "regenerated.jsonl").read_text().splitlines()
    assert replies[: len(first_replies)] == first_replies and len(generated) == 6  # the other 82 prompts only
    manifest = json.loads((tmp_path / "work" / "labels-train-top" / "manifest.json").read_text())
    assert len(manifest["shards"]) == 2 and not manifest["complete"]
    with monkeypatch.context() as patch:  # 3. resumed, stopped during step 7 of 12 (checkpoints every 4)
        labelled = _counting(patch, labels_module, "label_sequence")
        _stop_after(patch, trainer_module, "train_step", 6)
        with pytest.raises(Stop):
            run_recipe(config, resume=True)
    assert len(labelled) == manifest["examples"] - 32  # the sequences not labelled yet; the two shards were kept
    with monkeypatch.context() as patch:  # 4. resumed to the end: nothing regenerated or labelled again
        labelled = _counting(patch, labels_module, "label_sequence")
        report = run_recipe(config, resume=True)
    assert labelled == [] and report["resumed_from"] == 4 and report["steps"] == 12
    assert (tmp_path / "work" / "regenerated.jsonl").read_text().splitlines() == replies
    ours, theirs = (
        load_file(str(tmp_path / "heads" / "model.safetensors")),
        load_file(str(tmp_path / "straight-heads" / "model.safetensors")),
    )
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    training = report["throughput"]["training"]
    assert (
        training["tokens"]
        == json.loads((tmp_path / "straight-heads" / "training_report.json").read_text())["throughput"]["training"][
            "tokens"
        ]
    )  # the progress numbers continued through the resume


def test_a_run_killed_with_sigkill_resumes_to_the_uninterrupted_heads(tmp_path, tiny_checkpoint):
    """A real process, killed with SIGKILL once its first checkpoint is on disk, then `selfspec train --resume`."""
    data = tmp_path / "conversations.jsonl"
    words = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran"]
    data.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": " ".join(words[(i + j) % 8] for j in range(4))},
                        {"role": "assistant", "content": " ".join(words[(i * j) % 8] for j in range(10))},
                    ]
                }
            )
            + "\n"
            for i in range(24)
        )
    )
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"drafter: medusa\nmodel: {tiny_checkpoint}\nout: {tmp_path / 'heads'}\nwork_dir: {tmp_path / 'work'}\n"
        f"data: {{source: {data}, conversations: null, max_length: 48, regenerate: false, calibration_fraction: 0.1}}\n"
        "labels: {storage: stream, top_k: 4}\n"
        "train: {batch_size: 2, lr: 0.01, warmup_steps: 5, max_steps: 200, checkpoint_every: 10, log_every: 10}\n"
        "eval: {heldout_prompts: 0}\nmedusa: {num_heads: 2, draft_vocab_size: 0, max_rank: 3, max_tree_nodes: 8}\n"
    )
    checkpoints = tmp_path / "work" / "checkpoints-heads"
    command = [sys.executable, "-m", "selfspec.cli", "train", "medusa", "--config", str(recipe)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(checkpoints.glob("step-*.pt")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    stopped_at = max(int(p.stem.split("-")[1]) for p in checkpoints.glob("step-*.pt"))
    assert stopped_at < 200, "the run finished before it was killed: give it more steps"
    assert main(["train", "medusa", "--config", str(recipe), "--resume"]) == 0
    resumed = load_file(str(tmp_path / "heads" / "model.safetensors"))
    assert json.loads((tmp_path / "heads" / "training_report.json").read_text())["resumed_from"] == stopped_at
    assert main(["train", "medusa", "--config", str(recipe), "--out", str(tmp_path / "straight")]) == 0
    straight = load_file(str(tmp_path / "straight" / "model.safetensors"))
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


def test_the_work_directory_defaults_to_the_cache_outside_the_checkout(tmp_path, monkeypatch):
    from selfspec.training.config import RecipeConfig, tiny_scale

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    config = RecipeConfig(out="runs/eagle3")
    assert config.work_path.parent == tmp_path / "cache" / "runs" and config.work_path.name.startswith("eagle3-")
    assert RecipeConfig(out="elsewhere/eagle3").work_path != config.work_path  # same name, other output
    assert RecipeConfig(out=str(tmp_path / "runs" / "eagle3")).work_path == config.work_path  # the same place
    assert RecipeConfig(out="runs/eagle3", work_dir="~/w").work_path == Path("~/w").expanduser()
    assert tiny_scale(config).work_path != config.work_path  # a smoke run never shares the real run's files


def test_a_fresh_start_sets_the_earlier_runs_checkpoints_aside(tmp_path, tiny_checkpoint):
    sequences, make = _eagle_maker(tiny_checkpoint)
    train(make(), len(sequences), sequences.__getitem__, CONFIG, tmp_path / "c")  # checkpoints at 5, 10, 12 (2 kept)
    short = replace(CONFIG, max_steps=6)
    train(make(), len(sequences), sequences.__getitem__, short, tmp_path / "c")  # no --resume: a new run
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["step-5.pt", "step-6.pt"]
    assert sorted(p.name for p in (tmp_path / "c.previous").iterdir()) == ["step-10.pt", "step-12.pt"]
    summary = train(make(), len(sequences), sequences.__getitem__, short, tmp_path / "c", resume=True)
    assert summary.resumed_from == 6  # the new run's own, not the earlier run's step 12


WSD = replace(CONFIG, schedule="wsd", warmup_steps=2, max_steps=12, decay_steps=4, checkpoint_every=100)


def test_the_wsd_schedule_warms_up_holds_then_decays_linearly_whatever_the_run_length():
    factors = [trainer_module.lr_factors(WSD, 12)(step) for step in range(12)]
    assert factors == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2]
    longer = trainer_module.lr_factors(replace(WSD, max_steps=40), 40)
    assert [longer(step) for step in range(8)] == factors[:8]  # the stable part does not depend on max_steps
    with pytest.raises(SelfspecError, match="train.schedule must be 'cosine' or 'wsd', got 'linear'"):
        replace(WSD, schedule="linear")
    with pytest.raises(SelfspecError, match="train.decay_steps is the wsd schedule's decay"):
        replace(CONFIG, decay_steps=3)


def test_a_branch_from_a_kept_step_equals_a_run_of_that_length_from_the_start(tmp_path, tiny_checkpoint):
    """A wsd run extended to 20 steps keeps its step 8; a branch from it with a 4-step decay is the 12-step run."""
    sequences, make = _eagle_maker(tiny_checkpoint)
    short = make()
    train(short, len(sequences), sequences.__getitem__, WSD, tmp_path / "short")
    long = replace(WSD, max_steps=20, decay_steps=6, keep_steps=(8,), checkpoint_every=5)
    train(make(), len(sequences), sequences.__getitem__, long, tmp_path / "long")
    # Pruning keeps the newest two (15, 20) and the kept step.
    assert sorted(p.name for p in (tmp_path / "long").iterdir()) == ["step-15.pt", "step-20.pt", "step-8.pt"]
    branch = make()
    summary = train(
        branch,
        len(sequences),
        sequences.__getitem__,
        WSD,
        tmp_path / "branch",
        branch_from=tmp_path / "long" / "step-8.pt",
    )
    assert summary.resumed_from == 8
    _assert_same_weights(short, branch)
    assert sorted(p.name for p in (tmp_path / "branch").iterdir()) == ["step-12.pt"]  # its own, beside the run's
    assert sorted(p.name for p in (tmp_path / "long").iterdir()) == ["step-15.pt", "step-20.pt", "step-8.pt"]
    # A branch that has checkpoints of its own resumes from them, not from the branch point again.
    again = make()
    resumed = train(
        again,
        len(sequences),
        sequences.__getitem__,
        replace(WSD, max_steps=14, decay_steps=6),
        tmp_path / "branch",
        resume=True,
        branch_from=tmp_path / "long" / "step-8.pt",
    )
    assert resumed.resumed_from == 12
    with pytest.raises(SelfspecError, match="no checkpoint '.*step-9.pt' to branch from"):
        train(
            make(),
            len(sequences),
            sequences.__getitem__,
            WSD,
            tmp_path / "x",
            branch_from=tmp_path / "long" / "step-9.pt",
        )
    with pytest.raises(SelfspecError, match="made with train.schedule wsd, this run has cosine"):
        train(
            make(),
            len(sequences),
            sequences.__getitem__,
            replace(WSD, schedule="cosine", decay_steps=0),
            tmp_path / "y",
            branch_from=tmp_path / "long" / "step-8.pt",
        )
