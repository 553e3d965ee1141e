"""`selfspec serve`: an OpenAI-compatible HTTP server over one SelfSpec (docs/serve.md).

Modules: protocol.py (requests checked into a DecodeRequest, OpenAI's error body), text.py (a reply's text and its
stop strings), scheduler.py (the model and the requests in flight, stepped together by the batch engine), app.py (the
Starlette routes, server-sent events, the socket and uvicorn).
"""

from __future__ import annotations

from .app import ServerThread, listen, run, uvicorn_server
from .protocol import ApiError, DecodeRequest, ServedModel
from .scheduler import Scheduler

__all__ = ["ApiError", "DecodeRequest", "Scheduler", "ServedModel", "ServerThread", "listen", "run", "uvicorn_server"]
