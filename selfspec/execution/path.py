"""`ExecutionPath`: how one model's forward runs (the path chosen by selection.py), as a call: `forward` is what the
decoding loop and every drafter that runs the target's layers call. The model object, its config and its modules
stay as transformers made them; `active()` marks a generation, so that the path cannot change under it.

On `fast`, `forward` runs the path's twin of the model (twin.py: its own modules and config, the same weights), whose
linear layers are packed ones (linears.py, below their row split calibrated once per machine (calibration.py) on
selfspec's small-row product where it is built: native.py) and whose
`sdpa` attention is the grouped-head SDPA (attention.py, set through `set_attn_implementation`); `new_cache` gives the
KV cache written in place (kv_storage.py). On `compiled`, `forward` sends the decoding steps to the compiled graphs
(compiled.py) and anything else (prefill) to the twin. On `q4` (a model loaded with 4-bit linears, q4.py), the twin
keeps those linears, multiplies the LM head in bfloat16 (`BFloat16Head`) and runs attention whose rows do not depend
on the call's shape (attention.py: selfspec's native row attention, else float64 SDPA over a float64 cache), so that
each row of a tree computes what a one-token step computes.

The path is settled by `prepare()` (the first `forward` or `active()`, or anything that keys on `name` first): under
`auto`, where the compiled graphs are not stored, it is `fast`, with the build `pending`; `start_build()` starts it in
the background (background.py) and `switch_if_ready()` takes the compiled path once it is stored, never inside an
`active()` block, so a generation runs on one path from its first token to its last.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from typing import Iterator

import torch
from transformers import DynamicCache

from ..errors import SelfspecError, first_line
from . import native
from .attention import FLOAT64_SDPA, GROUPED_SDPA, ROW_ATTENTION
from .background import BackgroundBuild
from .calibration import calibrate
from .capabilities import CpuCapabilities, detect_capabilities
from .compiled import CompiledStep
from .kv_storage import InPlaceCache
from .linears import RowDispatch, pack_linears
from .q4 import BFloat16Head
from .selection import compile_mode, model_traits, select_path
from .twin import sharing_copy


class ExecutionPath:
    """How the target's forward runs. `path`: 'stock', 'fast', 'compiled' (fast, with the decoding steps compiled
    ahead of time), 'q4' (a model loaded with 4-bit linears) or 'auto' (the best of these that exists here:
    selection.py). Building one is cheap: packing,
    calibrating and compiling wait for `prepare()`."""

    def __init__(
        self,
        model: torch.nn.Module,
        path: str = "auto",
        model_name: str = "model",
        capabilities: CpuCapabilities | None = None,
        source: str | None = None,
    ):
        """capabilities: this machine's unless given (tests pass in other machines'). source: the model as
        `load_target` takes it, for a background build of the compiled graphs (None: no background build)."""
        # a path named is a path waited for; q4's graphs are built in the background as auto's are (its eager step
        # already beats the float32 paths)
        self.compile_mode = compile_mode() if path in ("auto", "q4") else "wait"
        choice = select_path(
            path, model_traits(model), capabilities or detect_capabilities(), self.compile_mode != "off"
        )
        self.model, self.source = model, source
        self.requested = path
        self.name, self.note = choice.name, choice.note
        self.dispatch = RowDispatch()  # calibrated when the twin is built, before any step runs
        self.four_bit = self.name.startswith("q4")  # a model loaded with 4-bit linears (q4.py)
        self.eager_name, self.compiled_name = ("q4", "q4-compiled") if self.four_bit else ("fast", "compiled")
        self.compiled = (
            CompiledStep(model, model_name, dispatch=self.dispatch, four_bit=self.four_bit)
            if self.name == self.compiled_name
            else None
        )
        self.pending: CompiledStep | None = None  # under `auto`: graphs not stored yet, the fast path runs meanwhile
        self.build: BackgroundBuild | None = None
        self._twin: torch.nn.Module | None = None  # fast and compiled: the model's twin with packed linear layers
        self.kv_dtype: torch.dtype | None = None  # the KV storage's (None: the model's; float64 under FLOAT64_SDPA)
        self._forward = model  # what `forward` calls, settled by `prepare`
        self._prepared = False
        self.recalibrate = False  # measure the row splits (the linears', the compiled graphs') anew, not read them
        self._depth = 0  # generations in flight (nested `active()` blocks)

    def row_split(self) -> RowDispatch:
        """The fast path's row split, calibrated now (building the twin with its packed linears) if it was not yet."""
        if self._twin is None:
            self._twin = self._build_twin()
        return self.dispatch

    def _build_twin(self) -> torch.nn.Module:
        twin = sharing_copy(self.model)
        attention = twin.config._attn_implementation  # transformers gives no public reader
        if self.four_bit:  # its linears are 4-bit already; the LM head runs in bfloat16, attention row by row
            rows = native.load(build_missing=self.compile_mode != "off")  # seconds, once per machine
            twin.set_attn_implementation(ROW_ATTENTION if rows else FLOAT64_SDPA)
            self.kv_dtype = None if rows else torch.float64
            twin.set_output_embeddings(BFloat16Head(twin.get_output_embeddings(), wide=rows))
            if self.compiled is not None:
                self.compiled.model = twin  # the q4 graph is traced from, and reads its weights from, the twin
        else:
            if attention == "sdpa":
                twin.set_attn_implementation(GROUPED_SDPA)
            # selfspec's small-row product below the split: loaded where stored, built (seconds) where the path was
            # named; under `auto` the background build makes it for the next process (native.py)
            weight = next(self.model.parameters())
            if (weight.device.type, weight.dtype) == ("cpu", torch.float32) and native.load(
                build_missing=self.compile_mode == "wait"
            ):
                self.dispatch.use_small_rows()
            calibrate(self.dispatch, pack_linears(twin, self.dispatch), remeasure=self.recalibrate)
        return twin

    @property
    def runner(self) -> torch.nn.Module:
        """The module tree this path's eager forward runs (the model on `stock`, else its twin): for a drafter that runs
        the target's own layers (layer-skip), so that it drafts on the path the target verifies on."""
        self.prepare()
        return self.model if self._twin is None else self._twin

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: DynamicCache | None = None,
        output_hidden_states: bool = False,
        use_cache: bool = True,
        **model_kwargs,
    ):
        """One forward of the target on this path over `input_ids` [batch, n] at `position_ids`, under
        `attention_mask` (None: causal; 4D: additive, over the cached positions and the new ones), appending their
        keys and values to `past_key_values` -> the model's output (logits, hidden states when asked). Other keyword
        arguments go to the model's forward as they are (`logits_to_keep`, dropped for a model that does not take it;
        the compiled graphs leave such calls to the twin)."""
        self.prepare()
        if "logits_to_keep" in model_kwargs and not takes_logits_to_keep(type(self.model)):
            model_kwargs.pop("logits_to_keep")  # such a model computes every position's logits
        return self._forward(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            **model_kwargs,
        )

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """A generation runs inside the block: the path is settled at its start and cannot change (switch_if_ready)
        before it ends."""
        self.prepare()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    @contextlib.contextmanager
    def argmax_only(self, enabled: bool = True) -> Iterator[None]:
        """Inside the block (where `enabled`), the steps' logits are read for each row's argmax alone (greedy
        verification): the compiled `few` graph's LM head then computes exactly only the logits that could be a row's
        maximum and leaves -inf elsewhere (head.py: the same argmax, about half the head's time). Other paths and
        graphs give every logit as always."""
        step = self.compiled
        if step is None or not enabled:
            yield
            return
        before, step.argmax_only = step.argmax_only, True
        try:
            yield
        finally:
            step.argmax_only = before

    def prepare(self) -> None:
        """Settle the path before anything runs on it or keys on its name (the cost curve): pack the linears and
        calibrate their row split, which decides the graphs the compiled path needs; then load them where they are
        stored, or compile them now where the path was named (or $SELFSPEC_COMPILE=wait), or leave them `pending`
        (the fast path runs) under `auto`."""
        if self.name == "stock" or self._prepared:
            return
        self.row_split()
        if self.compiled is not None and self.compile_mode == "background" and self.compiled.missing():
            self.pending, self.compiled = self.compiled, None
            self.name, self.note = self.eager_name, "compiled graphs not stored yet"
        elif self.compiled is not None:
            self._load_compiled()
        self._settle_forward()
        self._prepared = True

    def _settle_forward(self) -> None:
        self._forward = self._twin if self.compiled is None else self.compiled.route(self._twin)

    def start_build(self) -> str:
        """Between requests (the API's): start building the pending graphs in the background, once -> a line for the
        user, "" when there is nothing to say."""
        if self.pending is None:
            return ""
        if self.build is None:
            self.build = BackgroundBuild(self.pending.directory)
        return self.build.start(self.source, torch.get_num_threads(), "q4" if self.four_bit else "compiled")

    def switch_if_ready(self) -> bool:
        """Take the compiled path if its pending graphs are stored now (a background build finished). Never inside
        `active()`: a generation in flight keeps its path to its last token. Returns whether it switched."""
        if self.pending is None or self._depth or self.pending.missing():
            return False
        try:
            self.pending.load(compile_missing=False)
        except Exception as error:  # noqa: BLE001  (a package that does not load: keep the fast path, say why)
            self.pending, self.note = None, f"the stored compiled graphs did not load ({first_line(error)[:200]})"
            print(f"[selfspec] {self.note}: the fast path runs", file=sys.stderr, flush=True)
            return False
        self.compiled, self.pending = self.pending, None
        self.name, self.note = self.compiled_name, ""
        self._settle_forward()
        return True

    def between_requests(self) -> bool:
        """What a process that serves requests does before each one (SelfSpec.generate, bench): settle the path, take
        the compiled one if its graphs were stored since, start their background build if they are pending; each
        said in one line on stderr. Returns whether it switched (a drafter's cost curve is then the other path's)."""
        self.prepare()
        switched = self.switch_if_ready()
        if switched:
            print("selfspec: compiled graphs ready; switching to the compiled path", file=sys.stderr, flush=True)
        line = self.start_build()
        if line:
            print(line, file=sys.stderr, flush=True)
        return switched

    def _load_compiled(self) -> None:
        """Load (or compile, once per machine) the compiled steps. Under `auto` a failure leaves the fast path, said
        once; asked for by name, it is an error."""
        try:
            self.compiled.load(remeasure=self.recalibrate)
        except (KeyboardInterrupt, SelfspecError):
            raise
        except Exception as error:  # noqa: BLE001  (export and C++ compilation fail in many ways)
            reason = first_line(error)[:200]
            if self.requested == "compiled":
                raise SelfspecError(f"--path compiled: compiling the step failed ({reason}); use --path fast") from None
            print(
                f"[selfspec] no compiled step ({reason}): the {self.eager_name} path runs", file=sys.stderr, flush=True
            )
            self.name, self.note, self.compiled = self.eager_name, f"no compiled step: {reason}", None

    def pack(self, module: torch.nn.Module) -> bool:
        """For a drafter's own frozen, inference-only modules (its heads): on `fast` and `compiled`, every nn.Linear
        inside is replaced for good by a packed one, as in the target's twin. Returns whether it packed."""
        if self.name == "stock" or self.four_bit:
            return False
        pack_linears(module, self.dispatch, share_inputs=False)
        return True

    def new_cache(self) -> DynamicCache:
        """A KV cache for this path: on `fast` and `compiled`, full-attention layers are written in place
        (kv_storage.InPlaceCache)."""
        if self.name == "stock":
            return DynamicCache(config=self.model.config)
        self.row_split()  # settles the q4 path's attention, and with it the cache's dtype
        return InPlaceCache(self.model.config, self.kv_dtype)


@functools.lru_cache(maxsize=None)
def takes_logits_to_keep(model_class: type) -> bool:
    """Whether a model class's forward takes transformers' `logits_to_keep` (its causal LMs do)."""
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters
