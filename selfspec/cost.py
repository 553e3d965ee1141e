"""The verification cost curve: forward time for n new tokens relative to n = 1, on this machine.

Drafters read it to size their trees: on a CPU a 16-node tree costs ~2.2 plain steps, on a GPU 64 nodes cost about
one. `selfspec profile` measures and stores a curve per device; until then a built-in estimate is used.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from .files import atomic_write_text
from .models import Target, cache_root

# Built-in estimates, used until `selfspec profile` has measured this machine.
_BUILTIN = {
    "cpu": {1: 1.0, 2: 1.1, 4: 1.8, 8: 2.0, 16: 2.2, 32: 2.8, 64: 4.2},  # SmolLM2-135M fp32, 2-core CPU
    "cuda": {1: 1.0, 8: 1.0, 16: 1.02, 32: 1.05, 64: 1.1},
}
PROFILE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


@dataclass(frozen=True)
class CostCurve:
    sizes: tuple[int, ...]  # tree sizes measured, ascending, starting at 1
    relative_cost: tuple[float, ...]  # forward time over the n = 1 time
    source: str  # "builtin" or the profile file it came from

    def cost(self, n: int) -> float:
        """Relative cost of verifying n nodes, linearly interpolated (extrapolated past the last size)."""
        sizes, costs = self.sizes, self.relative_cost
        if n <= sizes[0]:
            return costs[0]
        for (n0, c0), (n1, c1) in zip(zip(sizes, costs), zip(sizes[1:], costs[1:])):
            if n <= n1:
                return c0 + (c1 - c0) * (n - n0) / (n1 - n0)
        slope = (costs[-1] - costs[-2]) / (sizes[-1] - sizes[-2])
        return costs[-1] + slope * (n - sizes[-1])

    def best_size(self, gains: Sequence[float], draft_cost_per_node: float = 0.0, min_size: int = 1) -> tuple[int, float]:
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

    def best_size_for_paths(self, sorted_log_probs: Sequence[float], max_size: int) -> int:
        """best_size for candidate nodes scored by their path's cumulative draft log-probability, best first: a
        path's draft probability estimates the chance that the target accepts all of it. At most `max_size` nodes."""
        return self.best_size([math.exp(score) for score in sorted_log_probs[: max_size - 1]])[0]

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
    return f"cpu-{torch.get_num_threads()}threads"


def profile_path(device: torch.device | str, model_name: str) -> Path:
    return cache_root() / "profiles" / f"{device_key(device)}--{model_name}.json"


def load_cost_curve(device: torch.device | str, model_name: str) -> CostCurve:
    """The stored profile for this device and model if `selfspec profile` made one, else the built-in estimate."""
    path = profile_path(device, model_name)
    if path.is_file():
        data = json.loads(path.read_text())
        return CostCurve(tuple(data["sizes"]), tuple(data["relative_cost"]), source=str(path))
    table = _BUILTIN["cuda" if torch.device(device).type == "cuda" else "cpu"]
    return CostCurve(tuple(table), tuple(table.values()), source="builtin")


def measure_cost_curve(target: Target, cache_length: int = 512, repeats: int = 7, sizes=PROFILE_SIZES) -> CostCurve:
    """Time one forward of n new tokens after `cache_length` cached ones: the fastest of `repeats` rounds (the least
    disturbed by other load), then made non-decreasing in n, since a larger tree never costs less."""
    from .tree_attention import DraftTree, build_tree_inputs, compact_cache, tree_forward

    model, device = target.model, target.device
    generator = torch.Generator().manual_seed(0)
    vocab = target.vocab_size
    prefix = torch.randint(0, vocab, (1, cache_length), generator=generator).to(device)
    cache = target.new_cache()
    samples: dict[int, list[float]] = {n: [] for n in sorted(set((1,) + tuple(sizes)))}
    with torch.inference_mode():
        model(input_ids=prefix, past_key_values=cache, use_cache=True)
        # Rounds interleave the sizes, so slow drifts of the machine hit every size alike; round 0 warms up.
        for round_index in range(repeats + 1):
            for n in samples:
                chain = DraftTree(tokens=torch.randint(0, vocab, (n,), generator=generator), parents=torch.arange(-1, n - 1))
                inputs = build_tree_inputs(chain, cache_length, target.dtype, device)
                _synchronize(device)
                start = time.perf_counter()
                tree_forward(model, cache, inputs)
                _synchronize(device)
                if round_index > 0:
                    samples[n].append(time.perf_counter() - start)
                compact_cache(cache, n, ())  # drop the n new positions again
    timings = {n: min(values) for n, values in samples.items()}
    relative = monotone_fit([timings[n] / timings[1] for n in sizes])
    return CostCurve(tuple(sizes), tuple(round(max(1.0, value), 3) for value in relative), source="measured")


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


def save_cost_curve(curve: CostCurve, device: torch.device | str, model_name: str) -> Path:
    return atomic_write_text(profile_path(device, model_name), json.dumps(curve.to_dict(), indent=1))


def _synchronize(device: torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
