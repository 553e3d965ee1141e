"""The `compiled` execution path: the target's decoding step compiled ahead of time by AOTInductor, on a CPU.

On a CPU the fast path's eager forward spends a third of a one-token step outside the matrix products: ~3,000 small
ops a forward, each paying PyTorch's dispatch and Python's call overhead. `torch.export` traces the stock
transformers forward (no modelling code is copied) into one graph; AOTInductor fuses the element-wise ops into C++
loops and compiles it into a shared library that any later process loads in about a second. Two graphs:
- `few`: 1-16 rows (requests x new tokens), traced with every product on selfspec's small-row kernel (native.py:
  the operator `selfspec::small_rows`, which streams each weight as stored at the speed memory allows) and its row
  attention. Compiled without its weights, it reads the model's own parameters (shared, not copied), but for the
  decoder's linear weights that a compact form gives back exactly (a Q4_1 GGUF's coded as its blocks, a bfloat16
  checkpoint's in bfloat16: compact.py), which it streams in that form (made at load), each product the float32
  weight's bit for bit. Built only where that kernel is. Its rows do not depend on how many rows a call has (both
  kernels compute each row on its own, in one order): a tree verified in `few` gives each node the logits one-token
  steps give it, bit for bit.
- `tree`: 1-64 new tokens, compiled with Inductor's freezing, so every product runs oneDNN's GEMM on weights packed
  once for small row counts (that packed copy lives in the package).
A step goes to `few` up to the rows where `few` still runs within 5% of `tree` on this machine (`few_limit`: the graphs
timed against each other once, beside their packages: `settle_split`), preferring it there for its row invariance;
`few` is built only where the small-row kernel beats the packed one at one row (the fast path's row split,
`RowDispatch.stock_rows`, measured once per machine with that kernel loaded); elsewhere every step runs in `tree`.
Every graph takes a batch: B rows of n new tokens, each row under its own whole mask over the cached positions and the
new ones. One request is B = 1; the batch engine (selfspec/batch) verifies its requests' trees as B rows of a ragged
cache, each row's mask showing it its own prefix and ancestors. The step's keys and values are written in
place, after the cache's `length`, into the cache's own storage (kv_storage.WrittenInPlace: `storage`, `reserve`,
`mark_filled`), so a step copies no cache.
Only the graphs the row split sends steps to are built (`graphs_needed`: `tree` alone where the packed kernel wins
from two rows). The q4 path (q4.py) has one graph of its own, `q4`: 1-64 rows of its twin (4-bit linears, a
bfloat16 LM head, the row attention), compiled without its weights like `few`; its rows do not depend on the row
count, so no split decides anything there. Compiling takes a minute or two per graph
on a 2-core CPU, once per kind of CPU, model weights, dtype and software versions: the packages are stored under the
selfspec cache (`package_dir`); under `auto` (and `q4`) a background process builds them while requests run on the
eager path (background.py). Prefill and anything else the graphs do not cover (more than 64 new tokens, a short
cache, other cache kinds) run the eager path.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from ..errors import SelfspecError
from ..files import atomic_write_text, cache_root, cpu_signature
from ..tree_attention import causal_block_mask
from . import native
from .attention import FLOAT64_SDPA, GROUPED_SDPA, ROW_ATTENTION
from .calibration import measure_until_quiet
from .compact import compact_weights
from .head import HeadProxy, head_proxy, stored_head_proxy
from .kv_storage import WrittenInPlace
from .linears import RowDispatch
from .q4 import GROUP, BFloat16Head
from .twin import sharing_copy

MAX_TREE_ROWS = 64  # the largest tree the `tree` graph takes; larger forwards run eager
MAX_BATCH = 16  # the most requests (batch rows) a graph takes at once (the batch engine's); more run eager
# graph -> the new tokens a row it takes (fewer are padded: graph_for); `q4` is the q4 path's only graph, the others
# float32's
GRAPHS = {"few": (1, 16), "tree": (1, MAX_TREE_ROWS), "q4": (1, MAX_TREE_ROWS)}
WEIGHTLESS = ("few", "q4")  # compiled without their weights: they read the model's own (CompiledStep.load)
MIN_CACHED = 16  # below this many cached positions the step runs eager (the graphs' cache dimension starts here)
PACKAGE_FORMAT = 10  # bumped whenever the graphs' inputs, outputs or row ranges change: older packages are not read
# (9: `few` takes the decoder's linear weights that bfloat16 holds exactly in bfloat16; 10: and those of a Q4_1 GGUF
# coded as its blocks: compact.py)
COMPACT = "selfspec_compact_weights"  # a `few` package's metadata: the weights it takes compact, `name:dtype,...`
_EXAMPLE_CACHED = 300  # the cache length the graphs are traced with (it stays dynamic)
FEW_ROWS_ENV = "SELFSPEC_FEW_ROWS"  # fixes the rows up to which steps run in `few` instead of measuring them (tests)
SPLIT_SIZES = (1, 2, 3, 4, 6, 8, 12, 16)  # the row counts at which `few` and `tree` are timed (up to `few`'s last)
# `few` is taken up to this much slower than `tree`: its rows equal one-token steps' bit for bit, `tree`'s do not
FEW_PREFERENCE = 1.05
SPLIT_FILE = "few-rows.json"  # beside the packages: the split measured between them
# bumped when either graph's cost by rows changes without a new package: a split stored with another is measured again
# (2: the bounded head reads its proxy once for all of a step's rows, and the graphs are timed as greedy steps run;
# 3: the small-row kernel asks for weight lines ahead, and takes up to four rows in one pass)
SPLIT_REVISION = 3


def weights_digest(model: torch.nn.Module, buffers: bool = False) -> str:
    """A digest of the model's parameters (names, shapes and a strided sample of values): the `tree` package carries
    the weights packed inside, so other weights (an adapter merged in, another checkpoint) need other packages.
    `buffers`: its buffers too (a 4-bit model's packed linears are buffers)."""
    digest = hashlib.sha1()
    tensors = [*model.named_parameters(), *(model.named_buffers() if buffers else [])]
    with torch.no_grad():
        for name, parameter in tensors:
            flat = parameter.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 4096)].float().cpu().numpy().tobytes()
            digest.update(f"{name}{tuple(parameter.shape)}".encode())
            digest.update(sample)
    return digest.hexdigest()[:12]


def package_dir(model: torch.nn.Module, model_name: str, four_bit: bool = False) -> Path:
    """Where the packages of `model` live: one directory per model weights, dtype (the digest samples the values as
    float32, so a bfloat16 copy of the same weights would otherwise share it), package format, kind of CPU, thread
    count and software versions; `four_bit`: the q4 path's twin, whose 4-bit weights are buffers."""
    versions = (
        f"torch{torch.__version__}-transformers{transformers.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
    )
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    if four_bit:  # its attention and head (native row attention and wide_product, or float64 SDPA over a float64
        # cache and oneDNN's bfloat16 head) are in the graph
        dtype += "-q4-f64attention" if _float64_attention(model) else "-q4-rowattention-widehead"
    key = (
        f"{Path(model_name).name}--{weights_digest(model, buffers=four_bit)}--{dtype}--format{PACKAGE_FORMAT}"
        f"--cpu-{cpu_signature()}-{torch.get_num_threads()}threads--{versions}"
    )
    return cache_root() / "compiled" / key.replace("/", "_")


class _StoreLayer(DynamicLayer):
    """Inside the traced step: one layer's KV storage [1, kv_heads, capacity, head_dim] holding `cached` positions;
    the step's keys and values are written in place after them."""

    def __init__(self, key_store: torch.Tensor, value_store: torch.Tensor, cached: int):
        super().__init__()
        self.key_store, self.value_store, self.cached = key_store, value_store, cached
        self.dtype, self.device, self.is_initialized = key_store.dtype, key_store.device, True
        self.keys, self.values = key_store[:, :, :cached], value_store[:, :, :cached]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.cached + key_states.shape[-2]
        self.key_store[:, :, self.cached : end].copy_(key_states)
        self.value_store[:, :, self.cached : end].copy_(value_states)
        self.keys, self.values = self.key_store[:, :, :end], self.value_store[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.cached


class _SmallRowProducts(torch.overrides.TorchFunctionMode):
    """While `few` is traced: every linear product of the stock modules is recorded as selfspec's small-row operator
    (native.py) instead of aten.linear (the model's code and modules are left as they are)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            return native.small_rows(*args, **kwargs)
        return func(*args, **kwargs)


def _float64_attention(model: torch.nn.Module) -> bool:
    """Whether `model` (the q4 path's twin) attends in float64 over a float64 cache (FLOAT64_SDPA)."""
    attention = model.config._attn_implementation  # transformers gives no public reader
    return attention == FLOAT64_SDPA


def _traced_twin(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    """What a float32 graph traces: a twin of `model` (its weights, its own modules and config) whose `sdpa`
    attention reads the grouped key/value heads as they are. The stock function repeats every layer's cached keys and
    values per query-head group under a mask, at every step (2.4 ms more than the grouped one over 512 cached
    positions of SmolLM2's 30 layers in the graph). `tree` takes the fast path's grouped SDPA (attention.py); `few`,
    built only where selfspec's native kernels are, their row attention (row-invariant, and faster at its rows)."""
    twin = sharing_copy(model)
    attention = twin.config._attn_implementation  # transformers gives no public reader
    if attention == "sdpa":
        twin.set_attn_implementation(ROW_ATTENTION if kind == "few" else GROUPED_SDPA)
    return twin


def _own_storages(model: torch.nn.Module) -> None:
    """Give `model` (a twin, traced for a frozen graph) copies of its weights that own their memory, tied ones tied
    still. AOTInductor sizes each constant it stores by its whole storage, and a loaded target's weights are views of
    one huge-page mapping (memory.into_huge_pages): SmolLM2's 272 tensors would count 0.54 GB each (a MemoryError
    asking for 147 GB). The copies live while the graph is compiled."""
    copies: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for module in model.modules():
            for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                if tensor.untyped_storage().nbytes() <= tensor.numel() * tensor.element_size():
                    continue
                if id(tensor) not in copies:
                    clone = tensor.detach().clone()
                    copies[id(tensor)] = torch.nn.Parameter(clone, False) if name in module._parameters else clone
                if name in module._parameters:
                    module._parameters[name] = copies[id(tensor)]
                else:
                    module._buffers[name] = copies[id(tensor)]


def _listing(compact: dict[str, torch.Tensor]) -> str:
    """The compact weights' names and forms, as a `few` package's metadata records them."""
    return ",".join(f"{name}:{str(weight.dtype).removeprefix('torch.')}" for name, weight in sorted(compact.items()))


def _take_weights(twin: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Give `twin`'s modules the weights named (as `_Step` names them) in place of their own (new Parameter objects:
    the model's stay as they are)."""
    modules = dict(twin.named_modules())
    for name, weight in weights.items():
        module_name, _, attribute = name.removeprefix("model.").rpartition(".")
        modules[module_name]._parameters[attribute] = torch.nn.Parameter(weight, requires_grad=False)


class _Step(torch.nn.Module):
    """The traced function: (new tokens [B, n], their positions [B, n], the whole additive mask [B, 1, n, cached + n]
    over the cached positions and the new ones, each layer's key and value storage [B, kv_heads, capacity, head_dim]
    holding `cached` positions) -> (logits [B, n, V], hidden states: the embeddings and every layer's output, each
    [B, n, H]). B is 1 for one request; the batch engine's rows are requests of different lengths, each row's mask
    showing it only its own."""

    def __init__(self, model: torch.nn.Module, head: HeadProxy | None = None):
        """head: the LM head's proxy and bounds (head.py), for a graph whose head is `selfspec::bounded_head`: it then
        takes one more input, `argmax_only` (a bool tensor), and runs the decoder, then the head over its last
        hidden state (a model whose causal LM forward does no more than that: `_plain_head`). A model whose output
        embeddings bound themselves (q4's BFloat16Head with its proxy) takes `argmax_only` too, handed to its head."""
        super().__init__()
        self.model = model
        self.bounded = head is not None
        self.head_takes_flag = _takes_flag(model)
        if head is not None:
            self.register_buffer("head_codes", head.codes, persistent=False)
            self.register_buffer("head_scale", head.scale, persistent=False)
            self.register_buffer("head_bound", head.bound, persistent=False)

    def forward(self, input_ids, position_ids, mask, key_stores, value_stores, argmax_only=None):
        n = input_ids.shape[1]
        cached = mask.shape[-1] - n
        cache = DynamicCache(config=self.model.config)
        cache.layers = [
            _StoreLayer(keys, values, cached) for keys, values in zip(key_stores, value_stores, strict=True)
        ]
        inputs = {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": mask}
        if self.head_takes_flag:
            with self.model.get_output_embeddings().deciding(argmax_only):
                output = self.model(**inputs, past_key_values=cache, use_cache=True, output_hidden_states=True)
            return output.logits, tuple(output.hidden_states)
        if not self.bounded:
            output = self.model(**inputs, past_key_values=cache, use_cache=True, output_hidden_states=True)
            return output.logits, tuple(output.hidden_states)
        output = self.model.get_decoder()(**inputs, past_key_values=cache, use_cache=True, output_hidden_states=True)
        weight = self.model.get_output_embeddings().weight
        proxy = HeadProxy(self.head_codes, self.head_scale, self.head_bound)
        logits = native.bounded_head(output.last_hidden_state, weight, proxy, argmax_only)
        return logits, tuple(output.hidden_states)


def _takes_flag(model: torch.nn.Module, directory: Path | None = None) -> bool:
    """Whether `model`'s output embeddings bound their own argmax (q4's BFloat16Head on selfspec's kernel): their
    proxy and bounds are made now if they were not (read from `directory` where stored there)."""
    head = model.get_output_embeddings()
    if not (isinstance(head, BFloat16Head) and head.wide):
        return False
    head.add_bounds(directory)
    return True


def _plain_head(model: torch.nn.Module) -> bool:
    """Whether `model`'s logits are its output embeddings' bias-free float32 product over the decoder's last hidden
    state and nothing more (no soft-capping or scaling after it), checked on a few tokens: the `few` graph then
    computes them itself, through bounded_head."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None or head.weight.dtype != torch.float32:
        return False
    tokens = torch.arange(4).view(1, 4) % model.config.vocab_size
    with torch.no_grad():
        logits = model(input_ids=tokens, use_cache=False).logits
        hidden = model.get_decoder()(input_ids=tokens, use_cache=False).last_hidden_state
    return torch.equal(logits, torch.nn.functional.linear(hidden, head.weight))


def _zero_stores(config, batch: int, capacity: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """One layer's key (or value) storage per layer, as the graphs take it: [batch, kv_heads, capacity, head_dim]."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return [torch.zeros(batch, kv_heads, capacity, head_dim, dtype=dtype) for _ in range(config.num_hidden_layers)]


def _example(model: torch.nn.Module, rows: int, store_dtype: torch.dtype | None = None, flag: bool = False) -> tuple:
    config = model.config
    dtype = next(model.parameters()).dtype
    batch = 2  # traced with two requests, so that the batch dimension stays dynamic (one request is B = 1)
    stores = _zero_stores(config, batch, 2 * _EXAMPLE_CACHED, store_dtype or dtype)
    positions = torch.arange(_EXAMPLE_CACHED, _EXAMPLE_CACHED + rows).view(1, rows).expand(batch, rows)
    return (
        torch.zeros(batch, rows, dtype=torch.long),
        positions.contiguous(),
        causal_block_mask(_EXAMPLE_CACHED, rows, dtype, "cpu").expand(batch, 1, rows, -1).contiguous(),
        stores,
        [store.clone() for store in stores],
        *((torch.tensor(True),) if flag else ()),
    )


def compile_step(model: torch.nn.Module, kind: str, path: Path, on_stage=None) -> None:
    """Trace and compile one graph (a key of GRAPHS) of `model`'s stock modules into the package `path`;
    `on_stage(kind, "export" | "compile")` hears each stage begin (a progress bar)."""
    from torch.export import Dim

    low, high = GRAPHS[kind]
    rows, layers = Dim(f"{kind}_rows", min=low, max=high), model.config.num_hidden_layers
    batch, width = Dim("batch", min=1, max=MAX_BATCH), Dim("width", min=MIN_CACHED + low, max=1 << 20)
    shapes = {
        "input_ids": {0: batch, 1: rows},
        "position_ids": {0: batch, 1: rows},
        "mask": {0: batch, 2: rows, 3: width},
        "key_stores": [{0: batch, 2: Dim.AUTO}] * layers,
        "value_stores": [{0: batch, 2: Dim.AUTO}] * layers,
    }
    float64_cache = kind == "q4" and _float64_attention(model)
    head = head_proxy(model.get_output_embeddings().weight) if kind == "few" and _plain_head(model) else None
    flag = head is not None or (kind == "q4" and _takes_flag(model))
    example = _example(model, min(max(low, 6), high), torch.float64 if float64_cache else None, flag)
    if flag:
        shapes["argmax_only"] = None
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.pt2")  # renamed over `path` once complete
    # `tree` freezes the weights (packed into the package); `few` and `q4` read the model's own (CompiledStep.load):
    # a package holding them would add their size twice to the process (copied out, and the library's pages). Their
    # own fused loops (norms, rotary embeddings, residuals: a few thousand floats a row) run on one thread: an OpenMP
    # region each, ~180 a step, cost more than they share out (1-4% of a step, the same results); their products and
    # attention are selfspec's and PyTorch's kernels, on every thread.
    options = (
        {"freezing": True}
        if kind == "tree"
        else {"freezing": False, "aot_inductor.package_constants_in_so": False, "cpp.threads": 1}
    )
    try:
        with torch.no_grad(), warnings.catch_warnings():  # Inductor freezes the weights only without autograd
            warnings.simplefilter("ignore")  # PyTorch's own deprecation notices while tracing: not the user's concern
            # Non-strict export traces the stock forward as Python runs it (no weights are loaded here: `strict`
            # is torch.export's tracing mode, not state-dict strictness); the strict, dynamo-based mode does not
            # get through transformers' cache objects.
            if on_stage is not None:
                on_stage(kind, "export")
            traced = model if kind == "q4" else _traced_twin(model, kind)  # q4's twin has its own attention
            if kind == "tree":
                _own_storages(traced)
            if kind == "few":
                compact = compact_weights(traced)
                _take_weights(traced, compact)
                options["aot_inductor.metadata"] = {COMPACT: _listing(compact)}
            with _SmallRowProducts() if kind == "few" else contextlib.nullcontext():
                program = torch.export.export(_Step(traced, head), example, dynamic_shapes=shapes, strict=False)
            if on_stage is not None:
                on_stage(kind, "compile")
            torch._inductor.aoti_compile_and_package(program, package_path=str(temp), inductor_configs=options)
        os.chmod(temp, 0o644)
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


def _padded(input_ids, position_ids, mask, rows: int) -> tuple:
    """A step of n tokens made `rows` long for a graph that takes no fewer: dummy rows (the last token again, at the
    next positions) that see the cached positions the last real row sees, and themselves; no real row sees them.
    Their keys and values land past the step's own and are left outside the cache's length."""
    batch, n = input_ids.shape
    extra, cached = rows - n, mask.shape[-1] - n
    lowest = torch.finfo(mask.dtype).min
    padded = torch.full((batch, 1, rows, cached + rows), lowest, dtype=mask.dtype)
    padded[..., :n, : cached + n] = mask
    padded[..., n:, :cached] = mask[..., n - 1 : n, :cached]
    padded[..., n:, cached + n :].diagonal(dim1=-2, dim2=-1).zero_()
    input_ids = torch.cat([input_ids, input_ids[:, -1:].expand(batch, extra)], dim=1)
    steps = torch.arange(1, extra + 1).view(1, extra)
    position_ids = torch.cat([position_ids, position_ids[:, -1:] + steps], dim=1)
    return input_ids, position_ids, padded


@dataclass(frozen=True)
class StepOutput:
    """What a compiled step returns in place of the model's output, by the same names (transformers'
    CausalLMOutputWithPast took 50-90 us to build, 1-1.5% of a one-token step)."""

    logits: torch.Tensor  # [batch, n, V]
    past_key_values: Cache
    hidden_states: tuple[torch.Tensor, ...] | None  # each [batch, n, H]: the embeddings', then each layer's


class _Graph:
    """A loaded package, called with the step's inputs as `_Step` takes them -> (logits, hidden states). It hands
    the flat list of tensors to the package's runner itself: the package's own call parses its input and output tree
    specifications at every call (0.2 ms a step for 60 cache tensors)."""

    def __init__(self, package, bounded: bool = False):
        self.package = package
        self.bounded = bounded  # its LM head is bounded_head: it takes `argmax_only`

    def __call__(self, input_ids, position_ids, mask, key_stores, value_stores, argmax_only: bool = False):
        flag = (_TRUE if argmax_only else _FALSE,) if self.bounded else ()
        outputs = self.package.loader.boxed_run([input_ids, position_ids, mask, *key_stores, *value_stores, *flag])
        return outputs[0], tuple(outputs[1:])


_TRUE, _FALSE = torch.tensor(True), torch.tensor(False)


class CompiledStep:
    """The compiled graphs of one model that its row split uses (`graphs_needed`), built ahead (`build`) or loaded
    from the cache (`load`), and the call that routes an eligible forward to them."""

    def __init__(
        self,
        model: torch.nn.Module,
        model_name: str,
        log=None,
        dispatch: RowDispatch | None = None,
        four_bit: bool = False,
    ):
        """dispatch: the fast path's row split, which decides whether `few` is used at all, and its rows until the
        graphs are timed against each other (`few_limit`); without one, `few` is used wherever the small-row kernel is
        loaded. four_bit: the q4 path's step (graph `q4`), `model` being its twin."""
        self.model, self.model_name, self.dispatch, self.four_bit = model, model_name, dispatch, four_bit
        self.log = log or (lambda message: print(message, file=sys.stderr, flush=True))
        self.runners: dict[str, object] | None = None
        self.compact: dict[str, torch.Tensor] = {}  # the weights `few` takes compact (compact.py), by name
        self.dtype = next(model.parameters()).dtype  # the masks' (the q4 path's KV storage may be float64)
        self._directory: Path | None = None
        self.few_rows: int | None = None  # the rows up to which `few` runs, once settled (settle_split)
        # set by ExecutionPath.argmax_only: the steps' logits are read for their argmax alone (greedy verification),
        # so a graph whose head is bounded_head computes the maximal candidates only (head.py)
        self.argmax_only = False

    @property
    def directory(self) -> Path:
        """Where this model's packages live (the weights' digest is computed once: a model's weights do not change
        while a path holds it)."""
        if self._directory is None:
            self._directory = package_dir(self.model, self.model_name, self.four_bit)
        return self._directory

    def graphs_needed(self) -> tuple[str, ...]:
        """The graphs `graph_for` can send a step to under this row split: `few` only where the small-row kernel is
        loaded and wins at one row (a machine where the packed kernel wins from one row on would compile it for
        nothing)."""
        if self.four_bit:
            return ("q4",)
        uses_few = self.graph_for(1)[0] == "few"
        return tuple(kind for kind in ("few", "tree") if kind != "few" or uses_few)

    def missing(self) -> list[str]:
        """The needed graphs whose packages are not stored yet."""
        return [kind for kind in self.graphs_needed() if not (self.directory / f"{kind}.pt2").is_file()]

    def build(self, on_stage=None) -> None:
        """Compile the needed graphs not stored yet (the model must be on its stock modules: the trace reads them).
        `on_stage(kind, stage)` hears each step begin: ("tree", "export"), ("tree", "compile")."""
        kinds = self.missing()
        for index, kind in enumerate(kinds):
            began = time.perf_counter()
            self.log(
                f"[selfspec] compiling the target's '{kind}' step for this machine ({index + 1}/{len(kinds)}; once, "
                f"minutes; stored in {self.directory})"
            )
            compile_step(self.model, kind, self.directory / f"{kind}.pt2", on_stage)
            self.log(f"[selfspec] compiled the '{kind}' step in {time.perf_counter() - began:.0f} s")

    def load(self, compile_missing: bool = True, remeasure: bool = False) -> None:
        """Load the needed packages, compiling those not stored yet unless `compile_missing` is False (then a
        missing one is a SelfspecError); then settle the split between them (`remeasure`: measured anew)."""
        if self.runners is not None:
            return
        if compile_missing:
            self.build()
        elif self.missing():
            raise SelfspecError(f"the compiled graphs {', '.join(self.missing())} are not stored in {self.directory}")
        runners = {
            kind: torch._inductor.aoti_load_package(str(self.directory / f"{kind}.pt2"))
            for kind in self.graphs_needed()
        }
        bounded = {kind for kind in runners if "head_codes" in runners[kind].get_constant_fqns()}
        head = stored_head_proxy(self.model.get_output_embeddings().weight, self.directory) if bounded else None
        if "q4" in runners and _takes_flag(self.model, self.directory):
            bounded.add("q4")  # its head (the twin's) holds its proxy
        step = _Step(self.model, head)
        own = dict(step.named_parameters(remove_duplicate=False)) | dict(step.named_buffers(remove_duplicate=False))
        for kind in set(runners) & set(WEIGHTLESS):  # it reads the model's own weights, not a copy
            needed = runners[kind].get_constant_fqns()
            if kind == "q4":  # Inductor passes each int4 product its group size as a tensor constant of its own
                own |= {name: torch.tensor(GROUP) for name in needed if name not in own and name.startswith("constant")}
            if kind == "few":  # the weights it takes compact: made now (checked exact), kept as long as the graph
                self.compact = compact_weights(self.model)
                if runners[kind].get_metadata().get(COMPACT, "") != _listing(self.compact):
                    raise SelfspecError(
                        f"the compiled step in {self.directory} takes other compact weights than this model has: "
                        "delete it"
                    )
                own |= self.compact
            if any(name not in own for name in needed):
                raise SelfspecError(
                    f"the compiled step in {self.directory} expects weights this model does not have: delete it"
                )
            runners[kind].load_constants(
                {name: own[name] for name in needed}, check_full_update=True, user_managed=True
            )
        self.runners = {kind: _Graph(runner, kind in bounded) for kind, runner in runners.items()}
        self.settle_split(remeasure)

    def few_limit(self) -> int:
        """The most rows (requests x new tokens) a step runs in `few`: 0 where `few` is not used (the q4 path, no
        small-row kernel, or the packed kernel wins from one row on); else $SELFSPEC_FEW_ROWS, or the split measured
        between the graphs (settle_split), or until then the rows below the linear layers' split."""
        if self.four_bit or not native.loaded() or (self.dispatch is not None and self.dispatch.stock_rows <= 1):
            return 0
        high = GRAPHS["few"][1]
        fixed = os.environ.get(FEW_ROWS_ENV)
        if fixed:
            if not fixed.isdigit():
                raise SelfspecError(f"${FEW_ROWS_ENV} must be a whole number of rows (0-{high}), got '{fixed}'")
            return min(high, int(fixed))
        if self.few_rows is not None:
            return self.few_rows
        return high if self.dispatch is None else min(high, self.dispatch.stock_rows - 1)

    def settle_split(self, remeasure: bool = False) -> None:
        """Set `few_rows` where both graphs are loaded: the split stored beside the packages, else measured now (a
        few seconds, once per machine: `time_graphs`) and stored where the machine was quiet enough to trust it."""
        if not {"few", "tree"} <= set(self.runners or ()) or os.environ.get(FEW_ROWS_ENV):
            return
        path = self.directory / SPLIT_FILE
        stored = json.loads(path.read_text()) if path.is_file() and not remeasure else {}
        if stored.get("revision", 1) == SPLIT_REVISION and "few_rows" in stored:
            self.few_rows = int(stored["few_rows"])
            return
        (timings, _), spread, quiet = measure_until_quiet(self.time_graphs, lambda result: result[1])
        few_rows = 0
        for size, following in zip(SPLIT_SIZES, SPLIT_SIZES[1:] + (SPLIT_SIZES[-1] + 1,), strict=True):
            few, tree = timings[size]
            if few > tree * FEW_PREFERENCE:
                break
            few_rows = following - 1
        self.few_rows = few_rows
        if quiet:
            document = {"few_rows": few_rows, "ms_few_tree": timings, "preference": FEW_PREFERENCE}
            document["revision"] = SPLIT_REVISION
            atomic_write_text(path, json.dumps(document, indent=1) + "\n")
        where = f"measured once, stored in {path}" if quiet else f"timings varied {spread:.1f}x: measured again later"
        self.log(f"[selfspec] steps of up to {few_rows} rows run in the compiled 'few' graph, more in 'tree' ({where})")

    def time_graphs(self, repeats: int = 5) -> tuple[dict[int, list[float]], float]:
        """Time one step of each graph at each of SPLIT_SIZES rows over 512 cached positions, interleaved, as greedy
        steps run (`few`'s bounded head: execution/head.py), as the cost curves are measured -> ({rows: [few ms, tree
        ms]}: the medians, and the largest median over fastest round of any timing)."""
        config, cached = self.model.config, 512
        keys, values = (_zero_stores(config, 1, cached + SPLIT_SIZES[-1], self.dtype) for _ in range(2))
        generator = torch.Generator().manual_seed(0)
        samples = {(n, kind): [] for n in SPLIT_SIZES for kind in ("few", "tree")}
        with torch.inference_mode():
            for round_index in range(repeats + 1):  # round 0 warms up
                for n in SPLIT_SIZES:
                    tokens = torch.randint(0, config.vocab_size, (1, n), generator=generator)
                    positions = torch.arange(cached, cached + n).view(1, n)
                    mask = causal_block_mask(cached, n, self.dtype, "cpu").view(1, 1, n, cached + n)
                    for kind in ("few", "tree"):
                        began = time.perf_counter()
                        self.runners[kind](tokens, positions, mask, keys, values, argmax_only=True)
                        if round_index:
                            samples[(n, kind)].append(time.perf_counter() - began)
        timings = {
            n: [round(statistics.median(samples[(n, kind)]) * 1e3, 3) for kind in ("few", "tree")] for n in SPLIT_SIZES
        }
        spread = max(statistics.median(values) / min(values) for values in samples.values())
        return timings, spread

    def route(self, eager):
        """The model's forward while the path is active: a decoding step the compiled graphs cover goes to them,
        anything else (prefill, other arguments) to `eager`, the model's own forward."""
        handled = {
            "input_ids",
            "position_ids",
            "attention_mask",
            "past_key_values",
            "use_cache",
            "output_hidden_states",
        }

        def forward(*args, **kwargs):
            input_ids, cache = kwargs.get("input_ids"), kwargs.get("past_key_values")
            if (
                args
                or kwargs.get("use_cache") is False
                or any(value is not None for key, value in kwargs.items() if key not in handled)
                or not self.eligible(input_ids, cache, kwargs)
            ):
                return eager(*args, **kwargs)
            return self(
                input_ids,
                kwargs.get("position_ids"),
                kwargs.get("attention_mask"),
                cache,
                bool(kwargs.get("output_hidden_states")),
            )

        return forward

    def graph_for(self, n: int, batch: int = 1) -> tuple[str, int]:
        """(graph, rows it runs) for a step of n new tokens for each of `batch` requests: in `few` up to `few_limit`
        rows in all, in `tree` beyond."""
        if self.four_bit:
            return "q4", max(n, GRAPHS["q4"][0])
        return ("few" if n * batch <= self.few_limit() else "tree"), n

    def eligible(self, input_ids, cache, kwargs) -> bool:
        """A step the graphs take: [batch, n] new tokens (batch <= MAX_BATCH, n <= MAX_TREE_ROWS) over a cache whose
        every layer is written in place (one request's, or the batch engine's rows) holding MIN_CACHED positions or
        more, under no mask or a whole [batch or 1, 1, n, cached + n] one."""
        if (
            input_ids is None
            or input_ids.dim() != 2
            or not 1 <= input_ids.shape[0] <= MAX_BATCH
            or not 1 <= input_ids.shape[1] <= MAX_TREE_ROWS
        ):
            return False
        if kwargs.get("inputs_embeds") is not None or not isinstance(cache, Cache) or not cache.layers:
            return False
        layers = cache.layers
        if not (
            all(isinstance(layer, WrittenInPlace) and layer.storage is not None for layer in layers)
            and len({layer.length for layer in layers}) == 1
            and layers[0].length >= MIN_CACHED
            and layers[0].storage[0].shape[0] == input_ids.shape[0]
        ):
            return False
        mask, (batch, n) = kwargs.get("attention_mask"), input_ids.shape
        return mask is None or (
            mask.dim() == 4 and mask.shape[0] in (1, batch) and tuple(mask.shape[1:]) == (1, n, layers[0].length + n)
        )

    def __call__(self, input_ids, position_ids, attention_mask, cache: Cache, output_hidden_states: bool):
        """One step through the compiled graphs (its inputs as `eligible` takes them); the cache's layers take the new
        positions in place, after the `length` they hold (every row's: the batch engine's rows of other lengths see
        only their own positions through the mask)."""
        (batch, n), cached = input_ids.shape, cache.layers[0].length
        if position_ids is None:
            position_ids = torch.arange(cached, cached + n).view(1, n)
        if attention_mask is None:  # a chain: causal among the new tokens
            attention_mask = causal_block_mask(cached, n, self.dtype, input_ids.device)
        position_ids = position_ids.expand(batch, n)
        mask = attention_mask.to(self.dtype).expand(batch, 1, n, cached + n)
        kind, rows = self.graph_for(n, batch)
        if rows > n:
            input_ids, position_ids, mask = _padded(input_ids, position_ids, mask, rows)
        keys, values = [], []  # each layer's storage, read once after its reserve (which may replace it)
        for layer in cache.layers:
            layer.reserve(cached + rows)
            layer_keys, layer_values = layer.storage
            keys.append(layer_keys)
            values.append(layer_values)
        stores = (keys, values)
        logits, hidden = self.runners[kind](
            input_ids, position_ids.contiguous(), mask.contiguous(), *stores, self.argmax_only
        )
        for layer in cache.layers:
            layer.mark_filled(cached + n)  # the dummy rows' keys and values stay outside the length
        return StepOutput(
            logits=logits[:, :n],
            past_key_values=cache,
            hidden_states=tuple(state[:, :n] for state in hidden) if output_hidden_states else None,
        )
