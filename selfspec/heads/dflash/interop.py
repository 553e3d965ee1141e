"""DFlash in the speculators library's format (what vLLM loads), both ways: `selfspec export --format speculators`,
`selfspec import`, and `--heads` pointing at a speculators DFlash directory. heads/speculators.py holds the format;
this module says what a DFlash drafter's config fields and draft layers are in it, and refuses the variants selfspec's
DFlash does not run."""

from __future__ import annotations

from pathlib import Path

from ...errors import SelfspecError
from ...models import Target
from ..artifacts import HeadArtifact
from ..speculators import (
    SpeculatorsDraft,
    config_document,
    export_state,
    head_for_export,
    import_directory,
    read_speculators,
    write_speculators,
)
from .head import MAX_LAYERS, DFlashConfig, DFlashHead, draft_layer_config, resolve_feature_layers


def _expected_layer(target: Target, num_layers: int | None = None) -> dict:
    """The draft-layer config values a speculators DFlash directory must carry to be one selfspec builds for
    `target`."""
    config = draft_layer_config(target, num_layers or 1)
    expected = {
        key: getattr(config, key)
        for key in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
        )
    }
    return {"model_type": "qwen3", **expected}


def imported_artifact(target: Target, directory: Path) -> HeadArtifact:
    """A speculators DFlash directory -> the dflash head artifact for `target` (fingerprinted to it: checked here)."""
    content = read_speculators(directory, target, "dflash", _expected_layer(target))
    fields, where = content.fields, f"'{directory}'"
    if fields.get("sample_from_anchor"):
        raise SelfspecError(
            f"{where} drafts from the anchor position too (sample_from_anchor), which selfspec's DFlash does not"
        )
    if fields.get("mask_token_id") is None:
        raise SelfspecError(f"{where} has no mask_token_id in its config.json")
    layers = content.layer_config.get("num_hidden_layers")
    if not isinstance(layers, int) or not 1 <= layers <= MAX_LAYERS:
        raise SelfspecError(f"{where} has {layers!r} draft layers: selfspec's DFlash takes 1 to {MAX_LAYERS}")
    if content.layer_config.get("layer_types") and set(content.layer_config["layer_types"]) != {"full_attention"}:
        raise SelfspecError(f"{where} uses sliding-window draft layers, which selfspec's DFlash does not")
    config = DFlashConfig(
        block_size=int(fields.get("block_size") or 8),
        num_layers=layers,
        feature_layers=tuple(fields.get("aux_hidden_state_layer_ids") or ()),
        draft_vocab_size=len(content.draft_vocab),
        mask_token_id=int(fields["mask_token_id"]),
        own_lm_head=content.own_lm_head,
    )
    config = DFlashConfig(
        **{**config.__dict__, "feature_layers": resolve_feature_layers(config, target.config.num_hidden_layers)}
    )
    state = {**content.state, "draft_vocab": content.draft_vocab}
    return HeadArtifact(
        "dflash", config, state, target.fingerprint, {"imported_from": "speculators", "verifier": content.verifier}
    )


def export_heads(target: Target, heads_dir: Path, out: Path, verifier: str, dtype: str = "bfloat16") -> Path:
    """`selfspec export --format speculators`: dflash heads (selfspec's or speculators') -> a speculators directory."""
    head = head_for_export(target, heads_dir, "dflash", DFlashConfig, DFlashHead, imported_artifact)
    state = export_state(head)
    fields = {
        "block_size": head.config.block_size,
        "aux_hidden_state_layer_ids": list(head.feature_layers),
        "mask_token_id": head.config.mask_token_id,
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
    }
    layer_config = config_document(head.layer_config, "float32", num_hidden_layers=head.config.num_layers)
    draft = SpeculatorsDraft(
        "dflash", fields, layer_config, state, head.draft_vocab, head.config.block_size - 1, verifier
    )
    return write_speculators(Path(out), target, draft, dtype)


def import_heads(target: Target, source: Path, out: Path) -> Path:
    """`selfspec import`: a speculators DFlash directory -> a dflash heads directory fingerprinted to `target`."""
    return import_directory(target, source, out, "dflash", DFlashHead, imported_artifact)
