"""Regeneration: the target writes the assistant replies (greedy), so heads learn what the target would say rather
than what ShareGPT's authors said."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ...errors import SelfspecError
from ...files import atomic_write_text
from ...models import Target
from ..clock import running_time
from ..config import RecipeConfig
from ..throughput import StageCount
from .conversations import load_conversations
from .greedy_batch import greedy_replies, supports_in_place
from .sharegpt import Conversation


def regenerated_conversations(target: Target, conversations, config: RecipeConfig, count: StageCount | None):
    """The conversations' first exchanges with the target's replies (regenerated where missing), in the sample's order
    (not the file's batch order), so an interrupted or re-batched run gives the same data."""
    data = config.data
    path = regenerate(
        target,
        conversations,
        config.work_path / "regenerated.jsonl",
        max_prompt_tokens=data.max_prompt_tokens,
        max_new_tokens=data.max_new_tokens,
        batch_size=data.regenerate_batch_size,
        engine=data.regenerate_engine,
        count=count,
    )
    rank = {conversation.id: index for index, conversation in enumerate(conversations)}
    replied = (c for c in load_conversations(str(path)) if c.id in rank and c.messages[-1]["content"].strip())
    return sorted(replied, key=lambda c: rank[c.id])


def _first_exchange(conversation: Conversation) -> list[dict] | None:
    """The messages up to and including the first user turn (system turns before it are kept)."""
    for index, message in enumerate(conversation.messages):
        if message["role"] == "user":
            return list(conversation.messages[: index + 1])
        if message["role"] != "system":
            return None
    return None


def _keep_only_replies_of(target: Target, out_path: Path, max_prompt_tokens: int, max_new_tokens: int) -> None:
    """Replies are resumed only when the same model made them under the same limits: `<out>.settings.json` says
    which; a file made otherwise (or before the settings were recorded) is moved to `<out>.previous.jsonl`."""
    settings = json.loads(
        json.dumps(
            {
                "fingerprint": target.fingerprint.to_dict(),
                "max_prompt_tokens": max_prompt_tokens,
                "max_new_tokens": max_new_tokens,
            }
        )
    )
    settings_path = out_path.with_name(out_path.stem + ".settings.json")
    if out_path.exists():
        try:
            recorded = json.loads(settings_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            recorded = None
        if recorded != settings:
            previous = out_path.with_name(out_path.stem + ".previous" + out_path.suffix)
            out_path.replace(previous)
            what = "without recorded settings" if recorded is None else "by another model or under other limits"
            tqdm.write(f"{out_path} was made {what}: moved to {previous}; regenerating")
    atomic_write_text(settings_path, json.dumps(settings, indent=1))


def regeneration_prompts(
    target: Target, conversations: list[Conversation], max_prompt_tokens: int, batch_size: int
) -> list[tuple[str, list[dict], list[int]]]:
    """(conversation id, first-exchange messages, prompt ids) for each conversation with a first user turn of at
    most `max_prompt_tokens`, in the order `regenerate` batches them: similar lengths share a batch (less padding),
    sorted within windows of 8 batches so an interrupted run is still a sample."""
    todo = []
    for conversation in conversations:
        prompt = _first_exchange(conversation)
        if prompt is None:
            continue
        ids = target.render_chat(prompt, True)
        if len(ids) <= max_prompt_tokens:
            todo.append((conversation.id, prompt, ids))
    window = batch_size * 8
    return [
        item
        for start in range(0, len(todo), window)
        for item in sorted(todo[start : start + window], key=lambda item: len(item[2]))
    ]


def regenerate(
    target: Target,
    conversations: list[Conversation],
    out_path: Path,
    max_prompt_tokens: int = 384,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    engine: str = "batched",
    count: StageCount | None = None,
) -> Path:
    """Write `out_path` (JSONL): for each conversation, its first user turn and the target's own greedy reply.

    Resumable: conversations already in `out_path` (made by the same model under the same limits) are skipped, and
    each batch is appended whole (a torn last line from an interruption is dropped on the next run; an empty reply
    is recorded too, and skipped when the data is read). engine "batched": greedy decoding of `batch_size` prompts at
    once on an in-place cache, finished rows leaving the batch (greedy_batch.py), the throughput choice on any
    device (a model with sliding or other special cache layers falls back to "generate"); "generate": HF
    `generate` over the same batches; "selfspec": selfspec's own lossless decoding (ngram drafter), one prompt at a
    time. All give the target's greedy text (up to float ties).
    `count`, when given, receives the new tokens generated in this invocation and the seconds it took.
    """
    replies_for = engine_replies(engine)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    _keep_only_replies_of(target, out_path, max_prompt_tokens, max_new_tokens)
    done = _completed_ids(out_path)
    todo = regeneration_prompts(target, [c for c in conversations if c.id not in done], max_prompt_tokens, batch_size)
    eos = set(target.eos_token_ids)
    count = count if count is not None else StageCount()
    with tqdm(total=len(todo), desc="regenerate", unit="conv") as bar, out_path.open("a", encoding="utf-8") as out:
        for start in range(0, len(todo), batch_size):
            began = running_time()
            batch = todo[start : start + batch_size]
            lines = []
            for (conversation_id, prompt, _), row in zip(
                batch, replies_for(target, [ids for _, _, ids in batch], max_new_tokens), strict=True
            ):
                cut = next((i for i, token in enumerate(row) if token in eos), None)
                count.tokens += len(row) if cut is None else cut + 1  # the generated tokens, the end marker too
                reply = target.tokenizer.decode(row[:cut] if cut is not None else row, skip_special_tokens=True)
                # Empty replies are written too, so a resumed run does not ask again; readers skip them.
                messages = prompt + [{"role": "assistant", "content": reply}]
                lines.append(json.dumps({"id": conversation_id, "messages": messages}))
            out.write("".join(line + "\n" for line in lines))
            out.flush()
            count.seconds += running_time() - began
            count.sequences += len(batch)
            bar.update(len(batch))
            bar.set_postfix({"tok/s": f"{count.tokens / max(count.seconds, 1e-9):,.0f}"}, refresh=False)
    return out_path


def engine_replies(engine: str):
    """The function behind a `data.regenerate_engine` name: (target, prompts' ids, max new tokens) -> each prompt's
    reply ids (through its first end marker, or `max new tokens` long)."""
    engines = {"batched": _batched_replies, "generate": _generate_replies, "selfspec": _selfspec_replies}
    if engine not in engines:
        raise SelfspecError(f"data.regenerate_engine must be one of {', '.join(engines)}, got '{engine}'")
    return engines[engine]


def _batched_replies(target: Target, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    if not supports_in_place(target):  # sliding-window or other special cache layers
        return _generate_replies(target, prompts, max_new_tokens)
    return greedy_replies(target, prompts, max_new_tokens)


def _generate_replies(target: Target, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else target.eos_token_ids[0]
    width = max(len(ids) for ids in prompts)
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompts], device=target.device)
    attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts], device=target.device)
    with torch.inference_mode():
        output = target.model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=list(target.eos_token_ids),
        )
    return output[:, width:].tolist()


def _selfspec_replies(target: Target, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from ...decoding import speculative_generate
    from ...heads import create_drafter

    drafter = create_drafter("ngram", target)
    return [list(speculative_generate(target, drafter, torch.tensor(ids), max_new_tokens)[0]) for ids in prompts]


def _completed_ids(path: Path) -> set[str]:
    if not path.is_file():
        return set()
    good, ids = [], set()
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            ids.add(json.loads(line)["id"])
            good.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            break  # a torn line from an interruption: drop it and everything after
    atomic_write_text(path, "".join(line + "\n" for line in good))
    return ids
