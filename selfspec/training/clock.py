"""A wall clock for long runs that leaves out the time the process was stopped.

A run of many hours gets paused: `kill -STOP` while something else is timed on the same CPU, Ctrl-Z, a suspended
VM. `time.perf_counter` keeps counting through a stop, so a pause inside a training step used to land in the run's
seconds, its tokens/s and the compute a scaling point reports. `running_time()` is `perf_counter` minus the stops:
a daemon thread ticks every `tick` seconds; a gap between ticks longer than `stall` during which the process got
(almost) no CPU time is a stop, and is left out. A long stretch in which the main thread holds the GIL (the ticker
cannot run, but the process is busy) is not a stop: the process's CPU time advanced over it.
"""

from __future__ import annotations

import threading
import time


class RunningClock:
    """`perf_counter` without the stretches the process was stopped (see the module docstring)."""

    def __init__(self, tick: float = 0.25, stall: float = 5.0):
        self.tick, self.stall = tick, stall
        self._lock = threading.Lock()
        self._stopped = 0.0
        self._last_wall = time.perf_counter()
        self._last_cpu = time.process_time()
        self._ticker: threading.Thread | None = None

    def stopped_seconds(self) -> float:
        """Seconds left out so far (stops the ticker has already seen)."""
        with self._lock:
            return self._stopped

    def __call__(self) -> float:
        self._start()
        with self._lock:
            now = time.perf_counter()
            # A stop that just ended and that the ticker has not booked yet counts already.
            return now - self._stopped - self._stop_since_last_tick(now, time.process_time())

    def _stop_since_last_tick(self, wall: float, cpu: float) -> float:
        gap = wall - self._last_wall
        if gap <= self.stall or cpu - self._last_cpu > gap / 4:
            return 0.0
        return gap - self.tick

    def _start(self) -> None:
        if self._ticker is None:
            with self._lock:
                if self._ticker is None:
                    self._last_wall, self._last_cpu = time.perf_counter(), time.process_time()
                    self._ticker = threading.Thread(target=self._watch, name="selfspec-running-clock", daemon=True)
                    self._ticker.start()

    def _watch(self) -> None:
        while True:
            time.sleep(self.tick)
            with self._lock:
                wall, cpu = time.perf_counter(), time.process_time()
                self._stopped += self._stop_since_last_tick(wall, cpu)
                self._last_wall, self._last_cpu = wall, cpu


_CLOCK = RunningClock()


def running_time() -> float:
    """Seconds on a clock that does not advance while the process is stopped; only differences mean anything."""
    return _CLOCK()
