"""The compiled path off the request's path (selfspec.execution.background): under `auto`, graphs not stored yet leave
the fast path running and one detached, low-priority build started (once, and not where another process builds or a
build failed before); only the graphs this machine's row split uses are built. No graph is compiled here: the
process is faked (test_compiled switches to real graphs between requests)."""

from __future__ import annotations

import os
import types
from dataclasses import replace

import pytest

from selfspec import SelfSpec, SelfspecError
from selfspec.cli import main
from selfspec.execution import COMPILE_ENV, CompiledStep, CpuCapabilities, ExecutionPath, RowDispatch
from selfspec.execution import background as background_module
from selfspec.execution import native as native_module

from .helpers import make_tiny_target

COMPILES = CpuCapabilities(avx2=True, onednn_linear=True, aot_inductor=True, cxx_compiler=True)


@pytest.fixture
def pending(tmp_path, monkeypatch):
    """A tiny model's `auto` path on a machine that can compile, with an empty cache, and Popen recorded."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    monkeypatch.delenv(COMPILE_ENV)  # the suite keeps `auto` from compiling
    monkeypatch.setattr("selfspec.execution.selection.AUTO_MIN_WEIGHTS", 0)
    started = []

    def popen(command, **kwargs):
        started.append((command, kwargs))
        return types.SimpleNamespace(pid=os.getpid())  # a live process, as the build is while it runs

    monkeypatch.setattr(background_module.subprocess, "Popen", popen)
    model = make_tiny_target("llama").model
    path = ExecutionPath(model, "auto", "tiny", capabilities=COMPILES, source="/models/tiny")
    return path, started


def test_a_pending_path_runs_fast_and_starts_one_detached_build(pending, capsys):
    path, started = pending
    assert path.name == "compiled" and not started  # before it is settled, and nothing starts on construction
    assert path.between_requests() is False
    assert path.name == "fast" and path.pending is not None and path.compiled is None
    command, options = started[0]
    assert command[1:5] == ["-m", "selfspec.cli", "compile", "--model"] and "/models/tiny" in command
    assert "--background" in command and command[command.index("--threads") + 1].isdigit()
    assert options["start_new_session"] and options["close_fds"]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"built in the background (pid {os.getpid()}" in err[0]
    path.between_requests()
    assert len(started) == 1 and capsys.readouterr().err == ""  # once per process, said once
    # Another process, before the build has taken its lock: the build it started is alive, so no second one.
    ExecutionPath(path.model, "auto", "tiny", capabilities=COMPILES, source="/models/tiny").between_requests()
    assert len(started) == 1 and "another process is compiling" in capsys.readouterr().err


def test_no_second_build_where_one_runs_or_one_failed(pending, capsys):
    path, started = pending
    path.prepare()
    with background_module.compile_lock(path.pending.directory, wait=False) as taken:
        assert taken  # another open file holds it, as another process would
        path.between_requests()
    assert not started and "another process is compiling" in capsys.readouterr().err
    again = ExecutionPath(path.model, "auto", "tiny", capabilities=COMPILES, source="/models/tiny")
    background_module.record_failure(path.pending.directory, "g++: internal compiler error")
    again.between_requests()
    assert not started and "compiling failed before: g++: internal compiler error" in capsys.readouterr().err


def test_the_compile_setting(monkeypatch):
    model = make_tiny_target("llama").model
    monkeypatch.setattr("selfspec.execution.selection.AUTO_MIN_WEIGHTS", 0)
    monkeypatch.setenv(COMPILE_ENV, "0")
    assert ExecutionPath(model, "auto", capabilities=COMPILES).name == "fast"
    monkeypatch.setenv(COMPILE_ENV, "wait")
    assert ExecutionPath(model, "auto", capabilities=COMPILES).compile_mode == "wait"
    assert ExecutionPath(model, "compiled", capabilities=COMPILES).compile_mode == "wait"  # named: waited for
    monkeypatch.setenv(COMPILE_ENV, "later")
    with pytest.raises(SelfspecError, match="SELFSPEC_COMPILE must be one of"):
        ExecutionPath(model, "auto", capabilities=COMPILES)


@pytest.mark.parametrize(
    "kernel, stock_rows, graphs",
    [
        (True, None, ("few", "tree")),
        (True, 1, ("tree",)),
        (True, 2, ("few", "tree")),
        (True, 3, ("few", "tree")),
        (False, None, ("tree",)),
        (False, 3, ("tree",)),
    ],
)
def test_only_the_graphs_the_row_split_uses_are_built(kernel, stock_rows, graphs, tmp_path, monkeypatch):
    """`few` takes a 1-3 token step only where selfspec's small-row kernel is loaded and wins at one row; elsewhere it
    is never built."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(native_module, "loaded", lambda: kernel)
    dispatch = None if stock_rows is None else RowDispatch(stock_rows)
    step = CompiledStep(make_tiny_target("llama").model, "tiny", dispatch=dispatch)
    assert step.graphs_needed() == graphs
    assert {step.graph_for(n)[0] for n in (1, 2, 3, 4)} == set(graphs)
    step.directory.mkdir(parents=True)
    (step.directory / "tree.pt2").write_bytes(b"")
    assert step.missing() == [kind for kind in graphs if kind != "tree"]


def test_a_bad_request_starts_no_build(tmp_path, monkeypatch, tiny_checkpoint):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    monkeypatch.delenv(COMPILE_ENV)
    monkeypatch.setattr("selfspec.execution.selection.AUTO_MIN_WEIGHTS", 0)
    monkeypatch.setattr(background_module, "spawn_compile", lambda *args: pytest.fail("a build started"))
    monkeypatch.setattr("selfspec.execution.path.detect_capabilities", lambda: replace(COMPILES))
    spec = SelfSpec(tiny_checkpoint, drafter="ngram")
    with pytest.raises(SelfspecError, match="no room"):
        spec.generate(prompt=" ".join(["cat"] * 300))
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("extra", [["--dtype", "bfloat16"], ["--device", "cuda"], ["--model", "/no/such/model"]])
def test_the_compile_command_refuses_what_it_cannot_build_in_one_line(extra, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    assert main(["compile", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("selfspec: error:") and err.count("\n") == 1 and not any(tmp_path.iterdir())


@pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"), reason="no autogroup on this kernel")
def test_a_background_build_yields_even_in_a_session_of_its_own():
    """Where sessions are scheduled as groups, nice alone ranks a build only inside its own session's group."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a session of its own, as a spawned build has
        try:
            os.setsid()
            background_module.lowest_priority()
            with open("/proc/self/autogroup") as handle:
                os.write(write, f"{os.getpriority(os.PRIO_PROCESS, 0)} {handle.read().split()[-1]}".encode())
        finally:
            os._exit(0)
    os.close(write)
    reported = os.read(read, 100).decode().split()
    os.waitpid(pid, 0)
    assert reported == ["19", "19"]
