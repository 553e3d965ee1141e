"""Aggregate run records into rows, and write results.json, results.md and PNG charts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..files import atomic_write, atomic_write_text
from . import metrics
from .metrics import RunRecord


@dataclass(frozen=True)
class Row:
    """One (method, dataset[, category]) aggregate. Field names are the results.json schema (see README)."""

    drafter: str
    dataset: str
    category: str | None
    temperature: float
    n_prompts: int
    new_tokens: int
    tau: float
    acceptance_rate: float | None
    tokens_per_s: float
    speedup_vs_hf: float | None
    speedup_vs_none: float | None
    ceiling_vs_none: float | None  # tau / cost(tree size): the speed-up if drafting were free
    mean_tree_size: float | None
    greedy_match_rate: float | None  # share of prompts whose output equals HF generate's; None when sampling
    peak_mem_mb: float
    accepted_draft_tokens: int = 0  # draft tokens the verifier accepted, over all steps
    accepted_by_source: dict[str, int] | None = None  # composite drafters (auto): the same per source
    draft_share: float | None = None  # share of the wall time the drafter took (proposals, bookkeeping); None for HF
    verify_share: float | None = None  # share of the wall time in the target's tree forwards and verification
    none_match_rate: float | None = None  # share equal to `none`'s on the same path (the q4 path's reference); greedy


def aggregate(
    records: list[RunRecord], temperature: float, cost: Callable[[int], float], by_category: bool = False
) -> list[Row]:
    reference = {r.prompt_id: r.token_ids for r in records if r.method == "hf"}
    plain = {r.prompt_id: r.token_ids for r in records if r.method == "none"}
    keys = sorted({(r.dataset, r.category if by_category else None) for r in records}, key=lambda k: (k[0], k[1] or ""))
    methods = list(dict.fromkeys(r.method for r in records))  # run order: hf, none, drafters, peers
    rows = []
    for dataset, category in keys:
        group = [r for r in records if r.dataset == dataset and (category is None or r.category == category)]
        baseline = {name: [r for r in group if r.method == name] for name in ("hf", "none")}
        for method in methods:
            mine = [r for r in group if r.method == method]
            if not mine:
                continue
            rows.append(
                Row(
                    drafter=method,
                    dataset=dataset,
                    category=category,
                    temperature=temperature,
                    n_prompts=len(mine),
                    new_tokens=sum(r.new_tokens for r in mine),
                    tau=_round(metrics.tau(mine)),
                    acceptance_rate=_round(metrics.acceptance_rate(mine)),
                    tokens_per_s=_round(metrics.tokens_per_s(mine)),
                    speedup_vs_hf=_round(metrics.speedup(mine, baseline["hf"])),
                    speedup_vs_none=_round(metrics.speedup(mine, baseline["none"])),
                    ceiling_vs_none=_round(metrics.cost_ceiling(mine, cost)),
                    mean_tree_size=_round(metrics.mean_tree_size(mine)),
                    greedy_match_rate=_round(metrics.greedy_match_rate(mine, reference)) if temperature == 0 else None,
                    none_match_rate=_round(metrics.greedy_match_rate(mine, plain)) if temperature == 0 else None,
                    peak_mem_mb=round(max(r.peak_mem_mb for r in mine), 1),
                    accepted_draft_tokens=metrics.accepted_draft_tokens(mine),
                    accepted_by_source=metrics.accepted_by_source(mine),
                    draft_share=_round(metrics.time_share(mine, "draft_s")),
                    verify_share=_round(metrics.time_share(mine, "verify_s")),
                )
            )
    return rows


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


_COLUMNS = [
    ("drafter", "drafter"),
    ("dataset", "dataset"),
    ("n_prompts", "n"),
    ("tau", "tau"),
    ("acceptance_rate", "accept"),
    ("tokens_per_s", "tok/s"),
    ("speedup_vs_hf", "vs HF"),
    ("speedup_vs_none", "vs none"),
    ("ceiling_vs_none", "ceiling"),
    ("mean_tree_size", "tree"),
    ("draft_share", "drafting"),
    ("greedy_match_rate", "= HF"),
    ("none_match_rate", "= none"),
    ("peak_mem_mb", "peak MB"),
]


def markdown_table(rows: list[Row], with_category: bool = False) -> str:
    columns = _COLUMNS[:2] + ([("category", "category")] if with_category else []) + _COLUMNS[2:]
    lines = ["| " + " | ".join(title for _, title in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for field, _ in columns:
            value = getattr(row, field)
            cells.append("-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def source_table(rows: list[Row]) -> str | None:
    """Accepted draft tokens per source of each composite drafter, per dataset (None when no row has sources). A
    token two sources proposed counts for each, so the shares can add up to more than 100%."""
    composite = [row for row in rows if row.accepted_by_source]
    if not composite:
        return None
    names = list(dict.fromkeys(name for row in composite for name in row.accepted_by_source))
    lines = [
        "| drafter | dataset | accepted draft tokens | " + " | ".join(names) + " |",
        "|" + "---|" * (3 + len(names)),
    ]
    for row in composite:
        total = row.accepted_draft_tokens
        cells = [
            f"{row.accepted_by_source.get(name, 0)} ({row.accepted_by_source.get(name, 0) / max(1, total):.0%})"
            if name in row.accepted_by_source
            else "-"
            for name in names
        ]
        lines.append(f"| {row.drafter} | {row.dataset} | {total} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_outputs(
    out_dir: Path, meta: dict, rows: list[Row], category_rows: list[Row], records: list[RunRecord]
) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    as_dicts = lambda items: [item.__dict__ for item in items]  # noqa: E731
    results = {"meta": meta, "rows": as_dicts(rows), "category_rows": as_dicts(category_rows)}
    results["runs"] = [
        {k: v for k, v in r.__dict__.items() if k not in ("token_ids", "accepted_lengths", "tree_sizes")}
        for r in records
    ]
    written = [out_dir / "results.json", out_dir / "results.md"]
    atomic_write_text(written[0], json.dumps(results, indent=1))
    sources = source_table(rows)
    markdown = (
        f"# selfspec bench\n\n`{meta['command']}`\n\nModel {meta['model']} on {meta['device']}, "
        f"{meta['max_new_tokens']} new tokens, temperature {meta['temperature']}.\n\n"
        + markdown_table(rows)
        + (f"\n\n## Accepted draft tokens by source\n\n{sources}" if sources else "")
        + "\n\n## Per category\n\n"
        + markdown_table(category_rows, with_category=True)
        + "\n"
    )
    atomic_write_text(written[1], markdown)
    written += _charts(out_dir, rows, category_rows)
    return written


def _charts(out_dir: Path, rows: list[Row], category_rows: list[Row]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    datasets = list(dict.fromkeys(r.dataset for r in rows))
    methods = [m for m in dict.fromkeys(r.drafter for r in rows) if m != "hf"]
    figure, axis = plt.subplots(figsize=(max(6, 1.6 * len(datasets) * len(methods) / 2), 4))
    width = 0.8 / max(1, len(methods))
    for offset, method in enumerate(methods):
        values = [
            next((r.speedup_vs_hf or 0 for r in rows if r.drafter == method and r.dataset == d), 0) for d in datasets
        ]
        axis.bar([i + offset * width for i in range(len(datasets))], values, width, label=method)
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(datasets))], datasets)
    axis.set_ylabel("speed-up vs HF generate")
    axis.legend(fontsize=8)
    paths.append(_save(figure, out_dir / "speedup.png"))

    categories = list(dict.fromkeys(f"{r.dataset}/{r.category}" for r in category_rows))
    drafters = [m for m in methods if any(r.drafter == m and r.acceptance_rate is not None for r in category_rows)]
    figure, axis = plt.subplots(figsize=(max(6, 0.5 * len(categories) * max(1, len(drafters))), 4))
    width = 0.8 / max(1, len(drafters))
    for offset, method in enumerate(drafters):
        values = [
            next((r.tau for r in category_rows if r.drafter == method and f"{r.dataset}/{r.category}" == c), 0)
            for c in categories
        ]
        axis.bar([i + offset * width for i in range(len(categories))], values, width, label=method)
    axis.set_xticks(range(len(categories)), categories, rotation=45, ha="right", fontsize=8)
    axis.set_ylabel("mean accepted length (tau)")
    axis.legend(fontsize=8)
    paths.append(_save(figure, out_dir / "tau_by_category.png"))
    return paths


def _save(figure, path: Path) -> Path:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    save_chart(figure, path)
    plt.close(figure)
    return path


def save_chart(figure, path: Path) -> Path:
    """`figure` as a PNG of 256 colours (temp file, then rename): a chart's lines and text look the same, at about a
    third of the bytes of its full-colour image, which matters where every tracked byte travels on each device call
    (docs/device.md)."""
    import io

    from PIL import Image

    image = io.BytesIO()
    figure.savefig(image, dpi=110, format="png")
    image.seek(0)
    palette = Image.open(image).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    return atomic_write(path, lambda temp: palette.save(temp, format="PNG", optimize=True))
