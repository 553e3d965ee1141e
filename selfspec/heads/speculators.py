"""Drafters in the format of the `speculators` library, which vLLM loads (`--speculative-config`), both ways: the
part EAGLE-3 (heads/eagle/eagle3.py) and DFlash (heads/dflash/) share. Each kind says what its config fields and
weights are; this module writes and reads the directory and checks what every kind carries.

A speculators directory holds `config.json` (`speculators_model_type`, the draft decoder layers' transformers config
under `transformer_layer_config`, the draft vocabulary size, the kind's own fields such as the target layers whose
hidden states it reads, and `speculators_config` with the verifier's name and the tokens a step proposes) and
`model.safetensors`: the drafter's weights under their speculators names, `lm_head.weight` (the draft-vocabulary
rows), `d2t` (draft index -> target id offset: target = index + d2t[index]) and `t2d` (a [V] mask of the target ids
in the draft vocabulary). selfspec's heads use speculators' module names, so both directions copy weights.

Export writes `embed_tokens` (the target's: speculators' loader leaves them uninitialised when they are absent) and
`lm_head` as the draft rows of the target's LM head (or the head's own, for imported heads that trained one). Import
checks what a directory can tell about its base model: hidden and vocabulary sizes (each kind checks its layers), and
that the embeddings and LM-head rows it carries are this model's (an LM head that is not becomes the head's own).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import SelfspecError
from ..files import atomic_directory
from ..models import Target
from .artifacts import CONFIG, WEIGHTS, HeadArtifact, load_state_strict, load_vocab_head, read_weights, save_head

SPECULATORS_VERSION = (
    "0.9.0"  # the speculators release whose format this follows (checked by tests/test_speculators.py)
)
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_ARCHITECTURES = {"eagle3": "Eagle3Speculator", "dflash": "DFlashSpeculator"}


def speculators_type(directory: Path) -> str | None:
    """The `speculators_model_type` of a directory's config.json ('eagle3', 'dflash', ...), None when it is not one."""
    try:
        document = json.loads((Path(directory) / CONFIG).read_text())
    except (OSError, ValueError):
        return None
    kind = document.get("speculators_model_type") if isinstance(document, dict) else None
    return kind if isinstance(kind, str) else None


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers EAGLE-3 and DFlash read by default in speculators, as hidden_states indices: 2, N // 2 and
    N - 3 (the inputs of those layers, as vLLM captures them); 0, N // 2, N for models too shallow for that."""
    if num_layers >= 6:
        return (2, num_layers // 2, num_layers - 3)
    return tuple(sorted({0, num_layers // 2, num_layers}))


def resolve_aux_layers(drafter: str, layers: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """The target layers a head reads (hidden_states indices): `layers`, or default_aux_layers when empty; distinct
    and inside the model, else a one-line error naming `drafter`."""
    layers = tuple(layers) or default_aux_layers(num_layers)
    if len(set(layers)) != len(layers) or not all(0 <= layer <= num_layers for layer in layers):
        raise SelfspecError(f"{drafter}: feature_layers {list(layers)} must be distinct and lie in 0 .. {num_layers}")
    return layers


def config_document(config, dtype: str, **overrides) -> dict:
    """A transformers config as speculators stores a draft layer's: its diff dict without the checkpoint's
    bookkeeping."""
    document = config.to_diff_dict()
    for key in ("architectures", "_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        document.pop(key, None)
    return {**document, "model_type": config.model_type, **overrides, "dtype": dtype}


@dataclass(frozen=True)
class SpeculatorsDraft:
    """A drafter in speculators' terms. Written: `state` holds `lm_head.weight` (the draft-vocabulary rows) beside
    the drafter's weights. Read: float32 weights, `lm_head.weight` only when it is the drafter's own."""

    kind: str  # speculators_model_type: 'eagle3' or 'dflash'
    fields: dict  # the kind's own top-level config fields (layer ids, block size, mask token, options)
    layer_config: dict  # transformer_layer_config
    state: dict[str, torch.Tensor]
    draft_vocab: torch.Tensor  # [V_draft] target ids
    speculative_tokens: int  # draft tokens a step proposes along one path
    verifier: str | None
    own_lm_head: bool = field(default=False)


def write_speculators(out: Path, target: Target, draft: SpeculatorsDraft, dtype: str = "bfloat16") -> Path:
    """Write a speculators directory at `out` (atomically)."""
    if dtype not in _DTYPES:
        raise SelfspecError(f"--weights-dtype must be one of {', '.join(_DTYPES)}, got '{dtype}'")
    state = {**draft.state, "embed_tokens.weight": target.model.get_input_embeddings().weight}
    state = {name: tensor.detach().to(_DTYPES[dtype]).contiguous().cpu() for name, tensor in state.items()}
    draft_vocab = draft.draft_vocab.cpu()
    state["d2t"] = draft_vocab - torch.arange(len(draft_vocab))
    state["t2d"] = torch.zeros(target.vocab_size, dtype=torch.bool).index_fill_(0, draft_vocab, True)
    document = {
        "architectures": [_ARCHITECTURES[draft.kind]],
        "speculators_model_type": draft.kind,
        "speculators_version": SPECULATORS_VERSION,
        "draft_vocab_size": len(draft_vocab),
        **draft.fields,
        "target_hidden_size": None,
        "transformer_layer_config": {**draft.layer_config, "dtype": dtype},
        "speculators_config": {
            "algorithm": draft.kind,
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": draft.speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {
                "name_or_path": draft.verifier,
                "architectures": list(getattr(target.config, "architectures", None) or []),
            },
        },
    }
    with atomic_directory(out) as temp:
        (temp / CONFIG).write_text(json.dumps(document, indent=2) + "\n")
        save_file(state, str(temp / WEIGHTS), metadata={"format": "pt"})
    return Path(out)


def read_speculators(directory: Path, target: Target, kind: str, expected_layer: dict) -> SpeculatorsDraft:
    """A speculators directory of `kind`, checked against `target`: `expected_layer` lists the draft layers' config
    values this model implies (a mismatch says the directory was made for another base)."""
    directory = Path(directory)
    found = speculators_type(directory)
    if found != kind:
        raise SelfspecError(f"'{directory}' holds a speculators '{found}' drafter, not '{kind}'")
    document = json.loads((directory / CONFIG).read_text())
    layer = document.get("transformer_layer_config") or {}
    where = f"'{directory}'"
    wrong = [
        f"{key} {layer.get(key)!r} (this model: {value!r})"
        for key, value in expected_layer.items()
        if layer.get(key) != value
    ]
    if document.get("target_hidden_size") not in (None, target.config.hidden_size):
        wrong.append(f"target_hidden_size {document['target_hidden_size']!r} (this model: {target.config.hidden_size})")
    if wrong:
        raise SelfspecError(f"{where} was made for another base model: {'; '.join(wrong)}")
    state, _ = read_weights(directory / WEIGHTS)
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
    proposal = ((document.get("speculators_config") or {}).get("proposal_methods") or [{}])[0]
    verifier = ((document.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    fields = {
        key: value
        for key, value in document.items()
        if key
        not in (
            "architectures",
            "speculators_model_type",
            "speculators_version",
            "transformer_layer_config",
            "speculators_config",
        )
    }
    return SpeculatorsDraft(
        kind,
        fields,
        layer,
        {name: tensor.float() for name, tensor in state.items()},
        draft_vocab,
        int(proposal.get("speculative_tokens") or 0),
        verifier,
        own_lm_head,
    )


def _draft_vocab(state: dict[str, torch.Tensor], vocab_size: int, where: str) -> torch.Tensor:
    """The draft vocabulary's target ids from d2t (offsets), checked against t2d; the whole vocabulary without them."""
    d2t, t2d = state.pop("d2t", None), state.pop("t2d", None)
    if d2t is None:
        return torch.arange(vocab_size)
    draft_vocab = torch.arange(len(d2t)) + d2t.long()
    valid = bool(((draft_vocab >= 0) & (draft_vocab < vocab_size)).all()) and len(set(draft_vocab.tolist())) == len(
        draft_vocab
    )
    if valid and t2d is not None:
        valid = (
            t2d.shape == (vocab_size,)
            and int(t2d.bool().sum()) == len(draft_vocab)
            and bool(t2d.bool()[draft_vocab].all())
        )
    if not valid:
        raise SelfspecError(
            f"{where}: d2t and t2d do not describe a draft vocabulary of this model's {vocab_size} tokens"
        )
    return draft_vocab


def _close(stored: torch.Tensor, reference: torch.Tensor) -> bool:
    """Equal up to the rounding of the stored dtype (a bf16 export of fp32 weights)."""
    if stored.shape != reference.shape:
        return False
    reference = reference.detach().float().cpu()
    tolerance = 1e-5 if stored.dtype == torch.float32 else 1e-2
    return bool(
        torch.allclose(stored.float(), reference, rtol=tolerance, atol=tolerance * float(reference.abs().max()))
    )


def check_directory(source: Path, kinds: tuple[str, ...]) -> str:
    """`selfspec import`'s first check: a speculators directory of one of `kinds` -> its kind."""
    source = Path(source)
    if not (source / CONFIG).is_file():
        raise SelfspecError(f"'{source}' has no config.json: pass a speculators directory ({' or '.join(kinds)})")
    kind = speculators_type(source)
    if kind is None:
        raise SelfspecError(
            f"'{source}' is not a speculators directory (its config.json has no speculators_model_type)"
        )
    if kind not in kinds:
        raise SelfspecError(
            f"'{source}' holds a speculators '{kind}' drafter: selfspec imports {' and '.join(kinds)} only"
        )
    return kind


def build_imported(head_class, artifact: HeadArtifact, target: Target, where: Path):
    """The head an imported artifact describes, its weights loaded strictly (every weight present, every shape
    right)."""
    head = head_class(artifact.config, target, artifact.state["draft_vocab"])
    load_state_strict(head, artifact.state, where)
    return head


def load_imported(head_class, imported_artifact, target: Target, directory: Path):
    """A speculators directory (`imported_artifact(target, directory)` reads it) -> its head, loaded strictly, in the
    target's dtype."""
    return build_imported(head_class, imported_artifact(target, directory), target, directory).to(target.dtype)


def head_for_export(target: Target, heads_dir: Path, kind: str, config_class, head_class, imported_artifact):
    """A selfspec heads directory of `kind`, or a speculators one (`imported_artifact(target, dir)` reads it) -> the
    head in float32."""
    heads_dir = Path(heads_dir)
    if speculators_type(heads_dir) is None:
        return load_vocab_head(target, heads_dir, kind, config_class, head_class).head.float()
    return build_imported(head_class, imported_artifact(target, heads_dir), target, heads_dir)


def export_state(head) -> dict[str, torch.Tensor]:
    """A head's weights as a speculators directory stores them: without the draft vocabulary (d2t/t2d carry it), with
    `lm_head.weight` (the target's draft rows, unless the head has its own)."""
    state = {name: tensor for name, tensor in head.state_dict().items() if name != "draft_vocab"}
    if not head.config.own_lm_head:
        state["lm_head.weight"] = head.draft_lm_weight
    return state


def import_directory(target: Target, source: Path, out: Path, kind: str, head_class, imported_artifact) -> Path:
    """`selfspec import`: a speculators directory of `kind` -> a heads directory at `out` fingerprinted to `target`."""
    check_directory(source, (kind,))
    artifact = imported_artifact(target, Path(source))
    build_imported(head_class, artifact, target, Path(source))  # refuses what does not load, before writing anything
    return save_head(Path(out), kind, artifact.config, artifact.state, artifact.fingerprint, artifact.extra)
