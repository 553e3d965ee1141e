"""`selfspec generate | chat | demo | bench | profile | train | tune | medusa-tree | drafters`.

Bad input gives one line on stderr (`selfspec: error: ...`) and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

# Quiet third-party chatter (progress bars of weight loading, hub warnings) before they are imported.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="default", help="checkpoint directory, .gguf file, or 'default' (SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="default: float32 on CPU, bfloat16 on CUDA",
    )
    parser.add_argument(
        "--kernels",
        default="auto",
        choices=["auto", "stock", "fast", "compiled"],
        help="the target's execution path: fast = weights pre-packed for small-row GEMMs (CPU, float32); compiled = "
        "fast, with the decoding steps compiled ahead of time (once per machine, a few minutes; needs g++); "
        "auto = the best of these that exists here",
    )


def _add_drafter_args(parser: argparse.ArgumentParser, drafter_help: str) -> None:
    parser.add_argument("--drafter", default="auto", help=drafter_help)
    parser.add_argument("--heads", default=None, help="directory of trained heads, for drafters that have them")


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--seed", type=int, default=0)


def _add_pace_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-pace",
        dest="pace",
        action="store_false",
        help="ask the drafter for a tree at every step, even while its drafting does not pay (default: pause it)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="selfspec", description="Lossless self-speculative decoding.")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate text, streaming it, then one line of statistics")
    _add_model_args(generate)
    _add_drafter_args(
        generate,
        "drafter spec: a name (see `selfspec drafters`) with options, e.g. "
        "layerskip:adaptive=false,max_draft=6 (default: auto, the lookups ngram and history "
        "merged with the trained heads found for the model)",
    )
    generate.add_argument("--prompt", required=True, help="the user message (goes through the chat template)")
    generate.add_argument("--raw", action="store_true", help="do not apply the chat template")
    generate.add_argument("--max-new-tokens", type=int, default=256)
    _add_sampling_args(generate)
    _add_pace_arg(generate)

    chat = commands.add_parser(
        "chat", help="talk with the model in the terminal; accepted draft bursts shown in colour"
    )
    _add_model_args(chat)
    _add_drafter_args(chat, "drafter spec, as for generate (default: auto)")
    chat.add_argument("--system", default=None, help="a system message that opens the conversation")
    chat.add_argument("--max-new-tokens", type=int, default=256, help="the longest reply, in tokens")
    _add_sampling_args(chat)
    chat.add_argument(
        "--no-color", action="store_true", help="plain text (colour is off anyway when not on a terminal)"
    )

    demo = commands.add_parser(
        "demo", help="serve a web page: speculative decoding beside plain decoding, accepted bursts highlighted"
    )
    _add_model_args(demo)
    _add_drafter_args(demo, "the drafter the page starts with (it can pick any other; default: auto)")
    demo.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    demo.add_argument("--port", type=int, default=7860)
    demo.add_argument("--max-new-tokens", type=int, default=128, help="the page's default answer length")

    profile = commands.add_parser("profile", help="measure and store this machine's verification cost curve")
    _add_model_args(profile)
    profile.add_argument(
        "--cache-length", type=_positive_int, default=512, help="cached tokens before the timed forward"
    )
    profile.add_argument("--repeats", type=_positive_int, default=7)
    profile.add_argument(
        "--json", action="store_true", help='print {"sizes": [...], "ms": {"stock": [...], "fast": [...]}} only'
    )

    bench = commands.add_parser("bench", help="benchmark drafters against HF generate and HF peers on real prompts")
    _add_model_args(bench)
    bench.add_argument(
        "--drafters",
        default="none,ngram",
        help="comma-separated drafter specs (`none` always runs), each with its options, e.g. "
        "medusa,layerskip:threshold=0.3,max_draft=6",
    )
    bench.add_argument("--datasets", default="mtbench,humaneval", help="comma-separated: mtbench, humaneval, sharegpt")
    bench.add_argument(
        "--prompts", default=None, help="a JSONL file of your own prompts (prompt / turns / conversations)"
    )
    bench.add_argument("--peers", default="hf_prompt_lookup,hf_early_exit", help="HF peers to run beside ('' for none)")
    bench.add_argument("--limit", type=_positive_int, default=None, help="a fixed, spread sample of N prompts per set")
    bench.add_argument("--max-new-tokens", type=_positive_int, default=128)
    bench.add_argument("--temperature", type=float, default=0.0)
    bench.add_argument("--top-k", type=int, default=0)
    bench.add_argument("--top-p", type=float, default=1.0)
    bench.add_argument("--seed", type=int, default=0)
    _add_pace_arg(bench)
    bench.add_argument(
        "--heads",
        default=None,
        help="heads directory: goes to the drafter of its kind (and to auto); other drafters use the shipped heads",
    )
    bench.add_argument("--out", default="runs/bench", help="directory for results.json, results.md and charts")
    bench.add_argument("--quick", action="store_true", help="smoke test: 2 prompts per set, 16 new tokens")

    train = commands.add_parser(
        "train", help="self-distil a drafter's heads from the target (data, labels, training, eval)"
    )
    train.add_argument(
        "drafter", help="which drafter to train (those with a training recipe: medusa, eagle, eagle3, dflash)"
    )
    train.add_argument("--config", required=True, help="a YAML recipe, e.g. configs/medusa-smollm2.yaml")
    train.add_argument("--model", default=None, help="override the recipe's model")
    train.add_argument("--out", default=None, help="override the recipe's output heads directory")
    train.add_argument("--max-steps", type=_positive_int, default=None, help="override train.max_steps")
    train.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in the work directory"
    )
    train.add_argument(
        "--tiny",
        action="store_true",
        help="a smoke run of the recipe at a tiny scale (minutes on a "
        "CPU; outputs get a -tiny suffix): check a recipe end to end before a long run",
    )

    tune = commands.add_parser(
        "tune", help="search a drafter's tuned data on this machine (layerskip: the skip set, Optuna)"
    )
    tune.add_argument("drafter", choices=["layerskip"], help="which drafter to tune")
    _add_model_args(tune)
    tune.add_argument(
        "--trials", type=_positive_int, default=60, help="trials in the study (a resumed study counts those it has)"
    )
    tune.add_argument("--seed", type=int, default=0, help="seeds the TPE sampler and the calibration sample")
    tune.add_argument(
        "--data",
        default="sharegpt",
        help="calibration data: 'sharegpt' (training split) or a JSONL file of conversations",
    )
    tune.add_argument("--prompts", type=_positive_int, default=4, help="calibration prompts timed per trial")
    tune.add_argument(
        "--max-new-tokens", type=_positive_int, default=48, help="tokens generated per calibration prompt"
    )
    tune.add_argument(
        "--draft-vocab-size", type=int, default=8192, help="the draft's LM-head rows: most frequent tokens (0 = all)"
    )
    tune.add_argument("--max-draft", type=_positive_int, default=8, help="upper bound of the searched chain length")
    tune.add_argument(
        "--out",
        default=None,
        help="skip-set file or directory (default: this model's entry in the selfspec cache, found automatically)",
    )
    tune.add_argument(
        "--storage", default=None, help="Optuna journal file of the study (default: beside --out); rerun to resume"
    )
    tune.add_argument(
        "--estimate-only",
        action="store_true",
        help="objective = stage-1 estimated speed-up, no timing (fast, deterministic)",
    )

    tree = commands.add_parser(
        "medusa-tree", help="rebuild a Medusa heads directory's tree from measured top-k accuracies"
    )
    _add_model_args(tree)
    tree.add_argument("--heads", required=True, help="the Medusa heads directory to update")
    tree.add_argument(
        "--data",
        required=True,
        help="'sharegpt' (training split) or a JSONL file of conversations the heads were not trained on",
    )
    tree.add_argument("--conversations", type=_positive_int, default=100)
    tree.add_argument(
        "--max-nodes", type=_positive_int, default=64, help="tree candidates to rank (the budget is chosen at run time)"
    )

    export = commands.add_parser(
        "export", help="write eagle3 or dflash heads in another library's format (speculators: vLLM loads it)"
    )
    export.add_argument("--model", default="default", help="the base model the heads are for (checked against them)")
    export.add_argument("--heads", required=True, help="the eagle3 or dflash heads directory to export")
    export.add_argument("--format", required=True, choices=["speculators"], help="the format to write")
    export.add_argument(
        "--verifier",
        default=None,
        help="the target's name recorded for the server to load (default: the "
        "hub id of the default model, else --model)",
    )
    export.add_argument("--weights-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    export.add_argument("out", help="the directory to write")
    imports = commands.add_parser(
        "import", help="turn a speculators EAGLE-3 or DFlash directory into heads checked against the model"
    )
    imports.add_argument("--model", default="default", help="the base model to check the heads against")
    imports.add_argument("source", help="the speculators directory (config.json + model.safetensors)")
    imports.add_argument("out", help="the heads directory to write")

    commands.add_parser("drafters", help="list the registered drafters")
    return parser


def _dtype(name: str | None):
    import torch

    return None if name is None else getattr(torch, name)


def _load_spec(args, needs_text: str | None = None):
    """The SelfSpec the model and drafter arguments name; `needs_text`: the command, which cannot run without a
    tokenizer."""
    from .api import SelfSpec
    from .errors import SelfspecError

    spec = SelfSpec(
        args.model,
        drafter=args.drafter,
        heads=args.heads,
        device=args.device,
        dtype=_dtype(args.dtype),
        kernels=args.kernels,
    )
    if needs_text and spec.target.tokenizer is None:
        raise SelfspecError(f"'{args.model}' has no tokenizer: {needs_text} needs one to read and show text")
    return spec


def _generate(args) -> None:
    from .errors import SelfspecError
    from .heads import parse_drafter_options
    from .sampling import SamplingConfig

    # Cheap checks first, so bad input fails before a model is loaded.
    SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    parse_drafter_options(args.drafter)
    if args.max_new_tokens <= 0:
        raise SelfspecError(f"--max-new-tokens must be a positive integer, got {args.max_new_tokens}")
    if not args.prompt.strip():
        raise SelfspecError("the prompt is empty: pass some text with --prompt")
    spec = _load_spec(args)
    result = spec.generate(
        prompt=args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        pace=args.pace,
        stream=lambda piece: print(piece, end="", flush=True),
        chat=not args.raw,
    )
    print()
    contributions = spec.drafter.stats().contributions()
    sources = f" accepted by source: {contributions}" if contributions else ""
    print(
        f"[selfspec] drafter={spec.drafter.describe()} kernels={spec.target.execution.name} "
        f"{result.stats.summary()}{sources}",
        file=sys.stderr,
    )


def _chat(args) -> None:
    from .chat import main_loop
    from .errors import SelfspecError
    from .heads import parse_drafter_options
    from .sampling import SamplingConfig

    SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)  # cheap checks first
    parse_drafter_options(args.drafter)
    if args.max_new_tokens <= 0:
        raise SelfspecError(f"--max-new-tokens must be a positive integer, got {args.max_new_tokens}")
    main_loop(_load_spec(args, needs_text="chat"), args)


def _demo(args) -> None:
    from .demo import MAX_NEW_TOKENS_LIMIT, DemoState, bind, serve
    from .errors import SelfspecError
    from .heads import parse_drafter_options

    parse_drafter_options(args.drafter)  # cheap checks first, then the port, then the model
    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
        raise SelfspecError(f"--max-new-tokens must be between 1 and {MAX_NEW_TOKENS_LIMIT}, got {args.max_new_tokens}")
    if not 0 < args.port < 65536:
        raise SelfspecError(f"--port must be between 1 and 65535, got {args.port}")
    server = bind(args.host, args.port)
    try:
        spec = _load_spec(args, needs_text="the demo")
    except BaseException:
        server.server_close()
        raise
    state = DemoState(spec, args.heads, args.max_new_tokens)
    print("selfspec demo: warming up (one short answer each way)", flush=True)
    state.warm_up()
    serve(server, state)


def _profile(args) -> None:
    import json

    import torch

    from .cost import PROFILE_SIZES, curve_from_times, measure_forward_times, save_cost_curve
    from .execution import ExecutionPath, fast_path_available
    from .models import load_target

    target = load_target(args.model, device=args.device, dtype=_dtype(args.dtype), kernels=args.kernels)
    paths = {"stock": ExecutionPath(target.model, "stock")}
    if fast_path_available(target.device, target.dtype)[0] and args.kernels != "stock":
        paths["fast"] = target.execution if target.execution.name == "fast" else ExecutionPath(target.model, "fast")
    if target.execution.name == "compiled":
        paths["compiled"] = target.execution
    times = measure_forward_times(target, paths, cache_length=args.cache_length, repeats=args.repeats)
    stored = {name: save_cost_curve(curve_from_times(times[name]), target.device, target.name, name) for name in paths}
    split = {"fast_stock_rows": paths["fast"].dispatch.stock_rows} if "fast" in paths else {}
    if args.json:
        print(
            json.dumps(
                {
                    "sizes": list(PROFILE_SIZES),
                    "ms": {name: [round(times[name][n] * 1e3, 2) for n in PROFILE_SIZES] for name in paths},
                    **split,
                }
            )
        )
        return
    step = times["stock"][1]
    header = "  ".join(f"{name + ' ms':>9}  {'x stock@1':>9}" for name in paths)
    print(f"{'n_new_tokens':>12}  {header}")
    for n in PROFILE_SIZES:
        print(
            f"{n:>12}  " + "  ".join(f"{times[name][n] * 1e3:>9.1f}  {times[name][n] / step:>9.2f}" for name in paths)
        )
    print(
        f"cache of {args.cache_length} tokens, {torch.get_num_threads()} threads; the drafters use the "
        f"'{target.execution.name}' curve{' (' + target.execution.note + ')' if target.execution.note else ''}"
    )
    if split:
        dispatch = paths["fast"].dispatch
        print(
            f"fast path: linear layers take the stock kernel below {dispatch.stock_rows} rows, the packed one from "
            f"there on ({dispatch.source})"
        )
    for name, path in stored.items():
        print(f"{name} curve stored in {path}")


def _bench(args) -> None:
    from pathlib import Path

    from .bench.harness import BenchRequest, parse_drafters, parse_list, run_bench, valid_peers
    from .bench.prompts import DATASETS
    from .bench.runner import BenchSettings
    from .models import load_target
    from .sampling import SamplingConfig

    SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    request = BenchRequest(
        drafters=parse_drafters(args.drafters),
        datasets=parse_list(args.datasets, DATASETS, "dataset"),
        peers=parse_list(args.peers, valid_peers(), "peer"),
        limit=args.limit,
        prompts_file=Path(args.prompts) if args.prompts else None,
        out_dir=Path(args.out),
        heads=Path(args.heads) if args.heads else None,
        quick=args.quick,
        command="selfspec " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else "selfspec bench",
    )
    settings = BenchSettings(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, pace=args.pace)
    target = load_target(args.model, device=args.device, dtype=_dtype(args.dtype), kernels=args.kernels)
    print(run_bench(target, request, settings))


def _train(args) -> None:
    from .training.config import load_recipe, tiny_scale
    from .training.pipeline import resolve_recipe, run_recipe

    resolve_recipe(args.drafter)  # an unknown or untrainable drafter fails before the recipe is read
    config = load_recipe(args.config, {"model": args.model, "out": args.out})
    if args.tiny:
        config = tiny_scale(config)
    if config.drafter != args.drafter:
        from .errors import SelfspecError

        raise SelfspecError(f"{args.config} is a '{config.drafter}' recipe, not '{args.drafter}'")
    report = run_recipe(config, resume=args.resume, max_steps=args.max_steps)
    heldout = report.get("heldout", {})
    print(
        f"heads written to {config.out}; held-out mean accepted length {heldout.get('mean_accepted_length', '-')}; "
        f"report: {config.out}/training_report.json"
    )


def _tune(args) -> None:
    from pathlib import Path

    from .heads.artifacts import SKIP_FILE
    from .heads.layerskip import user_skip_path
    from .models import load_target
    from .training.layerskip_search import TuneOptions, tune_layerskip

    options = TuneOptions(
        trials=args.trials,
        seed=args.seed,
        data=args.data,
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        draft_vocab_size=args.draft_vocab_size,
        max_draft=args.max_draft,
        timing=not args.estimate_only,
    )
    if args.data != "sharegpt" and not Path(args.data).is_file():
        from .errors import SelfspecError

        raise SelfspecError(f"calibration data '{args.data}' does not exist: pass 'sharegpt' or a JSONL file")
    target = load_target(args.model, device=args.device, dtype=_dtype(args.dtype), kernels=args.kernels)
    out = user_skip_path(target) if args.out is None else Path(args.out)
    out = out if out.suffix == ".json" else out / SKIP_FILE
    storage = Path(args.storage) if args.storage else out.with_name(out.stem + ".study.log")
    summary = tune_layerskip(target, options, storage, out, command="selfspec " + " ".join(sys.argv[1:]))
    best, baseline = summary["best"], summary.get("baseline_every_other_layer") or {}
    print(
        f"best of {summary['completed']} timed trials ({summary['pruned']} pruned): {best['value']} "
        f"(baseline every-other-layer: {baseline.get('value', '-')}); plain decoding "
        f"{summary.get('plain_tokens_per_s', '-')}"
    )
    print(
        f"skips attention {best['skip_attention']}, MLP {best['skip_mlp']}, threshold {best['threshold']}, "
        f"max draft {best['max_draft']}"
    )
    print(f"written to {out}; study in {storage}")


def _medusa_tree(args) -> None:
    from pathlib import Path

    from .models import load_target
    from .training.medusa_recipe import rebuild_tree

    target = load_target(args.model, device=args.device, dtype=_dtype(args.dtype), kernels=args.kernels)
    result = rebuild_tree(target, Path(args.heads), args.data, args.conversations, args.max_nodes)
    print(f"tree of up to {result['nodes']} nodes from {result['sequences']} sequences written to {args.heads}")


def _export(args) -> None:
    from pathlib import Path

    import torch

    from .exchange import export_heads, exportable_kind
    from .heads.speculators import speculators_type
    from .models import DEFAULT_MODEL, DEFAULT_MODEL_HUB_ID, load_target

    exportable_kind(Path(args.heads))  # bad input fails before the model loads
    target = load_target(args.model, device="cpu", dtype=torch.float32, kernels="stock")  # weights are copied, not run
    verifier = args.verifier or (
        DEFAULT_MODEL_HUB_ID if args.model == DEFAULT_MODEL else str(Path(args.model).resolve())
    )
    out = export_heads(target, Path(args.heads), Path(args.out), verifier, args.weights_dtype)
    print(f"speculators {speculators_type(out)} drafter written to {out} (verifier {verifier})")


def _import(args) -> None:
    from pathlib import Path

    import torch

    from .exchange import import_heads, importable_kind
    from .models import load_target

    importable_kind(Path(args.source))  # bad input fails before the model loads
    target = load_target(args.model, device="cpu", dtype=torch.float32, kernels="stock")
    drafter, out = import_heads(target, Path(args.source), Path(args.out))
    print(f"{drafter} heads written to {out}: use --drafter {drafter} --heads {out}")


def _drafters(args) -> None:
    from dataclasses import fields

    from .heads import drafter_entry, drafter_names

    for name in drafter_names():
        entry = drafter_entry(name)
        options = ", ".join(f.name for f in fields(entry.options_cls)) or "-"
        kind = (
            "composite"
            if entry.composite
            else "trained"
            if entry.recipe
            else ("tuned" if entry.has_artifacts else "parameter-free")
        )
        print(f"{name:<10} {kind:<15} options: {options}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    from .errors import SelfspecError

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    try:
        {
            "generate": _generate,
            "chat": _chat,
            "demo": _demo,
            "profile": _profile,
            "bench": _bench,
            "train": _train,
            "tune": _tune,
            "medusa-tree": _medusa_tree,
            "export": _export,
            "import": _import,
            "drafters": _drafters,
        }[args.command](args)
    except SelfspecError as error:
        print(f"selfspec: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nselfspec: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
