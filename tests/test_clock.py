"""The run clock leaves out the time a process was stopped (SIGSTOP), and only that: a long stretch in which the
main thread holds the GIL is busy time, not a stop."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

from selfspec.training.clock import RunningClock

CHILD = textwrap.dedent(
    """
    import time
    from selfspec.training.clock import RunningClock

    clock = RunningClock(tick=0.05, stall=0.5)
    wall, running = time.perf_counter(), clock()
    print("ready", flush=True)
    while clock() - running < 2.0:
        time.sleep(0.01)
    print(time.perf_counter() - wall, clock() - running, clock.stopped_seconds(), flush=True)
    """
)


def test_a_stop_is_left_out():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        child.send_signal(signal.SIGSTOP)
        time.sleep(2.5)
        child.send_signal(signal.SIGCONT)
        wall, running, stopped = map(float, child.stdout.readline().split())
        assert child.wait(timeout=30) == 0
    finally:
        child.kill()
    # The child waited for 2 s of running time: the 2.5 s stop came on top, and the clock booked it as a stop.
    assert wall >= 4.0, (wall, running)
    assert 2.0 <= running < 2.8, (wall, running)
    assert 2.0 <= stopped <= 2.9, stopped


def test_holding_the_gil_is_not_a_stop():
    clock = RunningClock(tick=0.05, stall=0.4)
    fastest = float("inf")
    for _ in range(3):  # the fastest of three: a calibration slowed by the other test worker made the call too short
        began = time.perf_counter()
        sum(range(10**6))
        fastest = min(fastest, time.perf_counter() - began)
    size = int(10**6 * 0.9 / max(fastest, 1e-4))  # a call of about 0.9 s on this machine
    wall, running = time.perf_counter(), clock()
    sum(range(size))  # one C call: the ticker cannot run until it returns
    wall, running = time.perf_counter() - wall, clock() - running
    assert wall > 0.5, "the busy call was too short to test anything: make it longer"
    assert running >= 0.95 * wall, (wall, running)
    assert clock.stopped_seconds() == 0.0


def test_the_progress_bar_eta_is_this_invocations_pace_on_the_run_clock():
    from selfspec.training.trainer.checkpoints import RunProgress
    from selfspec.training.trainer.loop import _postfix

    # Resumed at step 10 (after 900 s) and now at step 30: 20 steps in 200 s of running time, 70 steps to go.
    progress = RunProgress(step=30, tokens=110_000, seconds=1_100.0, window_loss=[2.0, 3.0], metrics={"top1": 0.25})
    shown = _postfix(progress, "top1", 100, since=(20, 200.0))
    assert shown == {"loss": "2.500", "first_draft_acc": "0.250", "tok/s": "100", "eta": "11:40"}
    assert "eta" not in _postfix(progress, "top1", 100, since=(0, 0.0))  # no step of this invocation yet


def test_the_reports_stage_seconds_are_on_the_run_clock(monkeypatch):
    """`training_report.json`'s timings (data_s, labels_s, train_s, heldout_eval_s, total_s) read the run clock:
    a stage the process was stopped in for an hour reports its running seconds, not the hour."""
    from types import SimpleNamespace

    from selfspec.training.trainer import pipeline

    ticks = iter(range(0, 10_000, 7))  # each reading of the run clock is 7 s after the last
    monkeypatch.setattr(pipeline, "running_time", lambda: next(ticks))
    monkeypatch.setattr(pipeline, "train", lambda *args, **kwargs: "summary")
    monkeypatch.setattr(pipeline, "checkpoint_dir", lambda config: None)
    timings: dict = {}
    data = SimpleNamespace(train=SimpleNamespace(count=1, get=None, get_batch=None))
    assert pipeline.train_head(None, data, SimpleNamespace(train=None), False, None, timings) == "summary"
    assert timings == {"train_s": 7}
    monkeypatch.setattr(pipeline, "running_time", lambda: next(ticks))
    monkeypatch.setattr(pipeline, "resolve_recipe", lambda drafter: lambda *args: {})
    for stub in ("load_target", "evaluate_heldout", "write_report", "to_dict"):
        monkeypatch.setattr(pipeline, stub, lambda *args, **kwargs: {})
    config = SimpleNamespace(train=SimpleNamespace(seed=0), model="m", out="o", drafter="d")
    report = pipeline.run_recipe(config)
    assert report["timings"] == {"heldout_eval_s": 7, "total_s": 21}
