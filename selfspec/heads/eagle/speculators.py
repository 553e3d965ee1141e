"""EAGLE-3 heads in the format of the `speculators` library, which vLLM loads (`--speculative-config`), both ways.

A speculators EAGLE-3 directory holds `config.json` (`speculators_model_type: eagle3`, the draft decoder layer's
transformers config, the draft vocabulary size, the target layers whose hidden states it fuses, the verifier's
name) and `model.safetensors`: `fc.weight`, `layers.0.*` (q/k/v 2H wide, `hidden_norm`), `norm.weight`,
`lm_head.weight` (the draft-vocabulary rows), `d2t` (draft index -> target id offset: target = index + d2t[index])
and `t2d` (a [V] mask of the target ids in the draft vocabulary); `embed_tokens.weight` is optional (absent, the
target's embeddings are used). selfspec's Eagle3Head uses those module names, so both directions copy weights.
This module only reads and writes the format; eagle3.py builds heads from it.

Export writes `embed_tokens` (the target's: speculators' loader leaves them uninitialised when they are absent) and
`lm_head` as the draft rows of the target's LM head (or the head's own, for imported heads that trained one). Import checks what a speculators directory can
tell about its base model: the layer type, hidden and vocabulary sizes, layer ids in range, and that embeddings and
LM-head rows it carries are this model's (an LM head that is not becomes the head's own).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ...errors import SelfspecError
from ...files import atomic_directory
from ...models import Target
from ..artifacts import CONFIG, WEIGHTS

SPECULATORS_VERSION = "0.9.0"  # the speculators release whose format this follows (checked by tests/test_speculators.py)
LAYER_TYPES = ("llama", "qwen3")  # the draft decoder layers speculators defines for EAGLE-3
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_UNSUPPORTED_OPTIONS = ("norm_before_fc", "fc_norm", "norm_output")  # speculators variants selfspec's head lacks


def speculators_type(directory: Path) -> str | None:
    """The `speculators_model_type` of a directory's config.json ('eagle3', 'dflash', ...), None when it is not one."""
    try:
        document = json.loads((Path(directory) / CONFIG).read_text())
    except (OSError, ValueError):
        return None
    kind = document.get("speculators_model_type") if isinstance(document, dict) else None
    return kind if isinstance(kind, str) else None


def check_layer_type(target: Target) -> None:
    model_type = getattr(target.config, "model_type", None)
    if model_type not in LAYER_TYPES:
        raise SelfspecError(f"speculators defines EAGLE-3 draft layers for {', '.join(LAYER_TYPES)} models, not "
                            f"'{model_type}': this head can be used in selfspec but not exported")


def _layer_config(target: Target, dtype: str) -> dict:
    """The draft decoder layer's transformers config: the target's, one layer deep."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = 1
    config.tie_word_embeddings = False
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1]
    document = config.to_diff_dict()
    for key in ("architectures", "_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        document.pop(key, None)
    return {**document, "model_type": config.model_type, "num_hidden_layers": 1, "vocab_size": target.vocab_size,
            "dtype": dtype}


@dataclass(frozen=True)
class SpeculatorsEagle3:
    """What a speculators EAGLE-3 directory holds, checked against a target and in selfspec's terms."""

    state: dict[str, torch.Tensor]  # the head's weights; read: float32, `lm_head.weight` only when it is the head's own
    draft_vocab: torch.Tensor  # [V_draft] target ids
    feature_layers: tuple[int, ...]  # () = the default layers
    norm_before_residual: bool
    own_lm_head: bool
    verifier: str | None


def write_speculators(out: Path, target: Target, content: SpeculatorsEagle3, depth: int, dtype: str = "bfloat16") -> Path:
    """Write a speculators EAGLE-3 directory at `out` (atomically); `content.state` holds `lm_head.weight` (the
    draft-vocabulary rows) beside the head's own weights."""
    check_layer_type(target)
    if dtype not in _DTYPES:
        raise SelfspecError(f"--weights-dtype must be one of {', '.join(_DTYPES)}, got '{dtype}'")
    state = {**content.state, "embed_tokens.weight": target.model.get_input_embeddings().weight}
    state = {name: tensor.detach().to(_DTYPES[dtype]).contiguous().cpu() for name, tensor in state.items()}
    draft_vocab = content.draft_vocab.cpu()
    state["d2t"] = draft_vocab - torch.arange(len(draft_vocab))
    state["t2d"] = torch.zeros(target.vocab_size, dtype=torch.bool).index_fill_(0, draft_vocab, True)
    document = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "draft_vocab_size": len(draft_vocab),
        "eagle_aux_hidden_state_layer_ids": list(content.feature_layers),
        "norm_before_residual": content.norm_before_residual,
        **{option: False for option in _UNSUPPORTED_OPTIONS},
        "embed_requires_grad": False,
        "target_hidden_size": None,
        "transformer_layer_config": _layer_config(target, dtype),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": depth,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": content.verifier, "architectures": list(getattr(target.config, "architectures", None) or [])},
        },
    }
    with atomic_directory(out) as temp:
        (temp / CONFIG).write_text(json.dumps(document, indent=2) + "\n")
        save_file(state, str(temp / WEIGHTS), metadata={"format": "pt"})
    return Path(out)


def read_speculators(directory: Path, target: Target) -> SpeculatorsEagle3:
    """A speculators EAGLE-3 directory, checked against `target` (the layer ids are checked when the head is built)."""
    directory = Path(directory)
    kind = speculators_type(directory)
    if kind != "eagle3":
        raise SelfspecError(f"'{directory}' holds a speculators '{kind}' drafter: selfspec imports speculators eagle3 heads only")
    document = json.loads((directory / CONFIG).read_text())
    layer = document.get("transformer_layer_config") or {}
    where = f"'{directory}'"
    for option in _UNSUPPORTED_OPTIONS:
        if document.get(option):
            raise SelfspecError(f"{where} uses the speculators option {option}, which selfspec's EAGLE-3 head does not implement")
    expected = {"model_type": target.config.model_type, "hidden_size": target.config.hidden_size,
                "vocab_size": target.vocab_size, "num_hidden_layers": 1}
    wrong = [f"{key} {layer.get(key)!r} (this model: {value!r})" for key, value in expected.items() if layer.get(key) != value]
    if document.get("target_hidden_size") not in (None, target.config.hidden_size):
        wrong.append(f"target_hidden_size {document['target_hidden_size']!r} (this model: {target.config.hidden_size})")
    if wrong:
        raise SelfspecError(f"{where} was made for another base model: {'; '.join(wrong)}")
    state = _read_weights(directory / WEIGHTS)
    draft_vocab = _draft_vocab(state, target.vocab_size, where)
    embeddings = state.pop("embed_tokens.weight", None)
    if embeddings is not None and not _close(embeddings, target.model.get_input_embeddings().weight):
        raise SelfspecError(f"{where} carries embeddings that are not this model's: it was made for another base model")
    lm_head = state.pop("lm_head.weight", None)
    if lm_head is None:
        raise SelfspecError(f"{where}: model.safetensors has no lm_head.weight")
    own_lm_head = not _close(lm_head, target.model.get_output_embeddings().weight.detach()[draft_vocab])
    if own_lm_head:
        state["lm_head.weight"] = lm_head
    for name in [name for name in state if name.startswith("verifier_")]:
        del state[name]  # training-only copies of the verifier's norm and LM head
    verifier = ((document.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    return SpeculatorsEagle3(
        {name: tensor.float() for name, tensor in state.items()}, draft_vocab,
        tuple(document.get("eagle_aux_hidden_state_layer_ids") or ()), bool(document.get("norm_before_residual")),
        own_lm_head, verifier,
    )


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise SelfspecError(f"'{path.parent}' has no {path.name} (a sharded or .bin checkpoint is not supported)")
    try:
        with safe_open(str(path), framework="pt") as file:
            return {name: file.get_tensor(name) for name in file.keys()}
    except (SafetensorError, OSError) as error:
        raise SelfspecError(f"{path} is unreadable ({error})") from None


def _draft_vocab(state: dict[str, torch.Tensor], vocab_size: int, where: str) -> torch.Tensor:
    """The draft vocabulary's target ids from d2t (offsets), checked against t2d; the whole vocabulary without them."""
    d2t, t2d = state.pop("d2t", None), state.pop("t2d", None)
    if d2t is None:
        return torch.arange(vocab_size)
    draft_vocab = torch.arange(len(d2t)) + d2t.long()
    valid = bool(((draft_vocab >= 0) & (draft_vocab < vocab_size)).all()) and len(set(draft_vocab.tolist())) == len(draft_vocab)
    if valid and t2d is not None:
        valid = t2d.shape == (vocab_size,) and int(t2d.bool().sum()) == len(draft_vocab) and bool(t2d.bool()[draft_vocab].all())
    if not valid:
        raise SelfspecError(f"{where}: d2t and t2d do not describe a draft vocabulary of this model's {vocab_size} tokens")
    return draft_vocab


def _close(stored: torch.Tensor, reference: torch.Tensor) -> bool:
    """Equal up to the rounding of the stored dtype (a bf16 export of fp32 weights)."""
    if stored.shape != reference.shape:
        return False
    reference = reference.detach().float().cpu()
    tolerance = 1e-5 if stored.dtype == torch.float32 else 1e-2
    return bool(torch.allclose(stored.float(), reference, rtol=tolerance, atol=tolerance * float(reference.abs().max())))

