"""Everything the tests share, in one module: tiny random models of several architectures, a tiny word-level
tokenizer, the greedy reference, the chi-square machinery, drafters that exercise the loop's extremes, and random
(untrained) heads and tuned data for every drafter that reads artifacts. Test files import from here, never from each
other; fixtures live in conftest.py."""

from __future__ import annotations

import copy
import random
import subprocess
import sys
from dataclasses import replace

import torch
from scipy.stats import chisquare
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from selfspec.cost import CostCurve, load_cost_curve
from selfspec.decoding import speculative_generate
from selfspec.execution.q4 import GROUP, Q4Linear
from selfspec.heads import create_drafter
from selfspec.heads.artifacts import save_head
from selfspec.heads.base import Drafter, DraftRequest, Observation
from selfspec.heads.dflash import DFlashConfig, DFlashHead
from selfspec.heads.eagle import Eagle3Config, Eagle3Head, EagleConfig, EagleHead
from selfspec.heads.layerskip import LayerSkipSettings, TunedSkipSet, save_skip_file
from selfspec.heads.medusa import MedusaConfig, MedusaHeads, MedusaLoraConfig
from selfspec.models import Target, load_target
from selfspec.sampling import SamplingConfig, logits_to_probs
from selfspec.training.config import (
    DataConfig,
    EvalConfig,
    LabelConfig,
    RecipeConfig,
    TrainConfig,
)
from selfspec.training.data.labels import label_sequence
from selfspec.training.data.sharegpt import Conversation
from selfspec.training.data.tokenizing import tokenize_conversation
from selfspec.training.recipes.medusa import MedusaTraining, best_tree
from selfspec.tree_attention import DraftTree

# ---- tiny models ----------------------------------------------------------------------------------------------------

_COMMON = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    initializer_range=0.4,  # peaked logits: greedy argmax has clear margins, sampling is far from uniform
)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 8}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 512}),
    "gemma": (GemmaConfig, GemmaForCausalLM, {"head_dim": 8}),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, {"head_dim": 8, "sliding_window": 200, "query_pre_attn_scalar": 8}),
}
CORE_FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma"]


def make_tiny_target(
    family: str = "llama", vocab_size: int = 96, seed: int = 0, path: str = "auto", **overrides
) -> Target:
    config_cls, model_cls, extra = FAMILIES[family]
    config = config_cls(vocab_size=vocab_size, **{**_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    if path == "q4":
        four_bit_layers(model)
    return Target(model=model, tokenizer=None, name=f"tiny-{family}", path=path)  # auto: stock for tiny models


def four_bit_layers(model: torch.nn.Module) -> None:
    """Quantise a tiny model's decoder linears in place to 4-bit groups of 32 as GGUF's Q4_1 does (a scale and a
    minimum per group, codes 0..15), as `Q4Linear`s: a stand-in for a model loaded from a Q4_1 GGUF file."""
    with torch.no_grad():
        for parent in model.model.layers.modules():
            for name, child in list(parent.named_children()):
                if type(child) is not torch.nn.Linear:
                    continue
                groups = child.weight.reshape(child.out_features, -1, GROUP)  # [N, K/32, 32]
                low, high = groups.amin(-1), groups.amax(-1)
                scale = (high - low).clamp_min(1e-8) / 15
                codes = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
                setattr(parent, name, Q4Linear(codes.reshape(child.weight.shape), scale, low + 8 * scale))


def q4_1_values(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] (K a multiple of 32) rounded as a Q4_1 GGUF stores it and de-quantises it to float32: per block
    of 32 values of a row, a float16 minimum m and scale d = (max - m) / 15, codes round((w - m) / d) in 0..15, and
    the value d * code + m in float32."""
    blocks = weight.detach().reshape(weight.shape[0], -1, 32)
    low = blocks.amin(-1).half().float()
    scale = ((blocks.amax(-1) - low) / 15).half().float()
    codes = ((blocks - low[..., None]) / scale.clamp_min(1e-30)[..., None]).round().clamp(0, 15)
    return (scale[..., None] * codes + low[..., None]).reshape(weight.shape)


def plain_greedy(target: Target, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The reference on a path whose numbers transformers' generate does not reproduce (q4): plain decoding on it."""
    tokens, _ = speculative_generate(target, create_drafter("none", target), torch.tensor(prompt), max_new_tokens)
    return list(tokens)


def make_word_tokenizer(words: list[str]):
    """A whole-word tokenizer with special tokens at 0..2 and a ChatML-style template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<user>", "<assistant>"]
    vocab = {token: i for i, token in enumerate(specials + words + ["<unk>"])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}{{ '<user> ' if m['role'] == 'user' else '<assistant> ' }}{{ m['content'] }} "
        "{% endfor %}{% if add_generation_prompt %}<assistant> {% endif %}"
    )
    return tokenizer


WORDS = "the a cat dog sat on mat and ran to home big small red blue one two three is was very".split()


# ---- greedy reference ------------------------------------------------------------------------------------------------

PROMPT = [1, 5, 17, 33, 5, 17, 40, 8, 9, 5, 17]
FLAT = CostCurve((1, 64), (1.0, 1.0), source="test")  # every tree is free: the largest ones get verified


def hf_greedy(target: Target, prompt: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    """The reference: transformers' own generate, greedy, same model."""
    with torch.inference_mode():
        output = target.model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos if eos is not None else target.eos_token_ids[0],
            pad_token_id=0,
        )
    return output[0, len(prompt) :].tolist()


def without_eos(target: Target) -> Target:
    """Generation that never stops early, for the reference and the loop alike."""
    target.model.generation_config.eos_token_id = None
    return target.with_eos(())


# ---- sampling: the chi-square machinery ------------------------------------------------------------------------------

VOCAB = 8
CHI_PROMPT = [
    5
]  # one token: no prefill forward, so tens of thousands of samples stay fast; step 2 still reads a compacted cache
SAMPLING = SamplingConfig(temperature=1.0, top_k=6, top_p=0.9)


def chi_target(num_hidden_layers: int = 1, path: str = "auto", family: str = "llama", compact: bool = False) -> Target:
    """A tiny target over VOCAB tokens with spread-out distributions, no EOS. `compact`: layer 0's q and up projections
    in the Q4_1 GGUF's float32 form and its down projection in bfloat16's (the compiled `few` graph takes those
    compact: execution/compact.py)."""
    target = make_tiny_target(
        family,
        vocab_size=VOCAB,
        initializer_range=0.15,
        num_hidden_layers=num_hidden_layers,
        path="auto" if compact else path,
    )
    if not compact:
        return target.with_eos(())
    give_compact_forms(target.model)  # before the path reads the weights
    return Target(model=target.model, tokenizer=None, name=target.name, path=path).with_eos(())


def give_compact_forms(model: torch.nn.Module) -> None:
    """Layer 0's q and up projections rounded to a Q4_1 GGUF's float32 values, its down projection to bfloat16's."""
    layer = model.model.layers[0]
    with torch.no_grad():
        for weight in (layer.self_attn.q_proj.weight, layer.mlp.up_proj.weight):
            weight.copy_(q4_1_values(weight))
        layer.mlp.down_proj.weight.copy_(layer.mlp.down_proj.weight.bfloat16().float())


def expected_joint(target, prompt: list[int] = CHI_PROMPT) -> torch.Tensor:
    """[V, V]: the target's probability of each pair of next tokens after `prompt`, under SAMPLING."""
    with torch.inference_mode():
        first = logits_to_probs(target.forward(torch.tensor([prompt])).logits[0, -1], SAMPLING)
        second = torch.stack(
            [
                logits_to_probs(target.forward(torch.tensor([prompt + [t]])).logits[0, -1], SAMPLING)
                for t in range(VOCAB)
            ]
        )
    return first[:, None] * second  # [V, V]


def sample_joint(target, drafter, samples: int, prompt: list[int] = CHI_PROMPT) -> torch.Tensor:
    counts = torch.zeros(VOCAB, VOCAB)
    for seed in range(samples):
        tokens, _ = speculative_generate(target, drafter, torch.tensor(prompt), 2, SAMPLING, seed=seed)
        counts[tokens[0], tokens[1]] += 1
    return counts


def chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    total = counts.sum()
    impossible = expected < 1e-9
    assert counts[impossible].sum() == 0, "sampled a token pair the target gives zero probability"
    observed, predicted = counts[~impossible].double(), (expected[~impossible] * total).double()
    # Pool rare cells so every expected count is >= 5, as the chi-square approximation needs.
    rare = predicted < 5
    if rare.any():
        observed = torch.cat([observed[~rare], observed[rare].sum().view(1)])
        predicted = torch.cat([predicted[~rare], predicted[rare].sum().view(1)])
    return float(chisquare(observed.numpy(), predicted.numpy() * observed.sum().item() / predicted.sum().item()).pvalue)


# ---- drafters that exercise the loop (not registered) ----------------------------------------------------------------


class _ContextDrafter(Drafter):
    def __init__(self, target):
        super().__init__(target, load_cost_curve("cpu", target.name))
        self.context: list[int] = []

    def reset(self) -> None:
        self.context = []

    def observe(self, observation: Observation) -> None:
        self.context.extend(observation.new_tokens)


class OracleDrafter(_ContextDrafter):
    """Knows the target's greedy continuation; proposes it as a chain (all accepted), optionally with a wrong
    sibling placed *before* each right child, so accepted nodes are not contiguous in the layout."""

    def __init__(self, target, full_sequence: list[int], depth: int = 4, decoys: bool = False):
        super().__init__(target)
        self.full, self.depth, self.decoys = full_sequence, depth, decoys

    def propose(self, request: DraftRequest) -> DraftTree:
        position = len(self.context)
        future = self.full[position : position + min(self.depth, request.max_depth)]
        if not self.decoys:
            return DraftTree.from_paths(request.root_token, [future])
        tokens, parents, parent = [request.root_token], [-1], 0
        vocab = self.target.vocab_size
        for token in future:
            tokens += [(token + 1) % vocab, token]  # decoy first, then the right token
            parents += [parent, parent]
            parent = len(tokens) - 1
        return DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents))


class RandomDrafter(_ContextDrafter):
    """Random tokens in a tree of `width` x `depth`: (almost) nothing is accepted."""

    def __init__(self, target, width: int = 2, depth: int = 3, seed: int = 0):
        super().__init__(target)
        self.width, self.depth = width, depth
        self.rng = torch.Generator().manual_seed(seed)

    def propose(self, request: DraftRequest) -> DraftTree:
        depth = min(self.depth, request.max_depth)
        paths = [
            torch.randint(0, self.target.vocab_size, (depth,), generator=self.rng).tolist() for _ in range(self.width)
        ]
        return DraftTree.from_paths(request.root_token, paths if depth > 0 else [])


class DrawnDrafter(_ContextDrafter):
    """Children *drawn* from a draft distribution q (the target's own distribution at a higher temperature, mixed
    with noise): exercises multi-candidate rejection sampling. Deterministic children when `drawn` is False."""

    def __init__(self, target, width: int = 2, depth: int = 2, drawn: bool = True, without_replacement: bool = False):
        super().__init__(target)
        self.width, self.depth, self.drawn, self.without_replacement = width, depth, drawn, without_replacement

    def _draft_dist(self, context: list[int]) -> torch.Tensor:
        logits = self.target.model(torch.tensor([context])).logits[0, -1].float()
        return 0.7 * torch.softmax(logits / 1.5, -1) + 0.3 / logits.shape[-1]

    def propose(self, request: DraftRequest) -> DraftTree:
        tokens, parents, dists = [request.root_token], [-1], []
        frontier = [(0, self.context)]
        for _ in range(min(self.depth, request.max_depth)):
            next_frontier = []
            for node, context in frontier:
                q = self._draft_dist(context)
                while len(dists) <= node:
                    dists.append(None)
                dists[node] = q
                if self.drawn:
                    picks = torch.multinomial(
                        q, self.width, replacement=not self.without_replacement, generator=request.generator
                    )
                else:
                    picks = torch.topk(q, self.width).indices
                for token in picks.tolist():
                    tokens.append(token)
                    parents.append(node)
                    next_frontier.append((len(tokens) - 1, context + [token]))
            frontier = next_frontier[:1]  # expand only the first child of each level
        vocab = self.target.vocab_size
        table = torch.stack(
            [
                d if d is not None else torch.full((vocab,), 1.0 / vocab)
                for d in dists + [None] * (len(tokens) - len(dists))
            ]
        )
        return DraftTree(
            tokens=torch.tensor(tokens),
            parents=torch.tensor(parents),
            draft_probs=table if self.drawn else None,
            without_replacement=self.without_replacement,
        )


class BigramTreeDrafter(Drafter):
    """A width-2, depth-2 tree from a fixed random bigram table q[last token]: children either drawn from q
    (with or without replacement) or taken as q's top-2 (deterministic)."""

    def __init__(self, target, drawn: bool, without_replacement: bool = False):
        super().__init__(target, load_cost_curve("cpu", target.name))
        # Its own generator: the table must not depend on which tests ran before in the same process.
        rng = torch.Generator().manual_seed(7)
        dirichlet = -torch.rand(VOCAB, VOCAB, generator=rng).log()  # Gamma(1) draws, normalised: Dirichlet(1) rows
        self.table = 0.5 * dirichlet / dirichlet.sum(-1, keepdim=True) + 0.5 / VOCAB
        self.table = 0.5 * torch.rand(VOCAB, VOCAB, generator=rng).softmax(-1) + 0.5 * self.table
        self.drawn, self.without_replacement = drawn, without_replacement

    def _children(self, last: int, generator) -> list[int]:
        q = self.table[last]
        if not self.drawn:
            return torch.topk(q, 2).indices.tolist()
        return torch.multinomial(q, 2, replacement=not self.without_replacement, generator=generator).tolist()

    def propose(self, request: DraftRequest) -> DraftTree:
        if request.max_depth < 1:
            return DraftTree.root_only(request.root_token)
        first = self._children(request.root_token, request.generator)  # nodes 1, 2
        tokens, parents, rows = [request.root_token] + first, [-1, 0, 0], [request.root_token]
        if request.max_depth >= 2:
            tokens += self._children(first[0], request.generator)  # nodes 3, 4 under node 1
            parents += [1, 1]
            rows.append(first[0])
        q_rows = [self.table[r] for r in rows] + [torch.full((VOCAB,), 1.0 / VOCAB)] * (len(tokens) - len(rows))
        # rows must line up with nodes: node 0 -> table[root], node 1 -> table[first[0]], others unused
        q = torch.stack(q_rows)
        return DraftTree(
            tokens=torch.tensor(tokens),
            parents=torch.tensor(parents),
            draft_probs=q if self.drawn else None,
            without_replacement=self.without_replacement,
        )

    def observe(self, observation: Observation) -> None:
        pass


# ---- random artifacts for the drafters that read them ----------------------------------------------------------------


def random_medusa_dir(target, directory, num_heads=3, draft_vocab=None, seed=0, max_nodes=12, lora=False):
    """Heads with random (non-zero) weights and a tree from made-up accuracies, saved like trained ones. lora: Medusa-2
    heads, with a LoRA adapter of random (non-zero) weights that changes what the model decodes."""
    config = MedusaConfig(
        num_heads=num_heads,
        draft_vocab_size=0 if draft_vocab is None else len(draft_vocab),
        max_rank=3,
        lora=MedusaLoraConfig(rank=4, alpha=8) if lora else None,
    )
    vocab = torch.arange(target.vocab_size) if draft_vocab is None else draft_vocab
    heads = MedusaHeads(config, target, vocab).float()
    torch.manual_seed(seed)
    for parameter in heads.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    accuracies = torch.tensor([[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.1]])[:num_heads]
    paths, values = best_tree(accuracies, max_nodes)
    tree = {"paths": [list(p) for p in paths], "values": values}
    write_adapter = (lambda path: _random_lora(target, config.lora, seed).save_pretrained(str(path))) if lora else None
    return save_head(directory, "medusa", config, heads.state_dict(), target.fingerprint, {"tree": tree}, write_adapter)


def _random_lora(target, lora: MedusaLoraConfig, seed: int):
    """A LoRA adapter (peft) on a copy of the target's model, its weights random so merging it changes the model."""
    from peft import LoraConfig, get_peft_model

    peft_config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules))
    adapted = get_peft_model(copy.deepcopy(target.model), peft_config)
    torch.manual_seed(seed)
    for name, parameter in adapted.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(parameter, std=0.5)
    return adapted


def _random_eagle_family_head(head_cls, config_cls, target, draft_vocab, seed, config, norms: bool):
    config = config_cls(
        **{
            "draft_vocab_size": 0 if draft_vocab is None else len(draft_vocab),
            "top_k": 3,
            "depth": 3,
            "max_tree_nodes": 10,
            **config,
        }
    )
    torch.manual_seed(seed)
    head = head_cls(config, target, torch.arange(target.vocab_size) if draft_vocab is None else draft_vocab)
    for _name, parameter in head.named_parameters():
        if parameter.dim() > 1:
            torch.nn.init.normal_(parameter, std=0.3)
        elif norms:  # so a mix-up of EAGLE-3's two input norms or of its final norm shows
            torch.nn.init.uniform_(parameter, 0.5, 1.5)
    return head


def random_eagle_dir(target, directory, draft_vocab=None, seed=0, **config):
    head = _random_eagle_family_head(EagleHead, EagleConfig, target, draft_vocab, seed, config, norms=False)
    return save_head(directory, "eagle", head.config, head.state_dict(), target.fingerprint, {})


def random_eagle3_head(target, draft_vocab=None, seed=0, **config) -> Eagle3Head:
    return _random_eagle_family_head(Eagle3Head, Eagle3Config, target, draft_vocab, seed, config, norms=True)


def random_eagle3_dir(target, directory, draft_vocab=None, seed=0, **config):
    head = random_eagle3_head(target, draft_vocab, seed, **config)
    config = Eagle3Config(**{**head.config.__dict__, "feature_layers": head.feature_layers})
    return save_head(directory, "eagle3", config, head.state_dict(), target.fingerprint, {})


def random_dflash_head(target, draft_vocab=None, seed=0, **config):
    """A DFlash head with random weights (norms included, so a round trip that dropped one would show)."""
    config = DFlashConfig(
        **{
            "block_size": 4,
            "draft_vocab_size": 0 if draft_vocab is None else len(draft_vocab),
            "top_k": 3,
            "max_tree_nodes": 10,
            "mask_token_id": target.vocab_size - 1,
            **config,
        }
    )
    torch.manual_seed(seed)
    head = DFlashHead(config, target, torch.arange(target.vocab_size) if draft_vocab is None else draft_vocab)
    for _name, parameter in head.named_parameters():
        if parameter.dim() > 1:
            torch.nn.init.normal_(parameter, std=0.3)
        else:
            torch.nn.init.normal_(parameter, mean=1.0, std=0.1)
    return head


def random_dflash_dir(target, directory, draft_vocab=None, seed=0, **config):
    head = random_dflash_head(target, draft_vocab, seed, **config)
    config = DFlashConfig(**{**head.config.__dict__, "feature_layers": head.feature_layers})
    return save_head(directory, "dflash", config, head.state_dict(), target.fingerprint, {})


def tuned_skip_file(target: Target, path, draft_vocab=None, **settings):
    """A layer-skip file as `selfspec tune layerskip` writes it (skips the MLP of layer 1 unless told otherwise)."""
    settings = LayerSkipSettings(**{"skip_mlp": (1,), "threshold": 0.0, "max_draft": 4, **settings})
    return save_skip_file(path, TunedSkipSet(settings, draft_vocab, target.fingerprint, {"trials": 0}))


# ---- training --------------------------------------------------------------------------------------------------------


def tiny_recipe(tmp_path, checkpoint, **changes) -> RecipeConfig:
    config = RecipeConfig(
        drafter="medusa",
        model=str(checkpoint),
        out=str(tmp_path / "heads"),
        work_dir=str(tmp_path / "work"),
        data=DataConfig(
            source="sharegpt",
            conversations=None,
            max_length=64,
            regenerate=True,
            max_prompt_tokens=64,
            max_new_tokens=12,
            regenerate_batch_size=16,
            calibration_fraction=0.1,
        ),
        labels=LabelConfig(storage="cache", top_k=4, shard_examples=16),
        train=TrainConfig(batch_size=4, lr=0.01, warmup_steps=2, max_steps=12, checkpoint_every=4, log_every=2),
        eval=EvalConfig(heldout_prompts=0),
        medusa=MedusaConfig(num_heads=2, draft_vocab_size=16, max_rank=3, max_tree_nodes=8),
    )
    return replace(config, **changes)


def tiny_training_setup(tiny_checkpoint, count=12, layers=(-1,)):
    target = load_target(str(tiny_checkpoint))
    rng = random.Random(1)
    examples = []
    for index in range(count):
        conversation = Conversation(
            str(index),
            (
                {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(4))},
                {"role": "assistant", "content": " ".join(rng.choice(WORDS) for _ in range(10))},
            ),
        )
        examples.append(tokenize_conversation(target, conversation, 64))
    sequences = [label_sequence(target, e, layers, 4) for e in examples]
    config = MedusaConfig(num_heads=2, draft_vocab_size=0, max_rank=3)

    def make():
        return MedusaTraining(MedusaHeads(config, target, torch.arange(target.vocab_size)), 0.8)

    return target, sequences, make


def record_sharegpt_splits(monkeypatch) -> list[str]:
    """The ShareGPT splits the training data code reads from now on, in order (a test's proof that it never reads the
    held-out one)."""
    import selfspec.training.data.sharegpt as sharegpt_module

    splits, real = [], sharegpt_module.load_sharegpt

    def spy(split, path=None):
        splits.append(split)
        return real(split, path)

    monkeypatch.setattr("selfspec.training.data.conversations.load_sharegpt", spy)
    return splits


def model_as_made(model: torch.nn.Module) -> dict:
    """What transformers made: every module object at its name, the parameters, the config object and its values, and
    no `forward` set on the instance."""
    return {
        "modules": [(name, id(module), type(module)) for name, module in model.named_modules()],
        "parameters": [(name, id(weight), weight.requires_grad) for name, weight in model.named_parameters()],
        "config": (id(model.config), model.config.to_json_string()),
        "instance forward": [name for name, module in model.named_modules() if "forward" in vars(module)],
    }


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`selfspec ARGS...` in a fresh process, as a user runs it: its exit code, stdout and stderr as text."""
    return subprocess.run([sys.executable, "-m", "selfspec.cli", *args], capture_output=True, text=True, env=env)
