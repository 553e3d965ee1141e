"""What each command does with its parsed arguments. Heavy imports happen inside the commands, after the cheap
checks, so bad input fails before a model loads."""

from __future__ import annotations

import os
import sys
import time


def _dtype(name: str | None):
    import torch

    return None if name is None else getattr(torch, name)


def _load_spec(args, needs_text: str | None = None):
    """The SelfSpec the model and drafter arguments name; `needs_text`: the command, which cannot run without a
    tokenizer."""
    from ..api import SelfSpec
    from ..errors import SelfspecError

    spec = SelfSpec(
        args.model,
        drafter=args.drafter,
        heads=args.heads,
        device=args.device,
        dtype=_dtype(args.dtype),
        path=args.path,
    )
    if needs_text and spec.target.tokenizer is None:
        raise SelfspecError(f"'{args.model}' has no tokenizer: {needs_text} needs one to read and show text")
    return spec


def _check_request(args, prompt: str | None = None) -> None:
    """The API's checks of what the request can be checked for before a model loads (bad input fails at once)."""
    from ..api import check_request

    check_request(args.drafter, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, prompt)


def _generate(args) -> None:
    from ..models import check_default_prompt_fits

    _check_request(args, args.prompt)
    check_default_prompt_fits(args.model, args.prompt, chat=not args.raw)
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
        f"[selfspec] drafter={spec.drafter.describe()} path={result.stats.path} {result.stats.summary()}{sources}",
        file=sys.stderr,
    )


def _chat(args) -> None:
    from ..chat import main_loop

    _check_request(args)
    main_loop(_load_spec(args, needs_text="chat"), args)


def _demo(args) -> None:
    from ..api import check_request
    from ..demo import MAX_NEW_TOKENS_LIMIT, DemoState, bind, serve
    from ..errors import SelfspecError

    check_request(args.drafter)  # cheap checks first, then the port, then the model
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


def _serve(args) -> None:
    from ..api import check_request
    from ..errors import SelfspecError
    from ..execution.compiled import MAX_BATCH
    from ..models import loads_four_bit
    from ..serve import Scheduler, ServedModel, listen, run
    from .parser import SERVE_DRAFTER

    if args.drafter is None:
        if args.heads:
            raise SelfspecError(
                f"--heads needs --drafter with serve (its default, {SERVE_DRAFTER}, reads no heads): e.g. --drafter "
                f"auto --heads {args.heads}"
            )
        args.drafter = SERVE_DRAFTER
    check_request(args.drafter, args.max_new_tokens)  # cheap checks first, then the port, then the model
    if not 0 <= args.port < 65536:
        raise SelfspecError(f"--port must be between 0 and 65535, got {args.port}")
    if not 1 <= args.slots <= 64:
        raise SelfspecError(f"--slots must be between 1 and 64, got {args.slots}")
    four_bit = loads_four_bit(args.model, args.path, args.device, _dtype(args.dtype))
    if four_bit and args.slots > MAX_BATCH:  # a fuller step would run eager, whose roundings differ
        raise SelfspecError(
            f"the q4 path serves up to {MAX_BATCH} requests at once (its compiled step's batch), got --slots "
            f"{args.slots}" + ("" if args.path == "q4" else "; --path compiled serves more (the float32 weights)")
        )
    sock = listen(args.host, args.port)
    try:
        spec = _load_spec(args, needs_text="the server")
        spec.target.execution.prepare()  # settle the path: compiled where its graphs are stored, else fast
        scheduler = Scheduler(spec, args.slots)
        # every slot's drafter built now, not on a request: a slot's first request otherwise waited for it (auto:
        # 3 s for the first, 0.1 s for each other, on the 2-core Zen 4)
        for slot in range(args.slots):
            scheduler.engine.slot_drafter(slot)
        drafter = scheduler.engine.slot_drafter(0).describe()
    except BaseException:
        sock.close()
        raise
    served = ServedModel(spec.target.name, spec.target, args.drafter, args.max_new_tokens)
    host, port = sock.getsockname()[:2]
    print(
        f"selfspec serve: http://{host}:{port}/v1  (model '{served.model_id}', drafter {drafter}, path "
        f"{spec.target.execution.name}; up to {args.slots} requests verified together; Ctrl-C stops it)",
        flush=True,
    )
    run(sock, scheduler, served)


def _profile_paths(target, args) -> dict:
    """The paths `profile` measures, settled first (profiling starts no background build: a compiled path whose
    graphs are not stored runs `fast`)."""
    from ..errors import SelfspecError
    from ..execution import ExecutionPath, fast_path_available

    has_fast = fast_path_available(target.device, target.dtype)[0] and args.path != "stock"
    if args.recalibrate and not has_fast:
        raise SelfspecError(
            "--recalibrate: this device and dtype have no fast path (stock kernels only), so no row split to measure"
        )
    target.execution.recalibrate = args.recalibrate  # measured as the path settles, stored, then read by the others
    target.execution.prepare()
    paths = {"stock": ExecutionPath(target.model, "stock")}
    if target.execution.four_bit:  # its model holds no float32 linears to pack
        return paths | {target.execution.name: target.execution}
    if has_fast and target.execution.name == "fast":
        paths["fast"] = target.execution
    elif has_fast:
        paths["fast"] = ExecutionPath(target.model, "fast")
        paths["fast"].recalibrate = args.recalibrate and target.execution.name == "stock"  # else measured above
    if target.execution.name == "compiled":
        paths["compiled"] = target.execution
    return paths


def _profile(args) -> None:
    import json

    import torch

    from ..cost import PROFILE_SIZES, busy_spread, curve_from_times, fastest, forward_time_samples, save_cost_curve
    from ..errors import SelfspecError
    from ..execution.calibration import BUSY_SPREAD
    from ..models import load_target

    if args.recalibrate and args.path == "stock":
        raise SelfspecError("--recalibrate measures the fast path's row split, which --path stock never uses")
    target = load_target(args.model, device=args.device, dtype=_dtype(args.dtype), path=args.path)
    paths = _profile_paths(target, args)
    samples = forward_time_samples(target, paths, cache_length=args.cache_length, repeats=args.repeats)
    times = {name: fastest(by_size) for name, by_size in samples.items()}
    spread = max(busy_spread(by_size) for by_size in samples.values())
    if spread > BUSY_SPREAD:
        print(
            f"selfspec profile: warning: the machine was busy (the same step's time varied {spread:.1f}x); the curves "
            "below took each size's fastest round, but run it again on a quiet machine to trust them",
            file=sys.stderr,
        )
    stored = {
        name: save_cost_curve(curve_from_times(times[name]), target.device, target.cost_key, name, target.dtype)
        for name in paths
    }
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
            f"fast path: linear layers take the {'small-row' if dispatch.kernel == 'small' else 'stock'} kernel below "
            f"{dispatch.stock_rows} rows, the packed one from "
            f"there on ({dispatch.source})"
        )
    if target.execution.pending is not None:
        print("compiled path: its graphs are not stored yet (`selfspec compile` builds them, then profile again)")
    if "compiled" in paths:
        few = paths["compiled"].compiled.few_limit()
        print(
            f"compiled path: steps of 1-{few} tokens run in its 'few' graph, {few + 1}-64 in 'tree'"
            if few
            else "compiled path: every step runs in its 'tree' graph"
        )
    for name, path in stored.items():
        print(f"{name} curve stored in {path}")


def _compile(args) -> None:
    """Build this machine's compiled graphs ahead (an image, a CI cache, a benchmark), with a progress bar; with
    --background (as a request starts it: execution/background.py) at the lowest priority, logging to the log."""
    import torch

    from ..cost import target_cost_curve
    from ..errors import SelfspecError, first_line
    from ..execution import COMPILE_ENV
    from ..execution.background import (
        LOG_FILE,
        build_locked,
        compiling_elsewhere,
        lowest_priority,
        remove_superseded,
    )
    from ..execution.compiled import PACKAGE_FORMAT
    from ..models import load_target

    if args.device not in (None, "cpu") or args.dtype not in (None, "float32"):  # before the model loads
        raise SelfspecError("selfspec compile builds the compiled path's graphs, which are for float32 on a CPU")
    if args.background:
        lowest_priority()  # the CPU goes to decoding first
    if args.threads:
        torch.set_num_threads(args.threads)  # the requesting process's count: part of the packages' key
    if args.path == "q4":
        os.environ[COMPILE_ENV] = "wait"  # the q4 path otherwise leaves its graphs to a background build: this one
    target = load_target(args.model, device=args.device, dtype=_dtype(args.dtype), path=args.path)
    step, began = target.execution.compiled, time.perf_counter()
    if step is None:
        raise SelfspecError(f"--path {args.path}: nothing to compile here ({target.execution.note})")
    split = target.execution.row_split().stock_rows  # decides the graphs this machine uses
    kinds = step.missing()
    print(
        f"selfspec compile: graphs {', '.join(step.graphs_needed())} (row split at {split}) in {step.directory}"
        + (f"; building {', '.join(kinds)}" if kinds else "; all stored already"),
        flush=True,
    )
    if kinds and compiling_elsewhere(step.directory) and not args.background:
        print(f"selfspec compile: waiting for the build another process runs ({step.directory / LOG_FILE})", flush=True)
    step.log = print if args.background else (lambda message: None)  # the bar says it on a terminal
    try:
        built = build_locked(step, wait=not args.background, show_progress=not args.background)
    except Exception as error:  # noqa: BLE001  (export and the C++ build fail in many ways)
        raise SelfspecError(f"compiling the step failed ({first_line(error)[:200]}); --path fast runs") from None
    if built is None:  # a request started this, and another build already runs
        print("selfspec compile: another process is building these graphs; leaving it to that one")
        return
    for old, size in remove_superseded(step.directory, PACKAGE_FORMAT):  # no process of this version reads them
        print(f"selfspec compile: removed {old.name} ({size / 2**20:.0f} MB), an older package format's", flush=True)
    target.execution.prepare()  # loads what was just stored (and times `few` against `tree` once, where both are)
    curve = target_cost_curve(target)  # the compiled path's cost curve, measured once here if none is stored
    few = step.few_limit()
    print(
        f"selfspec compile: done in {time.perf_counter() - began:.0f} s; "
        + (f"steps of up to {few} rows run in 'few', more in 'tree'; " if few else "")
        + f"the compiled path's cost curve: {curve.source}; later runs load the graphs in a second or two",
        flush=True,
    )


def _bench(args) -> None:
    from pathlib import Path

    from ..bench.harness import BenchRequest, parse_drafters, parse_list, run_bench, valid_peers
    from ..bench.runner import BenchSettings
    from ..models import load_target
    from ..sampling import SamplingConfig
    from ..training.data.prompt_sets import DATASETS

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
    target = load_target(args.model, device=args.device, dtype=_dtype(args.dtype), path=args.path)
    print(run_bench(target, request, settings))


def _train(args) -> None:
    from ..training.config import load_joint_recipe, load_recipe, tiny_scale
    from ..training.trainer.pipeline import resolve_recipe, run_recipe

    overrides = {"model": args.model, "out": args.out}
    if args.drafter == "heads":  # a joint recipe: one label pass, every head (the recipe is read before any model)
        joint = load_joint_recipe(args.config, overrides)
        _train_heads(tiny_scale(joint) if args.tiny else joint, args)
        return
    resolve_recipe(args.drafter)  # an unknown or untrainable drafter fails before the recipe is read
    config = load_recipe(args.config, overrides)
    if args.tiny:
        config = tiny_scale(config)
    if config.drafter != args.drafter:
        from ..errors import SelfspecError

        raise SelfspecError(f"{args.config} is a '{config.drafter}' recipe, not '{args.drafter}'")
    report = run_recipe(config, resume=args.resume, max_steps=args.max_steps)
    heldout = report.get("heldout", {})
    print(
        f"heads written to {config.out}; held-out mean accepted length {heldout.get('mean_accepted_length', '-')}; "
        f"report: {config.out}/training_report.json"
    )


def _train_heads(config, args) -> None:
    from ..training.recipes.joint import run_joint

    reports = run_joint(config, resume=args.resume, max_steps=args.max_steps)
    for name, report in reports.items():
        heldout = report.get("heldout", {})
        print(
            f"{name} written to {config.out}/{name}; held-out mean accepted length "
            f"{heldout.get('mean_accepted_length', '-')}; report: {config.out}/{name}/training_report.json"
        )


def _tune(args) -> None:
    from pathlib import Path

    from ..heads.artifacts import SKIP_FILE
    from ..heads.layerskip import user_skip_path
    from ..models import load_target
    from ..training.recipes.layerskip import TuneOptions, tune_layerskip

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
        from ..errors import SelfspecError

        raise SelfspecError(f"calibration data '{args.data}' does not exist: pass 'sharegpt' or a JSONL file")
    target = load_target(args.model, device=args.device, dtype=_dtype(args.dtype), path=args.path)
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

    from ..models import load_target
    from ..training.recipes.medusa import rebuild_tree

    # the shipped trees are the float32 weights' (as the heads' training data): `auto` keeps them on a 4-bit GGUF
    target = load_target(args.model, device=args.device, dtype=_dtype(args.dtype), path=args.path, four_bit=False)
    result = rebuild_tree(target, Path(args.heads), args.data, args.conversations, args.max_nodes)
    print(f"tree of up to {result['nodes']} nodes from {result['sequences']} sequences written to {args.heads}")


def _export(args) -> None:
    from pathlib import Path

    import torch

    from ..exchange import export_heads, exportable_kind
    from ..heads.speculators import speculators_type
    from ..models import DEFAULT_MODEL, DEFAULT_MODEL_HUB_ID, load_target

    exportable_kind(Path(args.heads))  # bad input fails before the model loads
    target = load_target(args.model, device="cpu", dtype=torch.float32, path="stock")  # weights are copied, not run
    verifier = args.verifier or (
        DEFAULT_MODEL_HUB_ID if args.model == DEFAULT_MODEL else str(Path(args.model).resolve())
    )
    out = export_heads(target, Path(args.heads), Path(args.out), verifier, args.weights_dtype)
    print(f"speculators {speculators_type(out)} drafter written to {out} (verifier {verifier})")


def _import(args) -> None:
    from pathlib import Path

    import torch

    from ..exchange import import_heads, importable_kind
    from ..models import load_target

    importable_kind(Path(args.source))  # bad input fails before the model loads
    target = load_target(args.model, device="cpu", dtype=torch.float32, path="stock")
    drafter, out = import_heads(target, Path(args.source), Path(args.out))
    print(f"{drafter} heads written to {out}: use --drafter {drafter} --heads {out}")


def _drafters(args) -> None:
    from dataclasses import fields

    from ..heads import drafter_entry, drafter_names

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


COMMANDS = {
    "generate": _generate,
    "chat": _chat,
    "demo": _demo,
    "serve": _serve,
    "profile": _profile,
    "bench": _bench,
    "compile": _compile,
    "train": _train,
    "tune": _tune,
    "medusa-tree": _medusa_tree,
    "export": _export,
    "import": _import,
    "drafters": _drafters,
}
