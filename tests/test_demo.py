"""`selfspec demo`: the page, the drafter list and the event stream over HTTP (a tiny checkpoint), bad input as
one-line errors, and the page in a real browser (headless Chromium driven by Selenium), on the tiny checkpoint and
on the real model with `auto`."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlencode

import pytest

from selfspec import SelfSpec
from selfspec.cli import main
from selfspec.demo import DemoState, bind, serve


def start_demo(spec, max_new_tokens: int = 12):
    server = bind("127.0.0.1", 0)  # any free port
    state = DemoState(spec, None, max_new_tokens)
    state.warm_up()
    thread = threading.Thread(target=serve, args=(server, state), daemon=True)
    thread.start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture(scope="module")
def tiny_demo(tiny_checkpoint):
    server, url = start_demo(SelfSpec(str(tiny_checkpoint), drafter="ngram"))
    yield url
    server.shutdown()


def events(url: str, **query) -> list[dict]:
    with urllib.request.urlopen(f"{url}/api/generate?{urlencode(query)}", timeout=300) as reply:
        assert reply.headers["Content-Type"] == "text/event-stream"
        body = reply.read().decode()
    return [json.loads(line[len("data: ") :]) for line in body.splitlines() if line.startswith("data: ")]


def test_the_page_and_the_drafter_list(tiny_demo):
    with urllib.request.urlopen(tiny_demo + "/", timeout=30) as reply:
        assert "text/html" in reply.headers["Content-Type"] and b"EventSource" in reply.read()
    with urllib.request.urlopen(tiny_demo + "/api/drafters", timeout=30) as reply:
        info = json.loads(reply.read())
    assert info["default"] == "ngram" and {"auto", "ngram", "none"} <= set(info["drafters"])
    with pytest.raises(urllib.error.HTTPError, match="404"):
        urllib.request.urlopen(tiny_demo + "/nowhere", timeout=30)


def test_the_stream_runs_the_drafter_then_plain_decoding_with_the_same_text(tiny_demo):
    # A prompt whose greedy continuation prompt lookup drafts a token of, on the tiny checkpoint: a burst shows.
    stream = events(tiny_demo, prompt="mat a the three red was dog ran", max_new_tokens=12)
    assert [event["event"] for event in stream if event["event"] != "step"] == ["start", "done", "start", "done", "end"]
    assert [event["run"] for event in stream if event["event"] == "start"] == ["spec", "plain"]
    texts, done = {}, {}
    for event in stream:
        if event["event"] == "step":
            texts[event["run"]] = texts.get(event["run"], "") + event["burst"] + event["own"]
            assert event["accepted"] >= 1 and (event["burst"] == "" or event["accepted"] > 1)
        elif event["event"] == "done":
            done[event["run"]] = event
    assert texts["spec"] == texts["plain"] and texts["spec"]  # lossless: greedy speculation is plain decoding
    assert done["spec"]["tokens"] == done["plain"]["tokens"] == 12  # no EOS within 12 tokens for this prompt
    steps = [event for event in stream if event["event"] == "step" and event["run"] == "spec"]
    assert [event["elapsed"] for event in steps] == sorted(event["elapsed"] for event in steps)
    assert any(event["burst"] for event in steps) and done["plain"]["tau"] == 1.0
    assert done["spec"]["forwards"] == len(steps)  # a step event per forward
    assert sum(event["accepted"] for event in steps) == done["spec"]["tokens"]
    assert done["spec"]["tau"] == round(done["spec"]["tokens"] / len(steps), 3)


@pytest.mark.parametrize(
    "query, fragment",
    [
        ({"prompt": "  "}, "prompt is empty"),
        ({"prompt": "the cat", "drafter": "nope"}, "unknown drafter"),
        ({"prompt": "the cat", "max_new_tokens": "0"}, "between 1 and"),
        ({"prompt": "the cat", "max_new_tokens": "many"}, "whole number"),
    ],
)
def test_bad_requests_are_one_line_errors_in_the_stream(tiny_demo, query, fragment):
    stream = events(tiny_demo, **query)
    assert [event["event"] for event in stream] == ["error", "end"]
    assert fragment in stream[0]["message"] and "\n" not in stream[0]["message"]


def test_cli_bad_input_is_one_line(tiny_checkpoint, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for extra, fragment in (
            (["--port", str(port)], "pass another --port"),
            (["--port", "70000"], "--port"),
            (["--max-new-tokens", "0"], "--max-new-tokens"),
            (["--drafter", "nope"], "unknown drafter"),
        ):
            assert main(["demo", "--model", str(tiny_checkpoint), *extra]) == 2
            err = capsys.readouterr().err.strip()
            assert err.startswith("selfspec: error:") and len(err.splitlines()) == 1 and fragment in err, err


def browser():
    """A headless Chromium driven through its own ChromeDriver, or a skip that says what is missing."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (make test installs it)")
    from selenium.webdriver.chrome.service import Service

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("no Chromium/ChromeDriver here (Debian: apt-get install chromium chromium-driver; make test tries)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,900",
    ):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver), options=options)


def run_in_browser(url: str, prompt: str, screenshot: Path, timeout: float) -> dict:
    """Type the prompt, press Generate, wait for both runs to finish; the page's state, stats and bursts."""
    chrome = browser()
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        chrome.get(url)
        WebDriverWait(chrome, 30).until(lambda page: page.find_element(By.TAG_NAME, "body").get_attribute("data-ready"))
        box = chrome.find_element(By.ID, "prompt")
        box.clear()
        box.send_keys(prompt)
        chrome.find_element(By.ID, "run").click()
        WebDriverWait(chrome, timeout).until(
            lambda page: page.find_element(By.TAG_NAME, "body").get_attribute("data-state") in ("done", "error")
        )
        chrome.save_screenshot(str(screenshot))
        return {
            "state": chrome.find_element(By.TAG_NAME, "body").get_attribute("data-state"),
            "message": chrome.find_element(By.ID, "message").text,
            "stats": [chrome.find_element(By.CSS_SELECTOR, f"#{run} .stats").text for run in ("spec", "plain")],
            "answers": [chrome.find_element(By.CSS_SELECTOR, f"#{run} .answer").text for run in ("spec", "plain")],
            "bursts": len(chrome.find_elements(By.CSS_SELECTOR, "#spec .answer .burst")),
            "bars": len(chrome.find_elements(By.CSS_SELECTOR, "#spec svg.chart rect")),
        }
    finally:
        chrome.quit()


def check_page(page: dict, screenshot: Path) -> None:
    assert page["state"] == "done", page["message"]
    assert all("tok/s" in stats and "tau" in stats for stats in page["stats"]), page["stats"]
    assert page["answers"][0] == page["answers"][1] and page["answers"][0]  # lossless, side by side
    assert page["bars"] > 0 and screenshot.stat().st_size > 10_000
    tau = float(page["stats"][0].split("tau")[1].split()[0])
    assert (page["bursts"] > 0) == (tau > 1.0), page  # accepted drafts are highlighted, and only they


def test_the_page_in_a_real_browser(tiny_demo, tmp_path):
    screenshot = tmp_path / "demo.png"
    check_page(run_in_browser(tiny_demo, "the cat sat on the mat the cat sat on the mat", screenshot, 120), screenshot)


@pytest.mark.real_model
def test_the_page_in_a_real_browser_on_the_default_model(tmp_path):
    """The default model with `auto`; SELFSPEC_DEMO_SCREENSHOT=path keeps the screenshot (docs/demo.png is one)."""
    screenshot = Path(os.environ.get("SELFSPEC_DEMO_SCREENSHOT", tmp_path / "demo.png"))
    server, url = start_demo(SelfSpec("default"), max_new_tokens=96)
    try:
        prompt = (
            "Fix the bug in this function and show the corrected code:\ndef is_palindrome(s):\n    return s == s[::1]"
        )
        page = run_in_browser(url, prompt, screenshot, 600)
    finally:
        server.shutdown()
    check_page(page, screenshot)
    assert page["bursts"] > 0 and "accepted:" in page["stats"][0]
