"""Conversations rendered with the target's own chat template into token sequences with an assistant loss mask, and
kept in the work directory so a resumed or second run does not render them again."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ...errors import SelfspecError
from ...files import atomic_write
from ...models import Target
from .sharegpt import Conversation


@dataclass(frozen=True)
class Example:
    id: str
    input_ids: torch.Tensor  # [L] long
    loss_mask: torch.Tensor  # [L] bool; True where the token is one heads should learn to predict (assistant text)
    kind: str = "original"  # "original": the conversation as it is; "regenerated": the target wrote the reply


def tokenize_conversation(
    target: Target, conversation: Conversation, max_length: int, kind: str = "original"
) -> Example | None:
    """Render through the chat template; the loss mask covers the assistant turns' tokens (their end marker too).

    Spans come from rendering growing prefixes of the conversation, which stay prefixes of the whole rendering for
    chat templates that wrap turns in special tokens. Returns None when no assistant token fits in `max_length`.
    """
    if target.tokenizer is None:
        raise SelfspecError("training data needs the target's tokenizer")
    messages = list(conversation.messages)
    if not getattr(target.tokenizer, "chat_template", None) and len(messages) == 1:
        ids = target.render_chat(messages, False)
        mask = [True] * len(ids)
    else:
        ids = target.render_chat(messages, False)
        mask = [False] * len(ids)
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = len(target.render_chat(messages[:index], True)) if index else 0
            if start >= max_length:  # this turn and all later ones lie past the cut: rendering them changes nothing
                break
            end = min(len(target.render_chat(messages[: index + 1], False)), len(ids))
            mask[start:end] = [True] * max(0, end - start)
    ids, mask = ids[:max_length], mask[:max_length]
    if len(ids) < 2 or not any(mask[1:]):
        return None
    return Example(conversation.id, torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool), kind)


TOKENIZED_FORMAT = 1  # bump when Example or the stored layout changes


def tokenized(target: Target, conversations, max_length: int, kind: str, work_dir: Path) -> list[Example]:
    """The conversations rendered and tokenized (tokenize_conversation), kept in `work_dir` under a key of everything
    the result depends on: the conversations' ids and text, the tokenizer and its chat template, `max_length`, `kind`.
    Rendering every prefix of the whole split's multi-turn conversations takes over ten CPU minutes, which a resumed
    or second run sharing the work directory does not pay again."""
    digest = hashlib.sha256()
    chat_template = getattr(target.tokenizer, "chat_template", None) or ""
    header = [TOKENIZED_FORMAT, target.fingerprint.tokenizer_hash, chat_template, max_length, kind]
    digest.update(json.dumps(header).encode())
    for conversation in conversations:
        digest.update(json.dumps([conversation.id, conversation.messages]).encode())
    path = work_dir / f"tokenized-{kind}-{digest.hexdigest()[:16]}.pt"
    if path.exists():
        stored = torch.load(path)
        ids = stored["input_ids"].long().split(stored["lengths"].tolist())
        masks = stored["loss_mask"].split(stored["lengths"].tolist())
        return [Example(name, i, m, kind) for name, i, m in zip(stored["ids"], ids, masks, strict=True)]
    examples = [example for example in tokenize_all(target, conversations, max_length, kind) if example is not None]
    stored = {
        "ids": [example.id for example in examples],
        "lengths": torch.tensor([len(example.input_ids) for example in examples], dtype=torch.long),
        "input_ids": torch.cat([e.input_ids for e in examples] or [torch.zeros(0, dtype=torch.long)]).to(torch.int32),
        "loss_mask": torch.cat([e.loss_mask for e in examples] or [torch.zeros(0, dtype=torch.bool)]),
    }
    atomic_write(path, lambda temp: torch.save(stored, temp))
    return examples


_POOL_TARGET: Target | None = None  # what forked tokenizing workers render with (inherited, never pickled)
POOL_MIN_CONVERSATIONS = 256  # fewer than this are tokenized in the process itself


def tokenize_all(target: Target, conversations, max_length: int, kind: str, workers: int | None = None) -> list:
    """tokenize_conversation over `conversations`, in order, with a progress bar: in forked worker processes (one per
    CPU, up to 16) when there are many conversations and more than two CPUs (a GPU host tokenizing the whole split),
    in this process otherwise. Either way the results are the same."""
    global _POOL_TARGET
    workers = workers if workers is not None else min(os.cpu_count() or 1, 16)
    bar = tqdm(total=len(conversations), desc=f"tokenize ({kind})", unit="conv")
    with bar:
        if workers <= 2 or len(conversations) < POOL_MIN_CONVERSATIONS or "fork" not in mp.get_all_start_methods():
            return [_tokenize_one(target, c, max_length, kind, bar) for c in conversations]
        _POOL_TARGET = target
        try:
            with ProcessPoolExecutor(workers, mp_context=mp.get_context("fork")) as pool:
                work = partial(_tokenize_in_worker, max_length=max_length, kind=kind)
                examples = []
                for conversation, row in zip(conversations, pool.map(work, conversations, chunksize=64), strict=True):
                    # Plain lists cross the process boundary (tensors would each take a shared-memory handle).
                    examples.append(row and Example(conversation.id, torch.tensor(row[0]), torch.tensor(row[1]), kind))
                    bar.update(1)
                return examples
        finally:
            _POOL_TARGET = None


def _tokenize_one(target: Target, conversation, max_length: int, kind: str, bar) -> Example | None:
    bar.update(1)
    return tokenize_conversation(target, conversation, max_length, kind)


def _tokenize_in_worker(conversation, max_length: int, kind: str) -> tuple[list[int], list[bool]] | None:
    example = tokenize_conversation(_POOL_TARGET, conversation, max_length, kind)
    return example and (example.input_ids.tolist(), example.loss_mask.tolist())
