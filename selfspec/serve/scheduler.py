"""The scheduler: the one object that owns the model and the queue of requests, and steps them.

This one decodes one request at a time, on one worker thread, through `SelfSpec.generate` (so a reply is what
`selfspec generate` gives for the same prompt and settings, and the compiled path's switch happens between requests as
it always does). Continuous batching (several requests' trees verified in one forward, a block-diagonal tree mask)
replaces this class behind the same seam: `submit` a checked request with a sink for its events, `Job.cancel` it,
`close`, `health`. The app never touches the model.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

from ..errors import SelfspecError, first_line
from .protocol import ApiError, DecodeRequest
from .text import ReplyText


@dataclass(frozen=True)
class Delta:
    """Text of the reply that can be sent now."""

    text: str


@dataclass(frozen=True)
class Outcome:
    """A finished reply: its whole text, why it ended, the token counts and the speculation statistics."""

    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length" (max_tokens, or the context's end)
    prompt_tokens: int
    completion_tokens: int
    speculation: dict  # the response's "selfspec" field


@dataclass(frozen=True)
class Failed:
    """The request could not be decoded (the server goes on with the next one)."""

    error: ApiError


Event = Delta | Outcome | Failed


@dataclass
class Job:
    """A submitted request: its events go to `sink` (called from the worker thread) until an Outcome or a Failed."""

    request: DecodeRequest
    sink: Callable[[Event], None]
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """The client went away: a queued job is skipped, a running one stops at its next step."""
        self.cancelled.set()


class Cancelled(Exception):
    """Raised from the step callback to end a job whose client went away."""


class StopStringReached(Exception):
    """Raised from the step callback when the reply reached a stop string: no need to decode further."""


@dataclass
class StepCounts:
    forwards: int = 0  # target forwards (one per step; the prefill not counted)
    tokens: int = 0  # committed tokens
    path: str = ""  # the execution path the steps ran on


class Scheduler:
    """Owns `spec` (a SelfSpec: one model in memory) and the queue; a worker thread decodes the jobs in order."""

    def __init__(self, spec):
        self.spec = spec
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.running: Job | None = None
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0}
        self.worker = threading.Thread(target=self._work, name="selfspec-decode", daemon=True)

    def start(self) -> None:
        self.worker.start()

    def submit(self, request: DecodeRequest, sink: Callable[[Event], None]) -> Job:
        job = Job(request, sink)
        self.jobs.put(job)
        return job

    def close(self) -> None:
        """Cancel the running job and stop the worker once it returns (queued jobs are dropped)."""
        if self.running is not None:
            self.running.cancel()
        self.jobs.put(None)

    def health(self) -> dict:
        return {"queued": self.jobs.qsize(), "running": self.running is not None, **self.counts}

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            if job.cancelled.is_set():
                self.counts["cancelled"] += 1
                continue
            self.running = job
            try:
                job.sink(self._decode(job))
                self.counts["completed"] += 1
            except Cancelled:
                self.counts["cancelled"] += 1
            except SelfspecError as error:  # a request the checks let through and the loop refused
                self.counts["failed"] += 1
                job.sink(Failed(ApiError(str(error))))
            except Exception as error:  # noqa: BLE001  (the server stays up; the trace goes to its log, not the client)
                self.counts["failed"] += 1
                print(f"selfspec serve: a request failed: {first_line(error)}", file=sys.stderr, flush=True)
                traceback.print_exc(file=sys.stderr)
                job.sink(Failed(ApiError("the server failed to decode this request", status=500, kind="server_error")))
            finally:
                self.running = None

    def _decode(self, job: Job) -> Outcome:
        """Decode one job through SelfSpec.generate; each step's text goes to the job's sink as it is committed."""
        request, target = job.request, self.spec.target
        reply, counts = ReplyText(target, request.stop), StepCounts()

        def on_step(token_ids: tuple[int, ...]) -> None:
            counts.forwards, counts.tokens = counts.forwards + 1, counts.tokens + len(token_ids)
            counts.path = counts.path or target.execution.name  # fixed for the whole request (inside its block)
            piece = reply.add(token_ids)
            if piece:
                job.sink(Delta(piece))
            if job.cancelled.is_set():
                raise Cancelled
            if reply.stopped:
                raise StopStringReached

        drafter = self.spec.drafter
        before, start = drafter.stats(), time.perf_counter()
        try:
            result = self.spec.generate(
                input_ids=list(request.input_ids),
                max_new_tokens=request.max_new_tokens,
                temperature=request.temperature,
                top_k=request.top_k,
                top_p=request.top_p,
                seed=request.seed,
                on_step=on_step,
            )
            finish_reason = "stop" if result.stats.stop_reason == "eos" else "length"
        except StopStringReached:
            finish_reason = "stop"
        decode_s = time.perf_counter() - start
        piece = reply.finish()
        if piece:
            job.sink(Delta(piece))
        accepted = counts.tokens - counts.forwards  # drafted tokens the target accepted
        speculation = {
            "drafter": drafter.describe(),
            "execution_path": counts.path,
            "tau": round(counts.tokens / max(1, counts.forwards), 4),
            "target_forwards": counts.forwards,
            "accepted_draft_tokens": accepted,
            "accepted_by_source": drafter.stats().accepted_since(before),
            "decode_s": round(decode_s, 4),
            "tokens_per_s": round(counts.tokens / decode_s, 2) if decode_s > 0 else 0.0,
            "queued_s": round(start - job.submitted, 4),
        }
        return Outcome(reply.text, finish_reason, len(request.input_ids), counts.tokens, speculation)
