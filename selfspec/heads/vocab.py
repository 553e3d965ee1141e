"""The reduced draft vocabulary every head drafts over: the most frequent target tokens, with maps both ways.

A head's last step is the target's own frozen LM head restricted to those rows: one [.., H] x [H, V_draft] GEMM
instead of [H, V]. Only the ids (`draft_vocab`) are saved with a head; the LM-head rows are rebuilt from the target at
load time, so the base model's weights never enter a heads directory.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import ClassVar

import torch

from ..cost import CostCurve
from ..execution import ExecutionPath, pack_weight, packed_linear
from ..models import Target
from ..tree_attention import DraftTree
from .artifacts import load_vocab_head
from .base import AcceptanceCalibration, Drafter, Observation, drafter_entry


class ReducedVocabHead(torch.nn.Module):
    """Base of the trainable heads (Medusa, EAGLE, DFlash): buffers `draft_vocab` [V_draft] (saved),
    `draft_lm_weight` [V_draft, H] and `target_to_draft` [V] (not saved)."""

    def attach_draft_vocab(self, lm_head_weight: torch.Tensor, draft_vocab: torch.Tensor) -> None:
        self.register_buffer("draft_vocab", draft_vocab.long().clone())  # [V_draft] target ids, ascending
        self.register_buffer("draft_lm_weight", lm_head_weight.detach()[draft_vocab].clone(), persistent=False)
        to_draft = torch.full((lm_head_weight.shape[0],), -1, dtype=torch.long)
        to_draft[draft_vocab] = torch.arange(len(draft_vocab))
        self.register_buffer("target_to_draft", to_draft, persistent=False)  # [V] draft index, or -1 outside

    packed_lm: torch.Tensor | None = None  # the draft LM-head rows packed for the target's fast path (`pack_for`)

    def pack_for(self, execution: ExecutionPath) -> None:
        """Inference only (a drafter's frozen head): on the fast path, pack the head's linear layers and its draft LM
        head once, as the target's are (a [rows, H] x [H, V_draft] product costs 2-4x more unpacked at 2+ rows)."""
        if execution.pack(self):
            self.packed_lm = pack_weight(self.draft_lm_weight)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V_draft] logits over the draft vocabulary."""
        if self.packed_lm is not None and hidden.dtype == self.draft_lm_weight.dtype:
            return packed_linear(hidden, self.packed_lm, None, self.draft_lm_weight.shape[0])
        return hidden @ self.draft_lm_weight.to(hidden.dtype).T

    def tree_from_draft_ids(self, root_token: int, draft_ids: list[int], parents: list[int]) -> DraftTree:
        """Non-root nodes as draft-vocabulary ids with parents indexing the same lists (-1 = the root), parents
        first -> the DraftTree in target ids (one gather)."""
        if not draft_ids:
            return DraftTree.root_only(root_token)
        device = self.draft_vocab.device
        target_ids = self.draft_vocab[torch.tensor(draft_ids, device=device)]
        root = torch.tensor([root_token], device=device)
        return DraftTree(tokens=torch.cat([root, target_ids]).long(), parents=torch.tensor([-1] + [p + 1 for p in parents]))


class VocabHeadDrafter(Drafter):
    """A drafter around one trained ReducedVocabHead whose tree follows the cost curve (EAGLE, DFlash): loading from
    a heads directory, and the budget options `top_k`, `max_nodes` and `fixed_nodes` (None = the head's config)."""

    head_cls: ClassVar[type[ReducedVocabHead]]

    def __init__(self, target: Target, cost_curve: CostCurve, head: ReducedVocabHead, options):
        super().__init__(target, cost_curve, options)
        self.head = head.to(target.device).eval().requires_grad_(False)
        self.head.pack_for(target.execution)
        self.top_k = options.top_k or head.config.top_k
        self.max_nodes = options.fixed_nodes or options.max_nodes or head.config.max_tree_nodes
        self.fixed_nodes = options.fixed_nodes
        self.calibration = AcceptanceCalibration()

    @classmethod
    def load(cls, target: Target, heads_dir: Path | None, cost_curve: CostCurve, options) -> "VocabHeadDrafter":
        config_cls = drafter_entry(cls.name).config_cls
        loaded = load_vocab_head(target, heads_dir, cls.name, config_cls, cls.head_cls)
        drafter = cls(target, cost_curve, loaded.head, options)
        drafter.heldout_tau = loaded.heldout_tau
        return drafter

    def tree_size(self, sorted_scores: list[float]) -> int:
        """Nodes to keep (root included) given the candidates' cumulative draft log-probabilities, best first. A
        path's draft probability estimates the chance the target accepts it all; calibrated by what the verifier
        has been accepting. The last call of a proposal sizes the tree that is verified."""
        gains = [math.exp(score) for score in sorted_scores[: self.max_nodes - 1]]
        size = self.fixed_nodes or self.cost_curve.best_size(self.calibration.scaled(gains))[0]
        self.calibration.proposed(gains[: size - 1])
        return size

    def calibrate(self, observation: Observation) -> None:
        """Subclasses call this first in observe()."""
        self.calibration.verified(observation.result)
