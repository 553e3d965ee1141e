"""The one exception type for bad input: the CLI prints its message on one line and exits non-zero."""


class SelfspecError(Exception):
    """A user-facing error: the message names the problem and what to do about it."""
