"""The command line's arguments: one subparser per command, shared groups of flags."""

from __future__ import annotations

import argparse


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _add_model_args(parser: argparse.ArgumentParser, path: bool = True) -> None:
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
    if not path:
        return
    parser.add_argument(
        "--path",
        default="auto",
        choices=["auto", "stock", "fast", "compiled", "q4"],
        help="the target's execution path: fast = weights pre-packed for small-row GEMMs (CPU, float32); compiled = "
        "fast, with the decoding steps compiled ahead of time (once per machine, a few minutes; needs g++); "
        "q4 = a GGUF file's own 4-bit weights on PyTorch's int4 kernel (CPU; not the float32 text: docs/execution.md); "
        "auto = the best of these that exists here",
    )


# `serve`'s drafter when none is named. With several requests in each step a drafter's own time delays them all, and
# prompt lookup alone served more than `auto` (whose trained heads take milliseconds a request each step) in ten of
# eleven measurements at four requests and four of five at two on the 2-core Zen 5: docs/serve.md, "Which drafter a
# server runs".
SERVE_DRAFTER = "ngram"


def _add_drafter_args(parser: argparse.ArgumentParser, drafter_help: str, default: str | None = "auto") -> None:
    parser.add_argument("--drafter", default=default, help=drafter_help)
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
    _add_decoding_commands(commands)
    _add_measuring_commands(commands)
    _add_training_commands(commands)
    _add_head_commands(commands)
    return parser


def _add_decoding_commands(commands: argparse._SubParsersAction) -> None:
    """generate, chat, demo and serve: text from a model"""
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

    serve = commands.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions): docs/serve.md"
    )
    _add_model_args(serve)
    _add_drafter_args(
        serve,
        f"drafter spec, as for generate (default: {SERVE_DRAFTER}, prompt lookup: with several requests a step it "
        "serves more than auto; docs/serve.md)",
        default=None,
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    serve.add_argument("--port", type=int, default=8000, help="0 picks a free port (the address is printed)")
    serve.add_argument(
        "--slots",
        type=int,
        default=4,
        help="requests decoded together, their draft trees verified in one forward (default 4; 1: one at a time)",
    )
    serve.add_argument(
        "--max-new-tokens",
        type=int,
        default=256,
        help="a request's token limit when it gives no max_tokens (within what the context leaves), as for generate",
    )


def _add_measuring_commands(commands: argparse._SubParsersAction) -> None:
    """profile, build and bench: what the machine and the drafters measure"""
    profile = commands.add_parser("profile", help="measure and store this machine's verification cost curve")
    _add_model_args(profile)
    profile.add_argument(
        "--cache-length", type=_positive_int, default=512, help="cached tokens before the timed forward"
    )
    profile.add_argument("--repeats", type=_positive_int, default=7)
    profile.add_argument(
        "--recalibrate",
        action="store_true",
        help="measure the row splits anew and store them (the fast path's linears', the compiled graphs'); else the "
        "stored ones are kept",
    )
    profile.add_argument(
        "--json", action="store_true", help='print {"sizes": [...], "ms": {"stock": [...], "fast": [...]}} only'
    )

    build = commands.add_parser(
        "compile",
        help="build this machine's compiled decoding graphs ahead, with a progress bar (requests otherwise start it "
        "in the background on first use); $SELFSPEC_COMPILE: docs/execution.md",
    )
    _add_model_args(build, path=False)
    build.add_argument(
        "--path",
        default="compiled",
        choices=["compiled", "q4"],
        help="whose graphs: the float32 compiled path's (default) or the 4-bit path's (a GGUF model)",
    )
    build.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="torch threads the graphs are built for (part of their key; default: torch's, as a request has)",
    )
    build.add_argument(
        "--background", action="store_true", help="as a request starts it: lowest priority, no bar, no waiting"
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


def _add_training_commands(commands: argparse._SubParsersAction) -> None:
    """train, tune and medusa-tree: making drafters"""
    train = commands.add_parser(
        "train", help="self-distil a drafter's heads from the target (data, labels, training, eval)"
    )
    train.add_argument(
        "drafter",
        help="which drafter to train (those with a training recipe: medusa, eagle, eagle3, dflash), or `heads`: "
        "EAGLE-3, DFlash and Medusa-1 together from one label pass (a joint recipe, e.g. configs/heads-smollm2.yaml)",
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


def _add_head_commands(commands: argparse._SubParsersAction) -> None:
    """export, import and drafters: the heads themselves"""
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
