"""The verification cost curve: forward time for n new tokens relative to n = 1, on this machine.

Drafters read it to size their trees: on a CPU a 16-node tree costs ~2.2 plain steps, on a GPU 64 nodes cost about
one. `selfspec profile` measures and stores a curve per device; until then a built-in estimate is used.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from .execution import ExecutionPath
from .execution.calibration import measure_until_quiet
from .files import atomic_write_text, cpu_signature
from .models import Target, cache_root

# Built-in estimates, used until `selfspec profile` has measured this machine.
_BUILTIN = {
    "cpu": {1: 1.0, 2: 1.1, 4: 1.8, 8: 2.0, 16: 2.2, 32: 2.8, 64: 4.2},  # SmolLM2-135M fp32, 2-core CPU
    # The same model on the fast path (selfspec.execution, q/k/v as one GEMM), 2-core AVX2 EPYC, cache of 300: the
    # mean of three `selfspec profile` runs. Used only with SELFSPEC_AUTO_PROFILE=0 (otherwise a curve is measured).
    "cpu-fast": {1: 1.0, 2: 1.03, 4: 1.16, 8: 1.34, 16: 1.69, 32: 2.41, 64: 3.99},
    # The compiled steps (selfspec.execution), 2-core AVX-512 Xeon, cache of 300, over the compiled one-token step
    # (23.3 ms; 2 rows measured 0.97 of it, made non-decreasing): `selfspec profile` on da81b84, run 1 of the README.
    "cpu-compiled": {1: 1.0, 2: 1.0, 4: 1.26, 8: 1.47, 16: 1.82, 32: 2.47, 64: 3.84},
    "cuda": {1: 1.0, 8: 1.0, 16: 1.02, 32: 1.05, 64: 1.1},
}
PROFILE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
_TABLE_SIZE = 256  # tree sizes (and batch rows) whose cost a curve keeps worked out (CostCurve.cost)
# Raised when an execution path's step costs change shape, so that curves measured before are measured again (a path
# not named here is at 1). compiled 2: steps of 1-3 tokens go to the graph the row split favours (compiled.py);
# 3: `tree` takes them unpadded; 4 (and fast 2): steps below the row split on selfspec's small-row kernel; q4 2:
# selfspec's row attention in place of float64 SDPA; compiled 5 and fast 3: the small-row kernel reads each weight once
# whatever the row count (its 3 and 4 rows got cheaper, and the row split moved); compiled 6: `few` takes up to 16 rows,
# as far as it keeps within 5% of `tree` (steps of 4-15 tokens got cheaper here); compiled 7 and q4 3: the bounded LM
# head reads its proxy once for all of a step's rows (a greedy step of 4 rows: 2.7 ms of head, not 7.2); compiled 8,
# fast 4, q4 and q4-compiled 4: the small-row kernel and the head's proxy ask for lines ahead as they stream (the
# products of 1 / 4 / 8 rows 10 / 23 / 23% faster, the head's proxy at 1 / 4 rows 2.6 / 3.8 -> 1.4 / 2.0 ms a step);
# compiled 9, q4 and q4-compiled 5: the row attention takes the rows sharing a key/value head together and its
# exponentials a vector at a time (30 layers at 1 / 8 rows 1.1 / 5.9 -> 0.6 / 3.0 ms); the head's proxy: 4 rows a pass;
# compiled 10, q4 and q4-compiled 6: with AVX-512 VNNI the head's proxy multiplies int16-coded rows (1 / 4 / 8 rows
# 0.71 / 1.80 / 3.48 -> 0.47 / 1.06 / 2.00 ms); compiled 11 and fast 5: the small-row kernel takes three or four rows
# in two passes of two over a block of eight weight rows (the batch engine's steps of four rows, products 12.3 -> 10.6
# ms a step on the 2-core Zen 5); compiled 12: `few` takes the linear weights in a compact form that reproduces them
# exactly (execution/compact.py: SmolLM2's, de-quantised from Q4_1, coded as its blocks: its products at 1 / 4 / 8 / 16
# rows 0.40 / 0.47 / 0.74 / 0.89x the time).
PATH_REVISIONS = {"compiled": 12, "fast": 5, "q4": 6, "q4-compiled": 6}


@dataclass(frozen=True)
class CostCurve:
    sizes: tuple[int, ...]  # tree sizes measured, ascending, starting at 1
    relative_cost: tuple[float, ...]  # forward time over the n = 1 time (shared_by > 1: what one request pays)
    source: str  # "builtin" or the profile file it came from
    # Requests verified in each step (the batch engine's). A tree then costs its request what the step's extra time is
    # worth in the B tokens a plain step would have emitted: relative_cost = 1 + B * (step time ratio - 1).
    shared_by: int = 1

    def cost(self, n: int) -> float:
        """Relative cost of verifying n nodes, linearly interpolated (extrapolated past the last size)."""
        if type(n) is int and 0 <= n <= _TABLE_SIZE:
            return self._table[n]
        return self._interpolated(n)

    def step_cost(self, n: int) -> float:
        """The time of the step that verifies a tree of n nodes over a plain step's (cost(n) for one request)."""
        return 1.0 + (self.cost(n) - 1.0) / self.shared_by

    @functools.cached_property
    def _table(self) -> tuple[float, ...]:
        """cost(n) for n = 0 .. _TABLE_SIZE, worked out once: drafters read the curve many times a step (ngram's
        `largest_size_within` alone walked the curve 64 times, ~0.1 ms a step), and lookups give the same floats."""
        return tuple(self._interpolated(n) for n in range(_TABLE_SIZE + 1))

    def _interpolated(self, n: float) -> float:
        sizes, costs = self.sizes, self.relative_cost
        if n <= sizes[0]:
            return costs[0]
        for (n0, c0), (n1, c1) in itertools.pairwise(zip(sizes, costs, strict=True)):
            if n <= n1:
                return c0 + (c1 - c0) * (n - n0) / (n1 - n0)
        slope = (costs[-1] - costs[-2]) / (sizes[-1] - sizes[-2])
        return costs[-1] + slope * (n - sizes[-1])

    def best_size(
        self, gains: Sequence[float], draft_cost_per_node: float = 0.0, min_size: int = 1
    ) -> tuple[int, float]:
        """The tree size n (root included) with the largest expected tokens per unit of cost, and that rate.

        gains[i] is what node i + 1 adds to the expected accepted length (its chance of being accepted), best first,
        so the first n - 1 gains are the best n-node tree. Rate(n) = (1 + sum of the first n - 1 gains) /
        (cost(n) + (n - 1) * draft_cost_per_node); sizes below `min_size` are not considered unless no gain is given.
        """
        best_n, best_rate, expected = 1, (1.0 / self.cost(1) if min_size <= 1 else 0.0), 1.0
        for index, gain in enumerate(gains):
            expected += gain
            n = index + 2
            rate = expected / (self.cost(n) + (n - 1) * draft_cost_per_node)
            if n >= min_size and rate > best_rate:
                best_n, best_rate = n, rate
        return best_n, best_rate

    def best_chain_length(self, acceptance: float, max_length: int) -> int:
        """Draft length k maximising expected tokens per step (1 + a + ... + a^k) over cost(k + 1)."""
        return self.best_size([acceptance**k for k in range(1, max(0, max_length) + 1)])[0] - 1

    def largest_size_within(self, cost_limit: float, max_size: int = 64) -> int:
        """The largest tree size whose cost stays within `cost_limit`."""
        return max([n for n in range(1, max_size + 1) if self.cost(n) <= cost_limit] or [1])

    def to_dict(self) -> dict:
        return {"sizes": list(self.sizes), "relative_cost": list(self.relative_cost)}


def device_key(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return "cuda-" + torch.cuda.get_device_name(device).replace(" ", "_")
    return f"cpu-{cpu_signature()}-{torch.get_num_threads()}threads"


def profile_path(
    device: torch.device | str, model_name: str, path: str = "stock", dtype: torch.dtype = torch.float32
) -> Path:
    """One profile per device, model, execution path and dtype (a bfloat16 step costs differently from a float32 one;
    float32's file keeps the name it had before the dtype joined the key). `model_name` is `Target.cost_key`, the
    folder name with a digest of the model's shapes, wherever selfspec stores or reads a target's curve."""
    suffix = "" if dtype == torch.float32 else "--" + str(dtype).replace("torch.", "")
    return cache_root() / "profiles" / f"{device_key(device)}--{model_name}--{path}{suffix}.json"


def load_cost_curve(
    device: torch.device | str, model_name: str, path: str = "stock", dtype: torch.dtype = torch.float32
) -> CostCurve:
    """The stored profile for this device, model, execution path (`path`: stock, fast or compiled) and dtype if
    `selfspec profile` made one on the path as it is now (PATH_REVISIONS), else the built-in estimate for that path."""
    stored = profile_path(device, model_name, path, dtype)
    if stored.is_file():
        data = json.loads(stored.read_text())
        if data.get("path_revision", 1) == PATH_REVISIONS.get(path, 1):  # else measured on an older path: unused
            return CostCurve(tuple(data["sizes"]), tuple(data["relative_cost"]), source=str(stored))
    kind = (
        "cuda"
        if torch.device(device).type == "cuda"
        else {"fast": "cpu-fast", "compiled": "cpu-compiled"}.get(path, "cpu")
    )
    table = _BUILTIN[kind]
    return CostCurve(tuple(table), tuple(table.values()), source=f"builtin ({kind})")


def measure_forward_times(
    target: Target, paths: dict[str, ExecutionPath], cache_length: int = 512, repeats: int = 7, sizes=PROFILE_SIZES
) -> dict[str, dict[int, float]]:
    """Seconds for one forward of n new tokens after `cache_length` cached ones, per execution path: the fastest of
    `repeats` rounds (the least disturbed by other load)."""
    samples = forward_time_samples(target, paths, cache_length, repeats, sizes)
    return {name: fastest(by_size) for name, by_size in samples.items()}


def fastest(samples: dict[int, list[float]]) -> dict[int, float]:
    """Each size's fastest round: the one least disturbed by other load."""
    return {n: min(values) for n, values in samples.items()}


def forward_time_samples(
    target: Target, paths: dict[str, ExecutionPath], cache_length: int = 512, repeats: int = 7, sizes=PROFILE_SIZES
) -> dict[str, dict[int, list[float]]]:
    """Every round's seconds for one forward of n new tokens, per execution path, as a greedy step runs it
    (ExecutionPath.argmax_only). Rounds interleave the paths and the sizes, so slow drifts of the machine hit every
    one alike; round 0 warms up."""
    from .tree_attention import DraftTree, build_tree_inputs, compact_cache, tree_forward

    device = target.device
    generator = torch.Generator().manual_seed(0)
    vocab = target.vocab_size
    prefix = torch.randint(0, vocab, (1, cache_length), generator=generator).to(device)
    sizes = sorted(set((1,) + tuple(sizes)))
    samples = {name: {n: [] for n in sizes} for name in paths}
    with torch.inference_mode():
        caches = {name: path.new_cache() for name, path in paths.items()}  # each path with the cache it writes
        for name, path in paths.items():
            with path.active():
                path.forward(prefix, past_key_values=caches[name])
        for round_index in range(repeats + 1):
            for name, path in paths.items():
                # as greedy decoding runs its steps (the default): a compiled graph's LM head bounds the argmax
                with path.active(), path.argmax_only():
                    for n in sizes:
                        chain = DraftTree(
                            tokens=torch.randint(0, vocab, (n,), generator=generator), parents=torch.arange(-1, n - 1)
                        )
                        inputs = build_tree_inputs(chain, cache_length, target.dtype, device)
                        _synchronize(device)
                        start = time.perf_counter()
                        tree_forward(path.forward, caches[name], inputs)
                        _synchronize(device)
                        if round_index > 0:
                            samples[name][n].append(time.perf_counter() - start)
                        compact_cache(caches[name], n, ())  # drop the n new positions again
    return samples


def busy_spread(samples: dict[int, list[float]]) -> float:
    """How much slower a size's median round was than its fastest, at the worst size: near 1 on a quiet machine. Under
    other load the fastest rounds are luck, and a curve made of them can say a 2-token step costs 2.6 one-token steps,
    which would size every tree down to its root for as long as the curve is stored."""
    return max(statistics.median(values) / min(values) for values in samples.values())


def curve_from_times(times: dict[int, float], sizes=PROFILE_SIZES) -> CostCurve:
    """Relative costs, made non-decreasing in n, since a larger tree never costs less."""
    relative = monotone_fit([times[n] / times[1] for n in sizes])
    return CostCurve(tuple(sizes), tuple(round(max(1.0, value), 3) for value in relative), source="measured")


def measure_cost_curve(target: Target, cache_length: int = 512, repeats: int = 7, sizes=PROFILE_SIZES) -> CostCurve:
    """The cost curve of the target's own execution path (the one the decoding loop runs)."""
    times = measure_forward_times(target, {"path": target.execution}, cache_length, repeats, sizes)["path"]
    return curve_from_times(times, sizes)


QUICK_SIZES = (1, 2, 4, 8, 16, 32, 64)


def target_cost_curve(target: Target) -> CostCurve:
    """The curve drafters size their trees by: this device, model and execution path. With no stored profile, a short
    one is measured now (a few seconds) and stored, so a curve from another machine never sizes the trees here;
    SELFSPEC_AUTO_PROFILE=0 keeps the built-in estimate instead."""
    target.execution.prepare()  # the path's name is settled here (a compiled path may run `fast` for now)
    key = (target.device, target.cost_key, target.execution.name, target.dtype)
    curve = load_cost_curve(*key)
    if not curve.source.startswith("builtin") or os.environ.get("SELFSPEC_AUTO_PROFILE", "1") == "0":
        return curve
    print(
        "selfspec: measuring this machine's verification cost curve once (a few seconds; `selfspec profile` "
        "measures a thorough one)",
        file=sys.stderr,
    )
    samples, spread, quiet = measure_until_quiet(
        lambda: forward_time_samples(target, {"path": target.execution}, 256, repeats=3, sizes=QUICK_SIZES)["path"],
        busy_spread,
    )
    if quiet:
        save_cost_curve(curve_from_times(fastest(samples), QUICK_SIZES), *key)
        return load_cost_curve(*key)
    print(
        f"selfspec: the machine is busy (the same step's time varied {spread:.1f}x), so the curve was not stored; the "
        "built-in estimate sizes the trees, and the next run measures again",
        file=sys.stderr,
    )
    return curve


def current_cost_curve(target: Target) -> CostCurve:
    """The curve stored for the target's path as it is now, else that path's built-in estimate, never measured: for a
    path that took over between requests (the compiled one, whose background build stores its curve once built), where
    measuring would keep the next request waiting."""
    return load_cost_curve(target.device, target.cost_key, target.execution.name, target.dtype)


def monotone_fit(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators): timing noise can make a
    larger size look cheaper, which would send the tree budget chasing a measurement artefact."""
    blocks: list[list[float]] = []  # [mean, count]
    for value in values:
        blocks.append([value, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (mean_a, count_a), (mean_b, count_b) = blocks[-2], blocks.pop()
            blocks[-1] = [(mean_a * count_a + mean_b * count_b) / (count_a + count_b), count_a + count_b]
    return [mean for mean, count in blocks for _ in range(int(count))]


def save_cost_curve(
    curve: CostCurve,
    device: torch.device | str,
    model_name: str,
    path: str = "stock",
    dtype: torch.dtype = torch.float32,
) -> Path:
    document = curve.to_dict() | {"path_revision": PATH_REVISIONS.get(path, 1)}
    return atomic_write_text(profile_path(device, model_name, path, dtype), json.dumps(document, indent=1))


def _synchronize(device: torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
