"""Soak of `selfspec serve`: thousands of short requests through the real server, its resident memory read as it goes.

    python scripts/soak_serve.py [--requests 2000] [--clients 4] [--max-tokens 24] [--out runs/serve-soak]
    python scripts/soak_serve.py --path compiled --threads 0 --requests 200 --clients 8 --max-tokens 16-128

The server (uvicorn and the batch scheduler, as `selfspec serve` runs them) runs in threads of this process on the
default model with `auto`, on --path (default fast; compiled reads stored graphs; no compiling here:
$SELFSPEC_COMPILE=0; decoding on a thread runs slower than `selfspec serve` does on its main thread: memory is what this
measures), and --clients client processes send it chat requests over loopback HTTP, one at a time each: the held-out
MT-bench, HumanEval and ShareGPT prompts in turn, --max-tokens each (a range A-B: each prompt its own, drawn from it by
the prompt's index), prompts of even index greedy and the others sampled (T = 0.8, top-p 0.95, seed = the prompt's
index), every third request streamed. Requests go in rounds of --every; after each round, with nothing in flight, the
process's resident memory (VmRSS) is read: what the server keeps between requests, not the working set of those in
flight, which a sampler thread records as each round's peak. A prompt that comes round again is asked with the same
settings, so its reply must be the same text: greedy ones token for token (the run fails if one differs); seeded ones up
to the rounding of a batched step (counted, docs/serve.md). A reply must be whole: a finish reason of `stop`, or
`length` at its max_tokens (the run fails on one that is not: a truncated reply). After the soak, the first replies of
--check greedy prompts and --check seeded ones are compared with `selfspec generate --drafter none` alone (the same
model in this process, the same settings and seed; a seeded one that differs is counted, not a failure).
Writes results.json and results.md to --out; the growth between request --from (default 200) and the last is the figure
the bar is set on.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

SAMPLED = {"temperature": 0.8, "top_p": 0.95}


def prompts() -> list[str]:
    """The held-out prompt sets, interleaved (one of each in turn while each lasts)."""
    from selfspec.training.data.prompt_sets import load_prompt_set

    sets = [[item.text for item in load_prompt_set(name)] for name in ("mtbench", "humaneval", "sharegpt")]
    return [group[k] for k in range(max(map(len, sets))) for group in sets if k < len(group)]


def token_limit(prompt_index: int, max_tokens: tuple[int, int]) -> int:
    """A prompt's max_tokens: the range's own for every prompt, or one drawn from it by the prompt's index."""
    low, high = max_tokens
    return low + (prompt_index * 7919) % (high - low + 1)


def parse_limit(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        limits = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--max-tokens takes N or A-B, got '{text}'") from None
    if not 1 <= limits[0] <= limits[1]:
        raise argparse.ArgumentTypeError(f"--max-tokens takes 1 <= A <= B, got '{text}'")
    return limits


def is_whole(reply: dict, limit: int) -> bool:
    """A reply that ended at a stop, or at its token limit exactly (not one cut short)."""
    return reply["finish"] == "stop" or (reply["finish"] == "length" and reply["tokens"] == limit)


def settings(index: int, prompt_index: int, max_tokens: tuple[int, int]) -> dict:
    """Request `index`'s body settings: by its prompt (greedy or seeded, its token limit), streamed every third
    request."""
    body: dict = {"max_tokens": token_limit(prompt_index, max_tokens), "stream": index % 3 == 0}
    if prompt_index % 2:
        body.update(SAMPLED, seed=prompt_index)
    return body


def one_request(url: str, prompt: str, body: dict) -> dict:
    """One chat request -> its text, finish reason and token count, or its error."""
    payload = {"messages": [{"role": "user", "content": prompt}], **body}
    connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=600)
    text, tokens, error, finish = "", 0, None, None
    try:
        connection.request("POST", "/v1/chat/completions", json.dumps(payload), {"Content-Type": "application/json"})
        reply = connection.getresponse()
        if not body["stream"]:
            answer = json.loads(reply.read())
            if reply.status != 200 or "error" in answer:
                return {"text": "", "tokens": 0, "error": f"{reply.status}: {answer.get('error')}"}
            return {
                "text": answer["choices"][0]["message"]["content"],
                "tokens": answer["usage"]["completion_tokens"],
                "finish": answer["choices"][0]["finish_reason"],
                "error": None,
            }
        while line := reply.readline():
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]["message"]
            elif chunk["choices"]:
                text += chunk["choices"][0]["delta"].get("content") or ""
                finish = chunk["choices"][0].get("finish_reason") or finish
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    except (OSError, http.client.HTTPException, ValueError) as failure:
        error = f"{type(failure).__name__}: {failure}"
    finally:
        connection.close()
    return {"text": text, "tokens": tokens, "finish": finish, "error": error}


def resident_mb() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def trimmed_mb() -> float:
    from selfspec.memory import release_freed_memory

    release_freed_memory()
    return resident_mb()


class PeakSampler(threading.Thread):
    """The highest resident size seen (every `period` s) since the last `take`."""

    def __init__(self, period: float = 0.5):
        super().__init__(daemon=True)
        self.period, self.peak, self.stopped = period, 0.0, threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.period):
            self.peak = max(self.peak, resident_mb())

    def take(self) -> float:
        peak, self.peak = max(self.peak, resident_mb()), 0.0
        return peak


def soak(args, pool: ProcessPoolExecutor) -> dict:
    import torch

    from selfspec import SelfSpec
    from selfspec.cli.parser import SERVE_DRAFTER
    from selfspec.serve import Scheduler, ServedModel, ServerThread

    if args.threads:
        torch.set_num_threads(args.threads)
    texts = prompts()
    args.drafter = args.drafter or SERVE_DRAFTER
    spec = SelfSpec(args.model, drafter=args.drafter, path=args.path)
    spec.target.execution.prepare()  # as `selfspec serve` does
    scheduler = Scheduler(spec, args.slots)
    drafter = scheduler.engine.slot_drafter(0).describe()  # built before the first request, as the command does
    server = ServerThread(scheduler, ServedModel(spec.target.name, spec.target, args.drafter, args.max_tokens[1]))
    sampler = PeakSampler()
    sampler.start()
    samples = [{"requests": 0, "rss_mb": round(resident_mb(), 1), "peak_mb": round(sampler.take(), 1), "wall_s": 0.0}]
    first_reply: dict[int, str] = {}  # prompt index -> its first reply's text
    differing = {"greedy": [], "sampled": []}
    counts = {"errors": 0, "truncated": 0, "tokens": 0, "repeats": {"greedy": 0, "sampled": 0}}
    began = time.perf_counter()
    try:
        for start in range(0, args.requests, args.every):
            indices = list(range(start, min(args.requests, start + args.every)))
            prompt_indices = [index % len(texts) for index in indices]
            bodies = [settings(index, p, args.max_tokens) for index, p in zip(indices, prompt_indices, strict=True)]
            replies = pool.map(
                one_request, [server.url] * len(indices), [texts[p] for p in prompt_indices], bodies, chunksize=1
            )
            for index, p, reply in zip(indices, prompt_indices, replies, strict=True):
                if reply["error"] is not None or reply["tokens"] == 0:
                    counts["errors"] += 1
                    print(f"request {index}: {reply['error']}", file=sys.stderr, flush=True)
                    continue
                counts["tokens"] += reply["tokens"]
                if not is_whole(reply, token_limit(p, args.max_tokens)):
                    counts["truncated"] += 1
                    print(f"request {index}: {reply['finish']} after {reply['tokens']} tokens", file=sys.stderr)
                kind = "sampled" if p % 2 else "greedy"
                if p in first_reply:
                    counts["repeats"][kind] += 1
                    if reply["text"] != first_reply[p]:
                        differing[kind].append(index)
                else:
                    first_reply[p] = reply["text"]
            sample = {
                "requests": indices[-1] + 1,
                "rss_mb": round(resident_mb(), 1),  # nothing in flight: the round has been answered
                "rss_trimmed_mb": round(trimmed_mb(), 1),  # the same after the C allocator gave back what it could
                "peak_mb": round(sampler.take(), 1),
                "wall_s": round(time.perf_counter() - began, 1),
            }
            samples.append(sample)
            print(json.dumps({**sample, "errors": counts["errors"], "truncated": counts["truncated"]}), flush=True)
        health = scheduler.health()
    finally:
        sampler.stopped.set()
        server.stop()
    checked = check_alone(SelfSpec(spec.target, drafter="none"), texts, first_reply, args)
    (counts["checked_alone"], unlike_alone), (counts["sampled_checked_alone"], sampled_unlike_alone) = checked
    return {
        "samples": samples,
        "counts": counts,
        "differing": {**differing, "greedy_vs_alone": unlike_alone, "sampled_vs_alone": sampled_unlike_alone},
        "health": health,
        "drafter": drafter,
        "path": spec.target.execution.name,
        "model": spec.target.name,
        "prompts": len(texts),
        "wall_s": round(time.perf_counter() - began, 1),
    }


def check_alone(alone, texts: list[str], first_reply: dict[int, str], args) -> list[tuple[int, list[int]]]:
    """The first replies of --check greedy and --check seeded prompts against `alone` (a SelfSpec with `none`) given
    the same settings and seed -> for greedy, then seeded: (the prompts checked, those whose replies differ)."""

    def differs(p: int) -> bool:
        sampling = {} if p % 2 == 0 else {**SAMPLED, "seed": p}
        reply = alone.generate(texts[p], max_new_tokens=token_limit(p, args.max_tokens), **sampling)
        return reply.text != first_reply[p]

    kinds = ([p for p in first_reply if p % 2 == 0][: args.check], [p for p in first_reply if p % 2][: args.check])
    return [(len(prompts), [p for p in prompts if differs(p)]) for prompts in kinds]


def summarize(result: dict, frm: int) -> dict:
    samples = result["samples"]
    at = min((sample for sample in samples if sample["requests"] >= frm), key=lambda sample: sample["requests"])
    last = samples[-1]
    after = [sample["rss_mb"] for sample in samples if sample["requests"] >= at["requests"]]
    return {
        "from_requests": at["requests"],
        "rss_from_mb": at["rss_mb"],
        "to_requests": last["requests"],
        "rss_to_mb": last["rss_mb"],
        "growth_mb": round(last["rss_mb"] - at["rss_mb"], 1),
        "range_after_from_mb": round(max(after) - min(after), 1),
        "max_peak_mb": max(sample["peak_mb"] for sample in samples),
    }


def write_outputs(out: Path, meta: dict, result: dict, summary: dict) -> None:
    from selfspec.files import atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "results.json", json.dumps({"meta": meta, "summary": summary, **result}, indent=1) + "\n")
    counts, differing = result["counts"], result["differing"]
    sampled_equal = counts["sampled_checked_alone"] - len(differing["sampled_vs_alone"])
    lines = [
        f"# selfspec serve soak: {meta['requests']} requests, {result['model']}, drafter {result['drafter']}",
        "",
        f"{meta['date']}, commit {meta['commit']}, {meta['machine']}, path {result['path']}, {meta['slots']} slots, "
        f"{meta['clients']} client processes, max_tokens {meta['max_tokens']}, torch threads {meta['threads']}. "
        f"Command: `{meta['command']}`",
        "",
        f"**Resident memory: {summary['rss_from_mb']:.1f} MB at request {summary['from_requests']}, "
        f"{summary['rss_to_mb']:.1f} MB at request {summary['to_requests']}: {summary['growth_mb']:+.1f} MB** "
        f"(range after request {summary['from_requests']}: {summary['range_after_from_mb']:.1f} MB; read with nothing "
        f"in flight, after each round of {meta['every']}; the highest seen while requests ran: "
        f"{summary['max_peak_mb']:.1f} MB).",
        "",
        f"{counts['errors']} errors, {counts['truncated']} truncated replies, {counts['tokens']} tokens in "
        f"{result['wall_s']:.0f} s. Replies to a prompt asked "
        f"again with the same settings: greedy {counts['repeats']['greedy'] - len(differing['greedy'])}/"
        f"{counts['repeats']['greedy']} the same text, seeded sampling "
        f"{counts['repeats']['sampled'] - len(differing['sampled'])}/{counts['repeats']['sampled']}. "
        f"Greedy replies equal to `selfspec generate --drafter none` alone: "
        f"{counts['checked_alone'] - len(differing['greedy_vs_alone'])}/{counts['checked_alone']}, seeded ones to "
        f"`generate --drafter none` with the same settings and seed: {sampled_equal}/"
        f"{counts['sampled_checked_alone']}. "
        f"Server health at the end: {json.dumps(result['health'])}.",
        "",
        "| requests | RSS MB (idle) | peak MB (in flight) | wall s |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {s['requests']} | {s['rss_mb']:.1f} | {s['peak_mb']:.1f} | {s['wall_s']:.0f} |" for s in result["samples"]
    ]
    atomic_write_text(out / "results.md", "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--drafter", default=None, help="the server's drafter (default: serve's)")
    parser.add_argument("--path", default="fast", help="fast (eager steps) or compiled (stored graphs)")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--clients", type=int, default=4, help="client processes, one request in flight each")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--max-tokens", type=parse_limit, default=(24, 24), help="N, or a range A-B (per prompt)")
    parser.add_argument("--every", type=int, default=50, help="requests a round; memory is read after each")
    parser.add_argument("--from", dest="frm", type=int, default=200, help="the request growth is measured from")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--check", type=int, default=50, help="greedy and seeded replies (each) compared with `none` alone at the end"
    )
    parser.add_argument("--out", default="runs/serve-soak")
    args = parser.parse_args(argv)
    os.environ.setdefault("SELFSPEC_COMPILE", "0")
    # The client processes start first, from a process that has loaded no model and runs no threads.
    with ProcessPoolExecutor(max_workers=args.clients) as pool:
        list(pool.map(time.sleep, [0.0] * args.clients))
        result = soak(args, pool)
    from selfspec.execution import describe_cpu

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {
        "requests": args.requests,
        "clients": args.clients,
        "slots": args.slots,
        "max_tokens": "-".join(map(str, sorted(set(args.max_tokens)))),
        "every": args.every,
        "threads": args.threads or "default",
        "machine": describe_cpu(),
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python scripts/soak_serve.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    summary = summarize(result, args.frm)
    write_outputs(Path(args.out), meta, result, summary)
    print(json.dumps(summary), flush=True)
    print(f"written to {args.out}/results.md")
    counts = result["counts"]
    differing = result["differing"]
    failed = differing["greedy"] or differing["greedy_vs_alone"] or counts["errors"] or counts["truncated"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
