"""A scaling table from one long run: the EAGLE-family recipe trains with the wsd schedule and keeps its checkpoints
at `train.keep_steps`; each kept step s becomes a point by a branch that decays the learning rate over a further
`decay` x s steps, on the next batches of the run's own data order. So a point has seen its data once, with steps in
proportion to it, and ends annealed, as a run of that length would (test_training_resume checks that a branch is
exactly such a run); the table costs the long run plus the branches (a tenth more by default), not a run per point.

Each point's head is measured on the target's greedy continuations of held-out prompts (MT-bench, HumanEval,
held-out ShareGPT: P(the first d drafts are all right), d = 1..3) and by tau, the mean accepted length of the real
decoder on held-out ShareGPT prompts. Its compute is the run's training seconds up to the point plus its branch's.
A least-squares line of chain@1 against log2(positions) then says how many positions each bar needs, if the trend
holds."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from tqdm.auto import tqdm

from ...errors import SelfspecError
from ...files import atomic_write_text
from ...heads.artifacts import save_head
from ...models import Target
from ...options import to_dict
from ..config import RecipeConfig
from ..data.prepare import recipe_data
from ..recipes.eagle import EagleTraining, eagle_family, new_eagle_head
from ..trainer.loop import train
from ..trainer.pipeline import checkpoint_dir, evaluate_heldout, write_report
from .draft_accuracy import eagle_chain_accuracy, greedy_continuations


def scaling_points(
    target: Target, config: RecipeConfig, decay: float = 0.1, eval_prompts: int = 8, eval_tokens: int = 96
) -> list[dict]:
    """One row per kept step of the recipe's run: its branch trained (resumably), its head saved and measured.
    Steps the run has not reached yet give a row saying so. Rows are kept in <work>/scaling/point-<s>.json, so a
    rerun measures only new points."""
    if config.drafter not in ("eagle", "eagle3"):
        raise SelfspecError(f"the scaling table is for EAGLE-family recipes (eagle, eagle3), not '{config.drafter}'")
    if config.train.schedule != "wsd" or not config.train.keep_steps:
        raise SelfspecError(
            "the scaling table branches from a wsd run's kept checkpoints: set train.schedule: wsd and "
            "train.keep_steps in the recipe, then train it"
        )
    if not 0 < decay <= 1:
        raise SelfspecError(f"the branches' decay is a fraction of each point's steps in (0, 1], got {decay}")
    eagle, head_cls, layers = eagle_family(target, config)
    work = config.work_path / "scaling"
    work.mkdir(parents=True, exist_ok=True)
    run_dir = checkpoint_dir(config)
    reached = [s for s in sorted(config.train.keep_steps) if (run_dir / f"step-{s}.pt").is_file()]
    rows = [{"step": s, "reached": False} for s in sorted(config.train.keep_steps) if s not in reached]
    todo = [s for s in reached if not (work / f"point-{s}.json").is_file()]
    if todo:
        data = recipe_data(target, config, layers, {})
        evaluation = greedy_continuations(target, work, eval_prompts, eval_tokens)
    for step in reached:
        path = work / f"point-{step}.json"
        if step in todo:
            tqdm.write(f"scaling point at step {step}: branch, then measure")
            branch_steps = max(1, round(decay * step))
            schedule = replace(
                config.train, max_steps=step + branch_steps, decay_steps=branch_steps, keep_steps=(), log_every=1
            )
            eagle_config, head = new_eagle_head(target, eagle, head_cls, data.train.sample)
            summary = train(
                EagleTraining(head, eagle_config),
                data.train.count,
                data.train.get,
                schedule,
                work / f"branch-{step}",
                resume=True,
                get_batch=data.train.get_batch,
                branch_from=run_dir / f"step-{step}.pt",
            )
            heads_dir = work / f"head-{step}"
            save_head(heads_dir, config.drafter, eagle_config, head.state_dict(), target.fingerprint, {})
            heldout = evaluate_heldout(heads_dir, config.drafter, config)
            # The head's directory is whole, as `selfspec train` leaves one: its report says what it is (the recipe
            # of a run of exactly this length, its outputs and checkpoints apart from the long run's) and what the
            # held-out evaluation measured (auto reads it).
            recipe = replace(
                config,
                out=f"{config.out}-step{step}",
                work_dir=f"{config.work_dir}-step{step}" if config.work_dir else None,
                train=replace(schedule, log_every=config.train.log_every),
            )
            write_report(
                heads_dir,
                {
                    "drafter": config.drafter,
                    "scaling_point": {"branch_of": str(run_dir / f"step-{step}.pt"), "branch_steps": branch_steps},
                    "steps": summary.steps,
                    "positions": summary.tokens,
                    "heldout": heldout,
                    "timings": {"train_s": round(summary.seconds, 1)},
                    "config": to_dict(recipe),
                },
            )
            row = {
                "step": step,
                "reached": True,
                "steps": summary.steps,
                "branch_steps": branch_steps,
                "positions": summary.tokens,
                "train_s": round(summary.seconds, 1),
                "chain": {
                    name: eagle_chain_accuracy(target, head, eagle_config, rows) for name, rows in evaluation.items()
                },
                "tau_heldout": heldout.get("mean_accepted_length"),
            }
            atomic_write_text(path, json.dumps(row, indent=1) + "\n")
        rows.append(json.loads(path.read_text()))
    return sorted(rows, key=lambda row: row["step"])


def fit_log_linear(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least squares y = a + b log2(x) over (x, y) -> (a, b); None with fewer than two distinct x."""
    xs = [math.log2(x) for x, _ in points]
    if len(set(xs)) < 2:
        return None
    mean_x, mean_y = sum(xs) / len(xs), sum(y for _, y in points) / len(points)
    slope = sum((x - mean_x) * (y - mean_y) for x, (_, y) in zip(xs, points, strict=True)) / sum(
        (x - mean_x) ** 2 for x in xs
    )
    return mean_y - slope * mean_x, slope


def predicted_positions(fit: tuple[float, float] | None, bar: float) -> float | None:
    """The positions at which the fitted line reaches `bar` (None without a fit or a rising line)."""
    if fit is None or fit[1] <= 0:
        return None
    return 2 ** ((bar - fit[0]) / fit[1])


def write_table(rows: list[dict], bars: dict[str, float], out: Path, header: str) -> dict:
    """scaling.json and scaling.md under `out`: the points, each set's fit of chain@1 and the positions (and, at the
    measured training rate, CPU hours) each bar needs by it."""
    done = [row for row in rows if row.get("reached")]
    rate = sum(row["positions"] for row in done) / max(1e-9, sum(row["train_s"] for row in done)) if done else None
    fits = {}
    for name, bar in bars.items():
        fit = fit_log_linear([(row["positions"], row["chain"][name][0]) for row in done])
        need = predicted_positions(fit, bar)
        fits[name] = {
            "intercept": fit and round(fit[0], 4),
            "per_doubling": fit and round(fit[1], 4),
            "bar": bar,
            "positions_needed": need and round(need),
            "hours_at_measured_rate": need and rate and round(need / rate / 3600, 1),
        }
    out.mkdir(parents=True, exist_ok=True)
    result = {"rows": rows, "fits": fits, "positions_per_s": rate and round(rate, 1)}
    atomic_write_text(out / "scaling.json", json.dumps(result, indent=1) + "\n")
    sets = list(bars)
    lines = [
        header,
        "",
        "| step (branch) | positions | train h | " + " | ".join(f"{s} chain@1/2/3" for s in sets) + " | tau held-out |",
        "|---|---|---|" + "---|" * len(sets) + "---|",
    ]
    for row in rows:
        if not row.get("reached"):
            lines.append(f"| {row['step']} | not reached yet |" + " |" * (len(sets) + 2))
            continue
        chains = " | ".join("/".join(f"{v:.3f}" for v in row["chain"][s]) for s in sets)
        lines.append(
            f"| {row['step']} (+{row['branch_steps']}) | {row['positions']:,} | {row['train_s'] / 3600:.2f} | "
            f"{chains} | {row['tau_heldout']} |"
        )
    lines += [
        "",
        "| set | chain@1 per doubling of data | bar | positions the line needs | CPU hours at the run's rate |",
    ]
    lines.append("|---|---|---|---|---|")
    for name, fit in fits.items():
        need = f"{fit['positions_needed']:,}" if fit["positions_needed"] else "-"
        lines.append(
            f"| {name} | {fit['per_doubling'] if fit['per_doubling'] is not None else '-'} | {fit['bar']} | {need} | "
            f"{fit['hours_at_measured_rate'] or '-'} |"
        )
    atomic_write_text(out / "scaling.md", "\n".join(lines) + "\n")
    return result
