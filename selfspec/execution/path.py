"""`ExecutionPath`: one model's path (chosen by selection.py), switched on only inside `active()`, which the decoding
loop enters for a whole generation: transformers' own `generate`, training and anything else that uses the model
outside it run the stock modules.

Inside `active()` on `fast`, the linear layers are packed ones (linears.py, their row split calibrated once per
machine: calibration.py) and `sdpa` models attend with the grouped-head SDPA (attention.py); `new_cache` gives the KV
cache written in place (kv_storage.py). On `compiled`, the model's forward also routes the decoding steps to the
compiled graphs (compiled.py) and anything else (prefill) to the eager fast path.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..errors import SelfspecError, first_line
from .attention import GROUPED_SDPA
from .calibration import calibrate
from .capabilities import CpuCapabilities, detect_capabilities
from .compiled import CompiledStep
from .kv_storage import InPlaceLayer
from .linears import ModuleSwap, RowDispatch, linear_swaps, pack_linears_for_good
from .selection import COMPILE_ENV, model_traits, select_path


class ExecutionPath:
    """How the target's forward runs. `kernels`: 'stock', 'fast', 'compiled' (fast, with the decoding steps compiled
    ahead of time), or 'auto' (the best of these that exists here: selection.py). Building one is cheap: packing,
    calibrating and compiling wait for the first `active()`."""

    def __init__(
        self,
        model: torch.nn.Module,
        kernels: str = "auto",
        model_name: str = "model",
        capabilities: CpuCapabilities | None = None,
    ):
        """capabilities: this machine's unless given (tests pass in other machines')."""
        choice = select_path(
            kernels,
            model_traits(model),
            capabilities or detect_capabilities(),
            auto_compiles=os.environ.get(COMPILE_ENV, "1") != "0",
        )
        self.model = model
        self.requested = kernels
        self.name, self.note = choice.name, choice.note
        self.dispatch = RowDispatch()  # calibrated when the swaps are built, before any step runs
        self.compiled = CompiledStep(model, model_name, dispatch=self.dispatch) if self.name == "compiled" else None
        self._swaps: list[ModuleSwap] | None = None
        self.recalibrate = False  # measure the row split anew when the swaps are built, not read the stored one
        self._depth = 0  # nested activations: only the outermost swaps modules in and out

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
        config = self.model.config
        attention = config._attn_implementation
        if attention == "sdpa":
            config._attn_implementation = GROUPED_SDPA
        try:
            if self.compiled is not None:
                self._load_compiled()  # traces the stock modules, so before the packed ones go in
            if self._swaps is None:
                self._swaps = self._build_swaps()
        except BaseException:
            config._attn_implementation = attention
            raise
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
