"""Run every method on every prompt, interleaved, and record what happened.

Methods: `hf` (transformers `generate`, the baseline users run today), selfspec drafters, and HF peers
(`hf_prompt_lookup`, `hf_early_exit`). For each prompt the methods run back to back in an order that rotates with
the prompt index, so slow drifts of the machine spread evenly over all of them. Each method is warmed up once first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from ..api import SelfSpec
from ..heads import parse_drafter_options
from ..heads.artifacts import heads_kind
from ..models import Target
from ..training.data.prompt_sets import PromptItem
from .metrics import RunRecord

HF_PEERS = ("hf_prompt_lookup", "hf_early_exit")


@dataclass(frozen=True)
class BenchSettings:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    prompt_lookup_tokens: int = 10  # HF's own default draft length for prompt lookup
    early_exit_layer: int | None = None  # None: half the target's layers
    pace: bool = True  # drafting that does not pay is paused (heads.paced.Paced)


@dataclass(frozen=True)
class MethodOutput:
    token_ids: tuple[int, ...]
    target_forwards: int
    accepted_lengths: tuple[int, ...] = ()
    tree_sizes: tuple[int, ...] = ()
    accepted_by_source: tuple[tuple[str, int], ...] = ()  # composite drafters (auto): accepted draft tokens per source
    draft_s: float | None = None  # selfspec drafters: GenerationStats' split of the time
    verify_s: float | None = None
    path: str = ""  # selfspec drafters: the execution path the run was on


Method = Callable[[torch.Tensor, int, int], MethodOutput]  # (input_ids [1, L], max_new_tokens, seed) -> output


class _ForwardCounter:
    """Counts full target forwards while active: calls of the last decoder layer (an early-exit draft never
    reaches it). The hook is removed on exit, so nothing stays attached to the model."""

    def __init__(self, target: Target):
        self.layer = target.model.model.layers[-1]
        self.count = 0

    def __enter__(self) -> "_ForwardCounter":
        self.count = 0
        self.handle = self.layer.register_forward_hook(self._hook)
        return self

    def __exit__(self, *_) -> None:
        self.handle.remove()

    def _hook(self, *_):
        self.count += 1


def _hf_method(target: Target, settings: BenchSettings, **generate_kwargs) -> Method:
    counter = _ForwardCounter(target)
    sampling = {"do_sample": False}
    if settings.temperature > 0:
        sampling = {
            "do_sample": True,
            "temperature": settings.temperature,
            "top_k": settings.top_k or None,
            "top_p": settings.top_p,
        }
    eos = list(target.eos_token_ids) or None

    def run(input_ids: torch.Tensor, max_new_tokens: int, seed: int) -> MethodOutput:
        torch.manual_seed(seed)
        with torch.inference_mode(), counter:
            output = target.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                eos_token_id=eos,
                pad_token_id=eos[0] if eos else None,
                **sampling,
                **generate_kwargs,
            )
        tokens = tuple(output[0, input_ids.shape[1] :].tolist())
        # HF's prefill already emits the first token, so every full forward counts (selfspec's prefill emits none)
        return MethodOutput(tokens, target_forwards=max(1, counter.count))

    return run


def _selfspec_method(target: Target, drafter_spec: str, settings: BenchSettings, heads: Path | None) -> Method:
    """The drafter as users run it: a SelfSpec on the shared target, kept across the prompts (its state and pacing
    carry over, as a server's would)."""
    spec = SelfSpec(target, drafter=drafter_spec, heads=heads)
    spec.drafter  # noqa: B018  (built now: a drafter that cannot load fails before any prompt runs)

    def run(input_ids: torch.Tensor, max_new_tokens: int, seed: int) -> MethodOutput:
        before = spec.drafter.stats()
        result = spec.generate(
            input_ids=input_ids,
            max_new_tokens=max_new_tokens,
            temperature=settings.temperature,
            top_k=settings.top_k,
            top_p=settings.top_p,
            seed=seed,
            pace=settings.pace,
        )
        tokens, stats = result.token_ids, result.stats
        by_source = tuple((spec.drafter.stats().accepted_since(before) or {}).items())
        return MethodOutput(
            tokens,
            stats.target_forwards,
            stats.accepted_lengths,
            stats.tree_sizes,
            by_source,
            stats.draft_s,
            stats.verify_s,
            stats.path,
        )

    return run


def build_methods(
    target: Target, drafters: list[str], peers: list[str], settings: BenchSettings, heads: Path | None = None
) -> dict[str, Method]:
    """The baseline `hf`, then `none` (always: speed-ups are also reported against it), the drafters, the peers.
    `heads` goes to the drafters of its kind and to composite ones (auto hands it to its source of that kind); the
    other drafters with trained parts read the heads shipped for the target."""
    methods: dict[str, Method] = {"hf": _hf_method(target, settings)}
    kind = heads_kind(heads) if heads is not None else None
    for spec in ["none"] + [d for d in drafters if d != "none"]:
        entry, _ = parse_drafter_options(spec)
        takes_heads = entry.composite or (entry.has_artifacts and kind in (None, entry.name))
        methods[spec] = _selfspec_method(target, spec, settings, heads if takes_heads else None)
    for peer in peers:
        if peer == "hf_prompt_lookup":
            methods[peer] = _hf_method(target, settings, prompt_lookup_num_tokens=settings.prompt_lookup_tokens)
        elif peer == "hf_early_exit":
            layer = settings.early_exit_layer or max(1, target.num_layers // 2)
            methods[peer] = _hf_method(target, settings, assistant_early_exit=layer)
    return methods


class PeakMemory:
    """Peak memory of one run: CUDA allocator peak, or the process's resident high-water mark on Linux CPUs."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_resident_peak()
        return self

    def __exit__(self, *_) -> None:
        if self.device.type == "cuda":
            self.peak_mb = torch.cuda.max_memory_allocated(self.device) / 2**20
        else:
            self.peak_mb = _resident_peak_mb()


def _reset_resident_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: reset VmHWM to the current RSS
    except OSError:
        pass


def _resident_peak_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _timed(method: Method, target: Target, input_ids: torch.Tensor, max_new_tokens: int, seed: int):
    with PeakMemory(target.device) as memory:
        _synchronize(target.device)
        start = time.perf_counter()
        output = method(input_ids, max_new_tokens, seed)
        _synchronize(target.device)
        wall = time.perf_counter() - start
    return output, wall, memory.peak_mb


def run_benchmark(
    target: Target,
    methods: dict[str, Method],
    prompts: list[PromptItem],
    settings: BenchSettings,
    progress: bool = True,
) -> list[RunRecord]:
    encoded = [target.encode_prompt(item.text).to(target.device) for item in prompts]  # through the chat template
    target.execution.between_requests()  # a background build of the compiled graphs starts here if one is due
    for method in methods.values():  # warm-up: kernels, allocator, caches
        method(encoded[0], min(8, settings.max_new_tokens), settings.seed)
    records: list[RunRecord] = []
    names = list(methods)
    bar = tqdm(total=len(prompts) * len(names), desc="bench", unit="run", disable=not progress)
    for index, (item, input_ids) in enumerate(zip(prompts, encoded, strict=True)):
        target.execution.between_requests()  # the compiled path takes over between prompts, once it is stored
        for name in names[index % len(names) :] + names[: index % len(names)]:
            bar.set_postfix_str(f"{item.dataset}:{item.id} {name}")
            output, wall, peak = _timed(
                methods[name], target, input_ids, settings.max_new_tokens, settings.seed + index
            )
            records.append(
                RunRecord(
                    method=name,
                    dataset=item.dataset,
                    category=item.category,
                    prompt_id=f"{item.dataset}:{item.id}",
                    new_tokens=len(output.token_ids),
                    wall_s=wall,
                    target_forwards=output.target_forwards,
                    accepted_lengths=output.accepted_lengths,
                    tree_sizes=output.tree_sizes,
                    token_ids=output.token_ids,
                    peak_mem_mb=peak,
                    accepted_by_source=output.accepted_by_source,
                    draft_s=output.draft_s,
                    verify_s=output.verify_s,
                    path=output.path,
                )
            )
            bar.update()
    bar.close()
    return records


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
