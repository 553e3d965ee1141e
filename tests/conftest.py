"""Tiny random models of several architectures, and a tiny word-level tokenizer for CLI and API tests."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from selfspec.models import Target

torch.set_num_threads(1)  # tiny models: threading overhead dominates, and xdist runs two workers

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


def make_tiny_target(family: str = "llama", vocab_size: int = 96, seed: int = 0, **overrides) -> Target:
    config_cls, model_cls, extra = FAMILIES[family]
    config = config_cls(vocab_size=vocab_size, **{**_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return Target(model=model, tokenizer=None, name=f"tiny-{family}")


@pytest.fixture(params=CORE_FAMILIES)
def tiny_target(request) -> Target:
    return make_tiny_target(request.param)


def make_word_tokenizer(words: list[str]):
    """A whole-word tokenizer with special tokens at 0..2 and a ChatML-style template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
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


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A saved tiny Llama with a tokenizer: a real checkpoint directory for CLI and loader tests."""
    tokenizer = make_word_tokenizer(WORDS)
    target = make_tiny_target("llama", vocab_size=len(tokenizer))
    directory = tmp_path_factory.mktemp("tiny-llama")
    target.model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
