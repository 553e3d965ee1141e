"""A trained head on disk: `config.json` (typed, unknown keys rejected) + `model.safetensors` (fingerprint of the base
model in its metadata), optionally an `adapter/` (LoRA on the base, Medusa-2). Written to a temporary directory and
renamed, so a directory is whole or absent. The base model's weights are never written here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..errors import SelfspecError
from ..files import atomic_directory
from ..models import ModelFingerprint, Target
from ..options import from_dict, to_dict

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
SKIP_FILE = "layerskip.json"  # tuned layer-skip data: a file of its own, or one inside a directory
ADAPTER = "adapter"
REPORT = "training_report.json"  # what training measured, held-out acceptance included (written by `selfspec train`)
SHIPPED_DIR = Path(__file__).parent / "trained"  # heads shipped in the repository, for the default model


@dataclass(frozen=True)
class HeadArtifact:
    drafter: str
    config: object  # the drafter's typed config dataclass
    state: dict[str, torch.Tensor]
    fingerprint: ModelFingerprint
    extra: dict  # data beside the weights (tree shape, accuracies, ...), stored in config.json under "data"


def save_head(
    directory: Path,
    drafter: str,
    config,
    state: dict[str, torch.Tensor],
    fingerprint: ModelFingerprint,
    extra: dict | None = None,
    write_adapter: Callable[[Path], None] | None = None,
) -> Path:
    """Write a head directory atomically (replacing an existing one)."""
    with atomic_directory(directory) as temp:
        document = {"drafter": drafter, "config": to_dict(config), "data": extra or {}}
        (temp / CONFIG).write_text(json.dumps(document, indent=1) + "\n")
        metadata = {"fingerprint": json.dumps(fingerprint.to_dict()), "drafter": drafter}
        save_file(
            {name: tensor.detach().contiguous().cpu() for name, tensor in state.items()},
            str(temp / WEIGHTS),
            metadata=metadata,
        )
        if write_adapter is not None:
            write_adapter(temp / ADAPTER)
    return Path(directory)


def load_head(directory: Path, drafter: str, config_cls, target: Target) -> HeadArtifact:
    """Read and check a head directory: the right drafter, a valid config, the fingerprint of `target`."""
    directory = Path(directory)
    config_path, weights_path = directory / CONFIG, directory / WEIGHTS
    if not config_path.is_file() or not weights_path.is_file():
        raise SelfspecError(f"'{directory}' is not a heads directory (needs {CONFIG} and {WEIGHTS})")
    try:
        document = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise SelfspecError(f"{config_path} is not valid JSON ({error.msg})") from None
    if isinstance(document, dict) and "speculators_model_type" in document:
        kind = document["speculators_model_type"]
        hint = "use --drafter eagle3" if kind == "eagle3" else "selfspec reads speculators eagle3 heads only"
        raise SelfspecError(f"'{directory}' holds speculators '{kind}' heads, not '{drafter}': {hint}")
    if not isinstance(document, dict) or set(document) != {"drafter", "config", "data"}:
        raise SelfspecError(f"{config_path}: expected the keys drafter, config, data")
    if document["drafter"] != drafter:
        raise SelfspecError(
            f"'{directory}' holds '{document['drafter']}' heads, not '{drafter}': use --drafter {document['drafter']}"
        )
    config = from_dict(config_cls, document["config"], where=str(config_path))
    state, metadata = read_weights(weights_path)
    if "fingerprint" not in metadata:
        raise SelfspecError(f"{weights_path} has no base-model fingerprint: it was not written by selfspec")
    fingerprint = ModelFingerprint.from_dict(json.loads(metadata["fingerprint"]))
    differences = fingerprint.differences(target.fingerprint)
    if differences:
        raise SelfspecError(
            f"heads in '{directory}' were trained for another base model ({'; '.join(differences)}): "
            f"train heads for this model with `selfspec train {drafter}`"
        )
    return HeadArtifact(drafter, config, state, fingerprint, document["data"])


def read_weights(weights_path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A weights file (a heads directory's, or a speculators checkpoint's) -> (its tensors, its metadata: for a heads
    directory, the fingerprint and the drafter)."""
    if not weights_path.is_file():
        raise SelfspecError(
            f"'{weights_path.parent}' has no {weights_path.name} (a sharded or .bin checkpoint is not supported)"
        )
    try:
        with safe_open(str(weights_path), framework="pt") as file:
            metadata = file.metadata() or {}
            return {name: file.get_tensor(name) for name in file.keys()}, metadata
    except (SafetensorError, OSError) as error:
        raise SelfspecError(f"{weights_path} is unreadable ({error}): retrain or re-download the heads") from None


def load_state_strict(module: torch.nn.Module, state: dict[str, torch.Tensor], where: Path) -> None:
    """load_state_dict(strict=True) with shape checks, as a one-line SelfspecError."""
    expected = module.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = [name for name in expected if name in state and state[name].shape != expected[name].shape]
    if missing or unexpected or wrong:
        raise SelfspecError(
            f"weights in '{where}' do not match the head's config (missing {missing[:3]}, unexpected {unexpected[:3]}, "
            f"wrong shape {wrong[:3]})"
        )
    module.load_state_dict(state, strict=True)


@dataclass(frozen=True)
class LoadedHead:
    head: torch.nn.Module  # in the target's dtype, weights loaded strictly
    directory: Path  # where it came from (given, or the shipped one found for the target)
    data: dict  # what is stored beside the weights (tree shape, accuracies, ...)

    @property
    def heldout_tau(self) -> float | None:
        return heldout_tau(self.directory)


def load_vocab_head(target: Target, heads_dir: Path | None, drafter: str, config_cls, head_cls) -> LoadedHead:
    """Find (or take) a heads directory, check it, and build `head_cls(config, target, draft_vocab)` with its weights
    loaded strictly, in the target's dtype (every head drafts over a reduced draft vocabulary)."""
    heads_dir = heads_dir or find_shipped_head(target, drafter, config_cls)
    artifact = load_head(heads_dir, drafter, config_cls, target)
    draft_vocab = artifact.state.get("draft_vocab")
    if draft_vocab is None or draft_vocab.dim() != 1 or int(draft_vocab.max()) >= target.vocab_size:
        raise SelfspecError(f"'{heads_dir}': missing or invalid draft_vocab")
    head = head_cls(artifact.config, target, draft_vocab)
    load_state_strict(head, artifact.state, heads_dir)
    return LoadedHead(head.to(target.dtype), heads_dir, artifact.extra)


def heldout_tau(directory: Path) -> float | None:
    """The mean accepted length a heads directory's training report measured on held-out prompts; None when the
    directory has no report (heads trained elsewhere) or the report has no held-out evaluation."""
    try:
        report = json.loads((Path(directory) / REPORT).read_text())
        return float(report["heldout"]["mean_accepted_length"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def find_shipped_head(target: Target, drafter: str, config_cls) -> Path:
    """The shipped heads directory for `drafter` whose fingerprint matches `target`; anything else needs --heads."""
    for candidate in sorted(SHIPPED_DIR.glob(f"{drafter}-*")):
        try:
            load_head(candidate, drafter, config_cls, target)
            return candidate
        except SelfspecError:
            continue
    raise SelfspecError(
        f"no shipped '{drafter}' heads match this model: train some with `selfspec train {drafter}` and pass --heads "
        f"DIR"
    )


def heads_kind(path: Path) -> str | None:
    """Which drafter a heads path is for: a heads directory names it in its config; a skip file (or a directory
    holding one) is layer-skip tuned data; None for anything else."""
    path = Path(path)
    if path.is_file():
        return "layerskip"
    try:
        document = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError):
        return "layerskip" if (path / SKIP_FILE).is_file() else None
    if isinstance(document, dict) and document.get("speculators_model_type") in ("eagle3", "dflash"):
        return document["speculators_model_type"]  # a speculators directory (heads/speculators.py)
    return document.get("drafter") if isinstance(document, dict) else None
