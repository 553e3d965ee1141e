"""Ship a trained head with the package: a heads directory copied into selfspec/heads/trained/NAME, in bfloat16 if asked
and only where that changes nothing measurable.

    python scripts/ship_head.py HEADS_DIR NAME [--dtype bfloat16] [--eval-prompts 8] [--max-new-tokens 96]

HEADS_DIR must be whole (its config, weights fingerprinted to --model, and a training report with its held-out
evaluation, which `auto` reads), and NAME must begin with its drafter's name (`eagle3-smollm2`): a drafter finds the
heads shipped for a model by that prefix. With --dtype bfloat16 the head's draft accuracy (chain@1/2/3 on the
target's greedy continuations of MT-bench, HumanEval and held-out ShareGPT prompts, cached in --work: EAGLE and
EAGLE-3 unrolled, DFlash's block at 1/2/4, Medusa's heads 1..3) is measured with its weights as they are and
rounded to bfloat16; if any figure moves by more than
--tolerance, nothing is written. The report gains a `shipped` entry: where the head came from, its stored dtype, that
check. The directory is written whole or not at all (an existing one is replaced).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from selfspec.errors import SelfspecError
from selfspec.files import atomic_directory
from selfspec.heads import create_drafter
from selfspec.heads.artifacts import CONFIG, REPORT, SHIPPED_DIR, WEIGHTS, heads_kind, heldout_tau, read_weights

CHECKED = ("eagle", "eagle3", "dflash", "medusa")  # drafters whose draft accuracy the bfloat16 check can measure


def check_request(args) -> str:
    """The drafter of a shippable request, or a SelfspecError naming what is wrong (nothing loaded yet)."""
    source = Path(args.heads)
    if not source.is_dir():
        raise SelfspecError(f"'{source}' is not a directory: give a heads directory (from selfspec train)")
    kind = heads_kind(source)
    if kind is None or not (source / WEIGHTS).is_file():
        raise SelfspecError(f"'{source}' holds no heads ({CONFIG} and {WEIGHTS})")
    if not re.fullmatch(rf"{re.escape(kind)}-[a-z0-9][a-z0-9-]*", args.name):
        raise SelfspecError(
            f"the name must be '{kind}-' and a lower-case suffix (e.g. {kind}-smollm2), got '{args.name}'"
        )
    if heldout_tau(source) is None:
        raise SelfspecError(
            f"'{source}' has no {REPORT} with a held-out evaluation (auto reads it): ship a head that "
            "`selfspec train` or scripts/eagle3_scaling.py wrote"
        )
    if args.dtype == "bfloat16" and kind not in CHECKED:
        raise SelfspecError(f"--dtype bfloat16 is checked for {', '.join(CHECKED)} heads only, not '{kind}'")
    if args.tolerance < 0:
        raise SelfspecError(f"--tolerance must be >= 0, got {args.tolerance}")
    return kind


def stored_weights(directory: Path, dtype: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(the weights, floating ones cast to `dtype`; the file's metadata, its fingerprint included)."""
    state, metadata = read_weights(directory / WEIGHTS)
    wanted = getattr(torch, dtype)
    return {name: t.to(wanted) if t.is_floating_point() else t for name, t in state.items()}, metadata


def write_heads(source: Path, destination: Path, dtype: str, shipped: dict | None) -> None:
    """`source` copied to `destination` (atomically), its weights stored in `dtype`, its report given `shipped`; its
    other files (the config, a Medusa-2 adapter) as they are."""
    state, metadata = stored_weights(source, dtype)
    with atomic_directory(destination) as temp:
        for item in source.iterdir():
            if item.name not in (WEIGHTS, REPORT):
                (shutil.copytree if item.is_dir() else shutil.copyfile)(item, temp / item.name)
        save_file(state, str(temp / WEIGHTS), metadata=metadata)
        if (source / REPORT).is_file():
            report = json.loads((source / REPORT).read_text())
            if shipped is not None:
                report["shipped"] = shipped
            (temp / REPORT).write_text(json.dumps(report, indent=1) + "\n")


def chain_accuracy(target, kind: str, directory: Path, evaluation) -> dict[str, list[float]]:
    from selfspec.training.studies import draft_accuracy

    head = create_drafter(kind, target, directory).head.float()
    if kind == "dflash":  # block depths 1, 2 and 4 where the block drafts that far
        depths = tuple(depth for depth in (1, 2, 4) if depth < head.config.block_size)
        return {
            name: draft_accuracy.dflash_chain_accuracy(target, head, rows, depths) for name, rows in evaluation.items()
        }
    if kind == "medusa":
        return {name: draft_accuracy.medusa_chain_accuracy(target, head, rows) for name, rows in evaluation.items()}
    return {
        name: draft_accuracy.eagle_chain_accuracy(target, head, head.config, rows) for name, rows in evaluation.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("heads", help="the heads directory to ship")
    parser.add_argument("name", help="its name under --into, its drafter's name first (eagle3-smollm2)")
    parser.add_argument("--model", default="default", help="the base model the shipped heads are for")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the stored weights")
    parser.add_argument("--tolerance", type=float, default=0.005, help="largest chain@d change bfloat16 may make")
    parser.add_argument("--eval-prompts", type=int, default=8, help="per prompt set, for the bfloat16 check")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="greedy continuation per prompt")
    parser.add_argument("--work", default="runs/ship-check", help="continuations and the candidate, for the check")
    parser.add_argument("--into", default=str(SHIPPED_DIR), help="where shipped heads live")
    args = parser.parse_args(argv)
    from selfspec.models import load_target

    try:
        kind = check_request(args)
        source, destination = Path(args.heads), Path(args.into) / args.name
        target = load_target(args.model, four_bit=False)
        create_drafter(kind, target, source)  # the fingerprint and the weights match the model
        shipped = {"from": str(source.resolve()), "stored_dtype": args.dtype}
        if args.dtype == "bfloat16":
            from selfspec.training.studies.draft_accuracy import greedy_continuations

            work = Path(args.work)
            candidate = work / "candidate"
            write_heads(source, candidate, "bfloat16", None)
            evaluation = greedy_continuations(target, work, args.eval_prompts, args.max_new_tokens)
            before = chain_accuracy(target, kind, source, evaluation)
            after = chain_accuracy(target, kind, candidate, evaluation)
            largest = max(abs(a - b) for name in before for a, b in zip(before[name], after[name], strict=True))
            shipped["bfloat16_check"] = {
                "prompts_per_set": args.eval_prompts,
                "max_new_tokens": args.max_new_tokens,
                "chain_float32": before,
                "chain_bfloat16": after,
                "largest_change": round(largest, 5),
            }
            print(json.dumps(shipped["bfloat16_check"]), flush=True)
            if largest > args.tolerance:
                raise SelfspecError(
                    f"bfloat16 weights move chain accuracy by {largest:.4f} > --tolerance {args.tolerance}: ship "
                    "--dtype float32"
                )
        write_heads(source, destination, args.dtype, shipped)
    except SelfspecError as error:
        print(f"ship_head: error: {error}", file=sys.stderr)
        return 2
    print(f"shipped {source} as {destination} ({args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
