"""The EAGLE-3 scaling table from one wsd run (selfspec/training/studies/scaling.py): a point per kept step, each a
branch that decays over a fraction more steps and is measured; points not reached yet are said so; measured points are
kept; the log-linear fit and what it predicts."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import selfspec.training.studies.scaling as scaling_module
from selfspec.errors import SelfspecError
from selfspec.heads.artifacts import heldout_tau
from selfspec.heads.eagle import Eagle3Config
from selfspec.models import load_target
from selfspec.training.config import EvalConfig, LabelConfig, TrainConfig, load_recipe
from selfspec.training.studies.scaling import fit_log_linear, predicted_positions, scaling_points, write_table
from selfspec.training.trainer.pipeline import run_recipe

from .helpers import tiny_recipe


def _wsd_recipe(tmp_path, checkpoint):
    config = tiny_recipe(
        tmp_path,
        checkpoint,
        drafter="eagle3",
        labels=LabelConfig(storage="stream", top_k=4),
        train=TrainConfig(
            batch_size=4,
            lr=0.01,
            warmup_steps=1,
            max_steps=6,
            schedule="wsd",
            decay_steps=2,
            keep_steps=(2, 4, 8),
            checkpoint_every=100,
            log_every=2,
        ),
        eval=EvalConfig(heldout_prompts=1, max_new_tokens=6),
        eagle3=Eagle3Config(draft_vocab_size=16, top_k=2, depth=3),
    )
    return replace(config, data=replace(config.data, regenerate=False, conversations=40, calibration_fraction=0.2))


def test_a_point_per_kept_step_reached_each_a_measured_branch_kept_for_reruns(
    tmp_path, tiny_checkpoint, fake_sharegpt, monkeypatch
):
    config = _wsd_recipe(tmp_path, tiny_checkpoint)
    run_recipe(config)
    target = load_target(config.model)
    rows = scaling_points(target, config, decay=0.5, eval_prompts=1, eval_tokens=6)
    assert [(row["step"], row["reached"]) for row in rows] == [(2, True), (4, True), (8, False)]
    two, four = rows[0], rows[1]
    assert (two["steps"], two["branch_steps"], four["steps"], four["branch_steps"]) == (3, 1, 6, 2)
    assert 0 < two["positions"] < four["positions"] and 0 <= two["train_s"] <= four["train_s"]
    for row in (two, four):
        assert set(row["chain"]) == {"mtbench", "humaneval", "sharegpt"}
        assert all(0 <= v <= 1 for chain in row["chain"].values() for v in chain)
        assert row["tau_heldout"] >= 1.0
    # Point 2 is the run of 3 steps (decay over the last one) from the start: same data, same weights.
    straight = replace(
        config,
        out=str(tmp_path / "straight"),
        train=replace(config.train, max_steps=3, decay_steps=1, keep_steps=()),
        eval=EvalConfig(heldout_prompts=0),
    )
    run_recipe(straight)
    point = load_file(str(config.work_path / "scaling" / "head-2" / "model.safetensors"))
    reference = load_file(str(tmp_path / "straight" / "model.safetensors"))
    assert point.keys() == reference.keys() and all(torch.equal(point[k], reference[k]) for k in point)
    # Its report holds that run's recipe, as a file `selfspec train` reads (its outputs apart from the long run's),
    # and what auto reads.
    report = json.loads((config.work_path / "scaling" / "head-2" / "training_report.json").read_text())
    (tmp_path / "point-2.yaml").write_text(json.dumps(report["config"]))
    recipe = load_recipe(tmp_path / "point-2.yaml")
    assert recipe == replace(
        config, out=f"{config.out}-step2", work_dir=f"{config.work_dir}-step2", train=straight.train
    )
    assert recipe.work_path != config.work_path
    assert (
        report["heldout"]["mean_accepted_length"]
        == two["tau_heldout"]
        == heldout_tau(config.work_path / "scaling" / "head-2")
    )
    assert (report["steps"], report["positions"]) == (3, two["positions"])
    # The main run's checkpoints are untouched by the branches.
    assert sorted(p.name for p in (config.work_path / "checkpoints-heads").glob("step-*.pt")) == [
        "step-2.pt",
        "step-4.pt",
        "step-6.pt",
    ]
    monkeypatch.setattr(scaling_module, "train", None)  # a rerun measures nothing it measured before
    monkeypatch.setattr(scaling_module, "recipe_data", None)
    assert scaling_points(target, config, decay=0.5, eval_prompts=1, eval_tokens=6) == rows
    table = write_table(rows, {"mtbench": 0.5, "humaneval": 0.52, "sharegpt": 0.6}, tmp_path / "out", "header")
    text = (tmp_path / "out" / "scaling.md").read_text()
    assert "| 8 | not reached yet |" in text and "| 4 (+2) |" in text
    assert json.loads((tmp_path / "out" / "scaling.json").read_text()) == json.loads(json.dumps(table))


def test_the_table_needs_a_wsd_run_with_kept_steps(tmp_path, tiny_checkpoint):
    config = _wsd_recipe(tmp_path, tiny_checkpoint)
    target = load_target(config.model)
    with pytest.raises(SelfspecError, match="set train.schedule: wsd and train.keep_steps"):
        scaling_points(target, replace(config, train=replace(config.train, schedule="cosine", decay_steps=0)))
    with pytest.raises(SelfspecError, match="EAGLE-family recipes"):
        scaling_points(target, replace(config, drafter="dflash"))
    with pytest.raises(SelfspecError, match=r"decay is a fraction .* in \(0, 1\], got 2"):
        scaling_points(target, config, decay=2)
    script = Path(__file__).resolve().parents[1] / "scripts" / "eagle3_scaling.py"
    done = subprocess.run(
        [sys.executable, str(script), "--config", "configs/eagle3-smollm2.yaml"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=script.parents[1],
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "eagle3_scaling: error: configs/eagle3-smollm2.yaml: the scaling table needs train.schedule: wsd and "
        "train.keep_steps"
    ]


def test_the_log_linear_fit_and_what_it_predicts():
    a, b = fit_log_linear([(1024, 0.30), (4096, 0.40), (16384, 0.50)])
    assert b == pytest.approx(0.05) and a == pytest.approx(0.30 - 0.05 * 10)
    assert predicted_positions((a, b), 0.60) == pytest.approx(65536)
    assert fit_log_linear([(1024, 0.3), (1024, 0.4)]) is None
    assert predicted_positions((0.5, -0.01), 0.6) is None and predicted_positions(None, 0.6) is None
