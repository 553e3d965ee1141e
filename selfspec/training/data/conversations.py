"""Conversations in: the ShareGPT training split (never the held-out 2%), or any JSONL file whose lines hold
`{"messages"|"conversations": [...]}` or `{"text": ...}`."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tqdm.auto import tqdm

from ...errors import SelfspecError
from .sharegpt import ROLES, Conversation, load_sharegpt


def load_conversations(source: str, limit: int | None = None, seed: int = 0) -> list[Conversation]:
    """`source` is "sharegpt" (training split only) or a JSONL path. A plain-text line becomes one assistant turn.
    ShareGPT conversations come in a seeded random order, so `limit` takes a sample spread over the whole split."""
    if source == "sharegpt":
        data = load_sharegpt("train")
        if data.dropped:
            details = ", ".join(f"{count} {reason}" for reason, count in sorted(data.dropped.items()))
            tqdm.write(f"sharegpt: {len(data.conversations)} conversations kept; dropped {details}")
        conversations = list(data.conversations)
        random.Random(seed).shuffle(conversations)
    else:
        conversations = _read_jsonl_conversations(Path(source))
    return conversations[:limit] if limit else conversations


def _read_jsonl_conversations(path: Path) -> list[Conversation]:
    if not path.is_file():
        raise SelfspecError(f"data file '{path}' does not exist: pass 'sharegpt' or a JSONL file of conversations")
    conversations = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise SelfspecError(f"{path}:{number}: not valid JSON ({error.msg})") from None
        conversations.append(_record_to_conversation(record, f"{path}:{number}"))
    if not conversations:
        raise SelfspecError(f"data file '{path}' holds no conversations")
    return conversations


def _record_to_conversation(record, where: str) -> Conversation:
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return Conversation(
            id=str(record.get("id", where)), messages=({"role": "assistant", "content": record["text"]},)
        )
    turns = record.get("messages", record.get("conversations")) if isinstance(record, dict) else None
    if not isinstance(turns, list) or not turns:
        raise SelfspecError(f'{where}: expected {{"messages": [...]}}, {{"conversations": [...]}} or {{"text": ...}}')
    messages = []
    for turn in turns:
        role = str(turn.get("role", turn.get("from", ""))).lower() if isinstance(turn, dict) else ""
        content = turn.get("content", turn.get("value")) if isinstance(turn, dict) else None
        if role not in ROLES or not isinstance(content, str):
            raise SelfspecError(f"{where}: each turn needs a known role (user/assistant/system...) and string content")
        messages.append({"role": ROLES[role], "content": content})
    return Conversation(id=str(record.get("id", where)), messages=tuple(messages))
