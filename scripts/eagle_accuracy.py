"""Draft accuracy of trained EAGLE / EAGLE-3 heads on the target's own greedy continuations of benchmark prompts.

    python scripts/eagle_accuracy.py HEADS_DIR [HEADS_DIR ...] [--eval-prompts 8] [--out runs/eagle-accuracy]

For each heads directory (`eagle` or `eagle3`, selfspec's or a speculators EAGLE-3 one): teacher-forced top-1 (depth
1) and the chance that a whole chain of d drafts is right (d = 1..3), on MT-bench, HumanEval and held-out ShareGPT
prompts (the same continuations as scripts/eagle_data_scaling.py, cached under --out). Writes accuracy.json and
accuracy.md under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from selfspec.heads import create_drafter
from selfspec.heads.artifacts import heads_kind
from selfspec.models import load_target
from selfspec.training.studies.draft_accuracy import eagle_chain_accuracy, greedy_continuations


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("heads", nargs="+", help="heads directories (eagle or eagle3)")
    parser.add_argument("--model", default="default")
    parser.add_argument("--eval-prompts", type=int, default=8, help="per prompt set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default="runs/eagle-accuracy")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = load_target(args.model, four_bit=False)
    evaluation = greedy_continuations(target, out, args.eval_prompts, args.max_new_tokens)
    rows = []
    for directory in args.heads:
        kind = heads_kind(Path(directory))
        if kind not in ("eagle", "eagle3"):
            sys.exit(f"eagle_accuracy: '{directory}' holds {kind or 'no'} heads, not eagle or eagle3")
        head = create_drafter(kind, target, directory).head.float()
        row = {"heads": directory, "drafter": kind}
        for dataset, sequences in evaluation.items():
            row[dataset] = eagle_chain_accuracy(target, head, head.config, sequences)
        rows.append(row)
        print(json.dumps(row), flush=True)
    (out / "accuracy.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        "| heads | drafter | " + " | ".join(f"{d} chain@1/2/3" for d in evaluation) + " |",
        "|---|---|" + "---|" * len(evaluation),
    ]
    lines += [
        f"| {row['heads']} | {row['drafter']} | "
        + " | ".join("/".join(f"{v:.3f}" for v in row[d]) for d in evaluation)
        + " |"
        for row in rows
    ]
    (out / "accuracy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
