"""Tuned skip sets on disk: a JSON file keyed by the base model's fingerprint, found in the user cache or among
the shipped heads."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import SelfspecError
from ...files import atomic_write_text
from ...models import ModelFingerprint, Target, cache_root
from ...options import from_dict, to_dict
from ..artifacts import SHIPPED_DIR, SKIP_FILE
from .config import LayerSkipSettings


@dataclass(frozen=True)
class TunedSkipSet:
    settings: LayerSkipSettings
    draft_vocab: torch.Tensor | None  # [V_draft] target ids, ascending; None = the whole vocabulary
    fingerprint: ModelFingerprint
    study: dict  # a summary of the search that produced it


def fingerprint_key(fingerprint: ModelFingerprint) -> str:
    return hashlib.sha256(json.dumps(fingerprint.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def user_skip_path(target: Target) -> Path:
    """Where `selfspec tune layerskip` writes by default, keyed by the model's fingerprint."""
    return cache_root() / "layerskip" / f"{fingerprint_key(target.fingerprint)}.json"


def find_skip_file(target: Target, given: Path | None) -> Path:
    """--heads (a file, or a directory holding layerskip.json), else this model's tuned file in the user cache,
    else a shipped one whose fingerprint matches."""
    if given is not None:
        path = given / SKIP_FILE if given.is_dir() else given
        if not path.is_file():
            raise SelfspecError(f"'{given}' holds no {SKIP_FILE}: pass the file `selfspec tune layerskip` wrote")
        return path
    candidates = [user_skip_path(target), *sorted(SHIPPED_DIR.glob("layerskip-*/" + SKIP_FILE))]
    for path in candidates:
        if path.is_file() and _read(path).get("fingerprint") == target.fingerprint.to_dict():
            return path
    raise SelfspecError(
        "no tuned layer-skip set for this model: run `selfspec tune layerskip --model ...`, "
        "or use the hand-made baseline with --drafter layerskip:skip=every-other"
    )


def _read(path: Path) -> dict:
    try:
        document = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise SelfspecError(f"{path} is not a readable skip-set file ({error})") from None
    if not isinstance(document, dict) or set(document) != {
        "drafter",
        "fingerprint",
        "settings",
        "draft_vocab",
        "study",
    }:
        raise SelfspecError(f"{path}: expected the keys drafter, fingerprint, settings, draft_vocab, study")
    return document


def load_skip_file(path: Path, target: Target) -> TunedSkipSet:
    document = _read(path)
    if document["drafter"] != "layerskip":
        raise SelfspecError(f"{path} holds '{document['drafter']}' data, not a layer-skip set")
    fingerprint = ModelFingerprint.from_dict(document["fingerprint"])
    differences = fingerprint.differences(target.fingerprint)
    if differences:
        raise SelfspecError(
            f"the skip set in {path} was tuned for another base model ({'; '.join(differences)}): "
            "run `selfspec tune layerskip` for this model"
        )
    settings = from_dict(LayerSkipSettings, document["settings"], where=str(path))
    vocab = document["draft_vocab"]
    if vocab is not None and (not vocab or min(vocab) < 0 or max(vocab) >= target.vocab_size):
        raise SelfspecError(f"{path}: draft_vocab holds ids outside the vocabulary")
    draft_vocab = None if vocab is None else torch.tensor(vocab, dtype=torch.long, device=target.device)
    return TunedSkipSet(settings, draft_vocab, fingerprint, document["study"])


def save_skip_file(path: Path, tuned: TunedSkipSet) -> Path:
    """Write atomically (temp file, then rename)."""
    document = {
        "drafter": "layerskip",
        "fingerprint": tuned.fingerprint.to_dict(),
        "settings": to_dict(tuned.settings),
        "draft_vocab": None if tuned.draft_vocab is None else tuned.draft_vocab.tolist(),
        "study": tuned.study,
    }
    return atomic_write_text(path, json.dumps(document, indent=1) + "\n")
