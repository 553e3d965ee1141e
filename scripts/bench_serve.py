"""Load benchmark of `selfspec serve`: throughput, time to first token and inter-token latency at several concurrency
levels, with speculation on (a drafter) and off (`none`), the two servers taking turns within each level (its
prompts in parts, each part sent to both, the order alternating) so that drifts of the machine hit both. At
concurrency c, c clients each send their next request as soon as their last one ends (a sustained load, as the
servers' users make it), over parts of 4c requests (at most half the level's, so that the servers alternate). Each
level reports two rates: over its parts' whole time (`tokens/s`), and while all c requests were in the server
(`steady tokens/s`: the server's `completion_tokens` sampled from /health every SAMPLE_EVERY seconds, over the
intervals whose both ends saw c or more requests running or queued). The first counts the time a part's last
requests take to drain with fewer than c in flight, which is not small: at 4 clients, parts of 16 requests had all
four in flight for 74% and 91% of their time (2026-11-29); the second is the rate at concurrency c.

    python scripts/bench_serve.py --concurrency 1,2,4,8 --requests 32 --max-tokens 128   # serve's drafter against none

`--vs` names the second server's drafter (`none` by default); `--vs` equal to `--drafter` (an A/A run) measures how far
two identical servers differ, the noise any ratio of a run is read against. Each part's pair of runs also gives a
ratio of its own: results.md lists their range beside each level's ratio.

Each server is a `selfspec serve` process of its own, as a user runs it (decoding on its main thread: a second server's
decoding thread in one process would slow both, Scheduler.work_here), on a free loopback port, driven by client
processes that stream (server-sent events) and time each chunk. Prompts: the held-out ShareGPT prompts the bench uses.
Writes results.json, results.md and throughput.png to --out.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from selfspec.bench.report import save_chart
from selfspec.cli.parser import SERVE_DRAFTER
from selfspec.files import atomic_write_text
from selfspec.training.data.prompt_sets import load_prompt_set

SERVE = "import sys; from selfspec.cli import main; sys.exit(main())"
SAMPLE_EVERY = 0.2  # seconds between two readings of a server's /health while a part runs


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class ServeProcess:
    """`selfspec serve --port 0 ...` started and waited for: `url` once it says where it listens; `stop()` ends it."""

    def __init__(self, model: str, drafter: str, slots: int, max_tokens: int, path: str = "auto"):
        command = [sys.executable, "-c", SERVE, "serve", "--model", model, "--drafter", drafter, "--port", "0"]
        command += ["--slots", str(slots), "--max-new-tokens", str(max_tokens), "--path", path]
        # Ctrl-C's default handling in the server, which `stop` relies on, even where this script runs as a shell's
        # background job (started with SIGINT ignored, which a child inherits: each server then took 30 s to be killed)
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, preexec_fn=_default_sigint)
        for line in self.process.stdout:
            found = re.search(r"(http://[^/\s]+)/v1", line)
            if found:
                self.url, self.banner = found.group(1), line.strip()
                return
        raise SystemExit(f"selfspec serve --drafter {drafter} did not start (exit {self.process.wait()})")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def execution_path(url: str) -> str:
    """The path the server decodes on, from a short request's `selfspec` field."""
    connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=600)
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    reply = json.loads(connection.getresponse().read())
    connection.close()
    return reply["selfspec"]["execution_path"]


def one_request(url: str, prompt: str, max_tokens: int) -> dict:
    """Stream one chat request; the times of its first content chunk and of each later one, and its token count."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True}
    began = time.perf_counter()
    chunk_times, tokens, error = [], 0, None
    connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=600)
    try:
        connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        reply = connection.getresponse()
        while line := reply.readline():
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]["message"]
                continue
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                chunk_times.append(time.perf_counter() - began)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    finally:
        connection.close()
    ended = time.perf_counter() - began
    ttft = chunk_times[0] if chunk_times else ended
    itl = (ended - ttft) / (tokens - 1) if tokens > 1 else 0.0
    return {"ttft_s": ttft, "itl_s": itl, "tokens": tokens, "wall_s": ended, "error": error}


class HealthSampler:
    """Reads a server's /health every SAMPLE_EVERY seconds on a thread of this process (which only waits on its
    client processes meanwhile) -> `samples`: (time, completion_tokens, requests running or queued)."""

    def __init__(self, url: str):
        self.connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)
        self.samples: list[tuple[float, int, int]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> HealthSampler:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()
        self.connection.close()

    def _poll(self) -> None:
        while True:
            self.connection.request("GET", "/health")
            health = json.loads(self.connection.getresponse().read())
            in_server = health["running"] + health["queued"]
            self.samples.append((time.perf_counter(), health["completion_tokens"], in_server))
            if self.done.wait(SAMPLE_EVERY):
                return


def steady_share(samples: list[tuple[float, int, int]], concurrency: int) -> tuple[int, float]:
    """(tokens, seconds) over the intervals between two samples that both saw `concurrency` or more requests in the
    server (running or queued)."""
    tokens, seconds = 0, 0.0
    for (t0, n0, in0), (t1, n1, in1) in itertools.pairwise(samples):
        if in0 >= concurrency and in1 >= concurrency:
            tokens, seconds = tokens + n1 - n0, seconds + t1 - t0
    return tokens, seconds


def run_requests(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> tuple[list[dict], float, tuple]:
    """`prompts` sent `concurrency` at a time -> each request's result, the wall time of them all, and the (tokens,
    seconds) decoded while all `concurrency` were in the server (steady_share)."""
    # Clients in processes of their own: threads of this one would hold the interpreter lock the server's decoding
    # thread needs (one started per batch of requests, before the clock).
    with ProcessPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(time.sleep, [0.0] * concurrency))
        with HealthSampler(url) as sampler:
            began = time.perf_counter()
            results = list(pool.map(one_request, [url] * len(prompts), prompts, [max_tokens] * len(prompts)))
            wall = time.perf_counter() - began
        return results, wall, steady_share(sampler.samples, concurrency)


def run_level(urls: dict[str, str], prompts: list[str], concurrency: int, max_tokens: int, flip: bool) -> list[dict]:
    """One concurrency level on every server (name -> url): the prompts in parts (part_size), each part sent to the
    servers in turn, the order alternating part by part (`flip`: the other server first), so that the machine's
    drifts over the level (its memory speed moves by the minute here) fall on both -> a row per server."""
    part_size = part_size_for(concurrency, len(prompts))
    parts = [prompts[start : start + part_size] for start in range(0, len(prompts), part_size)]
    collected = {name: ([], 0.0) for name in urls}
    part_rates: dict[str, list[float]] = {name: [] for name in urls}  # each part's tokens/s, part by part
    steady = {name: [0, 0.0] for name in urls}  # tokens and seconds with all `concurrency` in the server
    for index, part in enumerate(parts):
        names = list(urls) if (index % 2 == 0) != flip else list(urls)[::-1]
        for name in names:
            results, wall, (tokens, seconds) = run_requests(urls[name], part, concurrency, max_tokens)
            collected[name] = (collected[name][0] + results, collected[name][1] + wall)
            part_rates[name].append(round(sum(result["tokens"] for result in results) / wall, 2))
            steady[name][0] += tokens
            steady[name][1] += seconds
    rows = []
    for name, (results, wall) in collected.items():
        tokens, seconds = steady[name]
        rows.append(
            {
                "server": name,
                **summarize(results, wall, concurrency),
                "steady_tokens_per_s": round(tokens / seconds, 2) if seconds > 0 else None,
                "steady_share": round(seconds / wall, 3),  # of the level's time, all `concurrency` in the server
                "part_tokens_per_s": part_rates[name],
            }
        )
    return rows


def part_size_for(concurrency: int, requests: int) -> int:
    """Requests in a part: 4 per client (each client's requests back to back, the part's last ones draining with
    fewer in flight), at most half the level's so that the servers take turns, at least one per client."""
    return max(concurrency, min(4 * concurrency, requests // 2))


def summarize(results: list[dict], wall: float, concurrency: int) -> dict:
    ttft = sorted(result["ttft_s"] for result in results)
    itl = sorted(result["itl_s"] for result in results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "errors": sum(result["error"] is not None or result["tokens"] == 0 for result in results),
        "tokens": sum(result["tokens"] for result in results),
        "wall_s": round(wall, 3),
        "tokens_per_s": round(sum(result["tokens"] for result in results) / wall, 2),
        "ttft_p50_s": round(statistics.median(ttft), 4),
        "ttft_p99_s": round(_percentile(ttft, 0.99), 4),
        "itl_p50_ms": round(1e3 * statistics.median(itl), 2),
        "itl_p99_ms": round(1e3 * _percentile(itl, 0.99), 2),
    }


def _part_ratios(row: dict, baseline: dict) -> str:
    """The range of the level's part by part ratios (each part ran on both servers, one after the other)."""
    pairs = zip(row.get("part_tokens_per_s", ()), baseline.get("part_tokens_per_s", ()), strict=True)
    ratios = [on / off for on, off in pairs]
    return f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else ""


def _rate(row: dict) -> str:
    return "-" if row["steady_tokens_per_s"] is None else f"{row['steady_tokens_per_s']:.1f}"


def _ratio(row: dict, baseline: dict) -> str:
    if row["steady_tokens_per_s"] is None or not baseline["steady_tokens_per_s"]:
        return "-"
    return f"{row['steady_tokens_per_s'] / baseline['steady_tokens_per_s']:.2f}x"


def _percentile(values: list[float], share: float) -> float:
    return values[min(len(values) - 1, int(share * len(values)))]


def write_outputs(out: Path, meta: dict, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "results.json", json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [
        f"# selfspec serve under load: {meta['model']}, drafter {meta['drafter']} (on) against "
        f"{meta.get('vs', 'none')} (off)",
        "",
        f"{meta['date']}, {meta['machine']}, path {meta['path']}, {meta['slots']} slots, {meta['requests']} requests "
        f"a level, {meta['max_tokens']} tokens each, held-out ShareGPT prompts. Command: `{meta['command']}`",
        "",
        "`steady`: while all of a level's requests were in the server (running or queued), the share of the level's "
        "time that was in `share`; `tokens/s` counts the whole time, the parts' last requests draining with fewer in "
        "flight.",
        "",
        "| concurrency | server | tokens/s | vs off | parts vs off | steady tokens/s | steady vs off | share "
        "| TTFT p50 s | TTFT p99 s | ITL p50 ms | ITL p99 ms | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    off = {row["concurrency"]: row for row in rows if row["server"] == "off"}
    for row in rows:
        baseline = off[row["concurrency"]]
        ratio = row["tokens_per_s"] / baseline["tokens_per_s"]
        lines.append(
            f"| {row['concurrency']} | {row['server']} | {row['tokens_per_s']:.1f} | {ratio:.2f}x | "
            f"{_part_ratios(row, baseline)} | {_rate(row)} | {_ratio(row, baseline)} | {row['steady_share']:.2f} | "
            f"{row['ttft_p50_s']:.2f} | {row['ttft_p99_s']:.2f} | {row['itl_p50_ms']:.1f} | {row['itl_p99_ms']:.1f} | "
            f"{row['errors']} |"
        )
    if 1 in off:
        one = off[1]
        lines.append("")
        for row in rows:
            if row["concurrency"] > 1:
                lines.append(
                    f"- {row['concurrency']} requests, {row['server']}: "
                    f"{row['tokens_per_s'] / one['tokens_per_s']:.2f}x one request's rate on off "
                    f"({row['tokens_per_s']:.1f} / {one['tokens_per_s']:.1f}); steady {_ratio(row, one)} "
                    f"({_rate(row)} / {_rate(one)})"
                )
    atomic_write_text(out / "results.md", "\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for server in ("on", "off"):
        points = [(row["concurrency"], row["tokens_per_s"]) for row in rows if row["server"] == server]
        axis.plot(*zip(*points, strict=True), marker="o", label=f"speculation {server}")
    axis.set_xlabel("concurrent requests")
    axis.set_ylabel("tokens/s, all requests")
    axis.set_xscale("log", base=2)
    axis.legend()
    figure.tight_layout()
    save_chart(figure, out / "throughput.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--path", default="auto", help="the servers' execution path (serve's --path)")
    parser.add_argument(
        "--drafter", default=SERVE_DRAFTER, help=f"the server's drafter (default: serve's, {SERVE_DRAFTER})"
    )
    parser.add_argument("--vs", default="none", help="the second server's drafter (--drafter again: an A/A run)")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--concurrency", default="1,2,4,8")
    parser.add_argument("--requests", type=int, default=32, help="requests per level and server")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default="runs/bench-serve")
    args = parser.parse_args(argv)
    levels = [int(level) for level in args.concurrency.split(",")]
    prompts = [item.text for item in load_prompt_set("sharegpt")]
    servers = {}
    rows = []
    try:
        for name, drafter in (("on", args.drafter), ("off", args.vs)):
            servers[name] = ServeProcess(args.model, drafter, args.slots, args.max_tokens, args.path)
            print(servers[name].banner, flush=True)
        paths = {execution_path(server.url) for server in servers.values()}
        for server in servers.values():  # warm-up: the path's first steps, the drafters' first requests
            run_requests(server.url, prompts[:2], 2, 16)
        urls = {name: server.url for name, server in servers.items()}
        for index, level in enumerate(levels):
            sample = [prompts[(index * args.requests + k) % len(prompts)] for k in range(args.requests)]
            for row in run_level(urls, sample, level, args.max_tokens, flip=index % 2 == 1):
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    from selfspec.execution import describe_cpu

    meta = {
        "model": args.model if args.model != "default" else "SmolLM2-135M-Instruct",
        "drafter": args.drafter,
        "vs": args.vs,
        "path": "/".join(sorted(paths)),
        "slots": args.slots,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "machine": describe_cpu(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python scripts/bench_serve.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    write_outputs(Path(args.out), meta, rows)
    print(f"written to {args.out}/results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
