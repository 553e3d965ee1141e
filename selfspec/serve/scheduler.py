"""The scheduler: the one object that owns the model and the requests in flight, and steps them.

Up to `slots` requests decode together on one worker thread through the batch engine (selfspec.batch): every step
verifies each running request's draft tree in one target forward, requests join at the next step boundary and leave
at the one where they end, and a reply is what that request gets alone (`selfspec generate` for the same prompt and
settings). `submit` a checked request with a sink for its events, `Job.cancel` it, `close`, `health`: the app never
touches the model.
"""

from __future__ import annotations

import functools
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

from ..batch import BatchEngine, BatchRequest, Finished
from ..errors import SelfspecError, first_line
from ..memory import fix_mmap_threshold
from ..sampling import SamplingConfig
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
    cached_tokens: int = 0  # prompt tokens whose prefill a kept prefix spared (usage.prompt_tokens_details)


@dataclass(frozen=True)
class Failed:
    """The request could not be decoded (the server goes on with the next one)."""

    error: ApiError


Event = Delta | Outcome | Failed


Handoff = Callable[[Callable[[], None]], None]


@dataclass
class Job:
    """A submitted request: its events go to `sink` until an Outcome or a Failed. `handoff` runs a callable on the
    thread the sink belongs to (the server's event loop); without one the sink is called on the worker thread. A
    step's events, every job's, go over in one handoff once the step is done (Scheduler._send)."""

    request: DecodeRequest
    sink: Callable[[Event], None]
    handoff: Handoff | None = None
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """The client went away: a queued job is skipped, a running one stops at its next step."""
        self.cancelled.set()


@dataclass
class _Flight:
    """A job the engine holds: its reply text so far and what ended it early."""

    job: Job
    reply: ReplyText
    request: BatchRequest
    stopped: bool = False  # a stop string was reached (the engine was asked to end it)


class Scheduler:
    """Owns `spec` (a SelfSpec: one model in memory) and its batch engine of `slots` requests; a worker thread admits
    the jobs as slots free up and steps them together."""

    def __init__(self, spec, slots: int = 4):
        fix_mmap_threshold()  # a process that serves for days: freed tensors go back to the system (memory.py)
        self.spec = spec
        self.engine = BatchEngine(spec.target, spec.new_drafter, slots)
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.flights: dict[int, _Flight] = {}  # id(BatchRequest) -> its job
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0}
        # tokens decoded for the requests since the server started (its throughput, as a load test samples it)
        self.completion_tokens = 0
        self.worker = threading.Thread(target=self._work, name="selfspec-decode", daemon=True)
        self._closing = False
        # The events of the step under way, sent when it is done: one wake-up of the event loop a step rather than
        # one a request. Woken for each request's text as it was committed, the loop's thread took the interpreter
        # lock and a core from the step four times over: at four requests a step took 15.1-15.6 ms in the server
        # against 13.4-13.5 with one wake-up (its commits 1.1 against 0.5 ms; a probe, 2026-11-29).
        self._outbox: list[tuple[Job, Event]] = []

    def start(self) -> None:
        """Step the jobs on a thread of their own (tests, the in-process server of the benchmarks)."""
        self.worker.start()

    def work_here(self) -> None:
        """Step the jobs on the calling thread until `close` (the `serve` command's main thread). Decoding belongs on
        the thread that loaded the model: each thread that runs OpenMP work keeps a pool of its own, and with more pool
        threads than cores GNU OpenMP stops spinning between parallel regions, which doubled a step measured on a
        second thread (2-core EPYC: 38 ms instead of 18)."""
        self._work()

    def submit(self, request: DecodeRequest, sink: Callable[[Event], None], handoff: Handoff | None = None) -> Job:
        job = Job(request, sink, handoff)
        self.jobs.put(job)
        return job

    def close(self) -> None:
        """Cancel the jobs in flight and stop the worker after its current step (queued jobs are dropped)."""
        self._closing = True
        self.jobs.put(None)

    def health(self) -> dict:
        return {
            "queued": self.jobs.qsize() + len(self.engine.waiting),
            "running": self.engine.admitted,  # decoding, or their prompts being prefilled
            "slots": self.engine.slots,
            **self.counts,
            "completion_tokens": self.completion_tokens,
        }

    def _work(self) -> None:
        while not self._closing:
            if not self._take_jobs():
                break
            for flight in self.flights.values():
                if flight.job.cancelled.is_set():
                    flight.request.cancelled = True
            try:
                finished = self.engine.step()
            except Exception as error:  # noqa: BLE001  (the server stays up; the trace goes to its log, not the client)
                self._outbox.clear()  # the failed step's text: its jobs get a Failed instead
                self._fail_all(error)
                self._send()
                continue
            for result in finished:
                self._deliver(result)
            self._send()

    def _post(self, job: Job, event: Event) -> None:
        self._outbox.append((job, event))

    def _send(self) -> None:
        """Hand the posted events to their sinks: one handoff for all the jobs that share it, in the order posted."""
        if not self._outbox:  # a step that emitted nothing (prefill only, or text held back)
            return
        outbox, self._outbox = self._outbox, []
        groups: dict[int, tuple[Handoff | None, list[tuple[Job, Event]]]] = {}
        for job, event in outbox:
            groups.setdefault(id(job.handoff), (job.handoff, []))[1].append((job, event))
        for handoff, events in groups.values():
            if handoff is None:
                _run(events)
            else:
                handoff(functools.partial(_run, events))

    def _take_jobs(self) -> bool:
        """Move queued jobs to the engine: waiting for one while nothing is in flight. False once closed."""
        while True:
            if not self.engine.busy and self.jobs.empty():
                self.engine.between_requests()  # the compiled graphs: build them, or take them once built
            try:
                job = self.jobs.get(block=not self.engine.busy)
            except queue.Empty:
                return True
            if job is None:
                return False
            if job.cancelled.is_set():
                self.counts["cancelled"] += 1
                continue
            self._admit(job)

    def _admit(self, job: Job) -> None:
        request, target = job.request, self.spec.target
        sampling = SamplingConfig(temperature=request.temperature, top_k=request.top_k, top_p=request.top_p)
        batch_request = BatchRequest(list(request.input_ids), request.max_new_tokens, sampling, request.seed)
        flight = _Flight(job, ReplyText(target, request.stop), batch_request)

        def on_tokens(token_ids: tuple[int, ...]) -> None:
            self.completion_tokens += len(token_ids)
            piece = flight.reply.add(token_ids)
            if piece:
                self._post(job, Delta(piece))
            if flight.reply.stopped:  # no need to decode further: the engine ends it after this step
                flight.stopped = batch_request.cancelled = True

        batch_request.on_tokens = on_tokens
        try:
            self.engine.submit(batch_request)
        except SelfspecError as error:  # a request the checks let through and the engine refused
            self.counts["failed"] += 1
            self._post(job, Failed(ApiError(str(error))))
            self._send()  # now: the worker may wait for the next job before any step
            return
        self.flights[id(batch_request)] = flight

    def _deliver(self, result: Finished) -> None:
        flight = self.flights.pop(id(result.request))
        job, stats = flight.job, result.stats
        if job.cancelled.is_set():
            self.counts["cancelled"] += 1
            return
        piece = flight.reply.finish()
        if piece:
            self._post(job, Delta(piece))
        finish_reason = "stop" if flight.stopped or stats.stop_reason == "eos" else "length"
        decode_s = stats.wall_s
        speculation = {
            "drafter": result.drafter,
            "execution_path": stats.path,
            "tau": round(stats.mean_accepted_length, 4),
            "target_forwards": stats.target_forwards,
            "accepted_draft_tokens": stats.new_tokens - stats.target_forwards,
            "accepted_by_source": result.accepted_by_source,
            "decode_s": round(decode_s, 4),
            "tokens_per_s": round(stats.new_tokens / decode_s, 2) if decode_s > 0 else 0.0,
            "queued_s": round(max(0.0, result.admitted - job.submitted), 4),
        }
        self.counts["completed"] += 1
        prompt_tokens = len(job.request.input_ids)
        outcome = Outcome(
            flight.reply.text, finish_reason, prompt_tokens, stats.new_tokens, speculation, result.cached_tokens
        )
        self._post(job, outcome)

    def _fail_all(self, error: Exception) -> None:
        """A step failed: every job in flight gets a 500 (the trace goes to the server's log) and the engine starts
        afresh, its drafters rebuilt."""
        print(f"selfspec serve: a decoding step failed: {first_line(error)}", file=sys.stderr, flush=True)
        traceback.print_exception(error, file=sys.stderr)
        failure = ApiError("the server failed to decode this request", status=500, kind="server_error")
        for flight in self.flights.values():
            self.counts["failed"] += 1
            self._post(flight.job, Failed(failure))
        self.flights.clear()
        self.engine = BatchEngine(self.spec.target, self.spec.new_drafter, self.engine.slots)


def _run(events: list[tuple[Job, Event]]) -> None:
    for job, event in events:
        job.sink(event)
