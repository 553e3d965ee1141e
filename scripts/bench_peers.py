"""selfspec's float32 compiled path and its 4-bit path beside llama.cpp, one sitting, the same prompts.

The same held-out-style prompts as `selfspec bench` (MT-bench and HumanEval, a spread sample of --limit each), each
rendered once by the model's chat template into token ids that every method starts from; greedy, --max-new-tokens,
stopping at the model's end token. Methods, interleaved by prompt (each prompt starts the rotation one method later):
- selfspec on `compiled` (the float32 weights de-quantised from the GGUF) and on `q4` (the GGUF's own 4-bit blocks,
  its step compiled), each with `none` and the drafters named by --drafters;
- llama.cpp (llama-cpp-python) on the shipped Q4_1 file and on an F32 GGUF of the very weights selfspec's float32
  path runs (llama.cpp's own de-quantisation of the shipped file, written once beside the results), each plain and
  with its prompt lookup (`LlamaPromptLookupDecoding`).
Writes results.json and results.md: tokens/s per method (generated tokens over the wall time from the prompt's ids
to the last token, prefill included), and per selfspec method whether its tokens equal `none`'s on its own path.

    pip install llama-cpp-python        # built for this CPU
    python scripts/bench_peers.py --out docs/results/q4-peers-YYYY-MM-DD
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from selfspec.bench.runner import BenchSettings, _selfspec_method
from selfspec.errors import SelfspecError
from selfspec.files import atomic_write_text, cache_root
from selfspec.models import default_gguf_file, load_target
from selfspec.training.data.prompt_sets import load_prompt_set


def f32_gguf(source: Path) -> Path:
    """An F32 GGUF of `source`'s weights, de-quantised by llama.cpp itself (written once under the cache)."""
    import llama_cpp

    out = cache_root() / "peers" / (source.name.rsplit(".", 2)[0] + ".F32.gguf")
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = out.with_suffix(f".{os.getpid()}.tmp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = 0, True, torch.get_num_threads()  # 0: all F32
    if llama_cpp.llama_model_quantize(str(source).encode(), str(temp).encode(), ctypes.byref(params)) != 0:
        temp.unlink(missing_ok=True)
        raise SelfspecError(f"llama.cpp could not write an F32 copy of {source}")
    os.replace(temp, out)
    return out


def llama_method(model_file: Path, lookup: bool, eos: set[int], threads: int):
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=10) if lookup else None
    llm = Llama(
        str(model_file), n_ctx=2048, n_threads=threads, n_threads_batch=threads, draft_model=draft, verbose=False
    )

    def run(input_ids: torch.Tensor, max_new_tokens: int) -> list[int]:
        tokens: list[int] = []
        for token in llm.generate(input_ids[0].tolist(), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, reset=True):
            if token in eos:
                break
            tokens.append(token)
            if len(tokens) >= max_new_tokens:
                break
        return tokens

    return run


def selfspec_method(target, spec: str, settings: BenchSettings):
    method = _selfspec_method(target, spec, settings, None)

    def run(input_ids: torch.Tensor, max_new_tokens: int) -> list[int]:
        return list(method(input_ids, max_new_tokens, settings.seed).token_ids)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for results.json and results.md")
    parser.add_argument("--limit", type=int, default=8, help="prompts per set (mtbench, humaneval)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--drafters", default="ngram,auto", help="selfspec drafters beside `none`, on both paths")
    args = parser.parse_args()
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        sys.exit("bench_peers: error: llama-cpp-python is not installed: pip install llama-cpp-python")
    threads = torch.get_num_threads()
    settings = BenchSettings(max_new_tokens=args.max_new_tokens)
    targets = {"compiled": load_target("default", path="compiled"), "q4": load_target("default", path="q4")}
    for target in targets.values():
        target.execution.prepare()  # q4's graphs: stored by `selfspec compile --path q4` first, else it runs eager
    eos = set(targets["q4"].eos_token_ids)
    shipped = default_gguf_file()
    methods = {}
    for target in targets.values():
        for spec in ["none", *args.drafters.split(",")]:
            methods[f"selfspec {target.execution.name} {spec}"] = selfspec_method(target, spec, settings)
    for label, file in (("Q4_1", shipped), ("F32", f32_gguf(shipped))):
        methods[f"llama.cpp {label} plain"] = llama_method(file, False, eos, threads)
        methods[f"llama.cpp {label} lookup"] = llama_method(file, True, eos, threads)
    prompts = load_prompt_set("mtbench", args.limit) + load_prompt_set("humaneval", args.limit)
    encoded = [targets["q4"].encode_prompt(item.text) for item in prompts]
    for method in methods.values():  # warm-up
        method(encoded[0], 8)
    names = list(methods)
    runs = {name: [] for name in names}
    for index, (item, input_ids) in enumerate(zip(prompts, encoded, strict=True)):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            start = time.perf_counter()
            tokens = methods[name](input_ids, args.max_new_tokens)
            runs[name].append(
                {"prompt": f"{item.dataset}:{item.id}", "tokens": tokens, "s": time.perf_counter() - start}
            )
        print(f"prompt {index + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    write_results(Path(args.out), runs, args, threads)


def write_results(out: Path, runs: dict, args, threads: int) -> None:
    rows = []
    for name, records in runs.items():
        tokens, seconds = sum(len(r["tokens"]) for r in records), sum(r["s"] for r in records)
        row = {"method": name, "prompts": len(records), "tokens": tokens, "seconds": round(seconds, 3)}
        row["tokens_per_s"] = round(tokens / seconds, 2)
        if name.startswith("selfspec"):
            plain = runs[name.rsplit(" ", 1)[0] + " none"]
            row["equal_to_none"] = sum(a["tokens"] == b["tokens"] for a, b in zip(records, plain, strict=True))
        rows.append(row)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    machine = f"{cpu}, {os.cpu_count()} cores, {'AVX-512' if 'avx512f' in flags else 'AVX2'}"
    machine += ", avx512_bf16" if "avx512_bf16" in flags else ""
    kept = {  # per run: what it made and how long it took, not the tokens (the tree every device call carries is small)
        name: [
            {"prompt": r["prompt"], "new_tokens": len(r["tokens"]), "s": round(r["s"], 4)}
            | (
                {"equal_to_none": r["tokens"] == runs[name.rsplit(" ", 1)[0] + " none"][i]["tokens"]}
                if name.startswith("selfspec")
                else {}
            )
            for i, r in enumerate(records)
        ]
        for name, records in runs.items()
    }
    document = {
        "command": "python scripts/bench_peers.py " + " ".join(sys.argv[1:]),
        "commit": commit,
        "machine": machine,
        "threads": threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "max_new_tokens": args.max_new_tokens,
        "rows": rows,
        "runs": kept,
    }
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "results.json", json.dumps(document, indent=1))
    lines = [
        "# selfspec and llama.cpp, one sitting",
        "",
        f"`{document['command']}` at {commit}; {machine}; {threads} threads each; greedy, {args.max_new_tokens} new "
        "tokens; tokens/s = generated tokens over the wall time from the prompt's ids (prefill included).",
        "",
        "| method | prompts | tokens | tokens/s | = none on its path |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        equal = f"{row['equal_to_none']}/{row['prompts']}" if "equal_to_none" in row else "-"
        lines.append(f"| {row['method']} | {row['prompts']} | {row['tokens']} | {row['tokens_per_s']} | {equal} |")
    atomic_write_text(out / "results.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
