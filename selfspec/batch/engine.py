"""Several requests decoded together: each step verifies every active request's draft tree in one target forward.

The loop of decoding.py, per request, with the target forward shared: each request has a slot (its own drafter, kept
across the requests the slot serves, as `SelfSpec` keeps its one), a row of the ragged KV cache (cache.py), its own
sampling settings, seed and stop tokens. A step
1. admits waiting requests into free slots and prefills them, PREFILL_CHUNK prompt positions a step in all (more
   only while nothing decodes), so a long prompt's prefill is spread over the steps of those decoding instead of
   stalling them; a prompt whose prefill is complete is loaded into a cache row and decodes in this same step,
2. asks every active request's drafter for a tree within that request's budget,
3. runs one forward over all trees: input [rows, widest tree padded to a few widths (`padded_width`)], each row's
   nodes at its own positions, and a mask by which a row's nodes see that row's prefix and their own ancestors only
   (a row's padding nodes see themselves),
4. verifies each row with its own logits, exactly as a request alone is verified (the same StepDraws by seed and
   output position), keeps each row's accepted path in its cache row, and lets each drafter observe its result,
5. hands finished requests back (EOS, max_new_tokens, the context, or cancelled) and frees their rows.

Requests join and leave at step boundaries. What one request gets does not depend on the others: its tokens equal
what `speculative_generate` gives it alone (greedy: token for token; seeded sampling: the same text), up to the
float32 rounding of products over more rows, as between a one-token step and a tree step.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..cost import CostCurve, current_cost_curve
from ..decoding import GenerationStats, validate_request
from ..errors import SelfspecError
from ..heads.base import Drafter, DraftRequest, Observation
from ..heads.lookup import HistoryDrafter
from ..heads.paced import Paced, paced, share_steps
from ..memory import release_freed_memory
from ..models import Target
from ..sampling import SamplingConfig, StepDraws
from ..tree_attention import DraftTree, ancestor_matrix, chunk_forward, verify
from .cache import RaggedCache
from .pacing import BatchPacing, BatchPrices, padded_width
from .prefix import PrefixStore

# The row counts the target's forwards take come from a few sizes, not from every prompt length and tree size: the fast
# path's linears run oneDNN kernels compiled for each row count and kept in caches of 256 entries (selfspec/memory.py),
# and a server meeting every row count up to hundreds keeps churning them, its resident size swinging by tens of MB
# with whichever it met last. Padding is lossless: a padding node sees only itself, padded prompt positions come after
# the real ones (causal) and are dropped, and neither's logits are read.
PREFILL_CHUNK = 128  # prompt positions a prefill forward takes at most (BatchEngine._prefill)
PREFILL_STEP = 16  # a prefill's last chunk is padded to a multiple of this


@dataclass
class BatchRequest:
    """One request for the engine. `on_tokens` hears each step's committed tokens (the stream); `stop_ids`: the tokens
    that end it (default: the target's end-of-sequence tokens)."""

    input_ids: list[int]
    max_new_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int = 0
    on_tokens: Callable[[tuple[int, ...]], None] | None = None
    stop_ids: frozenset[int] | None = None
    cancelled: bool = False  # set it (from the thread that runs the engine's owner) to end the request at the next step


@dataclass
class Finished:
    request: BatchRequest
    token_ids: tuple[int, ...]
    stats: GenerationStats  # stop_reason "cancelled" for a request cancelled before its end
    admitted: float = 0.0  # time.perf_counter() when its prefill began (0.0: cancelled while it waited)
    drafter: str = ""  # the slot's drafter, described
    accepted_by_source: dict | None = None  # auto's sources: the tokens of each this request accepted
    cached_tokens: int = 0  # prompt positions copied from a kept prefix instead of forwarded (prefix.py)


@dataclass
class _Prefill:
    """A request admitted to a slot whose prompt is being prefilled, a chunk at a time (BatchEngine._advance)."""

    request: BatchRequest
    slot: int
    started: float
    cache: object = None  # the target's own cache over the prompt so far
    done: int = 0  # prompt positions in the cache (padding included): forwarded, or copied from a kept prefix
    end: int | None = None  # the positions its prefill forwards to (padding included); None: not begun
    cached_tokens: int = 0  # leading positions copied from a kept prefix (prefix.py), not forwarded
    parts: dict = field(default_factory=dict)  # hidden layer -> the real positions' states, chunk by chunk


@dataclass
class _Running:
    request: BatchRequest
    slot: int
    committed: list[int]
    generator: torch.Generator
    started: float
    prefill_s: float
    cached_tokens: int = 0  # its prompt's leading positions copied from a kept prefix (Finished.cached_tokens)
    new_tokens: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    stop_reason: str = "max_new_tokens"
    drafter_before: object = None  # the slot drafter's DrafterStats when the request was admitted

    def budget(self, context_limit: int) -> int:
        return min(self.request.max_new_tokens - len(self.new_tokens), context_limit - len(self.committed))


class BatchEngine:
    """Up to `slots` requests in flight on one target. `make_drafter()` builds one slot's drafter (called once per
    slot, when first needed); each is paced as `SelfSpec`'s is and kept for the requests its slot serves."""

    def __init__(self, target: Target, make_drafter: Callable[[], Drafter], slots: int = 4):
        if slots < 1:
            raise SelfspecError(f"slots must be at least 1, got {slots}")
        if target.sliding_window is not None:
            raise SelfspecError("batched decoding covers full-attention models only (this one has sliding windows)")
        self.target, self.make_drafter, self.slots = target, make_drafter, slots
        self.drafters: list[Drafter | None] = [None] * slots
        self.own_curves: list[CostCurve | None] = [None] * slots  # each slot drafter's curve for one request
        self.waiting: deque[BatchRequest] = deque()
        self.prefilling: list[_Prefill] = []  # admitted, their prompts not yet all forwarded (oldest first)
        self.running: list[_Running] = []  # row i of the cache is running[i]
        # storage for every slot from the first request (added a row at a time: 42 ms of copies at each ramp to four)
        self.cache = RaggedCache(target.num_layers, slots)
        self.prefixes = PrefixStore()  # the latest prompts' prefixes, which later prompts' prefills skip
        self.pacing = BatchPacing()  # whether drafting pays for several requests at once, measured
        self.prices = BatchPrices()  # what a tree costs in a step of several requests, measured
        self.rows_per_step: Counter[int] = Counter()  # requests verified together -> steps that did (bounded: slots)

    def submit(self, request: BatchRequest) -> None:
        """Queue a request (checked now: a bad one raises SelfspecError and is not queued)."""
        validate_request(self.target, torch.tensor(request.input_ids), request.max_new_tokens, request.seed)
        self.waiting.append(request)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @property
    def admitted(self) -> int:
        """Requests holding a slot: decoding, or their prompts being prefilled."""
        return len(self.running) + len(self.prefilling)

    def step(self) -> list[Finished]:
        """Admit what fits, run one shared verification step, return the requests that finished in it."""
        with torch.inference_mode(), self.target.execution.active():
            finished = self._drop_cancelled()
            self._admit()
            self._prefill_some()
            if self.running:
                self._decode_step()
                finished += self._drop_done()
        if finished:
            # What the finished requests freed (their prefills, activations, logits, cache storage) goes back to the
            # system, as SelfSpec.generate does after each request: a server otherwise creeps up (memory.py).
            release_freed_memory()
        return finished

    def _decode_step(self) -> None:
        """Steps 2-4 of the module docstring for the running requests, paced as a batch (pacing.py)."""
        began, rows = time.perf_counter(), len(self.running)
        self._price_trees()
        asked = self.pacing.ask(rows)
        if asked:
            trees = [self._propose(running) for running in self.running]
        else:  # drafting does not pay for this many requests now: plain steps
            trees = [DraftTree.root_only(running.committed[-1]) for running in self.running]
        greedy = all(running.request.sampling.greedy for running in self.running)
        verifying, widest = time.perf_counter(), padded_width(max(tree.size for tree in trees))
        with self.target.execution.argmax_only(greedy):  # a greedy row reads its argmax alone
            logits, hidden = self._forward(trees, widest)
        paths = [
            self._commit(running, tree, logits[row, : tree.size], {k: h[row] for k, h in hidden.items()})
            for row, (running, tree) in enumerate(zip(self.running, trees, strict=True))
        ]
        del logits, hidden
        self.cache.keep(paths)
        self.prices.record(rows, widest, time.perf_counter() - verifying)
        self.rows_per_step[rows] += 1
        emitted = sum(running.accepted_lengths[-1] for running in self.running)
        drafted = any(tree.size > 1 for tree in trees)
        self.pacing.record(rows, drafted, asked, emitted, time.perf_counter() - began)

    def run(self) -> list[Finished]:
        """Step until every submitted request has finished; their results in the order they finished."""
        done: list[Finished] = []
        while self.busy:
            done += self.step()
        return done

    # -- steps ----------------------------------------------------------------------------------------------------

    def slot_drafter(self, slot: int) -> Drafter:
        """Slot `slot`'s drafter, paced, built now if it was not yet."""
        if self.drafters[slot] is None:
            drafter = self.make_drafter()
            if drafter.target.model is not self.target.model:
                raise SelfspecError(f"drafter '{drafter.name}' drafts for another model than the engine's target")
            first = next((built for built in self.drafters if built is not None), None)
            if first is not None:
                share_histories(first, drafter)
            self.drafters[slot] = paced(drafter)
            self.own_curves[slot] = drafter.cost_curve
        return self.drafters[slot]

    def between_requests(self) -> None:
        """While no request is in flight (the server calls it before it waits for one): the path may take its compiled
        graphs now (a background build finished) or start building them (ExecutionPath.between_requests), and the
        slots' drafters then size their trees by that path's curve."""
        if self.busy:
            return
        if self.target.execution.between_requests():
            curve = current_cost_curve(self.target)
            for slot, drafter in enumerate(self.drafters):
                if drafter is not None:
                    drafter.cost_curve = self.own_curves[slot] = curve

    def _admit(self) -> None:
        busy = {running.slot for running in self.running} | {prefill.slot for prefill in self.prefilling}
        while self.waiting and self.admitted < self.slots:
            slot = next(index for index in range(self.slots) if index not in busy)
            busy.add(slot)
            self.slot_drafter(slot)
            self.prefilling.append(_Prefill(self.waiting.popleft(), slot, time.perf_counter()))

    def _prefill_some(self) -> None:
        """Forward PREFILL_CHUNK prompt positions of the admitted requests, oldest first (as many as it takes to have
        one decoding while none is), and start decoding those whose prompts are done."""
        budget = PREFILL_CHUNK
        while self.prefilling and (budget > 0 or not self.running):
            prefill = self.prefilling[0]
            budget -= self._advance(prefill)
            if prefill.done >= prefill.end:  # (_advance began it)
                self.prefilling.pop(0)
                self._start(prefill)

    def _advance(self, prefill: _Prefill) -> int:
        """Forward the next chunk of `prefill`'s prompt (its last position excepted: the first step's root) -> the
        positions forwarded. Chunks are PREFILL_CHUNK positions, the last padded to a multiple of PREFILL_STEP: the
        kernels a long prompt would otherwise compile for its length (one set per row count, larger for more rows:
        ~24 MB for a few prompts of 1,400 tokens on SmolLM2-135M) and its logits (1,400 x the vocabulary) stay a
        chunk's. Padded positions come after the real ones (causal: they change nothing before them) and are left
        out of the cache row and the drafter's hidden states."""
        prefix = prefill.request.input_ids[:-1]
        if prefill.end is None:
            self._begin(prefill)
        if prefill.done >= prefill.end:
            return 0
        start, end = prefill.done, min(prefill.done + PREFILL_CHUNK, prefill.end)
        chunk = prefix[start:end] + [prefix[-1]] * max(0, end - max(start, len(prefix)))
        if prefill.cache is None:
            prefill.cache = self.target.new_cache()
        hidden_layers = self.drafters[prefill.slot].hidden_layers
        ids = torch.tensor([chunk], device=self.target.device)
        output = chunk_forward(self.target.forward, prefill.cache, ids, hidden_layers, logits=False)
        for layer, states in output.hidden.items():
            prefill.parts.setdefault(layer, []).append(states[: len(prefix) - start])  # the real positions
        prefill.done = end
        return end - start

    def _begin(self, prefill: _Prefill) -> None:
        """Before a prefill's first chunk (not at admission: a prompt admitted beside another that shares its
        beginning finds it kept once that one's prefill is done): start after the longest kept prefix its prompt
        shares (prefix.py); what is left is padded to a multiple of PREFILL_STEP within the context."""
        prefix = prefill.request.input_ids[:-1]
        reused = self.prefixes.longest(prefix, self.drafters[prefill.slot].hidden_layers)
        if reused is not None:
            prefill.cache = self.target.new_cache()
            prefill.parts = {layer: [states] for layer, states in reused.load(prefill.cache).items()}
            prefill.done = prefill.cached_tokens = reused.positions
        left = len(prefix) - prefill.done
        prefill.end = min(prefill.done + -(-left // PREFILL_STEP) * PREFILL_STEP, self.target.context_limit)

    def _start(self, prefill: _Prefill) -> None:
        """A prompt prefilled: its keys and values into a new cache row, the slot's drafter told the prompt."""
        request, drafter = prefill.request, self.drafters[prefill.slot]
        committed = list(request.input_ids)
        keys = values = None
        if prefill.cache is not None:
            keys = [layer.keys for layer in prefill.cache.layers]
            values = [layer.values for layer in prefill.cache.layers]
        self.cache.add_row(keys, values, len(committed) - 1)
        hidden = {layer: parts[0] if len(parts) == 1 else torch.cat(parts) for layer, parts in prefill.parts.items()}
        if prefill.cache is not None:
            self.prefixes.keep(committed[:-1], prefill.cache, hidden)
        drafter.reset()
        drafter.observe(Observation(tuple(committed), hidden))
        generator = torch.Generator(device=self.target.device).manual_seed(request.seed)
        started = prefill.started
        running = _Running(
            request, prefill.slot, committed, generator, started, time.perf_counter() - started, prefill.cached_tokens
        )
        running.drafter_before = drafter.stats()
        self.running.append(running)

    def _price_trees(self) -> None:
        """Size this step's trees for the batch (pacing.py): with B requests a step forwards B rows as wide as the
        widest tree (padded), so a tree of n nodes makes the step take r times a plain step of B rows (estimated by
        the curve, then measured: BatchPrices), time that every request decoding or being prefilled waits for: each
        drafter sizes its tree by that price, and by its own curve again when its request is the only one admitted;
        and its drafting time, which delays them all, is paced as that many times its own (share_steps)."""
        rows, waiting = len(self.running), len(self.prefilling)
        for running in self.running:
            drafter = self.drafters[running.slot]
            own = self.own_curves[running.slot]
            alone = rows == 1 and waiting == 0
            drafter.cost_curve = own if alone else self.prices.curve(own, rows, waiting)
            share_steps(drafter, rows + waiting)

    def _propose(self, running: _Running) -> DraftTree:
        drafter = self.drafters[running.slot]
        budget = running.budget(self.target.context_limit)
        request = DraftRequest(running.committed[-1], budget - 1, running.request.sampling, running.generator)
        tree = drafter.propose(request).pruned(budget - 1)
        if tree.token_list[0] != running.committed[-1]:
            raise SelfspecError(f"drafter '{drafter.name}' rooted its tree elsewhere than the last committed token")
        return tree

    def _forward(self, trees: list[DraftTree], widest: int) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """One target forward over every row's tree, padded to `widest` nodes -> logits [rows, widest, V] and the
        drafters' hidden layers."""
        device = self.target.device
        input_ids, positions, mask = _step_inputs(trees, self.cache.lengths, widest, self.target.dtype)
        layers = sorted({layer for running in self.running for layer in self.drafters[running.slot].hidden_layers})
        output = self.target.forward(
            input_ids.to(device),
            position_ids=positions.to(device),
            attention_mask=mask.to(device),
            past_key_values=self.cache,
            output_hidden_states=bool(layers),
        )
        hidden = {layer: output.hidden_states[layer] for layer in layers}
        return output.logits, hidden

    def _commit(
        self, running: _Running, tree: DraftTree, logits: torch.Tensor, hidden: dict[int, torch.Tensor]
    ) -> tuple[int, ...]:
        """Verify one row, emit its tokens, tell its drafter -> the accepted path the row's cache keeps."""
        request, drafter = running.request, self.drafters[running.slot]
        draws = StepDraws(request.seed, len(running.new_tokens), running.generator)
        result = verify(tree, logits, request.sampling, draws)
        stop_ids = self.target.eos_token_ids if request.stop_ids is None else request.stop_ids
        emitted = result.emitted
        stop_at = next((i for i, token in enumerate(emitted) if token in stop_ids), None)
        if stop_at is not None:
            emitted, running.stop_reason = emitted[: stop_at + 1], "eos"
        running.committed.extend(emitted)
        running.new_tokens.extend(emitted)
        running.accepted_lengths.append(len(emitted))
        running.tree_sizes.append(tree.size)
        if request.on_tokens is not None:
            request.on_tokens(emitted)
        if stop_at is not None or len(running.new_tokens) >= request.max_new_tokens:
            return result.accepted_path
        if len(running.committed) >= self.target.context_limit:
            running.stop_reason = "context"
            return result.accepted_path
        rows: dict[int, torch.Tensor] = {}  # the accepted path's hidden states, for drafters that read them
        if hidden:
            path = torch.tensor(result.accepted_path, device=logits.device)
            rows = {layer: states.index_select(0, path) for layer, states in hidden.items()}
        drafter.observe(Observation(emitted, rows, tree, result.accepted_path))
        return result.accepted_path

    def _done(self, running: _Running) -> bool:
        request = running.request
        return (
            request.cancelled
            or running.stop_reason != "max_new_tokens"
            or len(running.new_tokens) >= request.max_new_tokens
        )

    def _drop_done(self) -> list[Finished]:
        finished = []
        for row in reversed(range(len(self.running))):
            running = self.running[row]
            if self._done(running):
                finished.append(self._finish(row, running))
        return finished[::-1]

    def _drop_cancelled(self) -> list[Finished]:
        cancelled = [request for request in self.waiting if request.cancelled]
        self.waiting = deque(request for request in self.waiting if not request.cancelled)
        results = [Finished(request, (), _empty_stats(self.target)) for request in cancelled]
        results += [
            Finished(prefill.request, (), _empty_stats(self.target), prefill.started)
            for prefill in self.prefilling
            if prefill.request.cancelled
        ]
        self.prefilling = [prefill for prefill in self.prefilling if not prefill.request.cancelled]
        return results + self._drop_done()

    def _finish(self, row: int, running: _Running) -> Finished:
        last = self.running.pop()  # the cache's last row moves into `row`, and so does its request
        if self.cache.drop_row(row) is not None:
            self.running[row] = last
        if running.request.cancelled:
            running.stop_reason = "cancelled"
        drafter = self.drafters[running.slot]
        stats = GenerationStats(
            new_tokens=len(running.new_tokens),
            target_forwards=len(running.accepted_lengths),
            accepted_lengths=tuple(running.accepted_lengths),
            tree_sizes=tuple(running.tree_sizes),
            prefill_s=running.prefill_s,
            wall_s=time.perf_counter() - running.started,
            stop_reason=running.stop_reason,
            paused_steps=drafter.stats().paused_steps - running.drafter_before.paused_steps,
            path=self.target.execution.name,
        )
        by_source = drafter.stats().accepted_since(running.drafter_before)
        drafter.reset()  # the request's own state (its context, a head's cache over it) is not kept while it idles
        return Finished(
            running.request,
            tuple(running.new_tokens),
            stats,
            running.started,
            drafter.describe(),
            by_source,
            running.cached_tokens,
        )


def _step_inputs(
    trees: list[DraftTree], lengths: list[int], widest: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's input ids and positions [rows, widest] and its mask [rows, 1, widest, start + widest] (start: the
    longest row's length, where every row's nodes are written, cache.py). Row r's nodes sit at lengths[r] + their
    depth and see its prefix [0, lengths[r]), themselves and their ancestors; its padding nodes (the root's token, at
    the root's position) see themselves alone. Built for all rows at once: per row, ten small tensor operations took
    0.3 ms of a step of four requests."""
    rows, start = len(trees), max(lengths)
    sizes = torch.tensor([tree.size for tree in trees]).view(rows, 1)
    cached = torch.tensor(lengths).view(rows, 1)
    nodes = torch.arange(widest).view(1, widest)
    real = nodes < sizes  # [rows, widest]: not padding
    input_ids = torch.tensor([tree.token_list + tree.token_list[:1] * (widest - tree.size) for tree in trees])
    depths = torch.tensor([tree.depth_list + (0,) * (widest - tree.size) for tree in trees])
    positions = cached + depths
    seen = torch.zeros(rows, widest, start + widest, dtype=torch.bool)
    seen[:, :, :start] = real.view(rows, widest, 1) & (torch.arange(start).view(1, 1, start) < cached.view(rows, 1, 1))
    seen[:, :, start:] = torch.eye(widest, dtype=torch.bool)  # every node, padding included, sees itself
    for row, tree in enumerate(trees):
        if tree.size > 1:
            seen[row, : tree.size, start : start + tree.size] = ancestor_matrix(tree)
    mask = torch.zeros(rows, 1, widest, start + widest, dtype=dtype)
    mask.view(rows, widest, start + widest).masked_fill_(~seen, torch.finfo(dtype).min)
    return input_ids, positions, mask


def share_histories(first: Drafter, drafter: Drafter) -> None:
    """`drafter`'s `history` sources (itself, or auto's) draft from and add to `first`'s: the slots keep one history of
    the requests the engine served, capped once (HistoryOptions.max_tokens), not one each growing to the cap. Both
    come from one factory, so they hold the same sources."""
    for own, shared in zip(_histories(drafter), _histories(first), strict=True):
        own.share_history(shared)


def _histories(drafter: Drafter) -> list[HistoryDrafter]:
    found, stack = [], [drafter]
    while stack:
        part = stack.pop(0)
        if isinstance(part, HistoryDrafter):
            found.append(part)
        stack += [part.drafter] if isinstance(part, Paced) else list(part.parts())
    return found


def _empty_stats(target: Target) -> GenerationStats:
    return GenerationStats(0, 0, (), (), 0.0, 0.0, "cancelled", path=target.execution.name)
