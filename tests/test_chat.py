"""`selfspec chat`: the conversation kept within the context, accepted bursts painted per step, the loop through
pipes, and the real thing through a pseudo-terminal (two turns typed, the screen read back)."""

from __future__ import annotations

import io
import re
import sys

import pytest

from selfspec import SelfSpec
from selfspec.chat import COLOURS, RESET, BurstPainter, Conversation, run_chat
from selfspec.cli import main
from selfspec.errors import SelfspecError

ANSI = re.compile(r"\x1b\[[0-9;]*m")
STATUS = re.compile(r"\[(\w+) \| ([\d.]+) tok/s \| tau ([\d.]+) \| (\d+) tokens([^\]\n]*)\]")


@pytest.fixture(scope="module")
def tiny_spec(tiny_checkpoint):
    return SelfSpec(str(tiny_checkpoint), drafter="ngram")


def test_the_conversation_drops_its_oldest_exchanges_to_fit_the_context(tiny_spec):
    target = tiny_spec.target
    conversation = Conversation(target, max_new_tokens=target.context_limit - 60)
    message = " ".join(["cat"] * 12)
    lengths = []
    for turn in range(6):
        lengths.append(conversation.prompt_for(f"{message} {turn}").shape[1])
        conversation.add_reply(message)
    assert conversation.dropped > 0 and max(lengths) <= 60
    assert conversation.turns[-2]["content"] == f"{message} 5"  # the newest turn is always there
    assert conversation.turns[0]["role"] == "user"  # dropped by whole exchanges
    with pytest.raises(SelfspecError, match="shorten it"):
        conversation.prompt_for(" ".join(["cat"] * 80))
    assert conversation.turns[-1]["role"] == "assistant"  # the message that did not fit is not kept


def test_bursts_are_painted_per_step_and_the_text_is_the_whole_reply(tiny_spec):
    target = tiny_spec.target
    tokens = target.tokenizer(" the cat sat on the mat the cat", add_special_tokens=False)["input_ids"]
    pieces: list[str] = []
    painter = BurstPainter(target, pieces.append, colour=True)
    steps = [tokens[:3], tokens[3:4], tokens[4:8]]  # a burst of 2 accepted drafts + the target's token, 1 alone, 3 + 1
    for step in steps:
        painter(step)
    assert ANSI.sub("", "".join(pieces)) == target.decode(tokens)
    assert pieces[0].startswith(COLOURS[0]) and pieces[0].index(RESET) > 0
    assert (
        pieces[0][pieces[0].index(RESET) + len(RESET) :] == target.decode(tokens[:3])[len(target.decode(tokens[:2])) :]
    )
    assert not ANSI.search(pieces[1])  # a step that accepted no draft is the target's own token, plain
    assert pieces[2].startswith(COLOURS[2])  # colours take turns by step
    plain: list[str] = []
    painter = BurstPainter(target, plain.append, colour=False)
    for step in steps:
        painter(step)
    assert "".join(plain) == target.decode(tokens)


def test_chat_through_pipes_keeps_the_history_and_writes_status_to_stderr(tiny_spec, monkeypatch):
    seen = []
    generate = tiny_spec.generate

    def spy(**kwargs):
        seen.append(kwargs["input_ids"].shape[1])
        return generate(**kwargs)

    monkeypatch.setattr(tiny_spec, "generate", spy)
    stdin = io.StringIO("the cat sat\n\nthe dog ran\n/reset\nthe cat sat\n/exit\nnever read\n")
    stdout, stderr = io.StringIO(), io.StringIO()
    run_chat(tiny_spec, stdin, stdout, stderr, interactive=False, colour=False, max_new_tokens=8)
    assert len(seen) == 3 and seen[1] > seen[0] + 8  # the second turn carries the first exchange
    assert seen[2] == seen[0]  # /reset: the third starts afresh (same message, same prompt)
    replies = stdout.getvalue().splitlines()
    assert len(replies) == 3 and not ANSI.search(stdout.getvalue())
    statuses = [STATUS.search(line) for line in stderr.getvalue().splitlines()]
    assert len(statuses) == 3 and all(status and status.group(1) == "ngram" for status in statuses)
    assert replies[0] == replies[2]  # greedy: the same conversation, the same reply


def test_chat_bad_input_is_one_line(tiny_checkpoint, tmp_path, capsys):
    for extra, fragment in (
        (["--max-new-tokens", "0"], "max_new_tokens"),
        (["--drafter", "nope"], "unknown drafter"),
        (["--drafter", "eagle", "--heads", str(tmp_path / "missing")], "does not exist"),
        (["--temperature", "-1"], "temperature"),
    ):
        assert main(["chat", "--model", str(tiny_checkpoint), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("selfspec: error:") and len(err.splitlines()) == 1 and fragment in err, err


def _pty_chat(arguments: list[str], turns: list[str], timeout: float):
    """Run `selfspec chat` in a pseudo-terminal, type the turns, and return (the raw screen text, statuses)."""
    pexpect = pytest.importorskip("pexpect", reason="pexpect drives the pseudo-terminal (make test installs it)")
    child = pexpect.spawn(
        sys.executable,
        ["-m", "selfspec.cli", "chat", *arguments],
        encoding="utf-8",
        timeout=timeout,
        dimensions=(40, 200),
    )
    screen, statuses = [], []
    child.expect("you> ")
    screen.append(child.before)
    for turn in turns:
        child.sendline(turn)
        child.expect(STATUS.pattern)
        screen.append(child.before + child.after)
        statuses.append(child.match)
        child.expect("you> ")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, "".join(screen)
    return "".join(screen), statuses


def test_chat_in_a_pseudo_terminal(tiny_checkpoint):
    screen, statuses = _pty_chat(
        ["--model", str(tiny_checkpoint), "--drafter", "ngram", "--max-new-tokens", "16"],
        ["the cat sat on the mat", "the dog ran"],
        timeout=120,
    )
    assert "drafter ngram" in screen and "/reset" in screen  # the banner
    assert [status.group(1) for status in statuses] == ["ngram", "ngram"]
    assert all(int(status.group(4)) > 0 for status in statuses)
    if any(float(status.group(3)) > 1.0 for status in statuses):  # some step accepted drafts: they are painted
        assert any(colour in screen for colour in COLOURS)


@pytest.mark.real_model
def test_chat_on_the_default_model_in_a_pseudo_terminal():
    """The real model and `auto` (prompt lookup and the shipped heads): two turns, the second one about the first."""
    screen, statuses = _pty_chat(
        ["--max-new-tokens", "40"],
        ["Repeat this sentence twice: the quick brown fox jumps over the lazy dog.", "Now say it once more."],
        timeout=600,
    )
    assert [status.group(1) for status in statuses] == ["auto", "auto"]
    assert "fox" in ANSI.sub("", screen)
    assert any(float(status.group(3)) > 1.0 for status in statuses)  # a sentence repeated is drafted by lookup
    assert any(colour in screen for colour in COLOURS)
    assert all("accepted: ngram=" in status.group(5) for status in statuses)  # auto says whose tokens were accepted
