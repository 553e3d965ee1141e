"""`layerskip`: the target drafts for itself with some attention and MLP sublayers skipped (Draft & Verify, SWIFT).

No extra weights: the draft runs the target's own embedding, decoder layers (or halves of them), final norm and LM
head, in the target's own transformers classes, skipping the sublayers named in a tuned skip set. It drafts a chain
autoregressively and stops when its top-1 probability falls under a threshold that adapts to the recent acceptance
rate; where it is unsure it can add its top-2 token as a sibling leaf. Its KV cache holds only the layers it runs,
for the committed tokens and the chain it drafted; after verification it is cut back to what was committed.

A draft token costs a forward through most of the target, so the drafter times its own one-token forwards against
the target's plain step (`DraftCost`): where one costs a whole plain step or more, no draft token can pay for itself
(it is accepted at most once), and it stops drafting for good (`dormant`) instead of paying probes forever.

Skip sets are data: `selfspec tune layerskip` searches them (Optuna) and writes a JSON file keyed by the model's
fingerprint, which this drafter finds by itself. `skip=every-other` uses the hand-made baseline instead.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from ..cost import CostCurve
from ..errors import SelfspecError
from ..files import atomic_write_text
from ..models import ModelFingerprint, Target, cache_root, sublayer_style
from ..options import from_dict, to_dict
from ..tree_attention import DraftTree, trim_cache
from .artifacts import SHIPPED_DIR, SKIP_FILE
from .base import DraftRequest, Drafter, Observation, register_drafter

@dataclass(frozen=True)
class LayerSkipSettings:
    """A layer-skip draft: which sublayers it skips (layer indices) and how far it drafts. The tuned data."""

    skip_attention: tuple[int, ...] = ()
    skip_mlp: tuple[int, ...] = ()
    threshold: float = 0.5  # stop drafting where the draft's top-1 probability falls below this (adapted at run time)
    max_draft: int = 4  # longest chain
    branch_threshold: float = 0.0  # below this top-1 probability, also propose the top-2 token (a leaf); 0 = never
    target_acceptance: float = 0.7  # the adaptive threshold steers the recent acceptance rate towards this
    adapt_step: float = 0.02  # threshold change per step

    def __post_init__(self) -> None:
        if self.max_draft < 1 or not 0.0 <= self.threshold < 1.0:
            raise SelfspecError("layerskip: max_draft must be >= 1 and threshold in [0, 1)")


@dataclass(frozen=True)
class LayerSkipOptions:
    """Run-time options. The settings fields (skip_attention ... adapt_step), when set, override the tuned ones."""

    skip: str = "tuned"  # "tuned" (this model's searched set) or "every-other" (the hand-made baseline)
    adaptive: bool = True  # adapt the threshold toward target_acceptance (Draft & Verify)
    skip_attention: tuple[int, ...] | None = None  # layer indices; on a command line 1+3+5
    skip_mlp: tuple[int, ...] | None = None
    threshold: float | None = None
    max_draft: int | None = None
    branch_threshold: float | None = None
    target_acceptance: float | None = None
    adapt_step: float | None = None

    def __post_init__(self) -> None:
        if self.skip not in ("tuned", "every-other"):
            raise SelfspecError(f"layerskip: skip must be 'tuned' or 'every-other', got '{self.skip}'")

    def overrides(self) -> dict:
        names = ("skip_attention", "skip_mlp", "threshold", "max_draft", "branch_threshold", "target_acceptance", "adapt_step")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


@dataclass(frozen=True)
class SkipPlan:
    """Which sublayers the draft runs, one flag per decoder layer (the count comes from the model's config)."""

    run_attention: tuple[bool, ...]
    run_mlp: tuple[bool, ...]

    @classmethod
    def from_settings(cls, settings: LayerSkipSettings, num_layers: int) -> "SkipPlan":
        for name, indices in (("skip_attention", settings.skip_attention), ("skip_mlp", settings.skip_mlp)):
            bad = [i for i in indices if not 0 <= i < num_layers]
            if bad:
                raise SelfspecError(f"layerskip: {name} holds layer(s) {bad} outside this model's {num_layers} layers")
        return cls(
            run_attention=tuple(i not in settings.skip_attention for i in range(num_layers)),
            run_mlp=tuple(i not in settings.skip_mlp for i in range(num_layers)),
        )


def every_other_layer(num_layers: int) -> tuple[int, ...]:
    """The hand-made baseline: both sublayers of every odd layer skipped."""
    return tuple(range(1, num_layers, 2))


class SkippingForward:
    """The target's forward with sublayers skipped, over its own modules. Stateless: the caller owns the cache."""

    def __init__(self, target: Target, plan: SkipPlan, draft_vocab: torch.Tensor | None, split_all: bool = False):
        model = target.model
        inner = getattr(model, "model", None)
        if inner is None or not all(hasattr(inner, name) for name in ("layers", "norm", "rotary_emb")):
            raise SelfspecError(f"layerskip: {type(model).__name__} does not expose model.layers / norm / rotary_emb")
        self.model, self.inner, self.plan = model, inner, plan
        self.layers = list(inner.layers[: target.config.num_hidden_layers])
        self.styles = [sublayer_style(layer, "layerskip") for layer in self.layers]
        self.split_all = split_all  # run every layer as two halves (tests check the halves against the stock layer)
        config = target.config
        layer_types = getattr(config, "layer_types", None)
        window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
        self.windows = [
            window if window and (layer_types is None or layer_types[i] == "sliding_attention") else None
            for i in range(len(self.layers))
        ]
        weight = model.get_output_embeddings().weight.detach()
        bias = getattr(model.get_output_embeddings(), "bias", None)
        self.draft_vocab = draft_vocab
        self.lm_weight = weight if draft_vocab is None else weight[draft_vocab.to(weight.device)].clone()
        self.lm_bias = None if bias is None else (bias if draft_vocab is None else bias[draft_vocab.to(bias.device)])
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def __call__(self, input_ids: torch.Tensor, cache: DynamicCache, cached: int, last_only: bool = False) -> torch.Tensor:
        """input_ids [n] after `cached` positions already in `cache` -> draft logits [n, V_draft] (or [1, V_draft] for
        the last position only); appends their KV."""
        n = input_ids.shape[0]
        device = input_ids.device
        positions = torch.arange(cached, cached + n, device=device).view(1, n)
        hidden = self.model.get_input_embeddings()(input_ids.view(1, n))  # [1, n, H]
        rotary = self.inner.rotary_emb(hidden, positions)
        masks = {window: self._mask(cached, n, window, hidden.dtype, device) for window in set(self.windows)}
        for index, layer in enumerate(self.layers):
            run_attention, run_mlp = self.plan.run_attention[index], self.plan.run_mlp[index]
            kwargs = dict(attention_mask=masks[self.windows[index]], position_ids=positions, past_key_values=cache,
                          position_embeddings=rotary)
            if run_attention and run_mlp and not self.split_all:
                output = layer(hidden, use_cache=True, **kwargs)
                hidden = output[0] if isinstance(output, tuple) else output
                continue
            sandwich = self.styles[index] == "sandwich"
            if run_attention:
                attended = layer.self_attn(hidden_states=layer.input_layernorm(hidden), **kwargs)[0]
                hidden = hidden + (layer.post_attention_layernorm(attended) if sandwich else attended)
            if run_mlp:
                if sandwich:
                    hidden = hidden + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(hidden)))
                else:
                    hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        if last_only:
            hidden = hidden[:, -1:]
        logits = torch.nn.functional.linear(self.inner.norm(hidden)[0], self.lm_weight, self.lm_bias)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @staticmethod
    def _mask(cached: int, n: int, window: int | None, dtype: torch.dtype, device) -> torch.Tensor | None:
        """[1, 1, n, cached + n] additive causal mask (limited to `window` keys back), or None where one new token may
        see every key."""
        total = cached + n
        if n == 1 and (window is None or total <= window):
            return None
        query = torch.arange(cached, total, device=device).view(n, 1)
        key = torch.arange(total, device=device).view(1, total)
        hidden = key > query
        if window is not None:
            hidden |= query - key >= window
        mask = torch.zeros(n, total, dtype=dtype, device=device).masked_fill_(hidden, torch.finfo(dtype).min)
        return mask.view(1, 1, n, total)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.draft_vocab is None else self.draft_vocab.to(draft_ids.device)[draft_ids]


class DraftCost:
    """What one draft token costs on this machine and path, in plain target steps: running means of the drafter's
    one-token forwards (seconds) and of the target's plain step (its verification forward scaled down by the cost
    curve). A property of the machine, not of a request: it is kept across requests."""

    MIN_SAMPLES = 4  # one-token draft forwards timed before any verdict
    DECAY = 0.8  # weight of the older timings

    def __init__(self) -> None:
        self.draft_s: float | None = None
        self.plain_s: float | None = None
        self.samples = 0

    @classmethod
    def _mean(cls, old: float | None, new: float) -> float:
        return new if old is None else cls.DECAY * old + (1 - cls.DECAY) * new

    def drafted(self, seconds: float, forwards: int) -> None:
        if forwards > 0:
            self.draft_s = self._mean(self.draft_s, seconds / forwards)
            self.samples += forwards

    def verified(self, forward_s: float, relative_cost: float) -> None:
        if forward_s > 0:
            self.plain_s = self._mean(self.plain_s, forward_s / relative_cost)

    @property
    def steps_per_token(self) -> float | None:
        """One draft forward in plain target steps; None until measured."""
        if self.draft_s is None or self.plain_s is None or self.samples < self.MIN_SAMPLES:
            return None
        return self.draft_s / self.plain_s

    @property
    def dormant(self) -> bool:
        """A draft forward costs a plain step or more: even a token that is always accepted does not pay for it."""
        cost = self.steps_per_token
        return cost is not None and cost >= 1.0


@register_drafter("layerskip", options=LayerSkipOptions, config=LayerSkipSettings)
class LayerSkipDrafter(Drafter):
    def __init__(self, target: Target, cost_curve: CostCurve, settings: LayerSkipSettings,
                 draft_vocab: torch.Tensor | None = None, options: LayerSkipOptions = LayerSkipOptions()):
        super().__init__(target, cost_curve, options)
        self.settings = settings
        self.adaptive = options.adaptive
        self.forward = SkippingForward(target, SkipPlan.from_settings(settings, target.config.num_hidden_layers), draft_vocab)
        self.draft_cost = DraftCost()  # kept across requests
        self.reset()

    @classmethod
    def load(cls, target: Target, heads_dir: Path | None, cost_curve: CostCurve, options: LayerSkipOptions) -> "LayerSkipDrafter":
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
        if observation.result is None:
            self.committed = list(observation.new_tokens)
        else:
            self.committed.extend(observation.new_tokens)
            if observation.tree is not None and observation.tree.size > 1:  # a step it drafted for
                self._adapt(len(observation.result.accepted_path) - 1)
            if observation.tree is not None:
                self.draft_cost.verified(observation.forward_s, self.cost_curve.cost(observation.tree.size))
        # Keep the draft KV of the longest prefix the committed text shares with what the draft cache holds.
        keep = 0
        for cached_token, committed_token in zip(self.cached, self.committed):
            if cached_token != committed_token:
                break
            keep += 1
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
        logits = self.forward(ids, self.cache, len(self.cached), last_only=True)
        self.cached.extend(tokens)
        return logits[-1]

    def propose(self, request: DraftRequest) -> DraftTree:
        self.drafted = 0
        limit = min(self.settings.max_draft, request.max_depth)
        if limit <= 0 or (request.pace and self.draft_cost.dormant):
            return DraftTree.root_only(request.root_token)
        tokens, parents = [request.root_token], [-1]
        chain_node = 0  # the deepest chain node so far; sibling leaves are never continued
        single_start, singles = 0.0, 0  # the one-token draft forwards after the catch-up, timed (DraftCost)
        with torch.inference_mode():
            logits = self._draft_logits(self.committed[len(self.cached):])  # the root, and any token not yet seen
            for depth in range(1, limit + 1):
                top = torch.softmax(logits.float(), dim=-1).topk(2)
                top_probs = top.values.tolist()  # one host sync per drafted token
                if depth == 1:
                    single_start = time.perf_counter()
                if top_probs[0] < self.threshold:
                    break
                top_ids = self.forward.to_target_ids(top.indices).tolist()
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
                singles += 1
        self.draft_cost.drafted(time.perf_counter() - single_start, singles)
        return DraftTree(tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long))


# ---- tuned skip sets on disk -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TunedSkipSet:
    settings: LayerSkipSettings
    draft_vocab: torch.Tensor | None  # [V_draft] target ids, ascending; None = the whole vocabulary
    fingerprint: ModelFingerprint
    study: dict  # a summary of the search that produced it


def fingerprint_key(fingerprint: ModelFingerprint) -> str:
    return hashlib.sha256(json.dumps(fingerprint.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def user_skip_path(target: Target) -> Path:
    """Where `selfspec tune layerskip` writes by default, keyed by the model's fingerprint."""
    return cache_root() / "layerskip" / f"{fingerprint_key(target.fingerprint)}.json"


def find_skip_file(target: Target, given: Path | None) -> Path:
    """--heads (a file, or a directory holding layerskip.json), else this model's tuned file in the user cache,
    else a shipped one whose fingerprint matches."""
    if given is not None:
        path = given / SKIP_FILE if given.is_dir() else given
        if not path.is_file():
            raise SelfspecError(f"'{given}' holds no {SKIP_FILE}: pass the file `selfspec tune layerskip` wrote")
        return path
    candidates = [user_skip_path(target), *sorted(SHIPPED_DIR.glob("layerskip-*/" + SKIP_FILE))]
    for path in candidates:
        if path.is_file() and _read(path).get("fingerprint") == target.fingerprint.to_dict():
            return path
    raise SelfspecError(
        "no tuned layer-skip set for this model: run `selfspec tune layerskip --model ...`, "
        "or use the hand-made baseline with --drafter layerskip:skip=every-other"
    )


def _read(path: Path) -> dict:
    try:
        document = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise SelfspecError(f"{path} is not a readable skip-set file ({error})") from None
    if not isinstance(document, dict) or set(document) != {"drafter", "fingerprint", "settings", "draft_vocab", "study"}:
        raise SelfspecError(f"{path}: expected the keys drafter, fingerprint, settings, draft_vocab, study")
    return document


def load_skip_file(path: Path, target: Target) -> TunedSkipSet:
    document = _read(path)
    if document["drafter"] != "layerskip":
        raise SelfspecError(f"{path} holds '{document['drafter']}' data, not a layer-skip set")
    fingerprint = ModelFingerprint.from_dict(document["fingerprint"])
    differences = fingerprint.differences(target.fingerprint)
    if differences:
        raise SelfspecError(
            f"the skip set in {path} was tuned for another base model ({'; '.join(differences)}): "
            "run `selfspec tune layerskip` for this model"
        )
    settings = from_dict(LayerSkipSettings, document["settings"], where=str(path))
    vocab = document["draft_vocab"]
    if vocab is not None and (not vocab or min(vocab) < 0 or max(vocab) >= target.vocab_size):
        raise SelfspecError(f"{path}: draft_vocab holds ids outside the vocabulary")
    draft_vocab = None if vocab is None else torch.tensor(vocab, dtype=torch.long, device=target.device)
    return TunedSkipSet(settings, draft_vocab, fingerprint, document["study"])


def save_skip_file(path: Path, tuned: TunedSkipSet) -> Path:
    """Write atomically (temp file, then rename)."""
    document = {
        "drafter": "layerskip",
        "fingerprint": tuned.fingerprint.to_dict(),
        "settings": to_dict(tuned.settings),
        "draft_vocab": None if tuned.draft_vocab is None else tuned.draft_vocab.tolist(),
        "study": tuned.study,
    }
    return atomic_write_text(path, json.dumps(document, indent=1) + "\n")
