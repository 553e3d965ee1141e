"""`ExecutionPath`: one model's path (chosen by selection.py), switched on only inside `active()`, which the decoding
loop enters for a whole generation: transformers' own `generate`, training and anything else that uses the model
outside it run the stock modules.

Inside `active()` on `fast`, the linear layers are packed ones (linears.py, their row split calibrated once per
machine: calibration.py) and `sdpa` models attend with the grouped-head SDPA (attention.py); `new_cache` gives the KV
cache written in place (kv_storage.py). On `compiled`, the model's forward also routes the decoding steps to the
compiled graphs (compiled.py) and anything else (prefill) to the eager fast path.

The path is settled by `prepare()` (the first `active()`, or anything that keys on `name` first): under `auto`, where
the compiled graphs are not stored, it is `fast`, with the build `pending`; `start_build()` starts it in the
background (background.py) and `switch_if_ready()` takes the compiled path once it is stored, never inside an
`active()` block, so a generation runs on one path from its first token to its last.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..errors import SelfspecError, first_line
from .attention import GROUPED_SDPA
from .background import BackgroundBuild
from .calibration import calibrate
from .capabilities import CpuCapabilities, detect_capabilities
from .compiled import CompiledStep
from .kv_storage import InPlaceLayer
from .linears import ModuleSwap, RowDispatch, linear_swaps, pack_linears_for_good
from .selection import compile_mode, model_traits, select_path


class ExecutionPath:
    """How the target's forward runs. `kernels`: 'stock', 'fast', 'compiled' (fast, with the decoding steps compiled
    ahead of time), or 'auto' (the best of these that exists here: selection.py). Building one is cheap: packing,
    calibrating and compiling wait for `prepare()`."""

    def __init__(
        self,
        model: torch.nn.Module,
        kernels: str = "auto",
        model_name: str = "model",
        capabilities: CpuCapabilities | None = None,
        source: str | None = None,
    ):
        """capabilities: this machine's unless given (tests pass in other machines'). source: the model as
        `load_target` takes it, for a background build of the compiled graphs (None: no background build)."""
        self.compile_mode = compile_mode() if kernels == "auto" else "wait"  # a path named is a path waited for
        choice = select_path(
            kernels, model_traits(model), capabilities or detect_capabilities(), self.compile_mode != "off"
        )
        self.model, self.source = model, source
        self.requested = kernels
        self.name, self.note = choice.name, choice.note
        self.dispatch = RowDispatch()  # calibrated when the swaps are built, before any step runs
        self.compiled = CompiledStep(model, model_name, dispatch=self.dispatch) if self.name == "compiled" else None
        self.pending: CompiledStep | None = None  # under `auto`: graphs not stored yet, the fast path runs meanwhile
        self.build: BackgroundBuild | None = None
        self._swaps: list[ModuleSwap] | None = None
        self._prepared = False
        self.recalibrate = False  # measure the row split anew when the swaps are built, not read the stored one
        self._depth = 0  # nested activations: only the outermost swaps modules in and out

    def row_split(self) -> RowDispatch:
        """The fast path's row split, calibrated now (packing the linears) if it was not yet."""
        if self._swaps is None:
            self._swaps = self._build_swaps()
        return self.dispatch

    def _build_swaps(self) -> list[ModuleSwap]:
        swaps = linear_swaps(self.model, self.dispatch)
        calibrate(self.dispatch, [swap.fast for swap in swaps], remeasure=self.recalibrate)
        return swaps

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run the model on this path inside the block; the stock modules are back afterwards, whatever happens."""
        if self.name == "stock" or self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self.prepare()  # compiling traces the stock modules, so before the packed ones go in
        config = self.model.config
        attention = config._attn_implementation
        if attention == "sdpa":
            config._attn_implementation = GROUPED_SDPA
        for swap in self._swaps:
            swap.apply()
        if self.compiled is not None:
            self.model.forward = self.compiled.route(type(self.model).forward.__get__(self.model))
        self._depth = 1
        try:
            yield
        finally:
            self._depth = 0
            self.model.__dict__.pop("forward", None)
            config._attn_implementation = attention
            for swap in self._swaps:
                swap.restore()

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
            self.name, self.note = "fast", "compiled graphs not stored yet"
        elif self.compiled is not None:
            self._load_compiled()
        self._prepared = True

    def start_build(self) -> str:
        """Between requests (the API's): start building the pending graphs in the background, once -> a line for the
        user, "" when there is nothing to say."""
        if self.pending is None:
            return ""
        if self.build is None:
            self.build = BackgroundBuild(self.pending.directory)
        return self.build.start(self.source, torch.get_num_threads())

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
        self.name, self.note = "compiled", ""
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
            self.compiled.load()
        except (KeyboardInterrupt, SelfspecError):
            raise
        except Exception as error:  # noqa: BLE001  (export and C++ compilation fail in many ways)
            reason = first_line(error)[:200]
            if self.requested == "compiled":
                raise SelfspecError(
                    f"--kernels compiled: compiling the step failed ({reason}); use --kernels fast"
                ) from None
            print(f"[selfspec] no compiled step ({reason}): the fast path runs", file=sys.stderr, flush=True)
            self.name, self.note, self.compiled = "fast", f"no compiled step: {reason}", None

    def pack(self, module: torch.nn.Module) -> bool:
        """For a drafter's own frozen, inference-only modules (its heads): on `fast` and `compiled`, every nn.Linear
        inside is swapped for good for a packed one, as the target's are inside `active()`. Returns whether it
        packed."""
        if self.name == "stock":
            return False
        pack_linears_for_good(module, self.dispatch)
        return True

    def new_cache(self) -> DynamicCache:
        """A KV cache for this path: on `fast` and `compiled`, full-attention layers are written in place
        (InPlaceLayer)."""
        cache = DynamicCache(config=self.model.config)
        if self.name != "stock":
            cache.layers = [InPlaceLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
        return cache
