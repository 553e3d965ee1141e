"""The device program's stages, each run as `python -m selfspec.device.stages NAME --stash S --budget B --results R`
by program.run_stage_process (a process of its own: killed at its budget, its GPU memory freed when it ends).
Each writes R/NAME.json; `--tiny` is the CPU rehearsal's scale."""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

GPU_RECIPE = Path("configs/gpu/heads-smollm2.yaml")
CHECK_DRAFTERS = ("none", "ngram", "history", "medusa", "eagle", "dflash", "layerskip", "auto")
TABLE_DRAFTERS = ("none", "ngram", "eagle", "eagle3", "dflash", "medusa", "auto")
SETS = ("mtbench", "humaneval", "sharegpt")


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def environment(args) -> dict:
    import accelerate
    import gguf  # noqa: F401  (brought by the bundle)
    import transformers

    if not args.tiny and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: the device program's stages past this one need a GPU")
    site = args.stash / "site"
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu",
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        if torch.cuda.is_available()
        else None,
        "cpus": __import__("os").cpu_count(),
        "site": sorted(p.name for p in site.iterdir() if not p.name.startswith(".")) if site.is_dir() else [],
    }


def cuda_sampling(args) -> dict:
    return sampling_check(400 if args.tiny else 2000)


def sampling_check(samples: int, lookup_every: int = 4) -> dict:
    """Seeded sampling of two tokens through the real loop on a tiny model over 8 tokens, on this device: the pairs'
    chi-square against the target's own joint distribution, and ngram's seeded output (drafts verified; the prompt
    repeats, so lookup has them) equal to plain sampling's. Raises RuntimeError when either fails."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from selfspec import SamplingConfig, create_drafter, speculative_generate
    from selfspec.models import Target
    from selfspec.sampling import logits_to_probs

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, initializer_range=0.15, max_position_embeddings=64, eos_token_id=None,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval().to(device())
    target = Target(model=model, tokenizer=None, name="tiny-llama", path="auto").with_eos(())
    sampling, prompt = SamplingConfig(temperature=1.0), [1, 2, 3, 1, 2, 3, 1, 2]
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=device())
        first = logits_to_probs(model(ids).logits[0, -1].float(), sampling)
        nexts = torch.cat([ids.expand(8, -1), torch.arange(8, device=device()).view(8, 1)], dim=1)
        second = torch.stack([logits_to_probs(row.float(), sampling) for row in model(nexts).logits[:, -1]])
    expected = (first[:, None] * second).cpu().double()  # [8, 8]
    counts, differing = torch.zeros(8, 8, dtype=torch.float64), 0
    plain, lookup = create_drafter("none", target), create_drafter("ngram", target)
    for seed in range(samples):
        tokens, _ = speculative_generate(target, plain, torch.tensor(prompt), 2, sampling, seed=seed)
        counts[tokens[0], tokens[1]] += 1
        if seed % lookup_every == 0:
            drafted, _ = speculative_generate(target, lookup, torch.tensor(prompt), 2, sampling, seed=seed)
            differing += drafted != tokens
    predicted = expected * samples
    keep = predicted >= 5  # cells too rare for the approximation pooled into one
    observed = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    predicted = torch.cat([predicted[keep], predicted[~keep].sum().view(1)])
    statistic = float(((observed - predicted) ** 2 / predicted.clamp(min=1e-12)).sum())
    dof = len(observed) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(statistic / 2.0)))
    if p_value < 1e-3 or differing:
        raise RuntimeError(f"sampling check failed: chi-square p = {p_value:.2e}, ngram differed {differing} times")
    return {"samples": samples, "chi_square": round(statistic, 2), "dof": dof, "p_value": round(p_value, 4)}


def real_model_checks(args) -> dict:
    """Every drafter's greedy output against HF `generate` on the default model, float32 and bfloat16."""
    from selfspec import create_drafter, load_target, speculative_generate
    from selfspec.training.data.prompt_sets import load_prompt_set

    prompts, new_tokens = (1, 8) if args.tiny else (2, 64)
    report = {}
    for dtype in (torch.float32, torch.bfloat16):
        target = load_target("default", device=device(), dtype=dtype, four_bit=False)
        rows = {}
        for item in load_prompt_set("mtbench", prompts):
            ids = target.encode_prompt(item.text)
            with torch.inference_mode():
                reference = target.model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False
                )[0, ids.shape[1] :].tolist()
            # The rehearsal runs bfloat16 (slow on most CPUs) through two drafters; the device through all.
            for name in CHECK_DRAFTERS if dtype == torch.float32 or not args.tiny else CHECK_DRAFTERS[:2]:
                tokens, stats = speculative_generate(target, create_drafter(name, target), ids, new_tokens)
                row = rows.setdefault(name, {"equal": 0, "prompts": 0, "tau": []})
                row["equal"] += list(tokens) == reference[: len(tokens)] and len(tokens) >= len(reference)
                row["prompts"] += 1
                row["tau"].append(round(stats.mean_accepted_length, 2))
        report[str(dtype).replace("torch.", "")] = rows
    unequal = [name for name, row in report["float32"].items() if row["equal"] < row["prompts"]]
    report["float32_all_equal"] = not unequal
    if unequal:  # float32 is exact by the guarantee: a difference is a bug on this device
        (args.results / "real_model_checks.json").write_text(json.dumps(report, indent=1))
        raise RuntimeError(f"float32 greedy output differs from HF generate for {', '.join(unequal)}")
    return report


def recipe(args):
    """The GPU recipe as this program runs it (tiny-scaled in the rehearsal), its outputs in the stash."""
    from dataclasses import replace

    from selfspec.training.config import load_joint_recipe, tiny_scale

    config = load_joint_recipe(GPU_RECIPE)
    if args.tiny:
        config = tiny_scale(config)
    return replace(config, out=str(args.stash / "heads"), work_dir=str(args.stash / "work"))


def regenerate(args) -> dict:
    """The target's greedy replies to the recipe's conversations, in its seeded order, a few batches at a time until
    the budget is nearly spent; the recipe the train stage runs then takes exactly the conversations replied to."""
    from dataclasses import replace

    import yaml

    from selfspec import load_target
    from selfspec.options import to_dict
    from selfspec.training.data.conversations import load_conversations
    from selfspec.training.data.regenerate import regenerate as regenerate_replies

    config = recipe(args)
    data = config.data
    target = load_target(config.model, device=device(), four_bit=False)
    conversations = load_conversations(data.source, seed=data.seed)[: data.conversations or None]
    chunk, done, began = data.regenerate_batch_size * 2, 0, time.monotonic()
    margin = 30 if not args.tiny else 5
    while done < len(conversations) and time.monotonic() - began + margin < args.budget * 0.8:
        done = min(len(conversations), done + chunk)
        regenerate_replies(
            target,
            conversations[:done],
            config.work_path / "regenerated.jsonl",
            max_prompt_tokens=data.max_prompt_tokens,
            max_new_tokens=data.max_new_tokens,
            batch_size=data.regenerate_batch_size,
            engine=data.regenerate_engine,
        )
    config = replace(config, data=replace(data, conversations=max(done, 1)))
    (args.stash / "recipe.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    return {"conversations": done, "of": len(conversations), "seconds": round(time.monotonic() - began, 1)}


def train(args) -> dict:
    """`selfspec train heads` on the recipe the regenerate stage wrote, its training within the budget (a minute or
    so kept for saving and each head's held-out evaluation)."""
    import yaml

    from selfspec.cli import main as cli

    path = args.stash / "recipe.yaml"
    document = yaml.safe_load(path.read_text())
    keep = 30 if args.tiny else 90
    document["train"]["time_budget_minutes"] = round(max(args.budget - keep, 30) / 60, 2)
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    status = cli(["train", "heads", "--config", str(path), "--resume"])
    if status:
        raise RuntimeError(f"selfspec train heads exited {status}")
    reports = {}
    for name in ("eagle3", "dflash", "medusa"):
        report_path = Path(document["out"]) / name / "training_report.json"
        if report_path.is_file():
            report = json.loads(report_path.read_text())
            reports[name] = {key: report.get(key) for key in ("steps", "first_draft_accuracy", "heldout", "throughput")}
    return reports


def evaluate(args) -> dict:
    """chain@1/2/3 of each new head on the target's greedy continuations of the three prompt sets."""
    from selfspec import create_drafter, load_target
    from selfspec.device.program import bfloat16_copy
    from selfspec.training.studies import draft_accuracy

    target = load_target("default", device=device(), four_bit=False)
    per_set, new_tokens = (1, 12) if args.tiny else (8, 96)
    rows = draft_accuracy.greedy_continuations(target, args.stash, per_set, new_tokens)
    measure = {
        "eagle3": lambda head, r: draft_accuracy.eagle_chain_accuracy(target, head, head.config, r),
        "dflash": lambda head, r: draft_accuracy.dflash_chain_accuracy(target, head, r),
        "medusa": lambda head, r: draft_accuracy.medusa_chain_accuracy(target, head, r),
    }
    report = {"prompts_per_set": per_set, "max_new_tokens": new_tokens}
    for name, chain in measure.items():
        directory = args.stash / "heads" / name
        if directory.is_dir():  # as trained (float32), and as it comes back (bfloat16: the ship rule's check)
            stored = args.stash / "bfloat16" / name
            bfloat16_copy(directory, stored)
            figures = {}
            for dtype, where in (("float32", directory), ("bfloat16", stored)):
                head = create_drafter(name, target, where).head.float()
                figures[dtype] = {set_name: chain(head, set_rows) for set_name, set_rows in rows.items()}
            changes = [
                abs(a - b) for s in rows for a, b in zip(figures["float32"][s], figures["bfloat16"][s], strict=True)
            ]
            report[name] = {**figures, "largest_bfloat16_change": round(max(changes, default=0.0), 4)}
    return report


def table(args) -> dict:
    """HF `generate` and every drafter with the new heads, float32 before bfloat16, one prompt set at a time, each
    written when done (the stage is killed at its budget: what is written stays)."""
    from selfspec import load_target
    from selfspec.bench.harness import BenchRequest, run_bench
    from selfspec.bench.runner import BenchSettings
    from selfspec.device.program import install_heads
    from selfspec.heads.artifacts import SHIPPED_DIR

    installed = install_heads(args.stash, SHIPPED_DIR)
    limit, new_tokens = (1, 8) if args.tiny else (8, 128)
    report = {"heads": installed}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).replace("torch.", "")
        target = load_target("default", device=device(), dtype=dtype, four_bit=False)
        for prompt_set in SETS if dtype == torch.float32 or not args.tiny else SETS[:1]:  # the rehearsal: one set
            request = BenchRequest(
                drafters=tuple(d for d in TABLE_DRAFTERS if d != "eagle3" or "eagle3" in installed),
                datasets=(prompt_set,),
                peers=(),
                limit=limit,
                prompts_file=None,
                out_dir=args.results / f"table-{name}-{prompt_set}",
                heads=None,
                quick=False,
                command=f"device program, table stage ({name}, {prompt_set})",
            )
            report.setdefault(name, {})[prompt_set] = run_bench(
                target, request, BenchSettings(max_new_tokens=new_tokens)
            )
            (args.results / "table.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


STAGES = {f.__name__: f for f in (environment, cuda_sampling, real_model_checks, regenerate, train, evaluate, table)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m selfspec.device.stages")
    parser.add_argument("stage", choices=sorted(STAGES))
    parser.add_argument("--stash", type=Path, required=True)
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--budget", type=float, required=True, help="seconds this stage may take")
    parser.add_argument("--tiny", action="store_true", help="the CPU rehearsal's scale")
    args = parser.parse_args(argv)
    result = STAGES[args.stage](args)
    (args.results / f"{args.stage}.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
