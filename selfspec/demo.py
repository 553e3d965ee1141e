"""`selfspec demo`: a web page where a prompt is answered by speculative decoding, then by plain decoding beside it.

The answer streams as the loop commits tokens, each step's accepted draft tokens highlighted (colours take turns by
step, as in `selfspec chat`), beside live tokens/s, the mean accepted length and a bar chart of tokens per step. The
plain run (drafter `none`) follows on the same model, one after the other, so the two never share the CPU.

Served by the standard library's HTTP server (no web framework to install; one page, a JSON list of drafters and one
Server-Sent Events endpoint), on 127.0.0.1 by default. One generation runs at a time; a second request waits.

Events of `GET /api/generate?prompt=...&drafter=...&compare=1&max_new_tokens=N`, one JSON object each:
  {"event": "start", "run": "spec" | "plain", "drafter": spec}
  {"event": "step", "run": ..., "burst": accepted draft text, "own": the target's token's text, "accepted": tokens
   this step, "tokens": tokens so far, "elapsed": seconds since the run started}
  {"event": "done", "run": ..., "tokens", "tok_s", "tau", "forwards", "sources": {source: accepted tokens} | null}
  {"event": "error", "message": one line}   then   {"event": "end"}
"""

from __future__ import annotations

import json
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from urllib.parse import parse_qs, urlparse

from .api import StepText
from .errors import SelfspecError
from .heads import drafter_names, parse_drafter_options

MAX_NEW_TOKENS_LIMIT = 1024


class DemoState:
    """The target (loaded once), a SelfSpec per drafter spec asked for (sharing the target), and the lock that runs
    one generation at a time."""

    def __init__(self, spec, heads, max_new_tokens: int):
        self.target = spec.target
        self.default = spec.drafter.describe()
        self.heads = heads  # for the default drafter only
        self.max_new_tokens = max_new_tokens
        self.specs = {self.default: spec}
        self.lock = threading.Lock()

    def warm_up(self) -> None:
        """One short generation with the default drafter and with plain decoding, so the first answer's tokens/s are
        not the first forwards' (the fast path packs its weights, oneDNN builds its kernels per row count)."""
        input_ids = self.target.encode_prompt("Say hello.")
        for drafter in (self.default, "none"):
            self.spec_for(drafter).generate(input_ids=input_ids, max_new_tokens=16)

    def spec_for(self, drafter: str):
        from .api import SelfSpec

        if drafter not in self.specs:
            parse_drafter_options(drafter)  # a bad spec is a one-line error before anything loads
            self.specs[drafter] = SelfSpec(self.target, drafter=drafter)
        return self.specs[drafter]

    def run(self, prompt: str, drafter: str, compare: bool, max_new_tokens: int, send) -> None:
        """Generate for `prompt` with `drafter`, then (compare) plain decoding, sending events through `send`."""
        if not prompt.strip():
            raise SelfspecError("the prompt is empty: type something to answer")
        input_ids = self.target.encode_prompt(prompt)
        runs = [("spec", drafter)] + ([("plain", "none")] if compare and drafter != "none" else [])
        with self.lock:
            specs = [(run, self.spec_for(name)) for run, name in runs]
            for run, spec in specs:
                self._one_run(run, spec, input_ids, max_new_tokens, send)

    def _one_run(self, run: str, spec, input_ids, max_new_tokens: int, send) -> None:
        splitter, counts = StepText(self.target), {"tokens": 0}
        start = time.perf_counter()
        send({"event": "start", "run": run, "drafter": spec.drafter.describe()})

        def on_step(token_ids) -> None:
            counts["tokens"] += len(token_ids)
            pieces = splitter.split(token_ids) or ("", "")
            send(
                {
                    "event": "step",
                    "run": run,
                    "burst": pieces[0],
                    "own": pieces[1],
                    "accepted": len(token_ids),
                    "tokens": counts["tokens"],
                    "elapsed": round(time.perf_counter() - start, 4),
                }
            )

        before = spec.drafter.stats()
        result = spec.generate(input_ids=input_ids, max_new_tokens=max_new_tokens, on_step=on_step)
        stats = result.stats
        send(
            {
                "event": "done",
                "run": run,
                "tokens": stats.new_tokens,
                "tok_s": round(stats.tokens_per_s, 2),
                "tau": round(stats.mean_accepted_length, 3),
                "forwards": stats.target_forwards,
                "sources": spec.drafter.stats().accepted_since(before),
            }
        )


def page() -> bytes:
    return resources.files("selfspec").joinpath("demo.html").read_bytes()


class DemoHandler(BaseHTTPRequestHandler):
    state: DemoState  # set on the server's handler class
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args) -> None:  # quiet: the terminal shows the address and errors only
        pass

    def do_GET(self) -> None:
        url = urlparse(self.path)
        if url.path == "/":
            self._reply(HTTPStatus.OK, "text/html; charset=utf-8", page())
        elif url.path == "/api/drafters":
            body = {
                "drafters": drafter_names(),
                "default": self.state.default,
                "model": self.state.target.name,
                "max_new_tokens": self.state.max_new_tokens,
            }
            self._reply(HTTPStatus.OK, "application/json", json.dumps(body).encode())
        elif url.path == "/api/generate":
            self._generate(parse_qs(url.query))
        else:
            self._reply(HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8", b"not found\n")

    def _reply(self, status: HTTPStatus, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _generate(self, query: dict[str, list[str]]) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

        def send(event: dict) -> None:
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.flush()

        first = {name: values[0] for name, values in query.items() if values}
        try:
            try:
                max_new_tokens = int(first.get("max_new_tokens", self.state.max_new_tokens))
            except ValueError:
                raise SelfspecError("max_new_tokens must be a whole number") from None
            if not 1 <= max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
                raise SelfspecError(f"max_new_tokens must be between 1 and {MAX_NEW_TOKENS_LIMIT}")
            self.state.run(
                first.get("prompt", ""),
                first.get("drafter") or self.state.default,
                first.get("compare", "1") not in ("0", "false"),
                max_new_tokens,
                send,
            )
        except SelfspecError as error:
            send({"event": "error", "message": str(error)})
        except (BrokenPipeError, ConnectionResetError):
            return  # the page went away
        send({"event": "end"})


def bind(host: str, port: int) -> ThreadingHTTPServer:
    """The server socket, bound before any model loads so a busy port fails at once (one line)."""
    handler = type("BoundDemoHandler", (DemoHandler,), {})
    try:
        server = ThreadingHTTPServer((host, port), handler)
    except OSError as error:
        raise listen_error(host, port, error) from None
    server.daemon_threads = True
    return server


def listen_error(host: str, port: int, error: OSError) -> SelfspecError:
    """The one line for a socket that cannot listen on host:port (the demo's and the server's)."""
    if error.errno in (98, 48) or isinstance(error, PermissionError):  # EADDRINUSE (Linux, macOS), or no rights
        return SelfspecError(f"cannot listen on {host}:{port} ({error.strerror}): pass another --port")
    return SelfspecError(f"cannot listen on {host}:{port}: {error}")


def serve(server: ThreadingHTTPServer, state: DemoState) -> None:
    server.RequestHandlerClass.state = state
    host, port = server.server_address[:2]
    print(f"selfspec demo: http://{host}:{port}/  (drafter {state.default}; Ctrl-C stops it)", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
