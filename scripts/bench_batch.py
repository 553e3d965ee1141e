"""Drafters in the batch engine alone (no server, no client): tokens/s with a queue kept full, drafters taking turns.

    python scripts/bench_batch.py --drafters none,ngram,auto --slots 4 --queue 8 --rounds 3

Each drafter gets an engine of its own over one loaded target (`--slots` requests decoded together) and, in each round,
the same `--per-round` held-out ShareGPT prompts, `--max-tokens` tokens each, submitted so that `--queue` requests are
waiting or in flight until the round's prompts run out (`--queue` above `--slots`: the slots never empty until the
end). The drafters run one after another within a round, the order reversed every other round, so that drifts of the
machine hit them all; each engine first decodes two short requests (the path's first steps, its drafters built).
Reports each drafter's tokens/s over all rounds, its ratio to the first drafter's, and its engine's steps paused by the
batch's pacing (docs/serve.md, "Which drafter a server runs", is where these runs are read). Results go to stdout and,
with --out, to results.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from selfspec import SelfSpec
from selfspec.batch import BatchEngine, BatchRequest
from selfspec.execution import describe_cpu
from selfspec.files import atomic_write_text
from selfspec.training.data.prompt_sets import load_prompt_set


def run_round(engine: BatchEngine, prompts: list[list[int]], queue: int, max_tokens: int) -> tuple[int, float]:
    """Decode `prompts` keeping `queue` requests submitted at once -> (tokens emitted, seconds)."""
    waiting, tokens, began = list(prompts), 0, time.perf_counter()
    while waiting or engine.busy:
        while waiting and engine.admitted + len(engine.waiting) < queue:
            engine.submit(BatchRequest(waiting.pop(0), max_tokens))
        tokens += sum(len(finished.token_ids) for finished in engine.step())
    return tokens, time.perf_counter() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--path", default="compiled", help="the target's execution path")
    parser.add_argument(
        "--drafters", default="none,ngram,auto", help="comma-separated drafter specs; the first is 1.0x"
    )
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--queue", type=int, default=8, help="requests submitted at once (waiting or decoding)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-round", type=int, default=16, help="prompts a round (different ones each round)")
    parser.add_argument(
        "--skip",
        type=int,
        default=0,
        help="prompts passed over after the two warm-up ones: the rounds start at prompt 2 + skip (bench_serve's "
        "level k, from 0, sends prompts 32k to 32k + 31)",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default=None, help="a folder for results.json")
    args = parser.parse_args(argv)
    names = args.drafters.split(",")
    texts = [item.text for item in load_prompt_set("sharegpt")]
    needed = 2 + args.skip + args.rounds * args.per_round
    if len(set(names)) != len(names) or min(args.slots, args.queue, args.rounds, args.per_round) < 1 or args.skip < 0:
        print(
            "bench_batch: give distinct drafters, --slots, --queue, --rounds and --per-round of at least 1, and a "
            "--skip of at least 0",
            file=sys.stderr,
        )
        return 2
    if needed > len(texts):  # checked before the model loads
        print(
            f"bench_batch: {args.rounds} rounds of {args.per_round} need {needed} prompts; there are {len(texts)}: "
            "pass fewer --rounds or --per-round",
            file=sys.stderr,
        )
        return 2
    first = SelfSpec(args.model, drafter=names[0], path=args.path)
    target = first.target
    specs = {name: first if name == names[0] else SelfSpec(target, drafter=name) for name in names}
    prompts = [target.encode_messages([{"role": "user", "content": text}])[0].tolist() for text in texts[:needed]]
    engines = {name: BatchEngine(target, spec.new_drafter, slots=args.slots) for name, spec in specs.items()}
    for engine in engines.values():
        for slot in range(args.slots):
            engine.slot_drafter(slot)
        run_round(engine, prompts[:2], 2, 16)  # warm-up
    totals = {name: [0, 0.0] for name in names}
    for index in range(args.rounds):
        batch = prompts[2 + args.skip + index * args.per_round :][: args.per_round]
        for name in names if index % 2 == 0 else names[::-1]:
            tokens, seconds = run_round(engines[name], batch, args.queue, args.max_tokens)
            totals[name][0] += tokens
            totals[name][1] += seconds
        print(f"round {index + 1}: " + ", ".join(f"{name} {t / s:.1f}" for name, (t, s) in totals.items()), flush=True)
    base = totals[names[0]][0] / totals[names[0]][1]
    rows = []
    for name in names:
        rate = totals[name][0] / totals[name][1]
        rows.append(
            {
                "drafter": name,
                "tokens_per_s": round(rate, 1),
                "vs_first": round(rate / base, 3),
                "batch_paused_steps": engines[name].pacing.paused_steps,
            }
        )
        print(
            f"{name:>12}: {rate:6.1f} tokens/s  {rate / base:.3f}x {names[0]}  "
            f"(steps paused by the batch's pacing: {engines[name].pacing.paused_steps})"
        )
    if args.out:
        meta = {
            "machine": describe_cpu(),
            "path": target.execution.name,
            "commit": subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
            ).stdout.strip(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python scripts/bench_batch.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        }
        atomic_write_text(
            Path(args.out) / "results.json", json.dumps({**meta, **vars(args), "rows": rows}, indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
