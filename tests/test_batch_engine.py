"""Batched speculation (selfspec.batch): requests that share verification forwards each get what they get alone."""

from __future__ import annotations

import pytest
import torch

from selfspec.batch import BatchEngine, BatchRequest, RaggedCache
from selfspec.batch.engine import PREFILL_CHUNK, _step_inputs
from selfspec.batch.pacing import (
    FIRST_PAUSE,
    PRICE_REFRESH,
    WINDOW,
    BatchPacing,
    BatchPrices,
    batch_curve,
)
from selfspec.cost import CostCurve
from selfspec.decoding import speculative_generate
from selfspec.errors import SelfspecError
from selfspec.heads import create_drafter
from selfspec.heads.paced import PlainStep
from selfspec.sampling import SamplingConfig
from selfspec.tree_attention import DraftTree

from .helpers import (
    PROMPT,
    OracleDrafter,
    hf_greedy,
    make_tiny_target,
    random_eagle_dir,
    random_medusa_dir,
    without_eos,
)

# Prompts of different lengths (one of a single token: an empty prefix) and different lengths to generate, so rows
# are ragged, finish at different steps and the waiting one joins mid-way.
REQUESTS = [
    (PROMPT, 24),
    ([1, 9, 9, 4, 9, 9, 4, 9, 9], 16),
    ([7], 20),
    (PROMPT[3:] + PROMPT, 30),
    ([2, 3, 4, 5, 6, 2, 3, 4], 12),
]


def drafter_factory(name: str, target, tmp_path):
    heads = {
        "eagle": lambda: random_eagle_dir(target, tmp_path / "eagle"),
        "medusa": lambda: random_medusa_dir(target, tmp_path / "medusa"),
    }.get(name, lambda: None)()
    return lambda: create_drafter(name, target, heads)


def alone(target, make, prompt, max_new_tokens, sampling=SamplingConfig(), seed=0):
    tokens, _ = speculative_generate(target, make(), torch.tensor(prompt), max_new_tokens, sampling, seed)
    return tokens


@pytest.mark.parametrize("path", ["stock", "fast", "q4"])
@pytest.mark.parametrize("name", ["none", "ngram", "eagle", "medusa"])
def test_greedy_requests_in_a_batch_equal_each_alone(name, path, tmp_path):
    target = without_eos(make_tiny_target("llama", path=path))
    make = drafter_factory(name, target, tmp_path)
    engine = BatchEngine(target, make, slots=3)
    forwards = []
    forward = target.forward

    def spy(*args, **kwargs):
        forwards.append((args[0] if args else kwargs["input_ids"]).shape)
        return forward(*args, **kwargs)

    target.forward = spy
    requests = [BatchRequest(list(prompt), count) for prompt, count in REQUESTS]
    for request in requests:
        engine.submit(request)
    done = {id(result.request): result for result in engine.run()}
    del target.forward
    for request, (prompt, count) in zip(requests, REQUESTS, strict=True):
        result = done[id(request)]
        assert list(result.token_ids) == list(alone(target, make, prompt, count)), (name, path, prompt)
        assert result.stats.new_tokens == count and result.stats.stop_reason == "max_new_tokens"
    assert max(engine.rows_per_step) == 3 and min(engine.rows_per_step) < 3  # shared steps; ragged at the end
    steps = [shape for shape in forwards if shape[0] > 1]  # prefills are one row each
    assert len(steps) >= 1 and max(shape[0] for shape in forwards) == 3
    assert engine.cache.rows == 0 and not engine.busy


@pytest.mark.parametrize("path", ["stock", "q4"])
@pytest.mark.parametrize("name", ["none", "ngram"])
def test_seeded_sampled_requests_in_a_batch_equal_each_alone(name, path, tmp_path):
    target = without_eos(make_tiny_target("qwen3", path=path))
    make = drafter_factory(name, target, tmp_path)
    engine = BatchEngine(target, make, slots=4)
    settings = [
        (SamplingConfig(temperature=1.0), 11),
        (SamplingConfig(temperature=0.7, top_k=8), 12),
        (SamplingConfig(temperature=1.2, top_p=0.9), 13),
        (SamplingConfig(), 0),  # greedy beside sampled rows
    ]
    requests = [
        BatchRequest(list(prompt), count, sampling, seed)
        for (prompt, count), (sampling, seed) in zip(REQUESTS, settings, strict=False)
    ]
    for request in requests:
        engine.submit(request)
    done = {id(result.request): result for result in engine.run()}
    for request in requests:
        expected = alone(target, make, request.input_ids, request.max_new_tokens, request.sampling, request.seed)
        assert done[id(request)].token_ids == expected, (name, request.sampling)


def test_stop_tokens_cancellation_and_a_slot_freed_for_the_next(tmp_path):
    target = without_eos(make_tiny_target("llama", path="fast"))
    make = drafter_factory("ngram", target, tmp_path)
    reference = alone(target, make, PROMPT, 24)
    stop = reference[5]
    engine = BatchEngine(target, make, slots=2)
    seen = []
    cancelled = BatchRequest(list(REQUESTS[1][0]), 40)
    cancelled.on_tokens = lambda tokens: seen.append(tokens) or setattr(cancelled, "cancelled", len(seen) >= 2)
    stopped = BatchRequest(list(PROMPT), 24, stop_ids=frozenset({stop}))
    waiting = BatchRequest(list(REQUESTS[2][0]), 10)
    for request in (cancelled, stopped, waiting):
        engine.submit(request)
    results = {id(result.request): result for result in engine.run()}
    assert results[id(cancelled)].stats.stop_reason == "cancelled" and len(seen) == 2
    stopped_tokens = results[id(stopped)].token_ids
    assert stopped_tokens == reference[: reference.index(stop) + 1] and results[id(stopped)].stats.stop_reason == "eos"
    assert list(results[id(waiting)].token_ids) == list(alone(target, make, REQUESTS[2][0], 10))


def test_the_ragged_cache_keeps_rows_apart():
    """A step writes every row's new positions after the longest prefix; `keep` then moves each row's accepted ones
    next to its own prefix, the rows apart."""
    cache = RaggedCache(num_layers=1)
    shape = (1, 2, 3, 4)
    first = torch.arange(24.0).view(shape)
    cache.add_row([first], [first + 100], 3)
    cache.add_row(None, None, 0)
    layer = cache.layers[0]
    assert layer.length == 3
    row0 = torch.tensor([-1.0, -3.0]).view(1, 2, 1).expand(2, 2, 4)  # two distinct new positions
    row1 = torch.tensor([-2.0, -4.0]).view(1, 2, 1).expand(2, 2, 4)
    new = torch.stack([row0, row1])  # [rows, heads, 2 new, dim]
    keys, _ = layer.update(new, new)
    assert keys.shape == (2, 2, 5, 4)
    assert torch.equal(keys[0, :, :3], first[0]) and torch.equal(keys[:, :, 3:], new)  # after the longest prefix
    cache.keep([(1,), (0, 1)])  # row 0 keeps its second new position only; row 1 both, moved to its own start
    assert cache.lengths == [4, 2] and torch.equal(layer.store[0][0, :, 3], torch.full((2, 4), -3.0))
    assert torch.equal(layer.store[0][0, :, :3], first[0])  # row 0's prefix untouched
    assert torch.equal(layer.store[0][1, :, :2], new[1]) and torch.equal(layer.store[1][1, :, :2], new[1])
    assert cache.drop_row(0) == 1 and cache.lengths == [2]  # the last row moves into the freed one
    assert torch.equal(layer.store[0][0, :, :2], new[1])


def test_a_steps_inputs_show_each_row_its_prefix_and_ancestors_alone():
    """Hand-written: row 0 (3 cached positions) verifies its root alone, row 1 (1 cached) a root with two children,
    both padded to 4 nodes and written after the longest prefix (positions 3-6 of the keys)."""
    trees = [
        DraftTree(torch.tensor([5]), torch.tensor([-1])),
        DraftTree(torch.tensor([7, 8, 9]), torch.tensor([-1, 0, 0])),
    ]
    input_ids, positions, mask = _step_inputs(trees, [3, 1], 4, torch.float32)
    assert input_ids.tolist() == [[5, 5, 5, 5], [7, 8, 9, 7]]  # padding repeats the root's token
    assert positions.tolist() == [[3, 3, 3, 3], [1, 2, 2, 1]]  # the length plus the depth; padding at the root's
    seen = [  # the keys each node sees
        [[0, 1, 2, 3], [4], [5], [6]],  # row 0: the root its prefix and itself; padding nodes themselves alone
        [[0, 3], [0, 3, 4], [0, 3, 5], [6]],  # row 1: never row 0's longer prefix (keys 1, 2), nor a sibling
    ]
    lowest = torch.finfo(torch.float32).min
    expected = torch.full((2, 1, 4, 7), lowest)
    for row, nodes in enumerate(seen):
        for node, keys in enumerate(nodes):
            expected[row, 0, node, keys] = 0.0
    assert mask.dtype == torch.float32 and torch.equal(mask, expected)


def test_bad_engines_and_requests_are_refused(tmp_path):
    target = without_eos(make_tiny_target("mistral", sliding_window=8))
    with pytest.raises(SelfspecError, match="full-attention models only"):
        BatchEngine(target, lambda: create_drafter("none", target), slots=2)
    target = make_tiny_target("llama")
    engine = BatchEngine(target, lambda: create_drafter("none", target), slots=2)
    with pytest.raises(SelfspecError, match="max_new_tokens"):
        engine.submit(BatchRequest([1, 2], 0))
    with pytest.raises(SelfspecError, match="empty"):
        engine.submit(BatchRequest([], 4))
    assert not engine.busy
    with pytest.raises(SelfspecError, match="slots"):
        BatchEngine(target, lambda: create_drafter("none", target), slots=0)


def test_trees_are_priced_for_the_batch(tmp_path):
    """A step of B requests pads every row to the widest tree's width (1, 2, 4, 8 ...): a tree of n nodes makes the
    step r times a plain step of B (estimated: the curve at B * width tokens over B roots), where a plain step emits B
    tokens, so its request is charged 1 + B (r - 1) plain tokens: a tree pays only for B (r - 1) extra tokens. A
    request alone goes back to its drafter's own curve."""
    curve = CostCurve((1, 2, 4, 8, 16), (1.0, 1.0, 1.2, 1.5, 2.5), source="test")
    assert batch_curve(curve, 1) == CostCurve(curve.sizes, curve.relative_cost, "test, priced for 1 requests")
    four = batch_curve(curve, 4)
    assert four.shared_by == 4 and four.cost(1) == 1.0
    assert four.step_cost(2) == pytest.approx(1.5 / 1.2) and four.cost(2) == pytest.approx(1 + 4 * (1.5 / 1.2 - 1))
    assert four.cost(3) == four.cost(4) == pytest.approx(1 + 4 * (2.5 / 1.2 - 1), abs=1e-3)  # 3 nodes: 4 wide
    # one more node at 1.25x the step: worth it for one extra token in four requests' step, not for 0.9
    assert four.best_size([0.9])[0] == 1 and four.best_size([1.1])[0] == 2
    step = PlainStep()  # a drafter's plain-step estimate divides a batch step's time by r, not by the price
    step.proposed()
    step._proposed_at -= 0.05
    step.observed(2, four)
    assert step.seconds == pytest.approx(0.05 / (1.5 / 1.2), rel=0.05)
    alone_beside_three = batch_curve(curve, 1, waiting=3)  # three prompts being prefilled wait for its steps too
    assert alone_beside_three.shared_by == 4 and alone_beside_three.cost(3) == pytest.approx(1 + 4 * (1.2 - 1))
    target = without_eos(make_tiny_target("llama"))
    engine = BatchEngine(target, drafter_factory("ngram", target, tmp_path), slots=2)
    seen = []
    propose = engine._propose
    engine._propose = lambda running: (
        seen.append((len(engine.running), engine.drafters[running.slot].cost_curve)) or propose(running)
    )
    long_prompt = [(5 * k) % 90 + 1 for k in range(PREFILL_CHUNK + 60)]  # prefilled over two steps of the others
    for prompt, count in [*REQUESTS[:2], (long_prompt, 4)]:
        engine.submit(BatchRequest(list(prompt), count))
    engine.run()
    assert {"priced for 2 requests" in curve.source for rows, curve in seen if rows == 2} == {True}
    assert {curve.shared_by for rows, curve in seen if rows == 2} == {2}
    beside = [curve for rows, curve in seen if rows == 1 and curve.shared_by == 2]
    assert beside and {"priced for 1 requests and 1 prefilling" in curve.source for curve in beside} == {True}
    assert {"priced for" in curve.source for rows, curve in seen if rows == 1 and curve.shared_by == 1} == {False}


def test_batch_prices_are_measured_once_a_width_ran_a_few_steps():
    """A width's price moves from the curve's estimate to its measured steps (the median of the latest, over the
    median plain step of as many requests) once it ran three times, worked out again every PRICE_REFRESH steps (each
    price of B requests on its own count, whatever other prices of B are asked for), and never falls below a narrower
    width's."""
    curve = CostCurve((1, 2, 4, 8, 16), (1.0, 1.0, 1.2, 1.5, 2.5), source="test")
    prices = BatchPrices()
    assert prices.curve(curve, 4) == batch_curve(curve, 4) and prices.curve(curve, 1) == batch_curve(curve, 1)
    for _ in range(PRICE_REFRESH):
        prices.record(4, 1, 0.020)
    for seconds in (0.030, 0.031, 0.5):  # an outlier: the median is read
        prices.record(4, 2, seconds)
    measured = prices.curve(curve, 4)
    assert measured.source.endswith("measured") and measured.shared_by == 4
    assert measured.step_cost(2) == pytest.approx(0.031 / 0.020) and measured.cost(4) == batch_curve(curve, 4).cost(4)
    for _ in range(PRICE_REFRESH - 3):
        prices.record(4, 4, 0.022)  # cheaper than 2 wide: priced as 2 wide
    assert prices.curve(curve, 4) is measured  # not worked out again yet
    for _ in range(3):
        prices.record(4, 4, 0.022)
    again = prices.curve(curve, 4)
    assert again.cost(4) == again.cost(2) == pytest.approx(1 + 4 * (0.031 / 0.020 - 1))
    assert prices.curve(curve, 2) == batch_curve(curve, 2)  # two requests: nothing measured yet
    beside = prices.curve(curve, 4, waiting=1)  # four requests and one prefilling: priced for five
    assert beside.shared_by == 5 and beside.cost(2) == pytest.approx(1 + 5 * (0.031 / 0.020 - 1))
    for _ in range(PRICE_REFRESH):
        prices.record(4, 4, 0.040)
        prices.curve(curve, 4)  # four requests alone, priced at every step, worked out again on its own count
    assert prices.curve(curve, 4, waiting=1).cost(4) == pytest.approx(1 + 5 * (0.040 / 0.020 - 1))


def test_accepted_nodes_away_from_the_chain_are_moved_in_each_row():
    """An oracle that puts a wrong sibling before each right child: every accepted path skips nodes, so each row's
    cache must gather its accepted nodes next to its prefix, rows of different lengths side by side."""
    target = without_eos(make_tiny_target("qwen2", path="fast"))
    requests = REQUESTS[:4]
    expected = [hf_greedy(target, list(prompt), count, eos=-1) for prompt, count in requests]
    oracles = iter(
        [
            OracleDrafter(target, list(prompt) + reply, depth=3, decoys=True)
            for (prompt, _), reply in zip(requests, expected, strict=True)
        ]
    )
    engine = BatchEngine(target, lambda: next(oracles), slots=4)
    submitted = [BatchRequest(list(prompt), count) for prompt, count in requests]
    for request in submitted:
        engine.submit(request)
    done = {id(result.request): result for result in engine.run()}
    for request, reply in zip(submitted, expected, strict=True):
        result = done[id(request)]
        assert list(result.token_ids) == reply and result.stats.mean_accepted_length > 2.5


def test_what_the_engine_keeps_between_requests_stays_bounded(monkeypatch):
    """A server's engine runs for days: the slots share one history, capped once; the cache's storage follows the rows
    in flight (it shrinks when a long request leaves and is freed when the last one does); what finished requests
    freed goes back to the system after each step that ended one. Greedy replies stay each one's alone."""
    import selfspec.batch.engine as engine_module
    from selfspec.batch.cache import MIN_CAPACITY
    from selfspec.batch.prefix import ENTRIES, MAX_POSITIONS

    trims = []
    monkeypatch.setattr(engine_module, "release_freed_memory", lambda: trims.append(1) or True)
    target = without_eos(make_tiny_target("llama", path="fast", max_position_embeddings=1024))
    make = lambda: create_drafter("auto", target, sources=("ngram", "history"))  # noqa: E731
    engine = BatchEngine(target, lambda: create_drafter("history", target, max_tokens=64), slots=3)
    long_prompt = [(3 * k) % 90 + 1 for k in range(600)]
    requests = [BatchRequest(long_prompt, 8)] + [BatchRequest(list(p), c) for p, c in REQUESTS * 3]
    for request in requests:
        engine.submit(request)
    capacities, finished = [], []
    while engine.busy:
        done = engine.step()
        finished += done
        capacities.append((engine.cache.capacity, max(engine.cache.lengths, default=0), bool(done)))
    assert len(finished) == len(requests) and len(trims) == sum(done for *_, done in capacities)
    assert max(capacity for capacity, *_ in capacities) >= 600  # the long prompt's row
    after_long = [(capacity, longest) for capacity, longest, _ in capacities[capacities.index(max(capacities)) :]]
    assert any(capacity == MIN_CAPACITY for capacity, _ in after_long)  # shrunk once it left
    assert all(capacity <= 3 * max(MIN_CAPACITY, longest) for capacity, longest in after_long[-5:])
    assert engine.cache.capacity == 0 and engine.cache.layers[0].keys is None  # idle: no storage held
    assert engine.cache.shared._views[3] == []  # nor views of it
    kept = engine.prefixes.entries  # the kept prompt prefixes: a few, each cut short (the long prompt's too)
    assert 1 <= len(kept) <= ENTRIES and all(entry.keys[0].shape[2] <= MAX_POSITIONS for entry in kept)
    histories = {id(drafter.drafter.history) for drafter in engine.drafters}
    assert len(histories) == 1 and len(engine.drafters[0].drafter.history) <= 64  # one history, capped once
    alone_make = lambda: create_drafter("none", target)  # noqa: E731
    for result in finished:
        request = result.request
        assert list(result.token_ids) == list(alone(target, alone_make, request.input_ids, request.max_new_tokens))
    # auto's history source is shared the same way
    engine = BatchEngine(target, make, slots=2)
    for prompt, count in REQUESTS[:3]:
        engine.submit(BatchRequest(list(prompt), count))
    engine.run()
    shared = [engine_module._histories(drafter) for drafter in engine.drafters]
    assert [len(found) for found in shared] == [1, 1] and shared[0][0].history is shared[1][0].history


@pytest.mark.parametrize("name", ["none", "eagle"])
def test_a_long_prompt_is_prefilled_in_chunks_and_decodes_as_alone(name, tmp_path):
    """A prefill forwards PREFILL_CHUNK positions at a time (its kernels and logits stay a chunk's), its keys, values
    and the drafter's hidden states those of the whole prompt: the reply is the one the request gets alone."""

    target = without_eos(make_tiny_target("llama", path="fast", max_position_embeddings=1024))
    make = drafter_factory(name, target, tmp_path)
    prompt = [(7 * k) % 90 + 1 for k in range(2 * PREFILL_CHUNK + 37)]
    rows = []
    forward = target.forward
    target.forward = lambda *args, **kwargs: (
        rows.append((args[0] if args else kwargs["input_ids"]).shape[1]) or forward(*args, **kwargs)
    )
    engine = BatchEngine(target, make, slots=2)
    requests = [BatchRequest(prompt, 20), BatchRequest(list(PROMPT), 12)]
    for request in requests:
        engine.submit(request)
    done = {id(result.request): result for result in engine.run()}
    del target.forward
    assert max(rows) == PREFILL_CHUNK and rows.count(PREFILL_CHUNK) == 2
    for request in requests:
        assert done[id(request)].token_ids == alone(target, make, request.input_ids, request.max_new_tokens)


def test_a_long_prefill_is_spread_over_the_steps_of_those_decoding(tmp_path):
    """A request that joins with a long prompt is prefilled a chunk a step while the running one keeps decoding (its
    steps come between the chunks, not after them all), and both replies are those each gets alone."""

    target = without_eos(make_tiny_target("llama", path="fast", max_position_embeddings=1024))
    make = drafter_factory("ngram", target, tmp_path)
    engine = BatchEngine(target, make, slots=2)
    first = BatchRequest(list(PROMPT), 30)
    engine.submit(first)
    engine.step()
    engine.step()  # decoding alone
    forwards = []
    forward = target.forward

    def spy(*args, **kwargs):
        prefill = kwargs.get("attention_mask") is None  # a step passes its tree mask; a prefill chunk is causal
        forwards.append((tuple((args[0] if args else kwargs["input_ids"]).shape), prefill))
        return forward(*args, **kwargs)

    target.forward = spy
    long_prompt = [(5 * k) % 90 + 1 for k in range(3 * PREFILL_CHUNK + 20)]  # a prefix of 3 chunks and 19
    joining = BatchRequest(long_prompt, 10)
    engine.submit(joining)
    done = {id(result.request): result for result in engine.run()}
    del target.forward
    chunks = [index for index, (_, prefill) in enumerate(forwards) if prefill]
    assert [forwards[index][0] for index in chunks] == [(1, PREFILL_CHUNK)] * 3 + [(1, 32)]  # the last 19, padded
    assert all(not forwards[index + 1][1] for index in chunks[:-1])  # a step of the first one after each chunk
    assert done[id(first)].token_ids == alone(target, make, first.input_ids, 30)
    assert done[id(joining)].token_ids == alone(target, make, long_prompt, 10)
    assert done[id(joining)].stats.new_tokens == 10 and engine.admitted == 0 and not engine.prefilling


def test_a_batch_whose_drafting_does_not_pay_decodes_plain_steps_for_a_while():
    """BatchPacing weighs windows of drafted steps of B requests against B tokens a plain step of B: a losing window
    pauses drafting for that batch size (16, then 32 steps ...), a paying one (at least the plain rate) asks again at
    once and halves the next pause; a step where every drafter declined skips asking for 1, 2, 4 ... steps. A request
    alone is left to its drafter."""
    pacing = BatchPacing()
    assert pacing.ask(1) and pacing.ask(4)
    pacing.record(4, drafted=False, asked=True, tokens=4, seconds=0.020)  # every drafter declined: a plain step
    assert [pacing.ask(4) for _ in range(2)] == [False, True]  # one step asked none
    pacing.record(4, drafted=False, asked=True, tokens=4, seconds=0.020)
    assert [pacing.ask(4) for _ in range(3)] == [False, False, True]
    for _ in range(WINDOW):  # 5 tokens in 0.030 s: 167 a second against 4 / 0.020 = 200 in plain steps
        pacing.record(4, drafted=True, asked=True, tokens=5, seconds=0.030)
    assert [pacing.ask(4) for _ in range(FIRST_PAUSE + 1)] == [False] * FIRST_PAUSE + [True]
    assert pacing.ask(1)  # one request: its drafter's own pacing decides
    for _ in range(WINDOW):  # still losing: twice as long
        pacing.record(4, drafted=True, asked=True, tokens=5, seconds=0.031)
    assert pacing.paused_left == 2 * FIRST_PAUSE
    pacing.paused_left = 0
    for _ in range(WINDOW):  # 5 tokens in 0.0248 s: 202 a second, it pays (at least the plain 200; no margin)
        pacing.record(4, drafted=True, asked=True, tokens=5, seconds=0.0248)
    assert pacing.ask(4) and pacing.sizes[4].pause == FIRST_PAUSE
    for _ in range(WINDOW):  # 5 tokens in 0.0256 s: 195 a second, below the plain rate: a loss
        pacing.record(4, drafted=True, asked=True, tokens=5, seconds=0.0256)
    assert pacing.paused_left == 2 * FIRST_PAUSE
    fresh = BatchPacing()  # drafted windows with no plain step measured yet: a few plain steps to measure one
    for _ in range(WINDOW):
        fresh.record(2, drafted=True, asked=True, tokens=3, seconds=0.02)
    assert [fresh.ask(2) for _ in range(3)] == [False, False, True]


# A "system preamble" the prompts below share, whole or in part (chat prompts through one template begin alike).
PREAMBLE = [1, 5, 17, 33, 5, 17, 40, 8, 9, 5, 17, 3, 4, 22, 61, 7, 7, 12]
SHARING = [
    PREAMBLE + [30, 31, 32, 33],
    PREAMBLE + [30, 44],  # its whole prefix is kept: nothing to forward
    PREAMBLE[:7] + [50, 51, 52, 53, 54],
    [2, 3, 4],
    PREAMBLE + [30, 31, 32, 33],  # the first again
    PREAMBLE + [60] * 20 + [61],
]


@pytest.mark.parametrize("path", ["stock", "fast", "q4"])
@pytest.mark.parametrize("name", ["none", "eagle", "medusa"])
def test_prompts_sharing_a_beginning_skip_its_prefill_and_reply_as_alone(name, path, tmp_path):
    """A prompt whose beginning a kept prefix shares copies those positions' keys, values and hidden states instead of
    forwarding them (prefix.py), the prompt admitted beside the one it shares them with too, and every reply is the
    one the request gets alone."""
    target = without_eos(make_tiny_target("llama", path=path))
    make = drafter_factory(name, target, tmp_path)
    forwarded = []
    forward = target.forward

    def spy(*args, **kwargs):
        if "logits_to_keep" in kwargs:  # a prefill chunk
            forwarded.append(kwargs["input_ids"].shape[1])
        return forward(*args, **kwargs)

    target.forward = spy
    engine = BatchEngine(target, make, slots=2)
    requests = [BatchRequest(list(prompt), 10) for prompt in SHARING]
    for request in requests:
        engine.submit(request)
    done = {id(result.request): result for result in engine.run()}
    del target.forward
    for request in requests:
        assert done[id(request)].token_ids == alone(target, make, request.input_ids, 10), (name, path)
    cached = [done[id(request)].cached_tokens for request in requests]
    assert cached == [0, len(PREAMBLE) + 1, 7, 0, len(SHARING[0]) - 1, len(PREAMBLE)]
    assert forwarded == [32, 16, 16, 32]  # what is left of each prompt less its last token, padded to 16s
    assert engine.prefixes.reused_positions == sum(cached)


def test_the_kept_prefixes_are_few_short_and_their_own():
    """The store keeps ENTRIES prompts' first MAX_POSITIONS positions, least recently used out first; a prefix that
    extends a kept one replaces it; a kept prefix whose hidden states lack a layer a drafter reads is not reused."""
    from selfspec.batch.prefix import PrefixStore

    target = make_tiny_target("llama", path="fast")

    def prefilled(prompt):
        cache = target.new_cache()
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            target.forward(input_ids=ids, past_key_values=cache, use_cache=True)
        return cache

    store = PrefixStore(entries=2, max_positions=6)
    hidden = {2: torch.arange(8.0).view(8, 1)}
    store.keep([1, 2, 3, 4, 5, 6, 7, 8], prefilled([1, 2, 3, 4, 5, 6, 7, 8]), hidden)
    assert [entry.tokens for entry in store.entries] == [(1, 2, 3, 4, 5, 6)]  # cut at max_positions
    assert store.entries[0].keys[0].shape[2] == 6 and store.entries[0].hidden[2].view(-1).tolist() == [0, 1, 2, 3, 4, 5]
    store.keep([1, 2, 3], prefilled([1, 2, 3]), hidden)  # a prefix of a kept one: nothing new
    store.keep([9, 9], prefilled([9, 9]), hidden)
    store.keep([9, 9, 4], prefilled([9, 9, 4]), hidden)  # extends (9, 9): replaces it
    assert [entry.tokens for entry in store.entries] == [(1, 2, 3, 4, 5, 6), (9, 9, 4)]
    hit = store.longest([1, 2, 3, 7], (2,))
    assert hit.positions == 3 and hit.entry.tokens[:3] == (1, 2, 3)
    assert store.longest([1, 2], (2, 5)) is None  # layer 5 was not kept
    assert store.longest([8, 1], (2,)) is None
    store.keep([4, 4], prefilled([4, 4]), hidden)  # the least recently used, (9, 9, 4), goes
    assert [entry.tokens for entry in store.entries] == [(1, 2, 3, 4, 5, 6), (4, 4)]
    cache = target.new_cache()
    states = store.longest([1, 2, 3, 4, 5, 6, 7], (2,)).load(cache)
    reference = prefilled([1, 2, 3, 4, 5, 6])
    assert cache.get_seq_length() == 6 and torch.equal(cache.layers[0].keys, reference.layers[0].keys)
    assert states[2].view(-1).tolist() == [0, 1, 2, 3, 4, 5]
    empty = PrefixStore(entries=0)
    empty.keep([1, 2], prefilled([1, 2]), hidden)
    assert empty.entries == [] and empty.longest([1, 2], ()) is None
