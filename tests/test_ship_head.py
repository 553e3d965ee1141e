"""scripts/ship_head.py: a heads directory shipped whole, in bfloat16 only where the draft accuracy holds, and a bad
request refused in one line before anything loads."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from selfspec.heads import create_drafter
from selfspec.models import load_target
from selfspec.training.trainer.pipeline import write_report

from .helpers import random_dflash_dir, random_eagle3_dir, random_medusa_dir

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ship_head.py"


def _script():
    spec = importlib.util.spec_from_file_location("ship_head", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trained(target, directory: Path, tau: float = 1.4) -> Path:
    random_eagle3_dir(target, directory)
    write_report(directory, {"drafter": "eagle3", "heldout": {"mean_accepted_length": tau}})
    return directory


def test_a_head_ships_in_bfloat16_only_while_its_accuracy_holds(tmp_path, tiny_checkpoint, fake_sharegpt, monkeypatch):
    target = load_target(str(tiny_checkpoint))
    source = _trained(target, tmp_path / "head")
    ship = _script()
    check = ["--eval-prompts", "1", "--max-new-tokens", "6", "--work", str(tmp_path / "work")]
    common = [str(source), "eagle3-tiny", "--model", str(tiny_checkpoint), "--into", str(tmp_path / "trained")]
    assert ship.main([*common, "--dtype", "bfloat16", "--tolerance", "1", *check]) == 0
    shipped = tmp_path / "trained" / "eagle3-tiny"
    original, stored = load_file(str(source / "model.safetensors")), load_file(str(shipped / "model.safetensors"))
    assert stored.keys() == original.keys() and stored["draft_vocab"].dtype == original["draft_vocab"].dtype
    for name, tensor in original.items():
        if tensor.is_floating_point():
            assert stored[name].dtype == torch.bfloat16 and torch.equal(stored[name], tensor.to(torch.bfloat16))
    report = json.loads((shipped / "training_report.json").read_text())
    assert report["heldout"] == {"mean_accepted_length": 1.4} and report["shipped"]["stored_dtype"] == "bfloat16"
    measured = report["shipped"]["bfloat16_check"]
    assert set(measured["chain_float32"]) == set(measured["chain_bfloat16"]) == {"mtbench", "humaneval", "sharegpt"}
    drafter = create_drafter("eagle3", target, shipped)  # bfloat16 on disk, the target's dtype in use
    assert {p.dtype for p in drafter.head.parameters()} == {target.dtype}
    # A change past the tolerance writes nothing.
    moved = {"mtbench": [0.40, 0.1, 0.0], "humaneval": [0.4, 0.1, 0.0], "sharegpt": [0.4, 0.1, 0.0]}
    monkeypatch.setattr(
        ship,
        "chain_accuracy",
        lambda target, kind, directory, evaluation: (
            {**moved, "mtbench": [0.39, 0.1, 0.0]} if directory.name == "candidate" else moved
        ),
    )
    other = [str(source), "eagle3-other", *common[2:], "--dtype", "bfloat16", *check]
    assert ship.main(other) == 2
    assert not (tmp_path / "trained" / "eagle3-other").exists()
    assert ship.main([*other, "--tolerance", "0.02"]) == 0
    assert (tmp_path / "trained" / "eagle3-other" / "model.safetensors").is_file()


def test_a_bad_request_is_one_line_and_exit_2_before_anything_loads(tmp_path, tiny_checkpoint):
    target = load_target(str(tiny_checkpoint))
    head = _trained(target, tmp_path / "head")
    bare = tmp_path / "bare"
    random_eagle3_dir(target, bare)  # no training report
    dflash = random_dflash_dir(target, tmp_path / "dflash")
    write_report(dflash, {"drafter": "dflash", "heldout": {"mean_accepted_length": 1.2}})
    cases = {
        (str(head), "smollm2-eagle3"): "the name must be 'eagle3-' and a lower-case suffix",
        (str(bare), "eagle3-tiny"): "has no training_report.json with a held-out evaluation",
        (str(dflash), "eagle3-tiny"): "the name must be 'dflash-' and a lower-case suffix",
        (str(tmp_path / "missing"), "eagle3-tiny"): "is not a directory",
    }
    for arguments, message in cases.items():
        done = subprocess.run(
            [sys.executable, str(SCRIPT), *arguments, "--model", "/nonexistent", "--into", str(tmp_path / "out")],
            capture_output=True,
            text=True,
            timeout=120,
        )
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and message in lines[0], (arguments, done.stderr)
    assert not (tmp_path / "out").exists()


def test_dflash_and_medusa_heads_ship_in_bfloat16_with_their_own_chain_check(tmp_path, tiny_checkpoint, fake_sharegpt):
    target = load_target(str(tiny_checkpoint))
    ship = _script()
    check = ["--eval-prompts", "1", "--max-new-tokens", "8", "--work", str(tmp_path / "work"), "--tolerance", "1"]
    for kind, make in (("dflash", random_dflash_dir), ("medusa", random_medusa_dir)):
        source = make(target, tmp_path / kind)
        write_report(source, {"drafter": kind, "heldout": {"mean_accepted_length": 1.2}})
        into = ["--model", str(tiny_checkpoint), "--into", str(tmp_path / "trained"), "--dtype", "bfloat16"]
        assert ship.main([str(source), f"{kind}-tiny", *into, *check]) == 0
        shipped = tmp_path / "trained" / f"{kind}-tiny"
        measured = json.loads((shipped / "training_report.json").read_text())["shipped"]["bfloat16_check"]
        head = create_drafter(kind, target, source).head
        # DFlash at block depths 1/2/4 as far as its block drafts, Medusa heads 1..3
        depths = sum(d < head.config.block_size for d in (1, 2, 4)) if kind == "dflash" else min(3, head.num_heads)
        assert all(len(figures) == depths for figures in measured["chain_float32"].values())
        assert {t.dtype for t in load_file(str(shipped / "model.safetensors")).values() if t.is_floating_point()} == {
            torch.bfloat16
        }
        create_drafter(kind, target, shipped)  # loads: the fingerprint and every key kept
