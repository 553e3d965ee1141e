"""Building the compiled graphs off the request's path: a detached, low-priority `selfspec compile` process.

Compiling a model's graphs takes minutes on a small CPU (docs/execution.md), and a user waiting for a first answer
must not wait for it. So under `auto` a process whose graphs are not stored decodes on the fast path and starts
`selfspec compile --background` in a session of its own (it outlives a one-shot `generate`), at the lowest priority
(it takes the CPU only when decoding leaves it), writing its output to `compile.log` in the package directory. A
long-lived process (chat, the demo, bench, one `SelfSpec`) takes the compiled path between two requests once the
packages are stored (ExecutionPath.switch_if_ready); any later process loads them at once.

Beside the packages: `compile.lock`, held (flock) by whichever process compiles, so two never build one package, and
`compile.pid`, the build a request started (alive, it counts as building before its model has loaded and it takes the
lock), so a second process does not start another build; `compile-failed.txt`, the reason a build failed, so later
processes stay on the fast path instead of failing again every time (`selfspec compile` tries again and clears it).

A package format that changed leaves the older packages of the same model and machine behind (their key differs in
`--formatN` alone): no process of this version reads them again, and each holds the float32 path's packed weights (658
MB on SmolLM2-135M). `selfspec compile` removes them once the current packages are stored (`remove_superseded`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

from ..errors import first_line
from ..files import atomic_write_text

LOCK_FILE, LOG_FILE, FAILED_FILE = "compile.lock", "compile.log", "compile-failed.txt"
PID_FILE = "compile.pid"  # the build a request started: it holds no lock until its model has loaded
STAGES = ("export", "compile")  # a graph's stages as compiled.compile_step reports them

try:
    import fcntl
except ImportError:  # no flock (Windows): no lock; the compiled path needs a Unix C++ toolchain there anyway
    fcntl = None


@contextlib.contextmanager
def compile_lock(directory: Path, wait: bool) -> Iterator[bool]:
    """Hold the package directory's compile lock inside the block; yields whether it was taken (`wait`: block until
    it is). The kernel drops it when its holder dies, so a killed build never leaves it taken."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / LOCK_FILE, "a+") as handle:
        if fcntl is not None:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
        try:
            yield True
        finally:
            if fcntl is not None:
                fcntl.flock(handle, fcntl.LOCK_UN)


def compiling_elsewhere(directory: Path) -> bool:
    """Whether another process builds `directory` now: it holds the compile lock, or a request started it and it is
    still alive (it takes the lock only once its model has loaded: seconds to minutes on a busy machine)."""
    if (directory / LOCK_FILE).is_file():
        with compile_lock(directory, wait=False) as taken:
            if not taken:
                return True
    try:
        os.kill(int((directory / PID_FILE).read_text()), 0)
    except (OSError, ValueError):  # no such file or process (it ended), or no right to signal it: not ours
        return False
    return True


def superseded(directory: Path, current_format: int) -> list[Path]:
    """The package directories beside `directory` (whose key holds `--format{current_format}--`) that differ from it
    only by an older package format."""
    marker = f"--format{current_format}--"
    if marker not in directory.name or not directory.parent.is_dir():
        return []
    before, after = directory.name.split(marker, 1)
    key = re.compile(re.escape(before) + r"--format(\d+)--" + re.escape(after))
    return sorted(
        sibling
        for sibling in directory.parent.iterdir()
        if sibling.is_dir() and (match := key.fullmatch(sibling.name)) and int(match.group(1)) < current_format
    )


def remove_superseded(directory: Path, current_format: int) -> list[tuple[Path, int]]:
    """Remove `superseded(directory, current_format)`, except one another process is building (an older selfspec)
    -> each removed directory and the bytes it held."""
    removed = []
    for old in superseded(directory, current_format):
        if compiling_elsewhere(old):
            continue
        size = sum(path.stat().st_size for path in old.rglob("*") if path.is_file())
        shutil.rmtree(old, ignore_errors=True)
        if not old.exists():
            removed.append((old, size))
    return removed


def recorded_failure(directory: Path) -> str | None:
    """The reason the last build in `directory` failed, if it did."""
    path = directory / FAILED_FILE
    return path.read_text().strip() or "unknown" if path.is_file() else None


def record_failure(directory: Path, reason: str) -> None:
    atomic_write_text(directory / FAILED_FILE, reason + "\n")


def clear_failure(directory: Path) -> None:
    (directory / FAILED_FILE).unlink(missing_ok=True)


def spawn_compile(source: str, threads: int, directory: Path, path: str = "compiled") -> subprocess.Popen:
    """Start `selfspec compile --background` for the model `source` (as `load_target` takes it) with `threads` torch
    threads (part of the packages' key), detached: a session of its own, no terminal, its output in the log. `path`:
    whose graphs (`compiled`, or `q4` for the 4-bit path's)."""
    package_root = str(Path(__file__).resolve().parents[2])  # the child imports this very selfspec
    python_path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "selfspec.cli", "compile", "--model", source]
    command += ["--device", "cpu", "--dtype", "float32", "--threads", str(threads), "--path", path, "--background"]
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / LOG_FILE, "ab") as log:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # outlives this process and its terminal's Ctrl-C
            close_fds=True,  # holds none of this process's pipes: `make run | tee` ends when the answer does
            env={**os.environ, "PYTHONPATH": python_path},
        )


def lowest_priority() -> None:
    """Make this process (a background build) yield the CPU to everything else: nice 19, and the same for its
    session's autogroup. A build runs in a session of its own, and where the kernel groups sessions (Linux's
    autogroup, on by default on desktops and some servers) nice only ranks processes inside one group: measured on a
    2-core EPYC, a build at nice 19 alone in its session took 49% of the CPU beside a decoding request's 55%."""
    os.nice(19)
    try:
        with open("/proc/self/autogroup", "w") as handle:
            handle.write("19")
    except OSError:  # no autogroup (other kernels, other systems): nice alone
        pass


class BackgroundBuild:
    """One path's background build, asked for at most once per process."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.asked = False
        self.process: subprocess.Popen | None = None

    def start(self, source: str | None, threads: int, path: str = "compiled") -> str:
        """Start the build of `path`'s graphs unless one runs elsewhere or failed before -> one line for the user
        (stderr) saying what happens, "" after the first call."""
        if self.asked:
            return ""
        self.asked = True
        eager = "the q4 path (eager)" if path == "q4" else "the fast path"  # what runs until the graphs are stored
        reason = recorded_failure(self.directory)
        if reason is not None:
            return f"selfspec: {eager} runs (compiling failed before: {reason}; `selfspec compile` tries again)"
        if compiling_elsewhere(self.directory):
            return (
                f"selfspec: {eager} runs; another process is compiling this machine's graphs "
                f"(log: {self.directory / LOG_FILE})"
            )
        if source is None:
            build = "selfspec compile --model ..." + (" --path q4" if path == "q4" else "")
            return f"selfspec: {eager} runs (graphs not compiled yet: `{build}` builds them)"
        self.process = spawn_compile(source, threads, self.directory, path)
        atomic_write_text(self.directory / PID_FILE, f"{self.process.pid}\n")
        return (
            f"selfspec: {eager} runs now; this machine's compiled graphs are being built in the background "
            f"(pid {self.process.pid}, log: {self.directory / LOG_FILE}); later requests and runs use them"
        )


def build_locked(step, wait: bool, show_progress: bool) -> list[str] | None:
    """Build the missing graphs of `step` (a CompiledStep) holding its compile lock -> the graphs built, or None where
    another process holds the lock and `wait` is False. A failure is recorded beside the packages (later requests
    run `fast` and say why) and raised."""
    with compile_lock(step.directory, wait=wait) as taken:
        if not taken:
            return None
        kinds = step.missing()  # what a build we waited for left to do
        clear_failure(step.directory)
        progress = CompileProgress(step.model, kinds, enabled=bool(kinds) and show_progress)
        try:
            step.build(on_stage=progress.stage)
        except Exception as error:
            record_failure(step.directory, first_line(error)[:300])
            raise
        finally:
            progress.close()
        return kinds


def estimated_seconds(model, kind: str, stage: str) -> float:
    """A first guess of a stage's seconds for the progress bar's ETA, from the model's size: SmolLM2-135M's `tree`
    graph took 6 s to export and 90 s to compile on a 2-core AMD EPYC (docs/execution.md)."""
    millions = sum(parameter.numel() for parameter in model.parameters()) / 1e6
    return 2 + 0.03 * millions if stage == "export" else 10 + 0.6 * millions


class CompileProgress:
    """A progress bar in seconds over the stages of a build (each graph's export, then its compile), with an ETA from
    `estimated_seconds`; a clock thread moves it within a stage, and a stage that runs over its guess pushes the end
    out instead of sitting at 100%."""

    def __init__(self, model, kinds: list[str], enabled: bool = True):
        from tqdm import tqdm

        self.plan = [((kind, stage), estimated_seconds(model, kind, stage)) for kind in kinds for stage in STAGES]
        self.bar = tqdm(
            total=round(sum(seconds for _, seconds in self.plan)),
            desc="compiling",
            unit="s",
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed} elapsed, ETA {remaining} {postfix}",
            disable=not enabled,
        )
        self.done = 0.0  # estimated seconds of the stages finished
        self.current: tuple[str, str] | None = None
        self.began = time.monotonic()
        self.stop = threading.Event()
        self.clock = threading.Thread(target=self._tick, daemon=True)
        self.clock.start()

    def stage(self, kind: str, stage: str) -> None:
        """CompiledStep.build's `on_stage`: `stage` of graph `kind` begins."""
        if self.current is not None:
            self.done += dict(self.plan)[self.current]
        self.current, self.began = (kind, stage), time.monotonic()
        self.bar.set_postfix_str(f"{kind}: {stage}")

    def _tick(self) -> None:
        while not self.stop.wait(0.5):
            if self.current is None:
                continue
            expected = dict(self.plan)[self.current]
            spent = time.monotonic() - self.began
            if spent > expected:  # over the guess: the end moves out with it
                self.bar.total = round(sum(seconds for _, seconds in self.plan) + spent - expected)
            self.bar.n = round(self.done + spent)
            self.bar.refresh()

    def close(self) -> None:
        self.stop.set()
        self.clock.join()
        self.bar.n = self.bar.total
        self.bar.close()
