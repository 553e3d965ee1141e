"""Seeded sampling on the default model: every drafter gives `none`'s text for a seed, and one SelfSpec object
serving many requests keeps doing so in bounded memory.

    python scripts/seeded_soak.py [--prompts 16] [--requests 1100] [--out docs/results/seeded-soak]

1. Drafters: `none`, `auto`, `ngram`, `eagle`, `medusa`, `dflash` and `history` on --prompts held-out prompts
   (MT-bench, HumanEval and held-out ShareGPT in turn), T = 0.8 and top-p 0.95, seed = the prompt's index: the
   token ids of each drafter against `none`'s.
2. Soak: one `SelfSpec(drafter="auto")` serves --requests requests (26 held-out prompts in turn, each greedy then
   sampled with its own seed): every output against `none`'s for the same prompt and seed, and the process's
   resident memory every 50 requests (growth after the first 100 is the bounded-memory figure).
Writes soak.json and soak.md under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import time
from pathlib import Path

import psutil

from selfspec import SelfSpec
from selfspec.execution import describe_cpu
from selfspec.files import atomic_write_text
from selfspec.models import load_target
from selfspec.training.data.prompt_sets import load_prompt_set

DRAFTERS = ("none", "auto", "ngram", "eagle", "medusa", "dflash", "history")
SAMPLED = dict(temperature=0.8, top_p=0.95)


def prompts(count: int) -> list[str]:
    per_set = -(-count // 3)
    sets = [load_prompt_set(name, per_set) for name in ("mtbench", "humaneval", "sharegpt")]
    mixed = [item.text for group in zip(*sets, strict=False) for item in group]
    return mixed[:count]


def drafters_agree(target, texts: list[str], max_new_tokens: int) -> dict:
    outputs, taus = {}, {}
    for name in DRAFTERS:
        spec = SelfSpec(target, drafter=name)
        runs = [
            spec.generate(text, max_new_tokens=max_new_tokens, seed=index, **SAMPLED)
            for index, text in enumerate(texts)
        ]
        outputs[name] = [run.token_ids for run in runs]
        taus[name] = sum(run.stats.new_tokens for run in runs) / sum(run.stats.target_forwards for run in runs)
        print(
            f"{name:8s} tau {taus[name]:.2f}  same as none on "
            f"{sum(a == b for a, b in zip(outputs[name], outputs['none'], strict=True))}/{len(texts)}",
            flush=True,
        )
    return {
        name: {
            "same_as_none": sum(a == b for a, b in zip(outputs[name], outputs["none"], strict=True)),
            "prompts": len(texts),
            "tau": round(taus[name], 3),
        }
        for name in DRAFTERS
    }


def soak(target, texts: list[str], requests: int, max_new_tokens: int) -> dict:
    plain = SelfSpec(target, drafter="none")
    reference = {
        (index, sampled): plain.generate(
            text, max_new_tokens=max_new_tokens, seed=index, **(SAMPLED if sampled else {})
        ).token_ids
        for index, text in enumerate(texts)
        for sampled in (False, True)
    }
    spec = SelfSpec(target, drafter="auto")
    process = psutil.Process()
    rss, mismatches, accepted, forwards, start = [], [], 0, 0, time.perf_counter()
    for request in range(requests):
        index, sampled = (request // 2) % len(texts), request % 2 == 1
        result = spec.generate(texts[index], max_new_tokens=max_new_tokens, seed=index, **(SAMPLED if sampled else {}))
        accepted += result.stats.new_tokens
        forwards += result.stats.target_forwards
        if result.token_ids != reference[(index, sampled)]:
            mismatches.append({"request": request, "prompt": index, "sampled": sampled})
        if (request + 1) % 50 == 0:
            rss.append((request + 1, process.memory_info().rss / 2**20))
            elapsed = time.perf_counter() - start
            print(
                f"request {request + 1}/{requests}: RSS {rss[-1][1]:.0f} MB, {len(mismatches)} mismatches, "
                f"tau {accepted / forwards:.2f}, ETA {elapsed / (request + 1) * (requests - request - 1) / 60:.1f} min",
                flush=True,
            )
    after_100 = next(mb for count, mb in rss if count >= 100)
    return {
        "requests": requests,
        "prompts": len(texts),
        "mismatches": mismatches,
        "tau": round(accepted / forwards, 3),
        "rss_mb": [[count, round(mb, 1)] for count, mb in rss],
        "rss_growth_after_100_mb": round(rss[-1][1] - after_100, 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--soak-prompts", type=int, default=26)
    parser.add_argument("--requests", type=int, default=1100)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--soak-new-tokens", type=int, default=24)
    parser.add_argument("--out", default="docs/results/seeded-soak")
    args = parser.parse_args(argv)
    target = load_target("default")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {
        "settings": {**vars(args), **SAMPLED},
        "commit": commit,
        "machine": describe_cpu(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if args.prompts:
        report["drafters"] = drafters_agree(target, prompts(args.prompts), args.max_new_tokens)
    if args.requests:
        report["soak"] = soak(target, prompts(args.soak_prompts), args.requests, args.soak_new_tokens)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "soak.json", json.dumps(report, indent=1) + "\n")
    lines = [
        f"{report['date']}, commit {commit}, {report['machine']}: `python scripts/seeded_soak.py`",
        "",
        "| drafter | same seeded text as none | tau |",
        "|---|---|---|",
    ]
    lines += [
        f"| {name} | {row['same_as_none']}/{row['prompts']} | {row['tau']} |"
        for name, row in report.get("drafters", {}).items()
    ]
    if "soak" in report:
        soak_report = report["soak"]
        lines += [
            "",
            f'Soak: {soak_report["requests"]} requests through one `SelfSpec(drafter="auto")`, '
            f"{len(soak_report['mismatches'])} outputs differing from `none`'s, RSS growth after request 100: "
            f"{soak_report['rss_growth_after_100_mb']} MB ({soak_report['rss_mb'][0][1]} MB at request 50, "
            f"{soak_report['rss_mb'][-1][1]} MB at the end).",
        ]
    atomic_write_text(out / "soak.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
