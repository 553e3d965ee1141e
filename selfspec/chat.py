"""`selfspec chat`: a conversation with the target in the terminal, with speculation made visible.

Each reply streams as the decoding loop commits tokens. A step commits the drafted tokens the target accepted and
then one token of the target's own; on a terminal the accepted drafted tokens of each step are printed in a colour of
their own (the colours take turns), so a burst of several tokens from one forward shows as one coloured run, and the
target's own tokens are plain. After each reply a status line gives tokens/s, the mean accepted length (tau), the
drafter and, for `auto`, which sources' tokens were accepted.

The conversation goes through the model's chat template; when it no longer fits in the context with room for a reply,
the oldest turns are dropped. Without a terminal (a pipe), every input line is one user turn, the replies go to
stdout without colour and the status lines to stderr.
"""

from __future__ import annotations

import sys
from typing import Callable, TextIO

from .api import StepText
from .errors import SelfspecError
from .models import Target

COLOURS = ("\033[36m", "\033[32m", "\033[33m", "\033[35m")  # cyan, green, yellow, magenta: one per step, in turn
RESET, DIM = "\033[0m", "\033[2m"
COMMANDS = "/reset forgets the conversation, /exit (or Ctrl-D) leaves"


class Conversation:
    """The turns so far, rendered through the chat template and kept within the target's context."""

    def __init__(self, target: Target, max_new_tokens: int, system: str | None = None):
        self.target, self.max_new_tokens = target, max_new_tokens
        self.system = [{"role": "system", "content": system}] if system else []
        self.turns: list[dict] = []
        self.dropped = 0  # turns dropped so far to stay within the context

    def prompt_for(self, user_text: str):
        """The input ids for the reply to `user_text`, appended as the newest turn: [1, L]. A message that cannot fit
        even alone is refused and the conversation left as it was."""
        user = {"role": "user", "content": user_text}
        room = self.target.context_limit - self.max_new_tokens
        alone = self.target.encode_messages(self.system + [user]).shape[1]
        if alone > room:
            raise SelfspecError(
                f"this message takes {alone} tokens, more than the {room} the context leaves beside a "
                f"reply of up to {self.max_new_tokens}: shorten it"
            )
        self.turns.append(user)
        while True:
            input_ids = self.target.encode_messages(self.system + self.turns)
            if input_ids.shape[1] <= room:
                return input_ids
            self.turns = self.turns[2:]  # the oldest exchange: a user turn and its reply
            self.dropped += 2

    def add_reply(self, text: str) -> None:
        self.turns.append({"role": "assistant", "content": text})

    def withdraw(self) -> None:
        """Forget the newest user turn (its reply was interrupted)."""
        if self.turns and self.turns[-1]["role"] == "user":
            self.turns.pop()

    def reset(self) -> None:
        self.turns, self.dropped = [], 0


class BurstPainter:
    """Prints each step's committed tokens: the step's accepted drafted tokens in the step's colour, the target's own
    token plain (api.StepText)."""

    def __init__(self, target: Target, write: Callable[[str], None], colour: bool):
        self.splitter, self.write, self.colour = StepText(target), write, colour
        self.steps = 0

    def __call__(self, token_ids) -> None:
        pieces = self.splitter.split(token_ids)
        colour = COLOURS[self.steps % len(COLOURS)]
        self.steps += 1
        if pieces is None:
            return
        burst, own = pieces
        if burst and self.colour:
            self.write(f"{colour}{burst}{RESET}{own}")
        else:
            self.write(burst + own)


def status_line(drafter_name: str, stats, sources: dict[str, int] | None) -> str:
    line = (
        f"[{drafter_name} | {stats.tokens_per_s:.1f} tok/s | tau {stats.mean_accepted_length:.2f} | "
        f"{stats.new_tokens} tokens" + (f" | {stats.path} path" if stats.path else "")
    )
    if sources:
        line += " | accepted: " + " ".join(f"{name}={count}" for name, count in sources.items())
    return line + "]"


def run_chat(
    spec,
    stdin: TextIO,
    stdout: TextIO,
    stderr: TextIO,
    interactive: bool,
    colour: bool,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    system: str | None = None,
) -> None:
    """The chat loop over a SelfSpec `spec`: read a turn, stream the reply, print the status line; until /exit or
    end of input. `interactive`: prompts and the status line on `stdout` (a terminal); otherwise status on `stderr`."""
    conversation = Conversation(spec.target, max_new_tokens, system)
    status_out = stdout if interactive else stderr
    spec.between_requests()  # a background compile, if one is due, runs while the user types
    drafter = spec.drafter
    if interactive:
        stdout.write(
            f"selfspec chat: {spec.target.name}, drafter {drafter.describe()}, path "
            f"{spec.target.execution.name}. {COMMANDS}.\n"
        )
        stdout.flush()
    turn = 0
    while True:
        line = read_turn(stdin, stdout, interactive)
        if line is None:
            return
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            conversation.reset()
            if interactive:
                stdout.write("(conversation forgotten)\n")
            continue
        try:
            input_ids = conversation.prompt_for(text)
        except SelfspecError as error:
            stderr.write(f"selfspec: {error}\n")
            stderr.flush()
            continue
        if interactive:
            stdout.write("bot> ")
        stdout.flush()
        before = drafter.stats()
        painter = BurstPainter(spec.target, lambda piece: (stdout.write(piece), stdout.flush()), colour)
        try:
            result = spec.generate(
                input_ids=input_ids,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=seed + turn,
                on_step=painter,
            )
        except KeyboardInterrupt:
            conversation.withdraw()
            stdout.write("\n(interrupted: the reply is left out of the conversation)\n")
            stdout.flush()
            continue
        turn += 1
        conversation.add_reply(result.text)
        sources = drafter.stats().accepted_since(before)
        stdout.write("\n")
        stdout.flush()
        dropped = f" (oldest turns dropped to fit the context: {conversation.dropped})" if conversation.dropped else ""
        status = status_line(drafter.name, result.stats, sources) + dropped
        status_out.write((f"{DIM}{status}{RESET}" if colour else status) + "\n")
        status_out.flush()


def read_turn(stdin: TextIO, stdout: TextIO, interactive: bool) -> str | None:
    """The next user line, or None at the end of input (Ctrl-D; Ctrl-C at the prompt also leaves). On a terminal
    the line is read with line editing (`input`)."""
    if not interactive or stdin is not sys.stdin or stdout is not sys.stdout:
        if interactive:
            stdout.write("\nyou> ")
            stdout.flush()
        return stdin.readline() or None
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    try:
        return input("\nyou> ")
    except (EOFError, KeyboardInterrupt):
        stdout.write("\n")
        return None


def stream_is_terminal(stream: TextIO) -> bool:
    return hasattr(stream, "isatty") and stream.isatty()


def main_loop(spec, args) -> None:
    """`selfspec chat`'s body once the model and drafter are loaded."""
    interactive = stream_is_terminal(sys.stdin) and stream_is_terminal(sys.stdout)
    colour = interactive and not args.no_color
    run_chat(
        spec,
        sys.stdin,
        sys.stdout,
        sys.stderr,
        interactive,
        colour,
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        args.top_p,
        args.seed,
        args.system,
    )
