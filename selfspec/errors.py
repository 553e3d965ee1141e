"""The one exception type for bad input: the CLI prints its message on one line and exits non-zero."""


class SelfspecError(Exception):
    """A user-facing error: the message names the problem and what to do about it."""


def first_line(error: BaseException) -> str:
    """An exception's message cut to its first line (its type's name when it has none), for one-line errors."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
