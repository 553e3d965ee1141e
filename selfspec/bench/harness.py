"""`selfspec bench`: prompt sets -> interleaved runs -> rows -> table, results.json, results.md, charts."""

from __future__ import annotations

import datetime
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..cost import target_cost_curve
from ..errors import SelfspecError
from ..execution import describe_cpu
from ..heads import parse_drafter_options
from ..models import Target
from ..options import split_drafter_specs
from ..training.data.prompt_sets import PromptItem, load_prompt_file, load_prompt_set
from .report import aggregate, markdown_table, source_table, write_outputs
from .runner import HF_PEERS, BenchSettings, build_methods, run_benchmark

QUICK_PROMPTS, QUICK_TOKENS = 2, 16


@dataclass(frozen=True)
class BenchRequest:
    drafters: tuple[str, ...]
    datasets: tuple[str, ...]
    peers: tuple[str, ...]
    limit: int | None
    prompts_file: Path | None
    out_dir: Path
    heads: Path | None
    quick: bool
    command: str


def parse_list(text: str, valid: list[str] | tuple[str, ...], what: str) -> tuple[str, ...]:
    """Comma-separated names (datasets, peers)."""
    items = tuple(item.strip() for item in text.split(",") if item.strip())
    unknown = [item for item in items if item not in valid]
    if unknown:
        raise SelfspecError(f"unknown {what} {', '.join(map(repr, unknown))}: choose from {', '.join(valid)}")
    return items


def parse_drafters(text: str) -> tuple[str, ...]:
    """Comma-separated drafter specs, each with its own options (`medusa,layerskip:threshold=0.3,max_draft=6`),
    checked now (names, option names and types), before any model is loaded."""
    specs = tuple(split_drafter_specs(text))
    for spec in specs:
        parse_drafter_options(spec)
    return specs


def collect_prompts(request: BenchRequest) -> list[PromptItem]:
    limit = QUICK_PROMPTS if request.quick else request.limit
    prompts: list[PromptItem] = []
    for name in request.datasets:
        prompts += load_prompt_set(name, limit=limit)
    if request.prompts_file is not None:
        user = load_prompt_file(request.prompts_file)
        prompts += user[:limit] if limit else user
    if not prompts:
        raise SelfspecError("no prompts to benchmark: name --datasets or pass --prompts FILE.jsonl")
    return prompts


def run_bench(target: Target, request: BenchRequest, settings: BenchSettings) -> str:
    """Run the benchmark; write the files; return the Markdown table."""
    if request.quick:
        settings = BenchSettings(**{**asdict(settings), "max_new_tokens": QUICK_TOKENS})
    prompts = collect_prompts(request)
    methods = build_methods(target, list(request.drafters), list(request.peers), settings, request.heads)
    records = run_benchmark(target, methods, prompts, settings)
    curve = target_cost_curve(target)
    rows = aggregate(records, settings.temperature, curve.cost)
    category_rows = aggregate(records, settings.temperature, curve.cost, by_category=True)
    meta = {
        "command": request.command,
        "model": target.name,
        "device": _device_name(target.device),
        "dtype": str(target.dtype).replace("torch.", ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        # The execution path selfspec's methods ran on (HF generate: stock); "fast then compiled" where the compiled
        # graphs were built in the background during the run and took over between prompts (each record says).
        "path": " then ".join(dict.fromkeys(r.path for r in records if r.path)) or target.execution.name,
        "cost_curve": {**curve.to_dict(), "source": curve.source},
        **asdict(settings),
    }
    written = write_outputs(request.out_dir, meta, rows, category_rows, records)
    sources = source_table(rows)
    table = markdown_table(rows) + (f"\n\naccepted draft tokens by source:\n\n{sources}" if sources else "")
    print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    return table


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({describe_cpu()}, {torch.get_num_threads()} threads)"


def valid_peers() -> tuple[str, ...]:
    return HF_PEERS
