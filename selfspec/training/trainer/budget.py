"""`train.time_budget_minutes`: a training run that fixes its own length to fit a time limit.

A lent GPU gives a call ten minutes, and a run that is killed at the limit saves no head and evaluates nothing. So
the trainer measures its pace over its first steps and then fixes the run's total steps at what fits the rest of the
budget (never more than max_steps); the learning-rate schedule is rebuilt for that total, so the decay still ends at
the last step. The plan is kept in the run's checkpoints (RunProgress.planned_steps): a resumed run follows it
instead of planning anew.
"""

from __future__ import annotations

PROBE_STEPS = 10  # steps of this invocation before the plan; its first step (one-time costs) is left out of the pace


class StepBudget:
    """Says, once, at which total step a run must end to fit `minutes` counted from `started` (running_time())."""

    def __init__(self, minutes: float | None, max_steps: int, started: float, first_step: int):
        self.seconds = None if minutes is None else minutes * 60
        self.max_steps, self.started, self.first_step = max_steps, started, first_step
        self.after_first: float | None = None  # the clock when this invocation's first step ended
        self.planned: int | None = None
        self.pace = 0.0  # measured seconds a step

    def plan(self, steps_done: int, now: float) -> int | None:
        """Called after each step (`steps_done` steps of the run done, the clock at `now`) -> the run's total steps
        when it is fixed at this call, else None. The pace is the mean step time after this invocation's first step,
        checkpoints and fetching included, as the remaining steps will pay them too."""
        done_here = steps_done - self.first_step
        if self.seconds is None or self.planned is not None:
            return None
        if done_here == 1:
            self.after_first = now
        if done_here < PROBE_STEPS or self.after_first is None:
            return None
        self.pace = (now - self.after_first) / (done_here - 1)
        remaining = self.seconds - (now - self.started)
        fitting = int(remaining // self.pace) if self.pace > 0 else self.max_steps
        self.planned = max(steps_done, min(self.max_steps, steps_done + fitting))
        return self.planned

    def describe(self) -> str:
        """One line for the log, once the plan is fixed."""
        return (
            f"time budget {(self.seconds or 0) / 60:g} min: {self.planned} steps in all (max_steps {self.max_steps}) "
            f"at {self.pace:.2f} s a step; the schedule now decays to step {self.planned}"
        )
