"""The reduced draft vocabulary every head drafts over: the most frequent target tokens, with maps both ways.

A head's last step is the target's own frozen LM head restricted to those rows: one [.., H] x [H, V_draft] GEMM
instead of [H, V]. Only the ids (`draft_vocab`) are saved with a head; the LM-head rows are rebuilt from the target at
load time, so the base model's weights never enter a heads directory. The same goes for the target's input
embeddings, which the heads that read token ids (EAGLE, DFlash) see as a frozen view. Imported heads that trained an LM
head of their own carry it instead (`own_lm_head`): it is saved with them.

`VocabHeadDrafter` is what every drafter around one such head shares (Medusa, EAGLE, DFlash): loading the head from
a heads directory or, for the kinds that have a speculators format, from a speculators directory; putting it on the
target's device and fast path; and sizing trees on the cost curve, calibrated by what the verifier accepts.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, ClassVar

import torch

from ..cost import CostCurve
from ..execution import ExecutionPath, pack_weight, packed_linear
from ..models import Target
from ..tree_attention import DraftTree
from .artifacts import HeadArtifact, LoadedHead, load_vocab_head
from .base import Drafter, DrafterStats, Observation, drafter_entry
from .calibration import AcceptanceCalibration
from .speculators import load_imported, speculators_type


class ReducedVocabHead(torch.nn.Module):
    """Base of the trainable heads (Medusa, EAGLE, DFlash): buffers `draft_vocab` [V_draft] (saved),
    `draft_lm_weight` [V_draft, H] and `target_to_draft` [V] (not saved); `embed_weight` [V, H] (not saved) for the
    heads that embed tokens; `lm_head` (saved) for the heads with an LM head of their own."""

    own_lm_head: bool = False  # drafts through its own `lm_head` rather than the target's draft rows

    def attach_draft_vocab(
        self, lm_head_weight: torch.Tensor, draft_vocab: torch.Tensor, own_lm_head: bool = False
    ) -> None:
        self.register_buffer("draft_vocab", draft_vocab.long().clone())  # [V_draft] target ids, ascending
        self.register_buffer("draft_lm_weight", lm_head_weight.detach()[draft_vocab].clone(), persistent=False)
        to_draft = torch.full((lm_head_weight.shape[0],), -1, dtype=torch.long)
        to_draft[draft_vocab] = torch.arange(len(draft_vocab))
        self.register_buffer("target_to_draft", to_draft, persistent=False)  # [V] draft index, or -1 outside
        self.own_lm_head = own_lm_head
        if own_lm_head:  # starts as the target's rows; the loaded weights replace them
            self.lm_head = torch.nn.Linear(lm_head_weight.shape[1], len(draft_vocab), bias=False)
            self.lm_head.weight.data.copy_(self.draft_lm_weight)

    def attach_embeddings(self, model: torch.nn.Module) -> None:
        """A frozen view of the target's input embeddings (not saved: the base's weights stay out of heads dirs)."""
        embedding = model.get_input_embeddings()
        self.register_buffer("embed_weight", embedding.weight.detach(), persistent=False)
        self.embed_scale = float(getattr(embedding, "embed_scale", 1.0))  # Gemma scales its embeddings

    def embed(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """tokens [...] -> [..., H] as the target embeds them, in `dtype`."""
        return torch.nn.functional.embedding(tokens, self.embed_weight).to(dtype) * self.embed_scale

    packed_lm: torch.Tensor | None = None  # the draft LM-head rows packed for the target's fast path (`pack_for`)

    def pack_for(self, execution: ExecutionPath) -> None:
        """Inference only (a drafter's frozen head): on the fast path, pack the head's linear layers and its draft LM
        head once, as the target's are (unpacked, a [rows, H] x [H, V_draft] product repacks the weight every call)."""
        if execution.pack(self):
            self.packed_lm = pack_weight(self.draft_lm_weight)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V_draft] logits over the draft vocabulary."""
        if self.own_lm_head:
            return self.lm_head(hidden)
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
        return DraftTree(
            tokens=torch.cat([root, target_ids]).long(), parents=torch.tensor([-1] + [p + 1 for p in parents])
        )


class VocabHeadDrafter(Drafter):
    """A drafter around one trained ReducedVocabHead (Medusa, EAGLE, DFlash). Trees are sized on the cost curve up to
    `max_nodes` (root included), or `fixed_nodes` every step, from the drafter's own acceptance estimates scaled by
    what the verifier has been accepting (`set_budget`)."""

    head_cls: ClassVar[type[ReducedVocabHead]]
    # The kinds with a speculators format (eagle3, dflash): their reader of a speculators directory, which `load` takes
    # as well as a heads directory. None: heads directories only.
    speculators_import: ClassVar[Callable[[Target, Path], HeadArtifact] | None] = None
    # The mean accepted length the head reached on held-out prompts when it was trained (its training report, read by
    # `load`); None where unknown (imported heads, heads without a report).
    heldout_tau: float | None = None

    def __init__(self, target: Target, cost_curve: CostCurve, head: ReducedVocabHead, options):
        super().__init__(target, cost_curve, options)
        self.head = head.to(target.device).eval().requires_grad_(False)
        self.head.pack_for(target.execution)
        self.calibration = AcceptanceCalibration()
        self.set_budget(options, head.config)

    def stats(self) -> DrafterStats:
        return DrafterStats(heldout_tau=self.heldout_tau)

    def set_budget(self, options, config) -> None:
        """`top_k`, `max_nodes` (root included) and `fixed_nodes` from EAGLE's and DFlash's options, None = the head's
        config. Drafters with other options override this."""
        self.top_k = options.top_k or config.top_k
        self.max_nodes = options.fixed_nodes or options.max_nodes or config.max_tree_nodes
        self.fixed_nodes = options.fixed_nodes

    @classmethod
    def load(cls, target: Target, heads_dir: Path | None, cost_curve: CostCurve, options) -> "VocabHeadDrafter":
        """A selfspec heads directory (the shipped one for the target when None), or a speculators directory for the
        kinds that read one (imported as it loads)."""
        if heads_dir is not None and cls.speculators_import is not None and speculators_type(heads_dir) is not None:
            head = load_imported(cls.head_cls, cls.speculators_import, target, Path(heads_dir))
            drafter = cls(target, cost_curve, head, options)
            drafter.heldout_tau = None  # trained elsewhere: no held-out report of ours
            return drafter
        loaded = load_vocab_head(target, heads_dir, cls.name, drafter_entry(cls.name).config_cls, cls.head_cls)
        drafter = cls.from_loaded(target, cost_curve, loaded, options)
        drafter.heldout_tau = loaded.heldout_tau
        return drafter

    @classmethod
    def from_loaded(cls, target: Target, cost_curve: CostCurve, loaded: LoadedHead, options) -> "VocabHeadDrafter":
        """The drafter for a head read from a heads directory; drafters that keep data beside the weights (a tree
        shape, an adapter) read it here."""
        return cls(target, cost_curve, loaded.head, options)

    def size_for_gains(self, gains: list[float]) -> int:
        """Nodes to keep (root included) given the candidates' estimated chances of acceptance, best first. Calibrated
        by what the verifier has been accepting; the last call of a proposal sizes the tree that is verified."""
        gains = gains[: self.max_nodes - 1]
        size = self.fixed_nodes or self.cost_curve.best_size(self.calibration.scaled(gains))[0]
        self.calibration.proposed(gains[: size - 1])
        return size

    def tree_size(self, sorted_scores: list[float]) -> int:
        """size_for_gains for candidates scored by cumulative draft log-probability: a path's draft probability
        estimates the chance the target accepts it all."""
        return self.size_for_gains([math.exp(score) for score in sorted_scores[: self.max_nodes - 1]])

    def calibrate(self, observation: Observation) -> None:
        """Subclasses call this first in observe()."""
        if observation.tree is not None:  # not the prefill
            self.calibration.verified(len(observation.accepted_path) - 1)
