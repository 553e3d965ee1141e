"""How EAGLE's draft accuracy grows with training data, on this machine.

    python scripts/eagle_data_scaling.py [--conversations 1600] [--steps 600] [--out runs/eagle-scaling]

Labels the target over raw ShareGPT training conversations (no regeneration: that runs at ~190 tok/s here, labelling
at ~550), trains one EAGLE head per data fraction (1/8, 1/4, 1/2, all; same steps and settings as the shipped
recipe otherwise) and measures each head on the target's own greedy continuations of held-out prompts (MT-bench,
HumanEval, ShareGPT held-out): teacher-forced top-1 (depth 1) and the chance that a whole chain of d drafts is
right (d = 1..3), which is what a chain drafter gets accepted. The shipped head is measured alongside. Writes
scaling.json and scaling.md under --out; the work directory keeps the labels, so a rerun skips them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from selfspec.heads import create_drafter
from selfspec.heads.artifacts import save_head
from selfspec.heads.eagle import EagleFamilyHead, EagleHead
from selfspec.models import load_target
from selfspec.training.config import load_recipe
from selfspec.training.data.prepare import recipe_data
from selfspec.training.recipes.eagle import EagleTraining, new_eagle_head
from selfspec.training.studies.draft_accuracy import eagle_chain_accuracy, greedy_continuations
from selfspec.training.trainer.loop import train


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/eagle-smollm2.yaml")
    parser.add_argument("--conversations", type=int, default=1600)
    parser.add_argument("--max-length", type=int, default=384)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--fractions", default="0.125,0.25,0.5,1")
    parser.add_argument("--eval-prompts", type=int, default=8, help="per prompt set")
    parser.add_argument("--out", default="runs/eagle-scaling")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = load_recipe(
        args.config,
        {
            "work_dir": str(out),
            "out": str(out / "head-1"),
            "data.regenerate": False,
            "data.conversations": args.conversations,
            "data.max_length": args.max_length,
        },
    )
    target = load_target(config.model, four_bit=False)
    timings: dict = {}
    data = recipe_data(target, config, (-1,), timings).train
    evaluation = greedy_continuations(target, out, args.eval_prompts, config.eval.max_new_tokens)
    results = []

    def measure(name: str, head: EagleFamilyHead, sequences: int, tokens: int, train_s: float) -> None:
        row = {"head": name, "sequences": sequences, "learnable_tokens": tokens, "train_s": round(train_s, 1)}
        for dataset, rows in evaluation.items():
            row[dataset] = eagle_chain_accuracy(target, head, config.eagle, rows)
        results.append(row)
        print(json.dumps(row), flush=True)

    shipped = create_drafter("eagle", target).head
    measure("shipped (regenerated, 1459 seq)", shipped, 1459, 0, 0.0)
    for fraction in (float(f) for f in args.fractions.split(",")):
        count = max(1, round(data.count * fraction))
        subset = data.sample[:count]
        learnable = sum(int(s.loss_mask[1:].sum()) for s in subset)
        torch.manual_seed(config.train.seed)
        _, head = new_eagle_head(target, config.eagle, EagleHead, subset)
        began = time.perf_counter()
        train(
            EagleTraining(head, config.eagle),
            count,
            subset.__getitem__,
            config.train,
            out / f"checkpoints-{fraction:g}",
            resume=False,
            max_steps=args.steps,
        )
        spent = time.perf_counter() - began
        head.eval()
        if fraction == 1:
            save_head(out / "head-1", "eagle", config.eagle, head.state_dict(), target.fingerprint, {})
        measure(f"raw sharegpt x{fraction:g}", head, count, learnable, spent)
    (out / "scaling.json").write_text(json.dumps({"labels_s": timings.get("labels_s"), "rows": results}, indent=1))
    lines = [
        "| head | sequences | learnable tokens | " + " | ".join(f"{d} chain@1/2/3" for d in evaluation) + " |",
        "|---|---|---|" + "---|" * len(evaluation),
    ]
    for row in results:
        lines.append(
            f"| {row['head']} | {row['sequences']} | {row['learnable_tokens']} | "
            + " | ".join("/".join(f"{v:.3f}" for v in row[d]) for d in evaluation)
            + " |"
        )
    (out / "scaling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
