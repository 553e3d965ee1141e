"""The `layerskip` drafter: an adaptive chain (and top-2 leaves) from the skipping forward. Whether its draft forwards
pay for themselves against plain target steps is its pacing's (paced.Paced, which times them with the rest of its
drafting), not the drafter's."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DynamicCache

from ...cost import CostCurve
from ...errors import SelfspecError
from ...models import Target
from ...options import from_dict, to_dict
from ...tree_attention import DraftTree, trim_cache
from ..base import Drafter, DraftRequest, Observation, register_drafter
from .config import LayerSkipOptions, LayerSkipSettings, SkipPlan, every_other_layer
from .forward import SkippingForward
from .skip_file import find_skip_file, load_skip_file


@register_drafter("layerskip", options=LayerSkipOptions, config=LayerSkipSettings)
class LayerSkipDrafter(Drafter):
    def __init__(
        self,
        target: Target,
        cost_curve: CostCurve,
        settings: LayerSkipSettings,
        draft_vocab: torch.Tensor | None = None,
        options: LayerSkipOptions = LayerSkipOptions(),
    ):
        super().__init__(target, cost_curve, options)
        self.settings = settings
        self.adaptive = options.adaptive
        self.skipping = SkippingForward(
            target, SkipPlan.from_settings(settings, target.config.num_hidden_layers), draft_vocab
        )
        self.reset()

    @classmethod
    def load(
        cls, target: Target, heads_dir: Path | None, cost_curve: CostCurve, options: LayerSkipOptions
    ) -> "LayerSkipDrafter":
        """skip=tuned: the tuned set for this model (--heads names a file or directory of one); skip=every-other: the
        hand-made baseline. Settings options override the tuned ones (threshold=0.3, max_draft=4, ...)."""
        if options.skip == "every-other":
            if heads_dir is not None:
                raise SelfspecError("layerskip: skip=every-other takes no --heads")
            every_other = every_other_layer(target.config.num_hidden_layers)
            settings, vocab = LayerSkipSettings(skip_attention=every_other, skip_mlp=every_other), None
        else:
            tuned = load_skip_file(find_skip_file(target, heads_dir), target)
            settings, vocab = tuned.settings, tuned.draft_vocab
        settings = from_dict(LayerSkipSettings, {**to_dict(settings), **options.overrides()}, where="layerskip options")
        return cls(target, cost_curve, settings, vocab, options)

    def reset(self) -> None:
        self.cache = DynamicCache()
        self.cached: list[int] = []  # tokens whose KV the draft cache holds, positions 0 .. len - 1
        self.committed: list[int] = []
        self.threshold = self.settings.threshold
        self.drafted = 0  # chain length drafted in the last proposal

    def observe(self, observation: Observation) -> None:
        if observation.tree is None:  # the prefill
            self.committed = list(observation.new_tokens)
        else:
            self.committed.extend(observation.new_tokens)
            if observation.tree.size > 1:  # a step it drafted for
                self._adapt(len(observation.accepted_path) - 1)
        # Keep the draft KV of the longest prefix the committed text shares with what the draft cache holds.
        shared = min(len(self.cached), len(self.committed))
        keep = next((i for i in range(shared) if self.cached[i] != self.committed[i]), shared)
        if keep < len(self.cached):
            trim_cache(self.cache, keep)
            del self.cached[keep:]

    def _adapt(self, accepted: int) -> None:
        """Draft & Verify's rule: raise the threshold while the drafts are accepted less often than the target rate,
        lower it while they are accepted more often (so drafting goes deeper)."""
        if not self.adaptive or self.drafted == 0:
            return
        step = self.settings.adapt_step
        rate = min(accepted, self.drafted) / self.drafted
        change = step if rate < self.settings.target_acceptance else -step
        self.threshold = min(0.95, max(0.0, self.threshold + change))

    def _draft_logits(self, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor(tokens, device=self.target.device)
        logits = self.skipping(ids, self.cache, len(self.cached), last_only=True)
        self.cached.extend(tokens)
        return logits[-1]

    def propose(self, request: DraftRequest) -> DraftTree:
        self.drafted = 0
        limit = min(self.settings.max_draft, request.max_depth)
        if limit <= 0:
            return DraftTree.root_only(request.root_token)
        tokens, parents = [request.root_token], [-1]
        chain_node = 0  # the deepest chain node so far; sibling leaves are never continued
        with torch.inference_mode():
            logits = self._draft_logits(self.committed[len(self.cached) :])  # the root, and any token not yet seen
            for depth in range(1, limit + 1):
                top = torch.softmax(logits.float(), dim=-1).topk(2)
                top_probs = top.values.tolist()  # one host sync per drafted token
                if top_probs[0] < self.threshold:
                    break
                top_ids = self.skipping.to_target_ids(top.indices).tolist()
                tokens.append(top_ids[0])
                parents.append(chain_node)
                next_chain_node = len(tokens) - 1
                if top_probs[0] < self.settings.branch_threshold:
                    tokens.append(top_ids[1])  # a leaf, tried by the verifier after the chain token
                    parents.append(chain_node)
                chain_node = next_chain_node
                self.drafted = depth
                if depth == limit:
                    break
                logits = self._draft_logits([top_ids[0]])
        return DraftTree(tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long))
