"""The measured sweep of learning rate and warm-up (arms in lockstep on shared batches, measured on calibration
sequences), and the streamed-label sample that a resumed long run no longer relabels at every start."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import selfspec.training.data.labels as labels_module
import selfspec.training.studies.sweep as sweep_module
from selfspec.errors import SelfspecError
from selfspec.heads.eagle import Eagle3Config
from selfspec.models import load_target
from selfspec.training.config import LabelConfig, TrainConfig
from selfspec.training.data.prepare import recipe_data
from selfspec.training.studies.sweep import Arm, parse_arms, sweep

from .helpers import tiny_recipe


def _stream_recipe(tmp_path, checkpoint, **changes):
    config = tiny_recipe(
        tmp_path,
        checkpoint,
        drafter="eagle3",
        labels=LabelConfig(storage="stream", top_k=4),
        train=TrainConfig(batch_size=4, lr=0.01, warmup_steps=1, max_steps=6, checkpoint_every=3, log_every=2),
        eagle3=Eagle3Config(draft_vocab_size=16, top_k=2, depth=3),
    )
    config = replace(config, data=replace(config.data, regenerate=False, conversations=40, calibration_fraction=0.2))
    return replace(config, **changes)


def _count_labelling(monkeypatch) -> list[int]:
    calls, real = [], labels_module.label_sequence

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(labels_module, "label_sequence", counted)
    return calls


def test_the_streamed_sample_is_labelled_once_and_kept_for_the_next_start(
    tmp_path, tiny_checkpoint, fake_sharegpt, monkeypatch
):
    config = _stream_recipe(tmp_path, tiny_checkpoint)
    target = load_target(config.model)
    calls = _count_labelling(monkeypatch)
    first = recipe_data(target, config, (0, 1, 2), {}).train
    assert len(calls) == len(first.sample) == 32  # all 32 training sequences (fewer than 256)
    calls.clear()
    again = recipe_data(target, config, (0, 1, 2), {}).train
    assert calls == []  # a resumed run's start: nothing relabelled
    assert [s.topk_ids.tolist() for s in again.sample] == [s.topk_ids.tolist() for s in first.sample]
    # Other data under the same ids (a shorter max_length cuts the same conversations) is labelled again.
    shorter = replace(config, data=replace(config.data, max_length=16))
    cut = recipe_data(target, shorter, (0, 1, 2), {}).train
    assert len(calls) == 32 and max(len(s.input_ids) for s in cut.sample) <= 16


def test_parse_arms_and_its_errors():
    assert parse_arms("3e-4:20, 1e-3:5") == [Arm(3e-4, 20), Arm(1e-3, 5)]
    for text, message in (
        ("1e-3", "is not LR:WARMUP"),
        ("x:3", "is not LR:WARMUP"),
        ("0:3", "must be > 0"),
        ("1e-3:-1", "warm-up >= 0"),
        ("", "no sweep arms given"),
    ):
        with pytest.raises(SelfspecError, match=message):
            parse_arms(text)


def test_sweep_arms_share_batches_and_start_weights_and_are_measured_on_calibration_only(
    tmp_path, tiny_checkpoint, fake_sharegpt, monkeypatch
):
    config = _stream_recipe(tmp_path, tiny_checkpoint)
    target = load_target(config.model)
    sample = recipe_data(target, config, (0, 1, 2), {}).train.sample  # labelled (and kept) here
    fetched = []
    real_collate = sweep_module.collate

    def spy(sequences, device):
        fetched.append([tuple(s.input_ids.tolist()) for s in sequences])
        return real_collate(sequences, device)

    monkeypatch.setattr(sweep_module, "collate", spy)
    calls = _count_labelling(monkeypatch)
    monkeypatch.setattr(sweep_module, "label_sequence", labels_module.label_sequence)  # the counted one
    monkeypatch.setattr("selfspec.training.data.prepare.label_batch", None)  # streamed labelling would fail here
    result = sweep(target, config, [Arm(0.01, 1), Arm(0.01, 1), Arm(0.002, 3)], steps=6, calibration_sequences=4)
    assert len(calls) == 4  # only the calibration sequences measured: training reads the kept sample
    trained = [row for batch in fetched[:6] for row in batch]
    assert len(trained) == len(set(trained)) == 24  # one pass over the sample: no sequence twice
    assert set(trained) <= {tuple(s.input_ids.tolist()) for s in sample}
    same, twin, other = result["rows"]
    # Same settings: same start, same batches, same noise -> the same numbers (all but the wall seconds, train_s).
    assert {k: v for k, v in same.items() if k != "train_s"} == {k: v for k, v in twin.items() if k != "train_s"}
    assert other["calibration_loss"] != same["calibration_loss"]
    assert {"lr", "warmup_steps", "calibration_loss", "top1", "top1@2", "top1@3", "train_s"} <= set(same)
    calibration = {tuple(e.input_ids.tolist()) for e in recipe_data(target, config, (0, 1, 2), {}).calibration_examples}
    assert not calibration & set(trained) and fetched[6][0] in calibration  # measured on calibration only
    with pytest.raises(SelfspecError, match="need 36 sequences and the labelled sample holds 32: at most 8 steps"):
        sweep(target, config, [Arm(0.01, 1)], steps=9)
    with pytest.raises(SelfspecError, match="the sweep trains EAGLE-family heads"):
        sweep(target, replace(config, drafter="dflash"), [Arm(0.01, 1)], steps=6)


def test_the_sweep_script_refuses_bad_arms_in_one_line():
    script = Path(__file__).resolve().parents[1] / "scripts" / "train_sweep.py"
    done = subprocess.run([sys.executable, str(script), "--arms", "fast"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["train_sweep: error: sweep arm 'fast' is not LR:WARMUP (e.g. 1e-3:30)"]
