"""`medusa`: K small heads on the target's last hidden state, head k guessing the token k + 1 places after the next.

Each head is a stack of residual blocks (h + SiLU(W h + b), W zero-initialised so an untrained head repeats the
target's own next-token guess) followed by the target's frozen LM head restricted to a reduced draft vocabulary
(the most frequent target tokens, with a map back to target ids): all heads share one [K, H] x [H, V_draft] GEMM.

The candidate tree is data: an ordered list of rank paths (a path (r1, r2) is "rank r1 of head 1, then rank r2 of
head 2"), sorted by the expected acceptance measured on held-out data, so the first n nodes are the best n-node
tree. The node budget maximises expected accepted length per unit of verification cost on this machine's curve.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..cost import CostCurve
from ..errors import SelfspecError
from ..models import Target
from ..training.config import MedusaConfig
from ..tree_attention import DraftTree
from .artifacts import ADAPTER, find_shipped_head, load_head, load_state_strict
from .base import DraftRequest, Drafter, Observation, register_drafter

class ResBlock(torch.nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, hidden_size)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + torch.nn.functional.silu(self.linear(hidden))


class MedusaHeads(torch.nn.Module):
    """The trainable heads plus a frozen view of the target's LM head rows for the draft vocabulary."""

    def __init__(self, config: MedusaConfig, lm_head_weight: torch.Tensor, draft_vocab: torch.Tensor):
        super().__init__()
        hidden_size = lm_head_weight.shape[1]
        self.config = config
        self.heads = torch.nn.ModuleList(
            torch.nn.Sequential(*(ResBlock(hidden_size) for _ in range(config.num_layers))) for _ in range(config.num_heads)
        )
        self.register_buffer("draft_vocab", draft_vocab.long().clone())  # [V_draft] target ids, saved with the heads
        # Not saved: rebuilt from the target at load time, so the base model's weights never enter a head directory.
        self.register_buffer("draft_lm_weight", lm_head_weight.detach()[draft_vocab].clone(), persistent=False)
        to_draft = torch.full((lm_head_weight.shape[0],), -1, dtype=torch.long)
        to_draft[draft_vocab] = torch.arange(len(draft_vocab))
        self.register_buffer("target_to_draft", to_draft, persistent=False)  # [V] draft index or -1

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    def head_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [K, ..., H]."""
        return torch.stack([head(hidden) for head in self.heads])

    def draft_logits(self, states: torch.Tensor) -> torch.Tensor:
        """[..., H] head states -> [..., V_draft] logits over the draft vocabulary."""
        return states @ self.draft_lm_weight.to(states.dtype).T

    def topk_target_ids(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """[H] last hidden state -> [K, k] target token ids, each head's top-k (best first)."""
        logits = self.draft_logits(self.head_states(hidden.to(self.draft_lm_weight.dtype)))  # [K, V_draft]
        return self.draft_vocab[logits.topk(k, dim=-1).indices]


def full_vocab(target: Target) -> torch.Tensor:
    return torch.arange(target.vocab_size)


def expected_gains(tree_values: list[float], cost_curve: CostCurve, max_nodes: int) -> int:
    """The node count n (root included) maximising (1 + sum of the first n - 1 node values) / cost(n)."""
    best_n, best_value, expected = 1, 1.0 / cost_curve.cost(1), 1.0
    for index, value in enumerate(tree_values[: max_nodes - 1]):
        expected += value
        gain = expected / cost_curve.cost(index + 2)
        if gain > best_value:
            best_n, best_value = index + 2, gain
    return best_n


class TreeTemplate:
    """A rank-path tree laid out once: per node, the (head, rank) it reads and its parent."""

    def __init__(self, paths: list[tuple[int, ...]], max_rank: int, device: torch.device):
        node_of = {(): 0}
        parents, flat = [-1], []
        for path in paths:
            assert path[:-1] in node_of, f"tree path {path} comes before its parent"
            node_of[path] = len(parents)
            parents.append(node_of[path[:-1]])
            flat.append((len(path) - 1) * max_rank + path[-1])  # row (head) * ranks + rank in [K, max_rank]
        self.parents = torch.tensor(parents, dtype=torch.long)
        self.flat_index = torch.tensor(flat, dtype=torch.long, device=device)
        self.max_rank = max_rank
        self.depth = max((len(p) for p in paths), default=0)

    def build(self, root_token: int, topk_ids: torch.Tensor) -> DraftTree:
        """topk_ids: [K, max_rank] target ids -> the DraftTree (tokens gathered in one op)."""
        tokens = topk_ids.reshape(-1)[self.flat_index]
        root = torch.tensor([root_token], dtype=torch.long, device=tokens.device)
        return DraftTree(tokens=torch.cat([root, tokens]), parents=self.parents)


@register_drafter("medusa")
class MedusaDrafter(Drafter):
    hidden_layers = (-1,)

    def __init__(self, target: Target, cost_curve: CostCurve, heads: MedusaHeads, tree: dict, max_nodes: int | None = None):
        super().__init__(target, cost_curve)
        self.heads = heads.to(target.device).eval().requires_grad_(False)
        paths = [tuple(path) for path in tree.get("paths", [])]
        values = [float(v) for v in tree.get("values", [])]
        if not paths or len(paths) != len(values):
            raise SelfspecError("the Medusa heads carry no tree: build one with `selfspec medusa-tree --heads DIR`")
        if max_nodes is not None and max_nodes < 1:
            raise SelfspecError(f"max_nodes must be >= 1, got {max_nodes}")
        limit = max_nodes if max_nodes is not None else len(paths) + 1
        self.tree_nodes = max_nodes if max_nodes is not None else expected_gains(values, cost_curve, limit)
        paths = [p for p in paths[: self.tree_nodes - 1] if max(p) < heads.config.max_rank and len(p) <= heads.num_heads]
        self.tree_nodes = len(paths) + 1
        self.max_rank = 1 + max((max(p) for p in paths), default=0)
        self.template = TreeTemplate(paths, self.max_rank, target.device)
        self.reset()

    @classmethod
    def load(cls, target: Target, heads_dir: Path | None, cost_curve: CostCurve, **options) -> "MedusaDrafter":
        heads_dir = heads_dir or find_shipped_head(target, "medusa", MedusaConfig)
        artifact = load_head(heads_dir, "medusa", MedusaConfig, target)
        draft_vocab = artifact.state.get("draft_vocab")
        if draft_vocab is None or draft_vocab.dim() != 1 or int(draft_vocab.max()) >= target.vocab_size:
            raise SelfspecError(f"'{heads_dir}': missing or invalid draft_vocab")
        lm_weight = target.model.get_output_embeddings().weight
        heads = MedusaHeads(artifact.config, lm_weight, draft_vocab)
        load_state_strict(heads, artifact.state, heads_dir)
        if (heads_dir / ADAPTER).is_dir():
            merge_adapter(target, heads_dir / ADAPTER)
        try:
            return cls(target, cost_curve, heads.to(target.dtype), artifact.extra.get("tree", {}), **options)
        except TypeError as error:
            raise SelfspecError(f"bad option for drafter 'medusa': {error}") from None

    def reset(self) -> None:
        self.last_hidden: torch.Tensor | None = None  # [H]: the state whose LM-head output was the next root

    def observe(self, observation: Observation) -> None:
        states = observation.hidden.get(-1)
        if states is not None and states.shape[0] > 0:
            self.last_hidden = states[-1]

    def propose(self, request: DraftRequest) -> DraftTree:
        if self.last_hidden is None or request.max_depth <= 0 or self.template.depth == 0:
            return DraftTree.root_only(request.root_token)
        with torch.inference_mode():
            topk_ids = self.heads.topk_target_ids(self.last_hidden, self.max_rank)  # [K, max_rank]
        return self.template.build(request.root_token, topk_ids)


def merge_adapter(target: Target, adapter_dir: Path) -> None:
    """Medusa-2: merge the LoRA adapter trained with the heads into the target, which is then the adapted model."""
    key = str(adapter_dir.resolve())
    if key in target.adapters:
        return
    if target.adapters:
        raise SelfspecError(f"this target already carries adapter {target.adapters[0]}: load a fresh target for other heads")
    from peft import PeftModel

    PeftModel.from_pretrained(target.model, str(adapter_dir)).merge_and_unload()
    target.adapters.append(key)
