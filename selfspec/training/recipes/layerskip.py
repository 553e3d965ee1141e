"""`selfspec tune layerskip`: a seeded Optuna (TPE) search for the layer-skip draft of a model.

A trial chooses a skip flag for every attention and every MLP sublayer (2 x layers binary choices, the count from the
model's config), the initial confidence threshold and the longest chain. Two stages:

1. Cheap (as SWIFT does): the draft path runs once over calibration text, in parallel, and its top-1 is compared with
   the target's at every assistant position. From that agreement a and the draft's cost c (its share of the weights
   one target step reads), the best chain length k gives an estimated speed-up (1 + a + ... + a^k) / (k c + V(k+1)),
   V the verification cost curve. Trials whose estimate falls below the median of earlier trials are pruned before
   any timing. The first trials are enqueued: the hand-made baseline (every other layer skipped) and greedy sets
   from a one-sublayer-at-a-time sensitivity pass.
2. The objective: measured tokens/s of self-speculative greedy decoding of calibration prompts.

Calibration prompts and text come from the ShareGPT training split (never the held-out 2%) or a JSONL file. The
study lives in an Optuna journal file: the same command resumes it, and `optuna.load_study` reads it. The best
trial is written as a skip-set file keyed by the model's fingerprint, which `--drafter layerskip` then finds.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from ...cost import CostCurve, target_cost_curve
from ...decoding import speculative_generate
from ...errors import SelfspecError
from ...heads.layerskip import (
    LayerSkipDrafter,
    LayerSkipSettings,
    SkippingForward,
    SkipPlan,
    TunedSkipSet,
    every_other_layer,
    fingerprint_key,
    save_skip_file,
)
from ...models import Target
from ..data.conversations import load_conversations
from ..data.tokenizing import tokenize_conversation
from ..trainer.losses import most_frequent


@dataclass(frozen=True)
class TuneOptions:
    trials: int = 60
    seed: int = 0
    data: str = "sharegpt"  # or a JSONL file of conversations
    prompts: int = 4  # calibration prompts timed per trial
    max_new_tokens: int = 48  # per calibration prompt
    agreement_tokens: int = 2048  # assistant tokens of calibration text for stage 1
    draft_vocab_size: int = 8192  # the most frequent tokens of the calibration data; 0 = the whole vocabulary
    max_draft: int = 8  # the search's upper bound on the chain length
    timing: bool = True  # stage 2; False makes the stage-1 estimate the objective (deterministic: tests, quick looks)


@dataclass(frozen=True)
class Calibration:
    prompts: list[list[int]]  # token ids, chat template applied
    texts: list[torch.Tensor]  # [L] token ids of whole conversations
    positions: list[torch.Tensor]  # [L - 1] bool: positions whose next token is assistant text
    target_next: list[torch.Tensor]  # [L - 1] the target's greedy next token at each position
    draft_vocab: torch.Tensor | None  # [V_draft] ascending target ids, None = whole vocabulary


def build_calibration(target: Target, options: TuneOptions) -> Calibration:
    """Prompts (first user turns), text for stage 1 and the draft vocabulary, from `options.data`."""
    conversations = load_conversations(options.data, limit=max(400, 4 * options.prompts), seed=options.seed)
    prompts, texts, positions, counts = [], [], [], Counter()
    for conversation in conversations:
        first_user = next((m for m in conversation.messages if m["role"] == "user"), None)
        if first_user is not None and len(prompts) < options.prompts:
            ids = target.render_chat([first_user], True)
            if 8 <= len(ids) <= 256:
                prompts.append(ids)
        example = tokenize_conversation(target, conversation, max_length=512)
        if example is None:
            continue
        counts.update(example.input_ids[example.loss_mask].tolist())
        if sum(int(p.sum()) for p in positions) < options.agreement_tokens:
            texts.append(example.input_ids)
            positions.append(example.loss_mask[1:])
    if not prompts or not texts:
        raise SelfspecError(f"calibration data '{options.data}' gave no usable prompts or assistant text")
    device = target.device
    with torch.inference_mode():
        target_next = [target.model(text.view(1, -1).to(device)).logits[0, :-1].argmax(-1).cpu() for text in texts]
    vocab = (
        None if options.draft_vocab_size <= 0 else most_frequent(counts, options.draft_vocab_size, target.vocab_size)
    )
    return Calibration(prompts, texts, positions, target_next, vocab)


def draft_agreement(target: Target, settings: LayerSkipSettings, calibration: Calibration) -> float:
    """Stage 1: how often the draft's top-1 equals the target's at assistant positions, teacher-forced, one pass
    over each text."""
    plan = SkipPlan.from_settings(settings, target.config.num_hidden_layers)
    vocab = None if calibration.draft_vocab is None else calibration.draft_vocab.to(target.device)
    forward = SkippingForward(target, plan, vocab)
    agree = total = 0
    with torch.inference_mode():
        for text, positions, expected in zip(
            calibration.texts, calibration.positions, calibration.target_next, strict=True
        ):
            logits = forward(text.to(target.device), DynamicCache(), 0)[:-1]
            guesses = forward.to_target_ids(logits.argmax(-1)).cpu()
            agree += int((guesses == expected)[positions].sum())
            total += int(positions.sum())
    return agree / max(1, total)


def draft_cost(target: Target, plan: SkipPlan, draft_vocab_size: int) -> float:
    """The draft's share of the weights one target step reads: the sublayers it runs plus its LM-head rows."""
    layers = target.model.model.layers

    def size(module) -> int:
        return sum(parameter.numel() for parameter in module.parameters())

    attention = [size(layer.self_attn) for layer in layers]
    mlp = [size(layer.mlp) for layer in layers]
    lm_rows = target.model.get_output_embeddings().weight.shape[1]
    full = sum(attention) + sum(mlp) + target.vocab_size * lm_rows
    used = sum(a for a, run in zip(attention, plan.run_attention, strict=True) if run) + sum(
        m for m, run in zip(mlp, plan.run_mlp, strict=True) if run
    )
    used += (draft_vocab_size or target.vocab_size) * lm_rows
    return used / full


def estimated_speedup(agreement: float, cost: float, max_draft: int, curve: CostCurve) -> tuple[float, int]:
    """(speed-up over plain decoding, chain length) for the best chain of 1 to `max_draft` tokens, each draft token
    accepted with probability `agreement`, independently. Below 1 where no chain pays; it still ranks trials."""
    size, rate = curve.best_size([agreement**k for k in range(1, max_draft + 1)], draft_cost_per_node=cost, min_size=2)
    return rate * curve.cost(1), size - 1


def measure_speed(target: Target, drafter, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, float]:
    """(tokens/s, mean accepted length) of greedy decoding over the prompts, one after another."""
    tokens = forwards = 0
    start = time.perf_counter()
    for prompt in prompts:
        _, stats = speculative_generate(target, drafter, torch.tensor(prompt), max_new_tokens, pace=False)
        tokens += stats.new_tokens
        forwards += stats.target_forwards
    return tokens / (time.perf_counter() - start), tokens / max(1, forwards)


def settings_for(trial, num_layers: int, max_draft: int) -> LayerSkipSettings:
    skip_attention = tuple(i for i in range(num_layers) if trial.suggest_categorical(f"skip_attn_{i}", [False, True]))
    skip_mlp = tuple(i for i in range(num_layers) if trial.suggest_categorical(f"skip_mlp_{i}", [False, True]))
    return LayerSkipSettings(
        skip_attention=skip_attention,
        skip_mlp=skip_mlp,
        threshold=trial.suggest_float("threshold", 0.0, 0.9),
        max_draft=trial.suggest_int("max_draft", 1, max_draft),
    )


def params_of(settings: LayerSkipSettings, num_layers: int) -> dict:
    """Trial parameters that reproduce `settings` (to enqueue hand-made starting points)."""
    params = {f"skip_attn_{i}": i in settings.skip_attention for i in range(num_layers)}
    params.update({f"skip_mlp_{i}": i in settings.skip_mlp for i in range(num_layers)})
    params.update(threshold=settings.threshold, max_draft=settings.max_draft)
    return params


def starting_points(
    target: Target, calibration: Calibration, max_draft: int, progress: bool = True
) -> list[LayerSkipSettings]:
    """Enqueued first: the hand-made baseline (both sublayers of every other layer skipped), then SWIFT-style
    greedy sets: sublayers ranked by the stage-1 agreement with only that one skipped, the best n skipped together."""
    num_layers = target.config.num_hidden_layers
    odd = every_other_layer(num_layers)
    chain = min(4, max_draft)
    points = [LayerSkipSettings(skip_attention=odd, skip_mlp=odd, threshold=0.5, max_draft=chain)]
    single = []
    for index in tqdm(range(2 * num_layers), desc="sublayer sensitivity", disable=not progress, leave=False):
        layer, is_attention = index % num_layers, index < num_layers
        settings = LayerSkipSettings(skip_attention=(layer,)) if is_attention else LayerSkipSettings(skip_mlp=(layer,))
        single.append((-draft_agreement(target, settings, calibration), index))
    ranked = [index for _, index in sorted(single)]
    for count in sorted({n for n in (1, 2, 4, 6, 9, 12, num_layers // 2) if n < 2 * num_layers}):
        chosen = ranked[:count]
        points.append(
            LayerSkipSettings(
                skip_attention=tuple(sorted(i for i in chosen if i < num_layers)),
                skip_mlp=tuple(sorted(i - num_layers for i in chosen if i >= num_layers)),
                threshold=0.3,
                max_draft=chain,
            )
        )
    return points


def tune_layerskip(target: Target, options: TuneOptions, storage_path: Path, out: Path, command: str = "") -> dict:
    """Run (or resume) the study; write the best trial to `out`. Returns the study summary stored in the file."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    num_layers = target.config.num_hidden_layers
    calibration = build_calibration(target, options)
    vocab_size = 0 if calibration.draft_vocab is None else len(calibration.draft_vocab)
    curve = target_cost_curve(target)
    storage_path.parent.mkdir(parents=True, exist_ok=True)
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(storage_path)))
    study = optuna.create_study(
        study_name=f"layerskip-{fingerprint_key(target.fingerprint)}-seed{options.seed}",
        storage=storage,
        load_if_exists=True,
        direction="maximize",
        sampler=optuna.samplers.TPESampler(seed=options.seed, multivariate=True, n_startup_trials=10),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=0),
    )
    if not study.trials:
        for settings in starting_points(target, calibration, options.max_draft):
            study.enqueue_trial(params_of(settings, num_layers))

    def objective(trial) -> float:
        settings = settings_for(trial, num_layers, options.max_draft)
        plan = SkipPlan.from_settings(settings, num_layers)
        agreement = draft_agreement(target, settings, calibration)
        estimate, _ = estimated_speedup(agreement, draft_cost(target, plan, vocab_size), settings.max_draft, curve)
        trial.set_user_attr("agreement", round(agreement, 4))
        trial.set_user_attr("estimated_speedup", round(estimate, 3))
        if not options.timing:
            return estimate
        trial.report(estimate, 0)
        if trial.number > 0 and trial.should_prune():  # trial 0, the baseline, is always timed
            raise optuna.TrialPruned()
        drafter = LayerSkipDrafter(target, curve, settings, calibration.draft_vocab)
        tokens_per_s, tau = measure_speed(target, drafter, calibration.prompts, options.max_new_tokens)
        trial.set_user_attr("mean_accepted_length", round(tau, 3))
        return tokens_per_s

    remaining = options.trials - len([t for t in study.trials if t.state.is_finished()])
    with tqdm(total=max(0, remaining), desc="tune layerskip", unit="trial") as bar:

        def report(study, trial) -> None:
            bar.update(1)
            states = [t.state for t in study.trials]
            if optuna.trial.TrialState.COMPLETE in states:
                bar.set_postfix(best=f"{study.best_value:.2f}", pruned=states.count(optuna.trial.TrialState.PRUNED))

        if remaining > 0:
            study.optimize(objective, n_trials=remaining, callbacks=[report])
    summary = summarize(study, target, options, curve, storage_path, command)
    if options.timing:  # plain decoding through the same loop, for scale
        from ...heads import create_drafter

        plain, _ = measure_speed(target, create_drafter("none", target), calibration.prompts, options.max_new_tokens)
        summary["plain_tokens_per_s"] = round(plain, 3)
    best = settings_for(optuna.trial.FixedTrial(study.best_params), num_layers, options.max_draft)
    save_skip_file(out, TunedSkipSet(best, calibration.draft_vocab, target.fingerprint, summary))
    return summary


def summarize(study, target: Target, options: TuneOptions, curve: CostCurve, storage_path: Path, command: str) -> dict:
    import optuna

    completed = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    if not completed:
        raise SelfspecError(
            "every trial was pruned or failed: run more trials (--trials) or check the calibration data"
        )
    num_layers = target.config.num_hidden_layers

    def describe(trial) -> dict:
        settings = settings_for(optuna.trial.FixedTrial(trial.params), num_layers, options.max_draft)
        return {
            "trial": trial.number,
            "value": round(trial.value, 3),
            **trial.user_attrs,
            "skip_attention": list(settings.skip_attention),
            "skip_mlp": list(settings.skip_mlp),
            "threshold": round(settings.threshold, 3),
            "max_draft": settings.max_draft,
        }

    ranked = sorted(completed, key=lambda t: -t.value)
    baseline = next((t for t in study.trials if t.number == 0 and t.state == optuna.trial.TrialState.COMPLETE), None)
    return {
        "objective": "tokens/s of greedy self-speculative decoding" if options.timing else "stage-1 estimated speed-up",
        "trials": len(study.trials),
        "completed": len(completed),
        "pruned": len([t for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]),
        "best": describe(ranked[0]),
        "top": [describe(t) for t in ranked[:5]],
        "baseline_every_other_layer": describe(baseline) if baseline else None,
        "options": {key: value for key, value in vars(options).items()},
        "storage": str(storage_path),
        "study_name": study.study_name,
        "cost_curve": curve.source,
        "command": command,
    }
