"""`selfspec serve`: the real server (uvicorn, real sockets) on the tiny checkpoint, driven by the `openai` client.

Replies equal SelfSpec.generate and plain decoding (greedy token for token, seeded sampling the same text), streamed
or not; stop strings, usage counts and the speculation statistics; every bad request is an OpenAI-style 4xx JSON
error after which the server still answers; a client that goes away frees the worker at the next step; concurrent
clients are each answered as if alone; the command itself (`selfspec serve` in a subprocess) answers as `selfspec
generate` prints. One test runs the default model with `auto` against `--drafter none`."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from selfspec import SelfSpec
from selfspec.cli import main
from selfspec.serve import Scheduler, ServedModel, ServerThread
from selfspec.serve.protocol import parse_completion
from selfspec.serve.scheduler import Delta, Outcome

PROMPTS = ["a dog", "the cat sat on the mat the cat sat on the", "mat a the three red was dog ran", "big red"]
MAX_TOKENS = 24
SECRET = "/home/someone/private/model.py line 12"


class Throttled:
    """A SelfSpec whose target forwards take `delay` seconds more (the tiny model decodes a reply in milliseconds: a
    client cannot go away in the middle of one otherwise), and fail while `fail` is set."""

    def __init__(self, spec: SelfSpec):
        self.spec, self.delay, self.fail = spec, 0.0, False
        forward = spec.target.forward

        def slow_forward(*args, **kwargs):
            time.sleep(self.delay)
            if self.fail:  # a bug deep inside decoding
                raise RuntimeError(f"{SECRET}: tensor shapes do not match")
            return forward(*args, **kwargs)

        spec.target.forward = slow_forward

    def __getattr__(self, name: str):
        return getattr(self.spec, name)


class Running:
    """The server on a free port in a thread of this process, and what the tests compare it with."""

    def __init__(self, checkpoint):
        self.spec = Throttled(SelfSpec(str(checkpoint), drafter="ngram"))
        self.scheduler = Scheduler(self.spec)
        self.served = ServedModel(self.spec.target.name, self.spec.target, "ngram", default_max_tokens=MAX_TOKENS)
        self.model = self.served.model_id
        self.server = ServerThread(self.scheduler, self.served)
        self.url = self.server.url
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        # References on models of their own (the server's is busy on its own thread): speculative and plain.
        self.reference = SelfSpec(str(checkpoint), drafter="ngram")
        self.plain = SelfSpec(self.reference.target, drafter="none")

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    running = Running(tiny_checkpoint)
    yield running
    running.stop()


def health(url: str) -> dict:
    return request(url, "GET", "/health")[1]


def request(url: str, method: str, path: str, body: bytes | str | None = None) -> tuple[int, dict]:
    """A raw HTTP request (bodies the openai client would never send); the status and the JSON reply."""
    connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
    try:
        connection.request(method, path, body=body, headers={"Content-Type": "application/json"})
        reply = connection.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        connection.close()


def chat(server: Running, prompt: str, stream: bool = False, **settings) -> tuple[str, str, dict, dict]:
    """(text, finish_reason, usage, selfspec statistics) of one chat request, streamed or not."""
    messages = [{"role": "user", "content": prompt}]
    settings.setdefault("max_tokens", MAX_TOKENS)
    if not stream:
        reply = server.client.chat.completions.create(model=server.model, messages=messages, **settings)
        choice = reply.choices[0]
        usage = reply.usage.model_dump(exclude_none=True)
        return choice.message.content, choice.finish_reason, usage, reply.model_extra["selfspec"]
    chunks = list(server.client.chat.completions.create(model=server.model, messages=messages, stream=True, **settings))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(chunk.choices[0].finish_reason is None and chunk.usage is None for chunk in chunks[:-1])
    assert all("selfspec" not in (chunk.model_extra or {}) for chunk in chunks[:-1])  # statistics come at the end
    last = chunks[-1]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    return text, last.choices[0].finish_reason, last.usage.model_dump(exclude_none=True), last.model_extra["selfspec"]


def finish_reason(stop_reason: str) -> str:
    return "stop" if stop_reason == "eos" else "length"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_greedy_chat_equals_generate_and_plain_decoding(server, stream):
    previous: list[int] = []
    for prompt in PROMPTS:
        expected = server.reference.generate(prompt, max_new_tokens=MAX_TOKENS)
        assert server.plain.generate(prompt, max_new_tokens=MAX_TOKENS).token_ids == expected.token_ids
        text, finish, usage, stats = chat(server, prompt, stream)
        assert text == expected.text, prompt
        assert finish == finish_reason(expected.stats.stop_reason)
        ids = server.reference.target.encode_prompt(prompt)[0].tolist()
        cached = usage.pop("prompt_tokens_details")["cached_tokens"]
        assert usage == {
            "prompt_tokens": len(ids),
            "completion_tokens": len(expected.token_ids),
            "total_tokens": len(ids) + len(expected.token_ids),
        }
        # the chat template's opening, shared with the prompt before, was kept and not forwarded again
        shared = next(
            (i for i, (a, b) in enumerate(zip(previous, ids, strict=False)) if a != b), min(len(previous), len(ids))
        )
        assert min(shared, len(ids) - 1) <= cached <= len(ids) - 1 and (not previous or cached > 0)
        previous = ids
        assert stats["target_forwards"] == expected.stats.target_forwards
        assert stats["tau"] == round(expected.stats.mean_accepted_length, 4)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_take_the_prompt_raw_as_generate_raw(server, stream):
    prompt = "the cat sat on the mat the cat sat"
    expected = server.reference.generate(prompt, max_new_tokens=MAX_TOKENS, chat=False)
    create = server.client.completions.create
    if stream:
        chunks = list(create(model=server.model, prompt=prompt, max_tokens=MAX_TOKENS, stream=True))
        text, last = "".join(chunk.choices[0].text for chunk in chunks), chunks[-1]
    else:
        last = create(model=server.model, prompt=prompt, max_tokens=MAX_TOKENS)
        text = last.choices[0].text
    assert text == expected.text and last.choices[0].finish_reason == finish_reason(expected.stats.stop_reason)
    assert last.usage.completion_tokens == len(expected.token_ids)
    assert last.usage.prompt_tokens == server.reference.target.encode_prompt(prompt, chat=False).shape[1]
    token_ids = server.reference.target.encode_prompt(prompt, chat=False)[0].tolist()
    assert create(model=server.model, prompt=token_ids, max_tokens=MAX_TOKENS).choices[0].text == expected.text


def test_seeded_sampling_equals_generate_alone(server):
    settings = {"temperature": 0.9, "top_p": 0.95, "seed": 7}
    for prompt in PROMPTS[:2]:
        expected = server.reference.generate(prompt, max_new_tokens=MAX_TOKENS, **settings)
        for stream in (False, True):
            assert chat(server, prompt, stream, extra_body={"top_k": 20}, **settings)[0] == (
                server.reference.generate(prompt, max_new_tokens=MAX_TOKENS, top_k=20, **settings).text
            )
        assert chat(server, prompt, **settings)[0] == expected.text
    texts = {chat(server, PROMPTS[0], temperature=1.0, seed=seed)[0] for seed in range(4)}
    assert len(texts) > 1  # the seed reaches the sampler


def test_stop_strings_cut_the_reply_before_their_first_occurrence(server):
    prompt = "a dog"
    full = server.reference.generate(prompt, max_new_tokens=MAX_TOKENS).text
    words = full.split()
    spanning = " ".join(words[4:6])  # two tokens: a stop string found across steps
    assert len(words) > 8 and spanning in full, full
    for stop in (words[3], [words[7], spanning], spanning, ["never there", "nor this"]):
        stops = [stop] if isinstance(stop, str) else stop
        cut = min((full.index(s) for s in stops if s in full), default=None)
        for stream in (False, True):
            text, finish, usage, _ = chat(server, prompt, stream, stop=stop)
            assert text == (full if cut is None else full[:cut]), (stop, stream)
            assert finish == ("length" if cut is None else "stop")
            assert 0 < usage["completion_tokens"] <= MAX_TOKENS


def test_max_tokens_is_a_length_finish_and_the_statistics_add_up(server):
    prompt = PROMPTS[1]  # repetitive: prompt lookup drafts, so steps accept several tokens
    text, finish, usage, stats = chat(server, prompt, max_tokens=20)
    assert finish == "length" and usage["completion_tokens"] == 20
    assert stats["drafter"] == "ngram" and stats["execution_path"] == "stock"
    assert stats["accepted_draft_tokens"] == 20 - stats["target_forwards"] > 0
    assert stats["tau"] == round(20 / stats["target_forwards"], 4) > 1
    assert stats["accepted_by_source"] is None  # ngram has no sources (auto counts its sources' tokens)
    assert stats["tokens_per_s"] > 0 and stats["queued_s"] >= 0
    default = chat(server, PROMPTS[1], max_tokens=None)  # the server's default limit
    assert default[2]["completion_tokens"] == MAX_TOKENS


BAD = [
    ("malformed JSON", "/v1/chat/completions", b'{"messages": [', 400, None),
    ("not an object", "/v1/chat/completions", [1, 2], 400, None),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-9"}, 404, "model"),
    ("zero max_tokens", "/v1/chat/completions", {"max_tokens": 0}, 400, "max_tokens"),
    ("negative max_tokens", "/v1/completions", {"max_tokens": -5}, 400, "max_tokens"),
    ("huge max_tokens", "/v1/chat/completions", {"max_tokens": 10**12}, 400, "max_tokens"),
    ("max_tokens a string", "/v1/chat/completions", {"max_tokens": "8"}, 400, "max_tokens"),
    (
        "huge max_completion_tokens",
        "/v1/chat/completions",
        {"max_completion_tokens": 10**6},
        400,
        "max_completion_tokens",
    ),
    ("prompt over the context", "/v1/completions", {"prompt": "cat " * 400}, 400, "prompt"),
    (
        "messages over the context",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "cat " * 400}]},
        400,
        "messages",
    ),
    ("stop a number", "/v1/chat/completions", {"stop": 3}, 400, "stop"),
    ("stop list of numbers", "/v1/completions", {"stop": [1, 2]}, 400, "stop"),
    ("stop empty string", "/v1/completions", {"stop": ""}, 400, "stop"),
    ("five stop strings", "/v1/completions", {"stop": list("abcde")}, 400, "stop"),
    ("unknown field", "/v1/chat/completions", {"temprature": 0.5}, 400, "temprature"),
    ("unsupported field value", "/v1/chat/completions", {"presence_penalty": 1.0}, 400, "presence_penalty"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("no messages", "/v1/chat/completions", {"messages": None}, 400, "messages"),
    ("a message without a role", "/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages"),
    ("a message of numbers", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("empty prompt", "/v1/completions", {"prompt": "  "}, 400, "prompt"),
    ("two prompts", "/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("token id outside the vocabulary", "/v1/completions", {"prompt": [1, 10**6]}, 400, "prompt"),
    ("n of 2", "/v1/chat/completions", {"n": 2}, 400, "n"),
    ("negative temperature", "/v1/chat/completions", {"temperature": -0.5}, 400, "temperature"),
    ("temperature a string", "/v1/chat/completions", {"temperature": "hot"}, 400, "temperature"),
    ("top_p zero", "/v1/completions", {"top_p": 0}, 400, "top_p"),
    ("top_p above one", "/v1/chat/completions", {"top_p": 1.5}, 400, "top_p"),
    ("top_k negative", "/v1/chat/completions", {"top_k": -1}, 400, "top_k"),
    ("top_k fractional", "/v1/chat/completions", {"top_k": 2.5}, 400, "top_k"),
    ("seed fractional", "/v1/chat/completions", {"seed": 1.5}, 400, "seed"),
    ("stream not a boolean", "/v1/chat/completions", {"stream": "yes"}, 400, "stream"),
    ("echo", "/v1/completions", {"echo": True}, 400, "echo"),
]


@pytest.mark.parametrize("case, path, changes, status, param", BAD, ids=[case[0] for case in BAD])
def test_bad_requests_are_openai_errors_and_the_server_stays_up(server, case, path, changes, status, param):
    if isinstance(changes, dict):
        base = {"messages": [{"role": "user", "content": "a dog"}]} if "chat" in path else {"prompt": "a dog"}
        body = json.dumps({"model": server.model, "max_tokens": 4, **base, **changes})
    else:
        body = changes if isinstance(changes, bytes) else json.dumps(changes)
    before = health(server.url)
    code, reply = request(server.url, "POST", path, body)
    assert code == status, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert error["type"] == "invalid_request_error" and error["message"] and "\n" not in error["message"]
    assert "Traceback" not in error["message"] and "File " not in error["message"]
    after = health(server.url)
    counts = ("completed", "cancelled", "failed", "queued")
    assert after["status"] == "ok" and [after[n] for n in counts] == [before[n] for n in counts]  # no decoding


def test_the_openai_client_sees_errors_as_its_own_exceptions(server):
    messages = [{"role": "user", "content": "a dog"}]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client.chat.completions.create(model="gpt-9", messages=messages)
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        server.client.chat.completions.create(model=server.model, messages=messages, n=3)
    with pytest.raises(openai.BadRequestError, match="context"):
        server.client.chat.completions.create(model=server.model, messages=messages, max_tokens=10**6, stream=True)
    tokenizer = server.spec.target.tokenizer
    template, tokenizer.chat_template = tokenizer.chat_template, "{{ raise_exception('roles must alternate') }}"
    try:
        with pytest.raises(openai.BadRequestError, match="chat template refused these messages: roles must alternate"):
            server.client.chat.completions.create(model=server.model, messages=messages)
    finally:
        tokenizer.chat_template = template
    assert request(server.url, "GET", "/nowhere")[0] == 404
    code, reply = request(server.url, "GET", "/v1/chat/completions")
    assert code == 405 and reply["error"]["code"] == "method_not_allowed"
    assert [model.id for model in server.client.models.list()] == [server.model]
    assert server.client.models.retrieve(server.model).id == server.model
    assert request(server.url, "GET", "/v1/models/gpt-9")[0] == 404


def test_a_failure_inside_decoding_is_a_500_without_its_trace_and_the_server_goes_on(server, capfd):
    server.spec.fail = True
    try:
        with pytest.raises(openai.InternalServerError) as failure:
            chat(server, PROMPTS[0])
        with pytest.raises(openai.APIError) as streamed:  # headers were sent: the error comes as the stream's event
            chat(server, PROMPTS[0], stream=True)
    finally:
        server.spec.fail = False
    for error in (failure.value, streamed.value):
        assert error.body["type"] == "server_error" and SECRET not in str(error.body)
    assert SECRET in capfd.readouterr().err  # the trace is in the server's log
    assert health(server.url)["failed"] >= 2
    assert chat(server, PROMPTS[0])[0] == server.reference.generate(PROMPTS[0], max_new_tokens=MAX_TOKENS).text


def test_a_client_that_goes_away_frees_the_worker_at_the_next_step(server):
    """A stream dropped after its first chunks, then a reply whose client timed out while waiting: each decode stops
    at its next step (counted as cancelled), and the next request starts at once, not after the abandoned ones."""
    messages = [{"role": "user", "content": PROMPTS[0]}]
    server.spec.delay = 0.1  # a whole reply would take seconds
    try:
        before = health(server.url)["cancelled"]
        stream = server.client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=MAX_TOKENS, stream=True
        )
        chunks = iter(stream)
        next(chunks), next(chunks)  # the role, then the first text
        stream.close()
        impatient = server.client.with_options(timeout=0.3)
        with pytest.raises(openai.APITimeoutError):
            impatient.chat.completions.create(model=server.model, messages=messages, max_tokens=MAX_TOKENS)
        deadline = time.monotonic() + 10
        while health(server.url)["cancelled"] < before + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert health(server.url)["cancelled"] == before + 2
        _, finish, usage, stats = chat(server, "big red", max_tokens=2)
        assert usage["completion_tokens"] == 2 and stats["queued_s"] < 0.3
    finally:
        server.spec.delay = 0.0


def test_concurrent_clients_are_each_answered_as_if_alone(server):
    cases = [(prompt, stream, seed) for prompt in PROMPTS for stream in (False, True) for seed in (None, 3)]

    def one(case):
        prompt, stream, seed = case
        settings = {} if seed is None else {"temperature": 0.8, "seed": seed}
        return chat(server, prompt, stream, **settings)[0]

    with ThreadPoolExecutor(max_workers=8) as pool:
        texts = list(pool.map(one, cases))
    for (prompt, _, seed), text in zip(cases, texts, strict=True):
        settings = {} if seed is None else {"temperature": 0.8, "seed": seed}
        assert text == server.reference.generate(prompt, max_new_tokens=MAX_TOKENS, **settings).text
    assert health(server.url)["queued"] == 0
    assert max(server.scheduler.engine.rows_per_step) > 1  # requests shared verification forwards


def test_a_steps_events_reach_their_sinks_in_one_handoff(server):
    """The scheduler hands a step's events, every request's, over in one call (the server's event loop woken once a
    step, not once a request and step): three requests decoding together take no more handoffs than the steps they
    span, and each still gets its text in order, then its outcome."""
    received: dict[int, list] = {index: [] for index in range(3)}
    handoffs = []

    def handoff(callback):
        handoffs.append(callback)
        callback()

    server.spec.delay = 0.02  # steps slow enough for the three to decode side by side
    try:
        for index, prompt in enumerate(PROMPTS[:3]):
            body = {"model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS}
            server.scheduler.submit(parse_completion(body, server.served), received[index].append, handoff)
        deadline = time.monotonic() + 60
        while not all(events and isinstance(events[-1], Outcome) for events in received.values()):
            assert time.monotonic() < deadline, received
            time.sleep(0.01)
    finally:
        server.spec.delay = 0.0
    for index, events in received.items():
        *deltas, outcome = events
        assert all(isinstance(event, Delta) for event in deltas)
        assert "".join(event.text for event in deltas) == outcome.text
        assert outcome.text == server.reference.generate(PROMPTS[index], max_new_tokens=MAX_TOKENS, chat=False).text
    steps = max(events[-1].speculation["target_forwards"] for events in received.values())
    assert len(handoffs) <= steps + 2, (len(handoffs), steps)


def test_cli_bad_input_is_one_line_before_the_model_loads(tiny_checkpoint, tmp_path, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        missing = str(tmp_path / "no-model")  # a busy port is reported before the model is looked for
        for model, extra, fragment in (
            (missing, ["--port", str(port)], "pass another --port"),
            (tiny_checkpoint, ["--port", "70000"], "--port"),
            (tiny_checkpoint, ["--max-new-tokens", "0"], "max_new_tokens"),
            (tiny_checkpoint, ["--drafter", "nope"], "unknown drafter"),
            (tiny_checkpoint, ["--heads", str(tmp_path)], "--heads needs --drafter"),  # the default reads no heads
            (missing, ["--port", "0"], "does not exist"),
        ):
            assert main(["serve", "--model", str(model), *extra]) == 2
            err = capsys.readouterr().err.strip()
            assert err.startswith("selfspec: error:") and len(err.splitlines()) == 1 and fragment in err, err


def default_sigint() -> None:
    """In the server's process before it starts: Ctrl-C handled as a terminal's is, whatever the suite was started from
    (a shell's background job starts with SIGINT ignored, and a child inherits that: the server then never stopped)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_cli_server(args: list[str], timeout: float) -> tuple[subprocess.Popen, str]:
    """`selfspec serve ... --port 0` in a subprocess; the process and the base URL it printed."""
    process = subprocess.Popen(
        [sys.executable, "-m", "selfspec.cli", "serve", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        preexec_fn=default_sigint,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    match = re.search(r"(http://127\.0\.0\.1:\d+)/v1", lines[0] if lines else "")
    if not match:
        process.kill()
        pytest.fail(f"selfspec serve did not start: {lines} {process.stderr.read() if process.poll() else ''}")
    return process, match.group(1)


def stop_cli_server(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        raise


def generate_cli(args: list[str], capsys) -> str:
    assert main(["generate", *args]) == 0
    return capsys.readouterr().out.removesuffix("\n")


def test_the_serve_command_answers_as_generate_prints(tiny_checkpoint, capsys):
    """`selfspec serve` with its defaults (drafter ngram) replies what `generate` prints."""
    prompt = PROMPTS[1]
    expected = generate_cli(["--model", str(tiny_checkpoint), "--drafter", "ngram", "--prompt", prompt], capsys)
    process, url = start_cli_server(["--model", str(tiny_checkpoint)], timeout=120)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}])
        assert reply.choices[0].message.content == expected
        assert reply.model_extra["selfspec"]["drafter"] == "ngram"  # serve's default drafter
        assert reply.usage.completion_tokens <= 256  # generate's default --max-new-tokens, the server's too
        assert health(url)["completed"] == 1
        assert health(url)["completion_tokens"] == reply.usage.completion_tokens  # what a load test samples
    finally:
        stop_cli_server(process)
    assert process.returncode in (0, 130, -signal.SIGINT) and "Traceback" not in process.stderr.read()


@pytest.mark.real_model
def test_the_default_model_with_auto_answers_as_plain_decoding(capsys):
    """`selfspec serve` (the default model's float32 weights, --drafter auto) through the openai client, streamed and
    not, equals `selfspec generate --drafter none` greedy; `auto` reports its sources' accepted tokens."""
    prompt = "Repeat this sentence twice: the quick brown fox jumps over the lazy dog."
    path = ["--path", "fast"]  # the path `auto` took before it took q4 for a 4-bit GGUF (the test below)
    plain = generate_cli([*path, "--drafter", "none", "--prompt", prompt, "--max-new-tokens", "32"], capsys)
    process, url = start_cli_server([*path, "--drafter", "auto"], timeout=600)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        messages = [{"role": "user", "content": prompt}]
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=32)
        assert reply.choices[0].message.content == plain and "fox" in plain
        chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=32, stream=True))
        assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == plain
        stats = reply.model_extra["selfspec"]
        assert stats["drafter"].startswith("auto") and stats["tau"] > 1
        assert stats["accepted_by_source"] and sum(stats["accepted_by_source"].values()) > 0
    finally:
        stop_cli_server(process)


@pytest.mark.real_model
def test_the_four_bit_path_serves_each_request_as_generate_gives_it(capsys):
    """`selfspec serve` (`--path auto`: the default GGUF's own 4-bit weights) with `auto`: three requests sent together,
    greedy and seeded sampling; each reply is `selfspec generate --path q4 --drafter none`'s text exactly, sampled
    ones included: on this path a batched step computes each request's rows as its own steps alone do, bit for bit
    (the int4 and row-attention kernels' rows do not depend on the call's other rows)."""
    prompts = [
        "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
        "Name three colours and one fruit of each colour.",
        "Write a haiku about caches.",
    ]
    settings = [{}, {"temperature": 0.8, "seed": 7}, {"temperature": 0.9, "top_p": 0.9, "seed": 3}]
    expected = []
    for prompt, setting in zip(prompts, settings, strict=True):
        flags = ["--path", "q4", "--drafter", "none", "--prompt", prompt, "--max-new-tokens", "32"]
        flags += [part for key, value in setting.items() for part in (f"--{key.replace('_', '-')}", str(value))]
        expected.append(generate_cli(flags, capsys))
    process, url = start_cli_server(["--drafter", "auto", "--slots", "3"], timeout=600)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        model = client.models.list().data[0].id

        def ask(index: int):
            messages = [{"role": "user", "content": prompts[index]}]
            return client.chat.completions.create(model=model, messages=messages, max_tokens=32, **settings[index])

        with ThreadPoolExecutor(len(prompts)) as pool:
            replies = list(pool.map(ask, range(len(prompts))))
        assert [reply.choices[0].message.content for reply in replies] == expected
        assert all(reply.model_extra["selfspec"]["execution_path"].startswith("q4") for reply in replies)
        assert len(set(expected)) == len(expected) and all(expected)
    finally:
        stop_cli_server(process)
    assert "Traceback" not in process.stderr.read()
