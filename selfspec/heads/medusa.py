"""`medusa`: K small heads on the target's last hidden state, head k guessing the token k + 1 places after the next.

Each head is a stack of residual blocks (h + SiLU(W h + b), W zero-initialised so an untrained head repeats the
target's own next-token guess) followed by the target's frozen LM head restricted to a reduced draft vocabulary
(the most frequent target tokens, with a map back to target ids): all heads share one [K, H] x [H, V_draft] GEMM.

The candidate tree is data: an ordered list of rank paths (a path (r1, r2) is "rank r1 of head 1, then rank r2 of
head 2"), sorted by the expected acceptance measured on held-out data, so the first n nodes are the best n-node
tree. The node budget maximises expected accepted length per unit of verification cost on this machine's curve.

Medusa-2 heads come with a LoRA adapter trained on the base: they draft for the adapted model, which is then the model
decoded. The drafter gets a Target of its own for it (`adapted_target`: the adapter merged into a copy that shares
every weight it leaves alone), so the target it was given, which plain decoding and other drafters may share, stays
the original model; the decoding loop verifies a drafter's trees on `drafter.target`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..cost import CostCurve
from ..errors import SelfspecError, first_line
from ..execution import sharing_copy
from ..models import Target
from ..tree_attention import DraftTree
from .artifacts import ADAPTER, LoadedHead
from .base import DrafterStats, DraftRequest, Observation, check_at_least_one, register_drafter
from .vocab import ReducedVocabHead, VocabHeadDrafter


@dataclass(frozen=True)
class MedusaLoraConfig:
    """Medusa-2: LoRA adapters on the base, trained jointly with the heads (maps onto peft's own LoraConfig)."""

    rank: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    distill_weight: float = 1.0  # weight of CE(original target || adapted target): keeps the base's outputs


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head
    draft_vocab_size: int = 8192  # the most frequent target tokens in the training labels; 0 = full vocabulary
    head_decay: float = 0.8  # loss weight of head k is decay**k (later heads are harder and matter less)
    max_tree_nodes: int = 64  # tree candidates ranked by the tree builder
    max_rank: int = 10  # top-k ranks per head the tree builder considers
    lora: MedusaLoraConfig | None = None  # Medusa-2: train LoRA adapters on the base jointly with the heads


@dataclass(frozen=True)
class MedusaOptions:
    max_nodes: int | None = None  # tree nodes verified per step, root included; None = what the cost curve picks

    def __post_init__(self) -> None:
        check_at_least_one("medusa", self)


class ResBlock(torch.nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, hidden_size)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + torch.nn.functional.silu(self.linear(hidden))


class MedusaHeads(ReducedVocabHead):
    """The trainable heads plus a frozen view of the target's LM head rows for the draft vocabulary."""

    def __init__(self, config: MedusaConfig, target: Target, draft_vocab: torch.Tensor):
        super().__init__()
        hidden_size = target.config.hidden_size
        self.config = config
        self.heads = torch.nn.ModuleList(
            torch.nn.Sequential(*(ResBlock(hidden_size) for _ in range(config.num_layers)))
            for _ in range(config.num_heads)
        )
        self.attach_draft_vocab(target.model.get_output_embeddings().weight, draft_vocab)

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    def head_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [K, ..., H]."""
        return torch.stack([head(hidden) for head in self.heads])

    def topk_target_ids(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """[H] last hidden state -> [K, k] target token ids, each head's top-k (best first)."""
        logits = self.draft_logits(self.head_states(hidden.to(self.draft_lm_weight.dtype)))  # [K, V_draft]
        return self.draft_vocab[logits.topk(k, dim=-1).indices]


class TreeTemplate:
    """A rank-path tree laid out once: per node, the (head, rank) it reads and its parent."""

    def __init__(self, paths: list[tuple[int, ...]], max_rank: int, device: torch.device):
        node_of = {(): 0}
        parents, flat = [-1], []
        for path in paths:
            if path[:-1] not in node_of:
                raise SelfspecError(
                    f"the Medusa tree lists path {path} before its parent: rebuild it with `selfspec medusa-tree`"
                )
            node_of[path] = len(parents)
            parents.append(node_of[path[:-1]])
            flat.append((len(path) - 1) * max_rank + path[-1])  # row (head) * ranks + rank in [K, max_rank]
        self.parents = torch.tensor(parents, dtype=torch.long)
        self.flat_index = torch.tensor(flat, dtype=torch.long, device=device)
        self.max_rank = max_rank
        self.depth = max((len(p) for p in paths), default=0)

    def build(self, root_token: int, topk_ids: torch.Tensor, nodes: int) -> DraftTree:
        """topk_ids: [K, max_rank] target ids -> the DraftTree of the first `nodes` nodes (root included; paths come
        parents first, so every prefix is a tree), tokens gathered in one op."""
        tokens = topk_ids.reshape(-1)[self.flat_index[: nodes - 1]]
        root = torch.tensor([root_token], dtype=torch.long, device=tokens.device)
        return DraftTree(tokens=torch.cat([root, tokens]), parents=self.parents[:nodes])


@register_drafter(
    "medusa", options=MedusaOptions, config=MedusaConfig, recipe="selfspec.training.recipes.medusa:train_medusa"
)
class MedusaDrafter(VocabHeadDrafter):
    hidden_layers = (-1,)
    head_cls = MedusaHeads

    def __init__(
        self,
        target: Target,
        cost_curve: CostCurve,
        heads: MedusaHeads,
        tree: dict,
        options: MedusaOptions = MedusaOptions(),
    ):
        super().__init__(target, cost_curve, heads, options)
        paths = [tuple(path) for path in tree.get("paths", [])]
        values = [float(v) for v in tree.get("values", [])]
        if not paths or len(paths) != len(values):
            raise SelfspecError("the Medusa heads carry no tree: build one with `selfspec medusa-tree --heads DIR`")
        # The largest tree worth verifying even if every value were right; each step verifies the best prefix of it
        # for the values as calibrated by what the verifier has been accepting (`max_nodes` fixes the size).
        largest = self.fixed_nodes if self.fixed_nodes is not None else cost_curve.best_size(values)[0]
        count = min(largest - 1, len(paths), len(values))  # the best prefix of the tree, as large as allowed
        kept = [
            (p, v)
            for p, v in zip(paths[:count], values[:count], strict=True)
            if max(p) < heads.config.max_rank and len(p) <= heads.num_heads
        ]
        paths, self.values = [p for p, _ in kept], [v for _, v in kept]
        self.tree_nodes = self.max_nodes = len(paths) + 1
        self.max_rank = 1 + max((max(p) for p in paths), default=0)
        self.template = TreeTemplate(paths, self.max_rank, target.device)
        self.reset()

    def set_budget(self, options: MedusaOptions, config: MedusaConfig) -> None:
        """`max_nodes` fixes the size verified every step; the largest tree follows from the tree data (__init__)."""
        self.fixed_nodes = options.max_nodes

    @classmethod
    def from_loaded(
        cls, target: Target, cost_curve: CostCurve, loaded: LoadedHead, options: MedusaOptions
    ) -> "MedusaDrafter":
        """The tree shape is data beside the weights; Medusa-2 heads draft for (and on) their own adapted target."""
        if (loaded.directory / ADAPTER).is_dir():
            target = adapted_target(target, loaded.directory / ADAPTER)
        return cls(target, cost_curve, loaded.head, loaded.data.get("tree", {}), options)

    def stats(self) -> DrafterStats:
        return replace(super().stats(), tree_nodes=self.tree_nodes)

    def reset(self) -> None:
        self.last_hidden: torch.Tensor | None = None  # [H]: the state whose LM-head output was the next root
        self.calibration.reset()

    def observe(self, observation: Observation) -> None:
        self.calibrate(observation)
        states = observation.hidden.get(-1)
        if states is not None and states.shape[0] > 0:
            self.last_hidden = states[-1]

    def propose(self, request: DraftRequest) -> DraftTree:
        if self.last_hidden is None or request.max_depth <= 0 or self.template.depth == 0:
            return DraftTree.root_only(request.root_token)
        size = min(self.size_for_gains(self.values), self.tree_nodes)
        if size <= 1:
            return DraftTree.root_only(request.root_token)
        with torch.inference_mode():
            topk_ids = self.head.topk_target_ids(self.last_hidden, self.max_rank)  # [K, max_rank]
        return self.template.build(request.root_token, topk_ids, size)


def adapted_target(target: Target, adapter_dir: Path) -> Target:
    """Medusa-2: `target` with the LoRA adapter trained with the heads merged in, as a Target of its own; `target`
    itself is left as it is (plain decoding, other drafters and other requests may share it). The copy shares the
    memory of every weight the adapter leaves alone and owns the ones the merge changes. A target that already is this
    adapted model is returned as it is; a copy that cannot be made is a one-line error."""
    key = str(adapter_dir.resolve())
    if key in target.adapters:
        return target
    if target.adapters:
        raise SelfspecError(
            f"this target already carries adapter {target.adapters[0]}: load a fresh target for other heads"
        )
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTunerLayer

    try:
        model = sharing_copy(target.model, new_parameters=True)
    except (RuntimeError, TypeError, copy.Error) as error:  # what a module that refuses deepcopy raises
        raise SelfspecError(
            f"Medusa-2 heads need a copy of the target to merge their adapter into, and this model "
            f"cannot be copied ({first_line(error)}): use Medusa-1 heads or another drafter"
        ) from None
    adapted = PeftModel.from_pretrained(model, str(adapter_dir))
    with torch.no_grad():
        for module in adapted.modules():  # the merge adds to these weights in place: give them memory of their own
            if isinstance(module, BaseTunerLayer):
                for weight in module.get_base_layer().parameters(recurse=False):
                    weight.data = weight.data.clone()
    model = adapted.merge_and_unload()
    adapted_target = Target(model=model, tokenizer=target.tokenizer, name=target.name, adapters=[key], path=target.path)
    return adapted_target.with_eos(target.eos_token_ids)
