"""What every call of the device program runs: take in the call's pieces, then the stages that are due, in order.

The stages, in priority order (each runs once; its result is kept in the stash, so a call that is rerun, or the
next call on the same warm machine, goes on where the last one stopped):
  environment        versions, the GPU, what the bundle brought
  cuda_sampling      a chi-square run of seeded sampling through the real loop, a tiny model on the GPU
  real_model_checks  greedy equality with HF `generate` for every drafter, the default model, float32 and bfloat16
  regenerate         the target's greedy replies to the training split's prompts, until its time is up
  train              one label pass feeding EAGLE-3, DFlash and Medusa (`selfspec train heads`), within its budget
  evaluate           chain@1/2/3 of the new heads on MT-bench, HumanEval and held-out ShareGPT
  table              HF `generate` and every drafter on 8 prompts of each set, float32 then bfloat16
A stage runs only when what it needs has arrived and its minimum time is left before the call's own deadline; it
gets the smaller of its planned budget and what is left. After every stage the call's output folder is rewritten:
status.json, log.txt, results.tar.xz, and the new heads as heads-<name>.tar.xz (bfloat16), at most 8 files.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tarfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from ..heads.artifacts import WEIGHTS
from .bundle import BUNDLE, STASH, receive

HEADS = ("eagle3", "dflash", "medusa")
MODEL_ITEMS = ("gguf.tar.xz", "model.tar")
DATA_ITEMS = MODEL_ITEMS + ("sharegpt.tar.xz",)


@dataclass(frozen=True)
class Stage:
    name: str
    needs: tuple[str, ...]  # items that must have arrived
    minimum_s: float  # not started with less time left than this
    budget_s: float  # at most this long (the stage enforces it)
    tiny_budget_s: float = 120.0


# Planned so the six calls fit the 15 device minutes with the machine's start (~1.5) and four transfers (~1): the
# stages' budgets sum to 12.5 minutes. The train stage's minimum is most of its budget, so it waits for a call of its
# own rather than starting short at the end of the last transfer.
STAGES = (
    Stage("environment", (), 5, 20),
    Stage("cuda_sampling", (), 20, 30),
    # (its rehearsal: float32 and bfloat16 on a CPU beside the suite's other worker ran past 300 s once on a 2-core
    # Zen 4, the whole rehearsal taking 3.5 minutes alone)
    Stage("real_model_checks", MODEL_ITEMS, 40, 75, 600),
    Stage("regenerate", DATA_ITEMS, 45, 90),
    Stage("train", DATA_ITEMS + ("regenerate",), 300, 330, 600),
    Stage("evaluate", ("train",), 30, 60, 300),
    Stage("table", ("train",), 60, 145, 600),
)


@dataclass
class Call:
    """One call's context: where things are, its deadline, and what the stages have done so far."""

    repo: Path
    name: str
    out: Path
    deadline: float  # time.monotonic() by which the call writes its last output
    tiny: bool  # the rehearsal's scale (a CPU, minutes)
    log: list[str] = field(default_factory=list)

    @property
    def stash(self) -> Path:
        return self.repo / STASH

    @property
    def results(self) -> Path:
        return self.stash / "results"

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, line: str) -> None:
        stamped = f"[{time.strftime('%H:%M:%S')}] {self.name}: {line}"
        self.log.append(stamped)
        print(stamped, flush=True)

    def state(self) -> dict:
        path = self.stash / "state.json"
        return json.loads(path.read_text()) if path.is_file() else {"done": {}, "calls": []}

    def record(self, state: dict) -> None:
        (self.stash / "state.json").write_text(json.dumps(state, indent=1) + "\n")


def run_call(call: Call) -> int:
    """Take in the call's folder, run the due stages, write the outputs. 0 when nothing failed."""
    call.stash.mkdir(parents=True, exist_ok=True)
    call.results.mkdir(exist_ok=True)
    state = call.state()
    began = time.monotonic()
    failed = False
    folder = call.repo / BUNDLE / call.name
    arrived = receive(folder, call.stash) if folder.is_dir() else []
    call.say(f"items whole in the stash: {', '.join(arrived) or 'none yet'}")
    for stage in STAGES:
        if stage.name in state["done"]:
            continue
        missing = [need for need in stage.needs if need not in arrived and need not in state["done"]]
        if missing:
            call.say(f"{stage.name}: waits for {', '.join(missing)}")
            continue
        if call.left() < stage.minimum_s:
            call.say(f"{stage.name}: {call.left():.0f} s left, it needs {stage.minimum_s:.0f}: left to the next call")
            break
        budget = min(stage.tiny_budget_s if call.tiny else stage.budget_s, call.left() - 10)
        call.say(f"{stage.name}: starts, budget {budget:.0f} s")
        started = time.monotonic()
        try:
            result = STAGE_FUNCTIONS[stage.name](call, budget)
        except Exception as error:  # one stage's failure is recorded and the rest still run and report
            failed = True
            call.say(f"{stage.name}: failed: {type(error).__name__}: {error}")
            (call.results / f"{stage.name}-error.txt").write_text(traceback.format_exc())
            deliver(call, state)
            if stage.name in ("environment", "train"):
                break  # nothing after them can run
            continue
        state["done"][stage.name] = {"seconds": round(time.monotonic() - started, 1), **(result or {})}
        (call.results / f"{stage.name}.json").write_text(json.dumps(result or {}, indent=1) + "\n")
        call.record(state)
        call.say(f"{stage.name}: done in {state['done'][stage.name]['seconds']} s")
        deliver(call, state)
    state["calls"].append({"name": call.name, "seconds": round(time.monotonic() - began, 1), "failed": failed})
    call.record(state)
    deliver(call, state)
    return 1 if failed else 0


def deliver(call: Call, state: dict) -> None:
    """Rewrite the call's output folder: status.json, log.txt, results.tar.xz, and each trained head (bfloat16)."""
    call.out.mkdir(parents=True, exist_ok=True)
    (call.out / "status.json").write_text(json.dumps(state, indent=1) + "\n")
    (call.out / "log.txt").write_text("\n".join(call.log) + "\n")
    with tarfile.open(call.out / "results.tar.xz.tmp", "w:xz") as archive:
        archive.add(call.results, arcname="results")
    (call.out / "results.tar.xz.tmp").rename(call.out / "results.tar.xz")
    for name in HEADS:
        source = call.stash / "heads" / name
        target = call.out / f"heads-{name}.tar.xz"
        if (source / WEIGHTS).is_file() and not target.is_file():
            stored = call.stash / "bfloat16" / name
            bfloat16_copy(source, stored)
            with tarfile.open(f"{target}.tmp", "w:xz") as archive:
                archive.add(stored, arcname=name)
            Path(f"{target}.tmp").rename(target)


def bfloat16_copy(source: Path, destination: Path) -> None:
    """A heads directory with its floating weights stored in bfloat16 (a 1-layer EAGLE-3 head is ~20 MB in float32,
    over the 16 MiB a file may come back in); every other file as it is. The evaluate stage measures what the
    rounding does to the chain figures."""
    import torch
    from safetensors.torch import save_file

    from ..heads.artifacts import read_weights

    shutil.rmtree(destination, ignore_errors=True)
    shutil.copytree(source, destination, ignore=shutil.ignore_patterns(WEIGHTS))
    state, metadata = read_weights(source / WEIGHTS)
    state = {key: t.to(torch.bfloat16) if t.is_floating_point() else t for key, t in state.items()}
    save_file(state, str(destination / WEIGHTS), metadata=metadata)


def python_env(call: Call) -> dict:
    """The environment of the program's subprocesses: the repo and the stash's site folder first on the path, the
    selfspec cache in the stash (it outlives a call while the machine stays warm)."""
    import os

    site = str(call.stash / "site")
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(call.repo), site, os.environ.get("PYTHONPATH", "")]),
        "SELFSPEC_CACHE": str(call.stash / "cache"),
        "PYTHONUNBUFFERED": "1",
    }


def run_stage_process(call: Call, budget: float, arguments: list[str]) -> dict:
    """A stage's work in a subprocess (`python -m selfspec.device.stages ...`): killed at its budget, its output
    kept in the log."""
    command = [sys.executable, "-m", "selfspec.device.stages", *arguments, "--results", str(call.results)]
    if call.tiny:
        command.append("--tiny")
    try:
        done = subprocess.run(
            command, cwd=call.repo, env=python_env(call), capture_output=True, text=True, timeout=budget
        )
    except subprocess.TimeoutExpired as expired:
        _keep_output(call, arguments[0], expired.stdout, expired.stderr)
        raise TimeoutError(f"{arguments[0]} ran past its {budget:.0f} s") from None
    _keep_output(call, arguments[0], done.stdout, done.stderr)
    if done.returncode != 0:
        tail = (done.stderr or "").strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"{arguments[0]} exited {done.returncode}: {tail[0]}")
    result_file = call.results / f"{arguments[0]}.json"
    return json.loads(result_file.read_text()) if result_file.is_file() else {}


def _keep_output(call: Call, stage: str, stdout, stderr) -> None:
    def text(value) -> str:
        return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")

    lines = (text(stdout) + text(stderr)).replace("\r", "\n").splitlines()
    progress = re.compile(r"\d+%\|")  # a progress bar's redraws: only its last state (100%) is worth keeping
    kept = [line for line in lines if line.strip() and (not progress.search(line) or "100%|" in line)][-80:]
    (call.results / f"{stage}-output.txt").write_text("\n".join(kept) + "\n")


def _staged(name: str):
    def stage(call: Call, budget: float) -> dict:
        return run_stage_process(call, budget, [name, "--stash", str(call.stash), "--budget", f"{budget:.0f}"])

    return stage


STAGE_FUNCTIONS = {stage.name: _staged(stage.name) for stage in STAGES}


def install_heads(stash: Path, shipped_dir: Path) -> list[str]:
    """The new heads where the drafters look for the default model's heads (on the device's copy of the tree), so
    `eagle3`, `dflash`, `medusa` and `auto` decode with them."""
    installed = []
    for name in HEADS:
        source = stash / "heads" / name
        if source.is_dir():
            destination = shipped_dir / f"{name}-smollm2"
            shutil.rmtree(destination, ignore_errors=True)
            shutil.copytree(source, destination)
            installed.append(name)
    return installed
