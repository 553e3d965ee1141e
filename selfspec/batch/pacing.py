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

What a drafter sizes its tree by is priced for the batch (`batch_curve`, `BatchPrices`). A step of B requests pads
every row to the widest tree's width w, so one request's tree of n nodes makes the whole step take r times a plain step
of B, and a plain step would have emitted B tokens in that time: the tree pays only if its extra tokens are at least
B * (r - 1), so its request is charged 1 + B * (r - 1) plain tokens for it (CostCurve.shared_by = B). Priced as r
alone, as before, a tree at 4 requests passed with a quarter of the tokens it needed: on the 2-core Zen 4, trees of 2
and 4 nodes at 4 requests earned 0.34 and 0.92 tokens where their steps took 1.5-1.7x a plain step of four (widths 2
and 4 together), and drafting there lost 5-8% against `none`. r is first estimated from the path's curve (B * w
tokens over B), then, once a few steps of that width ran, measured: the median of their latest times over that of B's
plain steps. Requests whose prompts are being prefilled beside the step wait for it too (their next chunk comes after
it), so they count among the B a tree is charged for: a request decoding alone while three prompts were prefilled had
drafted as if alone, and held their first tokens back (the `auto` server's time to first token at 4 requests was
25-30% over `none`'s).

Speed only: a root-only tree is a step of plain decoding, so what each request emits does not change. A request alone
(B = 1) is left to its drafter's own pacing, as `SelfSpec` runs it.
"""

from __future__ import annotations

import functools
import statistics
from collections import deque
from dataclasses import dataclass

from ..cost import CostCurve

# Drafted steps a window weighs. Eight steps' rate is noisy: with the slots always full on the Zen 5, 50 windows of
# `auto` came to 0.83-1.56 times the plain rate (1.16 on average), 11 fell below the margin (1.05) and paused
# drafting for 16-32 steps each (44% of the steps of four paused). 24 against 8 (engine alone, auto, interleaved, 8
# rounds each): 1.171x against 1.123x `none` at two requests (every round as high or higher), 1.013x against 0.983x
# at four (5 rounds of 8 higher), 1.092x against 1.019x with the slots always full (7 of 8).
WINDOW = 24
FIRST_PAUSE = 16  # steps paused after a first losing window; doubled for each losing window in a row
MAX_PAUSE = 512
MAX_IDLE = 8  # the most steps asking no drafter after a step where none drafted
PLAIN_DECAY = 0.8  # weight of the older plain steps in a batch size's plain-step time
# A window pays when its rate reaches this times the plain rate. It was 1.05 (a draw within the noise is not a gain)
# while windows were 8 steps; over 24 the noise is smaller, and the margin could trap a batch size in long pauses: at
# two requests kept busy (engine alone, 8 rounds) a 1.05 engine ran 2,764 of its steps paused against 880 for 1.0
# (1.035x against 1.127x `none`, lower in 7 rounds of 8); a repeat gave 1.148x against 1.154x (919 and 777 paused),
# four requests 1.043x against 1.033x, eight queued for four slots 0.989x against 0.992x.
MARGIN = 1.0
PRICE_SAMPLES = 8  # the latest step times a batch price is the median of
PRICE_MIN_SAMPLES = 3  # steps of a (rows, width) measured before their median replaces the curve's estimate
PRICE_REFRESH = 16  # steps of B rows between two workings-out of B's prices


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


def padded_width(nodes: int) -> int:
    """The width a step's rows are padded to for a widest tree of `nodes`: 1, 2, 4, 8, then multiples of 8."""
    return 1 << (nodes - 1).bit_length() if nodes <= 8 else -(-nodes // 8) * 8


def _tree_sizes(curve: CostCurve) -> tuple[int, ...]:
    """The tree sizes a batch price is given at: every size up to 8, then multiples of 8, as far as `curve` goes."""
    return tuple(range(1, 9)) + tuple(range(16, max(curve.sizes[-1], 8) + 1, 8))


@functools.lru_cache(maxsize=256)
def batch_curve(curve: CostCurve, rows: int, waiting: int = 0) -> CostCurve:
    """The estimated price of one request's tree of n nodes in a step of `rows` decoding requests while `waiting` more
    are being prefilled (module docstring): with r `curve` at rows * padded_width(n) over `curve` at rows (every
    request's root), 1 + (rows + waiting) * (r - 1). A request alone with none waiting: `curve` as it is."""
    if rows == 1 and waiting == 0:
        return CostCurve(curve.sizes, curve.relative_cost, source=f"{curve.source}, priced for 1 requests")
    sizes = _tree_sizes(curve)
    ratios = _estimated_ratios(curve, rows, sizes)
    return _priced(sizes, ratios, rows + waiting, f"{curve.source}, priced for {rows} requests" + _waiting(waiting))


def _estimated_ratios(curve: CostCurve, rows: int, sizes: tuple[int, ...]) -> list[float]:
    """Each tree size's step time ratio r as `curve` estimates it: its cost at rows * padded_width(n) over its cost at
    rows (every request's root)."""
    return [curve.cost(rows * padded_width(n)) / curve.cost(rows) for n in sizes]


def _waiting(waiting: int) -> str:
    return f" and {waiting} prefilling" if waiting else ""


def _priced(sizes: tuple[int, ...], ratios: list[float], rows: int, source: str) -> CostCurve:
    """A request's prices from the step time ratios r of its tree sizes, made non-decreasing: 1 + rows * (r - 1)."""
    prices: list[float] = []
    for ratio in ratios:
        prices.append(max(round(1.0 + rows * (ratio - 1.0), 4), prices[-1] if prices else 1.0))
    return CostCurve(sizes, tuple(prices), source=source, shared_by=rows)


class BatchPrices:
    """What a tree costs in a step of B requests, measured where it can be. `record` hears the time of each step's
    verification (the forward, the rows' verification and commits: not the drafters'), by B and padded width;
    `curve(own, B)` prices trees as batch_curve does, each width that ran at least PRICE_MIN_SAMPLES times at the
    median of its latest PRICE_SAMPLES steps over that of B's plain steps instead of the curve's estimate. Each
    (curve, B, waiting) is worked out again once PRICE_REFRESH steps of B rows ran since it last was, a new CostCurve
    only where a price moved."""

    def __init__(self) -> None:
        self.samples: dict[tuple[int, int], deque[float]] = {}
        self._steps: dict[int, int] = {}  # B -> steps of B rows recorded
        self._curves: dict[tuple[CostCurve, int, int], CostCurve] = {}  # (own curve, rows, waiting) -> prices
        self._worked: dict[tuple[CostCurve, int, int], int] = {}  # the same key -> _steps[B] when last worked out

    def record(self, rows: int, width: int, seconds: float) -> None:
        self.samples.setdefault((rows, width), deque(maxlen=PRICE_SAMPLES)).append(seconds)
        self._steps[rows] = self._steps.get(rows, 0) + 1

    def measured(self, rows: int, width: int) -> float | None:
        """The median time of the latest steps of `rows` rows as wide as `width`, once there are enough of them."""
        times = self.samples.get((rows, width))
        return statistics.median(times) if times is not None and len(times) >= PRICE_MIN_SAMPLES else None

    def curve(self, own: CostCurve, rows: int, waiting: int = 0) -> CostCurve:
        estimate = batch_curve(own, rows, waiting)
        if rows == 1 and waiting == 0:
            return estimate
        key, steps_now = (own, rows, waiting), self._steps.get(rows, 0)
        if key in self._curves and steps_now - self._worked[key] < PRICE_REFRESH:
            return self._curves[key]
        self._worked[key] = steps_now
        plain = self.measured(rows, 1)
        steps = [self.measured(rows, padded_width(n)) if plain is not None else None for n in estimate.sizes]
        if all(step is None for step in steps[1:]):
            self._curves[key] = estimate
            return estimate
        own_ratios = _estimated_ratios(own, rows, estimate.sizes)
        ratios = [guess if step is None else step / plain for step, guess in zip(steps, own_ratios, strict=True)]
        ratios[0] = 1.0
        priced = _priced(estimate.sizes, ratios, rows + waiting, f"{estimate.source}, measured")
        if self._curves.get(key) != priced:
            self._curves[key] = priced
        return self._curves[key]
