"""Labels from the target: what heads learn from, recorded by running the target over the training sequences.

For every position t of a sequence: the hidden states of the layers the head asks for (row t of
`hidden_states[layer]`) and the target's next-token distribution at t, as its top-k probabilities (which predict
token t + 1). Either cached on disk in shards with a manifest (resumable: finished shards are kept and the run
continues after the last one) or computed on the fly per batch (`storage: stream`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ...errors import SelfspecError
from ...files import atomic_write, atomic_write_text
from ...models import Target
from ..clock import running_time
from ..throughput import StageCount
from .tokenizing import Example

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class LabeledSequence:
    input_ids: torch.Tensor  # [L] long
    loss_mask: torch.Tensor  # [L] bool: token t is a learnable (assistant) token
    hidden: dict[int, torch.Tensor]  # layer -> [L, H] (bf16 when cached)
    topk_ids: torch.Tensor  # [L, k] long: the target's top-k next tokens after position t
    topk_probs: torch.Tensor  # [L, k] float: their probabilities (temperature 1)


def top_k_distribution(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [L, V] -> the softmax's top-k (probabilities [L, k] float32, ids [L, k]) without writing the [L, V]
    softmax: the top-k logits, normalised by the log-sum-exp (a third less time than softmax then top-k)."""
    logits = logits.float()
    top_logits, top_ids = logits.topk(top_k, dim=-1)
    return (top_logits - torch.logsumexp(logits, dim=-1, keepdim=True)).exp(), top_ids


def label_sequence(target: Target, example: Example, layers: tuple[int, ...], top_k: int) -> LabeledSequence:
    """One forward of the target over the whole sequence (no cache) -> its hidden states and top-k distribution."""
    with torch.inference_mode():
        outputs = target.model(
            input_ids=example.input_ids.view(1, -1).to(target.device),
            use_cache=False,
            output_hidden_states=bool(layers),
        )
        topk_probs, topk_ids = top_k_distribution(outputs.logits[0], top_k)
        hidden = {layer: outputs.hidden_states[layer][0].to(torch.bfloat16).cpu() for layer in layers}
    return LabeledSequence(example.input_ids, example.loss_mask, hidden, topk_ids.cpu(), topk_probs.half().cpu())


def label_batch(target: Target, examples: list[Example], layers: tuple[int, ...], top_k: int) -> list[LabeledSequence]:
    """`label_sequence` for several sequences, the results left on the target's device: what streamed labels use.
    Sequences of the same length go through one forward together; none is padded, so no position is computed for
    nothing and attention stays plainly causal (a padding mask would make it attend over the whole square)."""
    by_length: dict[int, list[int]] = {}
    for row, example in enumerate(examples):
        by_length.setdefault(len(example.input_ids), []).append(row)
    labeled: list[LabeledSequence | None] = [None] * len(examples)
    with torch.inference_mode():
        for rows in by_length.values():
            outputs = target.model(
                input_ids=torch.stack([examples[row].input_ids for row in rows]).to(target.device),
                use_cache=False,
                output_hidden_states=bool(layers),
            )
            for index, row in enumerate(rows):  # per row: the float32 logits are [L, V]
                example = examples[row]
                topk_probs, topk_ids = top_k_distribution(outputs.logits[index], top_k)
                hidden = {layer: outputs.hidden_states[layer][index].to(torch.bfloat16) for layer in layers}
                labeled[row] = LabeledSequence(
                    example.input_ids, example.loss_mask, hidden, topk_ids, topk_probs.half()
                )
    return labeled


def _manifest_header(target: Target, layers: tuple[int, ...], top_k: int, examples: list[Example]) -> dict:
    """What the shards were made from: a cache whose header differs is for other data and is made again."""
    digest = hashlib.sha256()
    for example in examples:  # the token ids and masks themselves (another max_length keeps ids, not tokens)
        digest.update(example.input_ids.to(torch.int32).numpy().tobytes())
        digest.update(example.loss_mask.to(torch.uint8).numpy().tobytes())
    return {
        "fingerprint": target.fingerprint.to_dict(),
        "layers": list(layers),
        "top_k": top_k,
        "examples": len(examples),
        "example_ids_head": [example.id for example in examples[:8]],
        "examples_sha256": digest.hexdigest()[:16],
    }


def build_label_cache(
    target: Target,
    examples: list[Example],
    directory: Path,
    layers: tuple[int, ...],
    top_k: int,
    shard_examples: int,
    count: StageCount | None = None,
) -> Path:
    """Write label shards for `examples` under `directory`, resuming after the last finished shard. `count`, when
    given, receives the token positions labelled in this invocation and the seconds it took."""
    directory.mkdir(parents=True, exist_ok=True)
    manifest_path = directory / MANIFEST
    header = _manifest_header(target, layers, top_k, examples)
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else None
    if manifest is None or {key: manifest.get(key) for key in header} != header:
        manifest = dict(header, shards=[], complete=False)  # new, or made for other data: start over
    done = sum(shard["examples"] for shard in manifest["shards"])
    with tqdm(total=len(examples), initial=done, desc="labels", unit="seq") as bar:
        while done < len(examples):
            began = running_time()
            batch = examples[done : done + shard_examples]
            sequences = []
            for example in batch:
                sequences.append(label_sequence(target, example, layers, top_k))
                bar.update(1)
            name = f"shard-{len(manifest['shards']):05d}.safetensors"
            _save_shard(directory / name, sequences)
            done += len(batch)
            manifest["shards"].append(
                {"file": name, "examples": len(batch), "tokens": sum(len(s.input_ids) for s in sequences)}
            )
            manifest["complete"] = done >= len(examples)
            _write_json(manifest_path, manifest)
            if count is not None:
                count.tokens += manifest["shards"][-1]["tokens"]
                count.seconds += running_time() - began
                count.sequences += len(batch)
    if not manifest["complete"]:  # zero examples
        manifest["complete"] = True
        _write_json(manifest_path, manifest)
    return directory


def _save_shard(path: Path, sequences: list[LabeledSequence]) -> None:
    lengths = torch.tensor([len(s.input_ids) for s in sequences])
    tensors = {
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        "input_ids": torch.cat([s.input_ids for s in sequences]),
        "loss_mask": torch.cat([s.loss_mask for s in sequences]).to(torch.uint8),
        "topk_ids": torch.cat([s.topk_ids for s in sequences]).to(torch.int32),
        "topk_probs": torch.cat([s.topk_probs for s in sequences]),
    }
    for layer in sequences[0].hidden:
        tensors[f"hidden.{layer}"] = torch.cat([s.hidden[layer] for s in sequences])
    atomic_write(path, lambda temp: save_file(tensors, str(temp)))


def load_label_cache(directory: Path) -> list[LabeledSequence]:
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise SelfspecError(f"no label cache in '{directory}' (missing {MANIFEST})")
    manifest = json.loads(manifest_path.read_text())
    if not manifest.get("complete"):
        raise SelfspecError(f"the label cache in '{directory}' is incomplete: rerun the training command to resume it")
    sequences = []
    for shard in manifest["shards"]:
        tensors = load_file(str(directory / shard["file"]))
        offsets = tensors["offsets"].tolist()
        layers = [int(key.split(".", 1)[1]) for key in tensors if key.startswith("hidden.")]
        for start, end in itertools.pairwise(offsets):
            sequences.append(
                LabeledSequence(
                    input_ids=tensors["input_ids"][start:end],
                    loss_mask=tensors["loss_mask"][start:end].bool(),
                    hidden={layer: tensors[f"hidden.{layer}"][start:end] for layer in layers},
                    topk_ids=tensors["topk_ids"][start:end].long(),
                    topk_probs=tensors["topk_probs"][start:end],
                )
            )
    return sequences


def _write_json(path: Path, data: dict) -> None:
    atomic_write_text(path, json.dumps(data, indent=1))
