"""`make heads-gpu`: the GPU recipes are sized as their comments say (>= 100M token positions per head, streamed
labels, the whole training split), and the Makefile's own commands run end to end at a tiny scale on the CPU, so
they work unchanged the day a GPU runs them."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from selfspec.cli import main
from selfspec.training.config import load_recipe, tiny_scale

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ("eagle3-smollm2", "dflash-smollm2")


def heads_gpu_commands() -> list[list[str]]:
    """The `selfspec train` lines of the Makefile's heads-gpu target, as argument lists (TINY=1's flag set)."""
    text = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^heads-gpu:.*\n((?:\t.*\n)+)", text, re.MULTILINE)
    assert recipe, "the Makefile has no heads-gpu target"
    lines = [line.strip() for line in recipe.group(1).splitlines() if "selfspec train" in line]
    tiny = [line.replace("$(if $(TINY),--tiny)", "--tiny") for line in lines]
    return [shlex.split(line.split("$(BIN)/selfspec", 1)[1]) for line in tiny]


@pytest.mark.parametrize("name", RECIPES)
def test_gpu_recipes_train_on_100m_token_positions_from_the_whole_split(name):
    config = load_recipe(ROOT / "configs" / "gpu" / f"{name}.yaml")
    positions = config.train.batch_size * config.data.max_length * config.train.max_steps
    assert positions >= 100_000_000, f"{name}: {positions:,} token positions"
    assert (config.data.source, config.data.conversations, config.labels.storage) == ("sharegpt", None, "stream")
    assert config.data.regenerate and config.data.original_conversations is None  # all regenerated + all original
    assert Path(config.out).parent == Path("runs/gpu-heads") and Path(config.work_dir).parent == Path("runs/gpu-heads")
    small = tiny_scale(config)
    assert small.out == f"{config.out}-tiny" and small.train.max_steps <= 4 and small.data.conversations <= 24
    assert small.dflash == config.dflash and small.eagle3 == config.eagle3  # model-dependent sizes stay


def test_make_heads_gpu_runs_at_a_tiny_scale_on_the_cpu(tmp_path, tiny_checkpoint, fake_sharegpt, monkeypatch):
    commands = heads_gpu_commands()
    assert [command[:2] for command in commands] == [["train", "eagle3"], ["train", "dflash"]]
    assert all("--resume" in command and "--tiny" in command for command in commands)
    shutil.copytree(ROOT / "configs" / "gpu", tmp_path / "configs" / "gpu")
    monkeypatch.chdir(tmp_path)
    for command in commands:  # the default model's place taken by the tiny checkpoint
        assert main(command + ["--model", str(tiny_checkpoint)]) == 0
    runs = tmp_path / "runs" / "gpu-heads"
    assert sorted(p.name for p in runs.iterdir()) == ["dflash-smollm2-tiny", "eagle3-smollm2-tiny", "work-tiny"]
    for name, drafter in zip(("eagle3-smollm2-tiny", "dflash-smollm2-tiny"), ("eagle3", "dflash"), strict=True):
        report = json.loads((runs / name / "training_report.json").read_text())
        assert report["drafter"] == drafter and report["steps"] == 4 and report["heldout"]["prompts"] == 1
        throughput = report["throughput"]
        # DFlash reads the replies EAGLE-3's run regenerated into the shared work directory.
        assert ("regeneration" in throughput) == (drafter == "eagle3") and throughput["training"]["tokens"] > 0
        assert throughput["labels"]["counts"].endswith("(streamed)") and throughput["labels"]["tokens_per_s"] > 0
        assert (runs / name / "model.safetensors").is_file()
        mix = report["data_mix"]  # both kinds, in the training and the calibration parts alike
        assert set(mix) == {"regenerated", "original"} and all(part["calibration_sequences"] for part in mix.values())
        assert sum(part["sequences"] for part in mix.values()) == report["training_sequences"] + sum(
            part["calibration_sequences"] for part in mix.values()
        )
    # Run again: the finished run resumes at its last step, regenerates and trains nothing more.
    assert main(commands[0] + ["--model", str(tiny_checkpoint)]) == 0
    report = json.loads((runs / "eagle3-smollm2-tiny" / "training_report.json").read_text())
    assert report["resumed_from"] == 4 and "regeneration" not in report["throughput"]
