"""Regeneration throughput: the target's greedy replies to ShareGPT training prompts, per engine, timed interleaved.

    python scripts/regeneration_throughput.py [--engines batched,generate] [--batch-sizes 48] [--prompts 96]
        [--max-new-tokens 192] [--out runs/regeneration-throughput]

The prompts: up to `--prompts` first user turns of at most `--max-prompt-tokens` tokens, from the first
2 x `--prompts` conversations of the recipe's seeded order (ShareGPT's training split), batched as `regenerate`
batches them. For each batch size, batch after batch, every engine answers the same batch in turn, so machine noise
falls on all alike. New tokens count as in the recipe's report (through the first end marker); seconds are on the
run clock (stops left out). Also written: how many replies each engine gives that are identical to the first
engine's (greedy ties between batch layouts can part them). Writes throughput.json and throughput.md under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from selfspec.files import atomic_write_text
from selfspec.models import load_target
from selfspec.training.clock import running_time
from selfspec.training.config import REGENERATE_ENGINES
from selfspec.training.data.conversations import load_conversations
from selfspec.training.data.regenerate import engine_replies, regeneration_prompts
from selfspec.training.throughput import machine


def reply_length(reply: list[int], eos: set[int]) -> int:
    cut = next((i for i, token in enumerate(reply) if token in eos), None)
    return len(reply) if cut is None else cut + 1


def _refuse(message: str) -> None:
    """Bad input: one line on stderr, exit status 2, before anything is loaded."""
    print(f"regeneration_throughput: error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument(
        "--engines", default="batched,generate", help=f"comma-separated, of {', '.join(REGENERATE_ENGINES)}"
    )
    parser.add_argument("--batch-sizes", default="48", help="comma-separated")
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--out", default="runs/regeneration-throughput")
    args = parser.parse_args(argv)
    engines = args.engines.split(",")
    unknown = [engine for engine in engines if engine not in REGENERATE_ENGINES]
    if unknown:
        _refuse(f"unknown engine {', '.join(unknown)}: choose from {', '.join(REGENERATE_ENGINES)}")
    try:
        batch_sizes = [int(size) for size in args.batch_sizes.split(",")]
    except ValueError:
        _refuse(f"--batch-sizes takes whole numbers separated by commas (e.g. 48,128), got '{args.batch_sizes}'")
    if min(batch_sizes) < 1 or args.prompts < 1 or args.max_new_tokens < 1:
        _refuse("--batch-sizes, --prompts and --max-new-tokens must be at least 1")
    target = load_target(args.model, four_bit=False)
    eos = set(target.eos_token_ids)
    conversations = load_conversations("sharegpt", seed=0)
    rows = []
    for batch_size in batch_sizes:
        todo = regeneration_prompts(target, conversations[: args.prompts * 2], args.max_prompt_tokens, batch_size)
        prompts = [ids for _, _, ids in todo[: args.prompts]]
        tokens = dict.fromkeys(engines, 0)
        seconds = dict.fromkeys(engines, 0.0)
        replies: dict[str, list] = {engine: [] for engine in engines}
        for engine in engines:  # first-use work (packing the weights, allocator) outside the timings
            engine_replies(engine)(target, prompts[:2], 8)
        batches = range(0, len(prompts), batch_size)
        for start in tqdm(batches, desc=f"batch size {batch_size}", unit="batch"):
            batch = prompts[start : start + batch_size]
            for engine in engines:
                began = running_time()
                answers = engine_replies(engine)(target, batch, args.max_new_tokens)
                seconds[engine] += running_time() - began
                answers = [answer[: reply_length(answer, eos)] for answer in answers]
                tokens[engine] += sum(len(answer) for answer in answers)
                replies[engine] += answers
        first = engines[0]
        for engine in engines:
            rows.append(
                {
                    "engine": engine,
                    "batch_size": batch_size,
                    "prompts": len(prompts),
                    "prompt_tokens": sum(len(ids) for ids in prompts),
                    "new_tokens": tokens[engine],
                    "seconds": round(seconds[engine], 1),
                    "new_tokens_per_s": round(tokens[engine] / max(seconds[engine], 1e-9), 1),
                    f"replies_identical_to_{first}": sum(
                        a == b for a, b in zip(replies[engine], replies[first], strict=True)
                    ),
                }
            )
            tqdm.write(json.dumps(rows[-1]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": machine(target.device),
        "dtype": str(target.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "execution_path": target.execution.name,
        "max_new_tokens": args.max_new_tokens,
        "max_prompt_tokens": args.max_prompt_tokens,
        "rows": rows,
    }
    atomic_write_text(out / "throughput.json", json.dumps(result, indent=1))
    first = engines[0]
    lines = [
        f"Regeneration throughput on {result['machine']} ({result['dtype']}, path {result['execution_path']}), "
        f"replies up to {args.max_new_tokens} new tokens:",
        "",
        f"| engine | batch | prompts | new tokens | seconds | new tokens/s | replies identical to {first} |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['engine']} | {r['batch_size']} | {r['prompts']} | {r['new_tokens']:,} | {r['seconds']} | "
        f"{r['new_tokens_per_s']} | {r[f'replies_identical_to_{first}']} |"
        for r in rows
    ]
    atomic_write_text(out / "throughput.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
