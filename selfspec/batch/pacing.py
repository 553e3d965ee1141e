"""Whether drafting pays for a batch of requests: trees priced for the batch, and the outcome measured.

Each drafter is paced on its own (heads/paced.py) and sizes its tree by the cost of the whole batch's rows
(`batch_curve`). What neither sees is the step as a whole: every row is as wide as the widest tree, so one
request's tree makes all of them pay its width, and a drafter's estimate of its acceptance can be optimistic. So the
engine measures the outcome. For each number of requests B it keeps the time of a plain step (every tree root-only)
and, over windows of steps where some drafter drafted, the tokens those steps emitted and their time. A window whose
rate (tokens a second) was not at least MARGIN times B plain tokens per plain step pauses drafting for that batch size
(root-only trees, without asking the drafters) for a number of steps that doubles with each losing window, up to
MAX_PAUSE; a window that paid asks again at once and halves the next pause. Steps where every drafter declined on its
own are plain steps too, and the next ones ask none of them (1, 2, 4 ... up to MAX_IDLE steps): asking costs a lookup
or a merge a request for nothing.

Speed only: a root-only tree is a step of plain decoding, so what each request emits does not change. A request alone
(B = 1) is left to its drafter's own pacing, as `SelfSpec` runs it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..cost import CostCurve

WINDOW = 8  # drafted steps a window weighs
FIRST_PAUSE = 16  # steps paused after a first losing window; doubled for each losing window in a row
MAX_PAUSE = 512
MAX_IDLE = 8  # the most steps asking no drafter after a step where none drafted
PLAIN_DECAY = 0.8  # weight of the older plain steps in a batch size's plain-step time
MARGIN = 1.05  # a window pays only this far above the plain rate: a draw within the noise is not a gain


@dataclass
class _Size:
    """What was measured for one number of requests."""

    plain_s: float | None = None  # running mean of a plain step's time
    window_s: float = 0.0  # the drafted steps of the current window: their time, tokens and count
    window_tokens: int = 0
    window_steps: int = 0
    pause: int = 0  # the next losing window's pause (0: FIRST_PAUSE)


class BatchPacing:
    """The engine asks `ask(rows)` before proposing a step's trees and tells `record(...)` after committing it."""

    def __init__(self) -> None:
        self.sizes: dict[int, _Size] = {}
        self.paused_left = 0  # steps still to run without asking the drafters (a pause, or after an idle step)
        self.idle = 0  # the last idle skip's length (0: the last asked step drafted)
        self.paused_steps = 0  # over the engine's life

    def ask(self, rows: int) -> bool:
        """Whether this step of `rows` requests asks the drafters for trees (else: root-only trees)."""
        if rows == 1 or self.paused_left == 0:
            return True
        self.paused_left -= 1
        self.paused_steps += 1
        return False

    def record(self, rows: int, drafted: bool, asked: bool, tokens: int, seconds: float) -> None:
        """A step of `rows` requests took `seconds` (proposals to commits) and emitted `tokens`; `drafted`: some tree
        had more than its root; `asked`: the drafters were asked."""
        if rows == 1:
            return
        size = self.sizes.setdefault(rows, _Size())
        if not drafted:
            size.plain_s = seconds if size.plain_s is None else PLAIN_DECAY * size.plain_s + (1 - PLAIN_DECAY) * seconds
            if asked:  # every drafter declined: ask none for the next steps, for longer each time in a row
                self.idle = min(MAX_IDLE, 2 * self.idle or 1)
                self.paused_left = max(self.paused_left, self.idle)
            return
        self.idle = 0
        size.window_s += seconds
        size.window_tokens += tokens
        size.window_steps += 1
        if size.window_steps < WINDOW:
            return
        if size.plain_s is None:  # nothing to weigh the window against yet: a few plain steps to measure one
            self.paused_left = max(self.paused_left, 2)
            size.window_s, size.window_tokens, size.window_steps = 0.0, 0, 0
            return
        paid = size.window_tokens / size.window_s >= MARGIN * rows / size.plain_s
        if paid:
            size.pause //= 2
        else:
            size.pause = min(MAX_PAUSE, 2 * size.pause or FIRST_PAUSE)
            self.paused_left = max(self.paused_left, size.pause)
        size.window_s, size.window_tokens, size.window_steps = 0.0, 0, 0


@functools.lru_cache(maxsize=256)
def batch_curve(curve: CostCurve, rows: int) -> CostCurve:
    """The cost of one request's tree of n nodes in a step of `rows` requests padded to it: `curve` at rows * n over
    `curve` at rows (every request's root), for the sizes `curve` has."""
    sizes = curve.sizes
    relative = tuple(round(curve.cost(rows * n) / curve.cost(rows), 4) for n in sizes)
    return CostCurve(sizes, relative, source=f"{curve.source}, priced for {rows} requests")
