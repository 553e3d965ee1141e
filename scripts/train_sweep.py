"""A short measured sweep of an EAGLE-family recipe's learning rate and warm-up (selfspec/training/studies/sweep.py).

    python scripts/train_sweep.py --config configs/eagle3-smollm2-long.yaml \
        --arms 3e-4:5,1e-3:5,3e-3:5,1e-2:5,1e-3:15 --steps 32 --out docs/results/eagle3-sweep

Every arm trains a copy of the same initial head on the same batches of the recipe's labelled sample (its sequence
length, batch size and labels; with streamed labels the first 256 training sequences), for --steps steps, one pass,
ending in a decay; the table compares them on the recipe's calibration
sequences (top-1 agreement of the first draft, and of the 2nd and 3rd unrolled drafts for EAGLE-3). Writes
sweep.json and sweep.md under --out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from selfspec.errors import SelfspecError
from selfspec.files import atomic_write_text
from selfspec.models import load_target
from selfspec.training.config import load_recipe
from selfspec.training.studies.sweep import parse_arms, sweep
from selfspec.training.throughput import machine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/eagle3-smollm2-long.yaml")
    parser.add_argument("--arms", default="3e-4:5,1e-3:5,3e-3:5,1e-2:5,1e-3:15", help="LR:WARMUP,... one head each")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--calibration", type=int, default=64, help="calibration sequences measured")
    parser.add_argument("--out", default="runs/sweep")
    args = parser.parse_args(argv)
    try:
        arms = parse_arms(args.arms)
        config = load_recipe(args.config)
        if args.steps < 5:
            raise SelfspecError(f"--steps must be >= 5, got {args.steps}")
    except SelfspecError as error:
        print(f"train_sweep: error: {error}", file=sys.stderr)
        return 2
    began = time.time()
    target = load_target(config.model, four_bit=False)
    result = sweep(target, config, arms, args.steps, args.calibration)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result.update(
        {
            "config": args.config,
            "commit": commit,
            "machine": machine(target.device),
            "batch_size": config.train.batch_size,
            "max_length": config.data.max_length,
            "wall_s": round(time.time() - began, 1),
        }
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "sweep.json", json.dumps(result, indent=1) + "\n")
    metrics = [key for key in result["rows"][0] if key.startswith("top1")]
    lines = [
        f"{args.steps} steps of {config.train.batch_size} x <= {config.data.max_length} tokens "
        f"({result['positions']:,} positions of the {result['sample_sequences']} labelled sample), {args.calibration} "
        f"calibration sequences; {result['machine']}; commit {commit}",
        "",
        "| lr | warm-up | train loss (last 10) | calibration loss | " + " | ".join(metrics) + " | train s |",
        "|---|---|---|---|" + "---|" * len(metrics) + "---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['lr']:g} | {row['warmup_steps']} | {row['train_loss_last10']} | {row['calibration_loss']} | "
            + " | ".join(f"{row[key]:.4f}" for key in metrics)
            + f" | {row['train_s']} |"
        )
    atomic_write_text(out / "sweep.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
