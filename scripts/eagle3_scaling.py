"""EAGLE-3's scaling table from the long CPU run (selfspec/training/studies/scaling.py).

    python scripts/eagle3_scaling.py [--config configs/eagle3-smollm2-long.yaml] [--out docs/results/eagle3-scaling]

For every step the recipe keeps (train.keep_steps) that its run has reached: a branch decays the learning rate over
--decay x that many more steps, and the head is measured (chain@1/2/3 on the target's greedy continuations of
MT-bench, HumanEval and held-out ShareGPT prompts; tau on held-out ShareGPT prompts). Writes scaling.json and
scaling.md under --out, with each set's chain@1 per doubling of data and the positions the issue's bars need by that
line. Rerun as the run goes on: measured points are kept in the run's work directory.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from selfspec.errors import SelfspecError
from selfspec.models import load_target
from selfspec.training.config import load_recipe
from selfspec.training.studies.scaling import scaling_points, write_table
from selfspec.training.throughput import machine

BARS = {"mtbench": 0.50, "humaneval": 0.52, "sharegpt": 0.60}  # issue 30's first-draft accuracy bars


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/eagle3-smollm2-long.yaml")
    parser.add_argument("--decay", type=float, default=0.1, help="each branch's decay, a fraction of its steps")
    parser.add_argument("--eval-prompts", type=int, default=8, help="per prompt set")
    parser.add_argument("--eval-tokens", type=int, default=96, help="greedy continuation length per prompt")
    parser.add_argument("--out", default="runs/eagle3-scaling")
    args = parser.parse_args(argv)
    try:
        config = load_recipe(args.config)
        if config.train.schedule != "wsd" or not config.train.keep_steps:
            raise SelfspecError(f"{args.config}: the scaling table needs train.schedule: wsd and train.keep_steps")
        if not 0 < args.decay <= 1:
            raise SelfspecError(f"--decay must be in (0, 1], got {args.decay}")
    except SelfspecError as error:
        print(f"eagle3_scaling: error: {error}", file=sys.stderr)
        return 2
    target = load_target(config.model, four_bit=False)
    rows = scaling_points(target, config, args.decay, args.eval_prompts, args.eval_tokens)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    header = (
        f"{args.config}: batches of {config.train.batch_size} x <= {config.data.max_length} tokens, lr "
        f"{config.train.lr:g} (wsd), branches decay over {args.decay:g} x their steps; chain@d on "
        f"{args.eval_prompts} prompts a set x {args.eval_tokens} greedy tokens; {machine(target.device)}; "
        f"commit {commit}"
    )
    result = write_table(rows, BARS, Path(args.out), header)
    print((Path(args.out) / "scaling.md").read_text())
    return 0 if result["rows"] else 1


if __name__ == "__main__":
    sys.exit(main())
