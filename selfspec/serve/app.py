"""The HTTP face of `selfspec serve`: a Starlette app run by uvicorn, on a socket bound before the model loads.

Routes: POST /v1/chat/completions and /v1/completions (a JSON reply, or with "stream": true server-sent events in
OpenAI's chunk format ending with `data: [DONE]`), GET /v1/models, /v1/models/{id} and /health. Every error is OpenAI's
JSON error body with its status; no trace ever reaches a client. Decoding happens on the scheduler's thread; the
event loop only parses, queues and relays.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
import uuid
from typing import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .protocol import ApiError, DecodeRequest, ServedModel, parse_chat, parse_completion, read_json
from .scheduler import Delta, Failed, Job, Outcome, Scheduler

DISCONNECT_POLL_S = 0.25  # how often a waiting non-streaming request looks whether its client is still there


class Reply:
    """The OpenAI objects of one request's reply: the whole response, or its stream of chunks."""

    def __init__(self, request: DecodeRequest):
        self.request = request
        chat = request.kind == "chat"
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _envelope(self, object_name: str, choice: dict) -> dict:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.request.model,
            "choices": [{"index": 0, **choice}],
        }

    def _choice(self, text: str | None, finish_reason: str | None, whole: bool) -> dict:
        if self.request.kind == "completion":
            return {"text": text or "", "logprobs": None, "finish_reason": finish_reason}
        if whole:
            return {"message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
        return {"delta": {} if text is None else {"content": text}, "logprobs": None, "finish_reason": finish_reason}

    def whole(self, outcome: Outcome) -> dict:
        body = self._envelope(self.object, self._choice(outcome.text, outcome.finish_reason, whole=True))
        return {**body, "usage": usage(outcome), "selfspec": outcome.speculation}

    def chunk(self, text: str | None) -> dict:
        object_name = "chat.completion.chunk" if self.request.kind == "chat" else "text_completion"
        return self._envelope(object_name, self._choice(text, None, whole=False))

    def first_chunk(self) -> dict | None:
        """Chat streams open with the assistant's role, as OpenAI's do."""
        if self.request.kind != "chat":
            return None
        chunk = self.chunk("")
        chunk["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        return chunk

    def last_chunk(self, outcome: Outcome) -> dict:
        chunk = self.chunk(None)
        chunk["choices"][0]["finish_reason"] = outcome.finish_reason
        return {**chunk, "usage": usage(outcome), "selfspec": outcome.speculation}


def usage(outcome: Outcome) -> dict:
    return {
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": outcome.completion_tokens,
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
    }


def handoff_to(loop: asyncio.AbstractEventLoop) -> Callable[[Callable[[], None]], None]:
    """The jobs' handoff (scheduler.Job): the worker thread's callables run on the event loop's thread."""

    def handoff(callback: Callable[[], None]) -> None:
        try:
            loop.call_soon_threadsafe(callback)
        except RuntimeError:  # the loop has closed (the server is stopping): nobody is waiting for it
            pass

    return handoff


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


class Server:
    """The routes over one scheduler and the model it serves."""

    def __init__(self, scheduler: Scheduler, served: ServedModel):
        self.scheduler, self.served = scheduler, served
        self.created = int(time.time())
        self._handoffs: dict[asyncio.AbstractEventLoop, Callable] = {}  # one per loop: the scheduler sends a step's
        # events to all the jobs sharing a handoff in one call

    def _handoff(self, loop: asyncio.AbstractEventLoop) -> Callable:
        if loop not in self._handoffs:
            self._handoffs = {loop: handoff_to(loop)}  # (a server runs one loop; a new one replaces the closed one)
        return self._handoffs[loop]

    def app(self) -> Starlette:
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ]
        handlers = {ApiError: self.api_error, HTTPException: self.http_error, Exception: self.server_error}
        return Starlette(routes=routes, exception_handlers=handlers)

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.served.model_id, **self.scheduler.health()})

    def _model_card(self) -> dict:
        return {"id": self.served.model_id, "object": "model", "created": self.created, "owned_by": "selfspec"}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        if request.path_params["model"] != self.served.model_id:
            raise ApiError(
                f"the model '{request.path_params['model']}' does not exist here",
                "model",
                "model_not_found",
                status=404,
            )
        return JSONResponse(self._model_card())

    async def chat_completions(self, request: Request) -> Response:
        return await self._answer(request, parse_chat(read_json(await request.body()), self.served))

    async def completions(self, request: Request) -> Response:
        return await self._answer(request, parse_completion(read_json(await request.body()), self.served))

    async def _answer(self, request: Request, decode: DecodeRequest) -> Response:
        events: asyncio.Queue = asyncio.Queue()
        job = self.scheduler.submit(decode, events.put_nowait, self._handoff(asyncio.get_running_loop()))
        reply = Reply(decode)
        if decode.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(self._stream(job, events, reply), media_type="text/event-stream", headers=headers)
        try:
            event = await self._final_event(request, events)
        finally:
            job.cancel()  # a no-op once it finished; a client that went away frees the worker at the next step
        if event is None:
            return Response(status_code=499)  # nobody is there to read it
        if isinstance(event, Failed):
            return error_response(event.error)
        return JSONResponse(reply.whole(event))

    @staticmethod
    async def _final_event(request: Request, events: asyncio.Queue) -> Outcome | Failed | None:
        """The job's last event, looking every DISCONNECT_POLL_S whether the client is still waiting for it (None: it
        went away)."""
        loop = asyncio.get_running_loop()
        look_at = loop.time() + DISCONNECT_POLL_S
        while True:
            try:
                event = await asyncio.wait_for(events.get(), max(0.0, look_at - loop.time()))
            except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11 on
                event = None
            if event is not None and not isinstance(event, Delta):
                return event
            if loop.time() >= look_at:  # text keeps coming while decoding: look at the time, not at a quiet spell
                if await request.is_disconnected():
                    return None
                look_at = loop.time() + DISCONNECT_POLL_S

    @staticmethod
    async def _stream(job: Job, events: asyncio.Queue, reply: Reply) -> AsyncIterator[str]:
        """The job's events as server-sent events. A client that disconnects cancels this generator (Starlette
        watches for it): the job is cancelled and the worker stops it at its next step."""
        try:
            first = reply.first_chunk()
            if first is not None:
                yield sse(first)
            while True:
                event = await events.get()
                if isinstance(event, Delta):
                    yield sse(reply.chunk(event.text))
                    continue
                yield sse(event.error.body() if isinstance(event, Failed) else reply.last_chunk(event))
                break
            yield sse("[DONE]")
        finally:
            job.cancel()

    async def api_error(self, request: Request, error: Exception) -> Response:
        assert isinstance(error, ApiError)
        return error_response(error)

    async def http_error(self, request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return error_response(
            ApiError(f"{request.method} {request.url.path}: {error.detail}", None, code, status=error.status_code)
        )

    async def server_error(self, request: Request, error: Exception) -> Response:
        return error_response(ApiError("the server failed on this request", status=500, kind="server_error"))


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening before any model loads, so a busy port fails at once (one line)."""
    from ..demo import listen_error

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free; one listened on is not
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as error:
        sock.close()
        raise listen_error(host, port, error) from None
    return sock


def uvicorn_server(scheduler: Scheduler, served: ServedModel):
    """A uvicorn server of the app (quiet: the command prints the address and errors only)."""
    import uvicorn

    app = Server(scheduler, served).app()
    return uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2))


def run(sock: socket.socket, scheduler: Scheduler, served: ServedModel) -> None:
    """Serve on `sock` until interrupted (Ctrl-C, SIGTERM); the scheduler's running job is cancelled on the way out.
    The HTTP server runs on a thread of its own and decoding on this one, the thread that loaded the model
    (Scheduler.work_here says why)."""
    server = uvicorn_server(scheduler, served)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="selfspec-http", daemon=True)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    thread.start()
    try:
        scheduler.work_here()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        scheduler.close()
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def _interrupt(signum, frame) -> None:
    """SIGTERM stops the server as Ctrl-C does."""
    raise KeyboardInterrupt


class ServerThread:
    """The server on a free loopback port in threads of this process (tests, the load benchmark): started at once,
    `url` to call, `stop()` to end it and its scheduler."""

    def __init__(self, scheduler: Scheduler, served: ServedModel):
        sock = listen("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.scheduler, self.server = scheduler, uvicorn_server(scheduler, served)
        scheduler.start()
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.scheduler.close()
