"""The OpenAI API subset `selfspec serve` speaks: request bodies checked and turned into a `DecodeRequest`, and every
problem an `ApiError` that the app sends as OpenAI's error body with a 4xx status.

The decoding settings are checked by `selfspec.api.check_request`, the rules `selfspec generate` applies; this module
checks only what the API adds (field names and JSON types, messages, stop strings, `n`, the context)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from ..api import check_request
from ..errors import SelfspecError, first_line
from ..models import Target

MAX_STOP_STRINGS = 4  # as OpenAI's API
ROLES = ("system", "user", "assistant")
# Fields of OpenAI's requests that are accepted as long as they ask for nothing this server does not do; any other
# field is an error (a client asking for something must not get a reply that silently ignores it).
NEUTRAL = {
    "user": lambda value: value is None or isinstance(value, str),
    "stream_options": lambda value: value is None or isinstance(value, dict) and set(value) <= {"include_usage"},
    "logprobs": lambda value: value in (None, False),
    "presence_penalty": lambda value: value in (None, 0),
    "frequency_penalty": lambda value: value in (None, 0),
}
COMMON = {"model", "stream", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n"} | set(NEUTRAL)
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens"}
COMPLETION_FIELDS = COMMON | {"prompt", "echo"}
SETTINGS = ("temperature", "top_k", "top_p", "seed", "max_new_tokens")  # what check_request's messages begin with


class ApiError(Exception):
    """A request the server cannot answer, as OpenAI reports it: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class DecodeRequest:
    """One checked request, ready for the scheduler: the prompt's token ids and the decoding settings."""

    kind: str  # "chat" (/v1/chat/completions) or "completion" (/v1/completions)
    model: str
    input_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stream: bool = False


@dataclass(frozen=True)
class ServedModel:
    """What requests are checked against: the model's id, its target (tokenizer, context) and the drafter spec."""

    model_id: str
    target: Target
    drafter: str
    default_max_tokens: int


def read_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    return body


def parse_chat(body: dict, served: ServedModel) -> DecodeRequest:
    """A /v1/chat/completions body -> the request; the messages go through the model's chat template."""
    _check_fields(body, CHAT_FIELDS)
    messages = _messages(body.get("messages"))
    try:
        input_ids = served.target.render_chat(messages, add_generation_prompt=True)
    except Exception as error:  # noqa: BLE001  (a chat template refuses messages with an exception of its own)
        raise ApiError(f"the model's chat template refused these messages: {first_line(error)}", "messages") from None
    limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return _request("chat", body, served, input_ids, (limit_name, "messages"))


def parse_completion(body: dict, served: ServedModel) -> DecodeRequest:
    """A /v1/completions body -> the request; the prompt is taken as it is (no chat template), as `generate --raw`."""
    _check_fields(body, COMPLETION_FIELDS)
    if body.get("echo") not in (None, False):
        raise ApiError("echo is not supported", "echo")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ApiError("the prompt is empty: pass some text to complete", "prompt")
        input_ids = served.target.encode_prompt(prompt, chat=False)[0].tolist()
    elif isinstance(prompt, list) and prompt and all(_is_int(token) for token in prompt):
        input_ids = prompt
        if min(prompt) < 0 or max(prompt) >= served.target.vocab_size:
            raise ApiError(
                f"the prompt holds token ids outside the vocabulary [0, {served.target.vocab_size})", "prompt"
            )
    else:
        raise ApiError("prompt must be a non-empty string, or one list of token ids (one prompt per request)", "prompt")
    return _request("completion", body, served, input_ids, ("max_tokens", "prompt"))


def _request(kind: str, body: dict, served: ServedModel, input_ids: list[int], names: tuple[str, str]) -> DecodeRequest:
    """The settings every request shares; `names`: the fields that hold the token limit and the prompt."""
    limit_name = names[0]
    model = body.get("model")
    if model is not None and model != served.model_id:
        raise ApiError(
            f"the model '{model}' does not exist here: this server serves '{served.model_id}'",
            "model",
            "model_not_found",
            status=404,
        )
    if body.get("n") not in (None, 1):
        raise ApiError("n must be 1: one choice per request", "n")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ApiError("stream must be true or false", "stream")
    max_tokens = _max_tokens(body.get(limit_name), names, len(input_ids), served)
    settings = {name: body.get(name) for name in ("temperature", "top_k", "top_p", "seed")}
    for name, value in settings.items():
        if value is not None and not _is_number(value):
            raise ApiError(f"{name} must be a number, got {json.dumps(value)}", name)
    defaults = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0}  # selfspec generate's
    settings = {name: defaults[name] if value is None else value for name, value in settings.items()}
    try:  # the rules SelfSpec applies (drafter spec, sampling, max_new_tokens, seed)
        check_request(served.drafter, max_tokens, **settings)
    except SelfspecError as error:
        message = str(error)
        param = next((name for name in SETTINGS if message.startswith(name)), None)
        param = limit_name if param == "max_new_tokens" else param
        raise ApiError(message.replace("max_new_tokens", limit_name), param) from None
    return DecodeRequest(
        kind=kind,
        model=served.model_id,
        input_ids=tuple(int(token) for token in input_ids),
        max_new_tokens=max_tokens,
        stop=_stop(body.get("stop")),
        stream=bool(stream),
        **settings,
    )


def _max_tokens(value, names: tuple[str, str], prompt_tokens: int, served: ServedModel) -> int:
    """The request's token limit: given, it must fit in the context beside the prompt (OpenAI's rule); not given, the
    server's default, within what the context leaves."""
    name, prompt_name = names
    context = served.target.context_limit
    if prompt_tokens >= context:
        raise ApiError(
            f"the prompt is {prompt_tokens} tokens, which leaves no room in the model's context of {context} tokens: "
            "shorten it",
            prompt_name,
            "context_length_exceeded",
        )
    if value is None:
        return min(served.default_max_tokens, context - prompt_tokens)
    if not _is_int(value):
        raise ApiError(f"{name} must be a positive integer, got {json.dumps(value)}", name)
    if value > 0 and prompt_tokens + value > context:
        raise ApiError(
            f"{name} is {value}, but the prompt's {prompt_tokens} tokens leave {context - prompt_tokens} of the "
            f"model's context of {context} tokens",
            name,
            "context_length_exceeded",
        )
    return value


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list of {role, content} objects", "messages")
    checked = []
    for index, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or message.get("role") not in ROLES
            or not set(message)
            <= {
                "role",
                "content",
                "name",
            }
        ):
            raise ApiError(
                f"messages[{index}] must be an object with a role ({', '.join(ROLES)}) and a content", "messages"
            )
        checked.append({"role": message["role"], "content": _content(message.get("content"), index)})
    return checked


def _content(content, index: int) -> str:
    """A message's text: a string, or a list of text parts ({"type": "text", "text": ...}) joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content
    ):
        return "".join(part["text"] for part in content)
    raise ApiError(f"messages[{index}].content must be a string or a list of text parts", "messages")


def _stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP_STRINGS
        or not all(isinstance(item, str) and item for item in stops)
    ):
        raise ApiError(f"stop must be a non-empty string or a list of up to {MAX_STOP_STRINGS} of them", "stop")
    return tuple(stops)


def _check_fields(body: dict, known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise ApiError(f"unknown or unsupported field '{unknown[0]}'", unknown[0], "unsupported_parameter")
    for name, neutral in NEUTRAL.items():
        if name in body and not neutral(body[name]):
            raise ApiError(f"{name} is not supported (only its neutral value is accepted)", name)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and not (isinstance(value, float) and math.isinf(value))
