"""GPU check on the default model: greedy equality with HF generate, `none` vs HF speed, the CUDA cost curve.

Usage: python scripts/gpu_check.py PATH.gguf OUT_DIR [n_prompts] [max_new_tokens]
Run on a CUDA machine; the dev tool used to validate the CUDA code paths (results go in the issue notes).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from selfspec import SamplingConfig, create_drafter, load_target, speculative_generate
from selfspec.cost import measure_cost_curve
from selfspec.training.data.prompt_sets import load_prompt_set


def timed(fn, *args):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn(*args)
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def check(target, prompts, max_new_tokens: int) -> dict:
    drafters = {name: create_drafter(name, target) for name in ("none", "ngram")}
    ids = [target.encode_prompt(p.text).to("cuda") for p in prompts]

    def hf_generate(x):
        return target.model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False
        )[0, x.shape[1] :].tolist()  # noqa: E731

    hf_generate(ids[0])  # warm-up
    for d in drafters.values():
        speculative_generate(target, d, ids[0], 8)
    totals = {"hf": [0, 0.0], "none": [0, 0.0], "ngram": [0, 0.0]}
    matches = {"none": 0, "ngram": 0}
    forwards = {"none": 0, "ngram": 0}
    for x in ids:
        with torch.inference_mode():
            reference, wall = timed(hf_generate, x)
        totals["hf"][0] += len(reference)
        totals["hf"][1] += wall
        for name, drafter in drafters.items():
            (tokens, stats), wall = timed(speculative_generate, target, drafter, x, max_new_tokens, SamplingConfig())
            totals[name][0] += len(tokens)
            totals[name][1] += wall
            forwards[name] += stats.target_forwards
            matches[name] += int(list(tokens) == reference)
    result = {name: {"tok_s": round(n / t, 1), "tokens": n} for name, (n, t) in totals.items()}
    for name in drafters:
        result[name]["greedy_match"] = f"{matches[name]}/{len(ids)}"
        result[name]["tau"] = round(totals[name][0] / forwards[name], 2)
        result[name]["speedup_vs_hf"] = round(result[name]["tok_s"] / result["hf"]["tok_s"], 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", type=Path, help="the default model's GGUF file")
    parser.add_argument("out", type=Path, help="directory for gpu_check.json")
    parser.add_argument("n_prompts", type=int, nargs="?", default=5)
    parser.add_argument("max_new_tokens", type=int, nargs="?", default=256)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(2, "gpu_check.py: no CUDA device here: run it on a machine with a GPU\n")
    gguf, out, n_prompts, max_new_tokens = args.gguf, args.out, args.n_prompts, args.max_new_tokens
    prompts = load_prompt_set("mtbench", limit=n_prompts)
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for dtype in (torch.float32, torch.bfloat16):
        target = load_target(gguf, device="cuda", dtype=dtype)
        target.name = "SmolLM2-135M-Instruct"
        name = str(dtype).replace("torch.", "")
        report[name] = check(target, prompts, max_new_tokens)
        curve = measure_cost_curve(target, cache_length=512, repeats=9)
        report[name]["cost_curve"] = dict(zip(curve.sizes, curve.relative_cost, strict=True))
        print(name, json.dumps(report[name]), flush=True)
        del target
        torch.cuda.empty_cache()
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
