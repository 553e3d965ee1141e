"""The per-machine row split of the fast path's linear layers (`RowDispatch.stock_rows`): up to how many rows the
stock kernel beats the packed one, measured once per CPU kind, thread count and set of weight shapes, and stored."""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import time
from typing import Callable, TypeVar

import torch

from ..files import atomic_write_text, cache_root, cpu_signature
from .linears import RowDispatch

T = TypeVar("T")

# A timing whose median round took this much longer than its fastest was taken under other load (here, and for the
# cost curves in cost.py); a measurement stored for good is tried this many times before giving up for the run.
BUSY_SPREAD = 1.35
QUICK_TRIES = 3


def measure_until_quiet(measure: Callable[[], T], spread_of: Callable[[T], float]) -> tuple[T, float, bool]:
    """Run `measure` up to QUICK_TRIES times until its result's spread (median round over fastest) is within
    BUSY_SPREAD -> (the last result, its spread, whether it is quiet enough to store)."""
    for _ in range(QUICK_TRIES):
        result = measure()
        spread = spread_of(result)
        if spread <= BUSY_SPREAD:
            return result, spread, True
    return result, spread, False


STOCK_ROWS_ENV = "SELFSPEC_STOCK_ROWS"  # fixes RowDispatch.stock_rows instead of measuring it (tests, or by hand)
CALIBRATION_ROWS = (1, 2, 3, 4, 6, 8)  # row counts timed; from the first where packing wins, it is used
_ALWAYS_STOCK = 1 << 30


def _time_pass(modules: list[torch.nn.Module], inputs: dict[int, torch.Tensor]) -> float:
    began = time.perf_counter()
    for module in modules:
        module(inputs[module.in_features])
    return time.perf_counter() - began


def measure_stock_rows(
    modules: list[torch.nn.Module], dispatch: RowDispatch, repeats: int = 5
) -> tuple[int, dict, float]:
    """Time one pass over every packed module (in forward order, so the weights stream from memory as in a forward)
    with the stock and the packed kernels, interleaved, at each of CALIBRATION_ROWS -> (stock_rows: one past the
    largest row count up to which stock wins at every size, {rows: [stock ms, packed ms]}: the medians, and the
    largest median over fastest round of any timing: near 1 on a quiet machine, see cost.busy_spread)."""
    kept, timings, spread = dispatch.stock_rows, {}, 1.0
    try:
        with torch.inference_mode():
            for rows in CALIBRATION_ROWS:
                inputs = {size: torch.randn(1, rows, size) * 0.1 for size in {module.in_features for module in modules}}
                samples = {_ALWAYS_STOCK: [], 0: []}
                for _ in range(repeats + 1):  # the first round warms up and is dropped
                    for mode in samples:
                        dispatch.stock_rows = mode
                        samples[mode].append(_time_pass(modules, inputs))
                timings[rows] = [round(statistics.median(samples[mode][1:]) * 1e3, 3) for mode in samples]
                spread = max([spread] + [statistics.median(kept[1:]) / min(kept[1:]) for kept in samples.values()])
    finally:
        dispatch.stock_rows = kept
    stock_rows = 1
    for rows in CALIBRATION_ROWS:
        if timings[rows][0] >= timings[rows][1]:
            break
        stock_rows = rows + 1
    return stock_rows, timings, spread


def calibrate(dispatch: RowDispatch, modules: list[torch.nn.Module], remeasure: bool = False) -> None:
    """Set `dispatch.stock_rows` for these modules on this machine: $SELFSPEC_STOCK_ROWS, else the stored result for
    this machine and these weight shapes, else measured now (a few seconds, once) and stored. `remeasure` measures
    and stores anew even where a result is stored (`selfspec profile --recalibrate`: one taken while the machine was
    busy can be wrong for good)."""
    if os.environ.get(STOCK_ROWS_ENV):
        dispatch.stock_rows, dispatch.source = max(1, int(os.environ[STOCK_ROWS_ENV])), f"${STOCK_ROWS_ENV}"
        return
    shapes = sorted(tuple(module.weight.shape) for module in modules)
    signature = hashlib.sha1(repr(shapes).encode()).hexdigest()[:12]
    path = (
        cache_root()
        / "profiles"
        / f"cpu-{cpu_signature()}-{torch.get_num_threads()}threads--linears-{signature}--{dispatch.key}-rows.json"
    )
    if path.is_file() and not remeasure:
        dispatch.stock_rows, dispatch.source = int(json.loads(path.read_text())["stock_rows"]), str(path)
        return
    measured, spread, quiet = measure_until_quiet(
        lambda: measure_stock_rows(modules, dispatch), lambda result: result[2]
    )
    dispatch.stock_rows, timings = measured[0], measured[1]
    if not quiet:  # a verdict taken under other load can be wrong for good (a 1-row step 1.75x slower): used now only
        dispatch.source = f"measured on a busy machine (timings varied {spread:.1f}x), not stored"
        print(
            f"selfspec: the machine is busy (the fast path's kernel timings varied {spread:.1f}x): its row split is "
            "used for this run only, and the next run measures again",
            file=sys.stderr,
        )
        return
    dispatch.source = f"measured, stored in {path}"
    atomic_write_text(
        path, json.dumps({"stock_rows": dispatch.stock_rows, "ms_stock_packed": timings}, indent=1) + "\n"
    )
