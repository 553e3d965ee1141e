"""`selfspec generate | chat | demo | serve | bench | profile | train | tune | medusa-tree | export | import |
drafters`.

Bad input gives one line on stderr (`selfspec: error: ...`) and exit code 2, never a traceback.
Modules: parser.py (the arguments), commands.py (what each command does).
"""

from __future__ import annotations

import os
import sys

# Quiet third-party chatter (progress bars of weight loading, hub warnings) before they are imported.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from .commands import COMMANDS  # noqa: E402  (after the environment above)
from .parser import build_parser  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    from ..errors import SelfspecError

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    try:
        COMMANDS[args.command](args)
    except SelfspecError as error:
        print(f"selfspec: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nselfspec: interrupted", file=sys.stderr)
        return 130
    return 0


__all__ = ["build_parser", "main"]
